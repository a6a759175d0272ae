"""Refinement rows of one layer's store: the age ladder, its second rung, and the heavy rows.

* ``ladder_tokens = N`` (an age ladder, codebook K/V): the ``n <= N`` newest pool tokens ``[q_end - n, q_end)`` also
  keep the refinement bits of their embedded code (``Quantizer.refine``) in a small ring per head group
  (``ladder``), and are read refined (``decode_refined``); a token that ages past them drops its bits and is read at
  the base width, as stored. The attention walks the pool up to ``q_end - n`` and reads the young rows as one more
  small segment (:meth:`Refinement.read_ladder`). ``ladder2_tokens = N2 <= N`` (a second rung): the ``n2`` newest of
  them also keep a second bit per coordinate (``refine2``) in a second ring (``ladder2``) and are read through both;
  past them a row reads refined once.
* ``heavy_tokens = K`` (:mod:`kvquant.heavy`): per (row, KV head), the ``K`` prompt rows its attention weighs most
  keep their first-rung refinement parts, and are read refined wherever they are (:meth:`Refinement.heavy_rows`).

:class:`Refinement` is the component of a :class:`~kvquant.store.LayerStore` that holds both (the rings, the heavy
rows and their positions); what it needs of the store (the head groups, the table tensor, the pool's end, each
row's first eligible position) comes as arguments.
"""

from __future__ import annotations

import copy as _copy
from collections.abc import Callable
from typing import Any

import torch

from .groups import HeadGroup, group_rows
from .heavy import gather_parts, pick_rows, position_dtype, put_rows, take_rows
from .quantizers.base import Factored
from .tensor_store import QuantizedTensorStore

# heavy_tokens: (first position, key scores [B, H, T], pool end of the scored chunk's own write or None)
HeavyScores = tuple[int, torch.Tensor, "int | None"]
# per group: (positions [B, Hg, n] (-1: none; None: no side refined), K and V first-rung parts [B, Hg, n, ...])
HeavyEntry = tuple[torch.Tensor | None, dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None]
Ring = tuple[dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None]


def _rows(parts: dict[str, torch.Tensor], start: int) -> dict[str, torch.Tensor]:
    """Parts ``[B, H, T, ...]`` from row ``start`` on."""
    return {n: t[:, :, start:] for n, t in parts.items()}


def _ring_push(prev: dict[str, torch.Tensor] | None, new: dict[str, torch.Tensor], cap: int) -> dict[str, torch.Tensor]:
    """A ladder ring's parts with rows ``new`` appended after ``prev`` (None: a new ring), its newest ``cap`` kept."""
    if prev is not None:
        new = {n: torch.cat([prev[n], t], dim=2) for n, t in new.items()}
    return {n: t[:, :, -cap:] for n, t in new.items()}


def _nbytes(parts: dict[str, torch.Tensor] | None) -> int:
    return sum(t.numel() * t.element_size() for t in (parts or {}).values())


class Refinement:
    """The age ladder's rings and the heavy rows of one layer (see the module doc).

    Args:
        ladder_tokens, ladder2_tokens: rows the first / second rung's ring keeps (0: no ladder / second rung).
        heavy_tokens: heavy rows per (row, KV head) (0: none).
        block_size: tokens per block of the layer.
        device: the layer's device.
    """

    def __init__(
        self, ladder_tokens: int, ladder2_tokens: int, heavy_tokens: int, block_size: int, device: torch.device
    ) -> None:
        self.ladder_tokens = ladder_tokens
        self.ladder2_tokens = ladder2_tokens
        self.heavy_tokens = heavy_tokens
        self.block_size = block_size
        self.device = device
        # the age ladder's ring: per group, K and V refinement parts [B, Hg, n, ...] of the n newest pool tokens
        # (None: that side's quantizer has no embedded refinement)
        self.ladder: list[Ring] = []
        self.ladder_n = 0
        # the second rung's ring: the same layout, the ladder2_n newest pool tokens (None: no second rung there)
        self.ladder2: list[Ring] = []
        self.ladder2_n = 0
        # heavy rows: per group, (positions [B, Hg, n] (-1: none), K and V first-rung parts [B, Hg, n, ...]) of the
        # prompt rows its attention weighs most; empty until picked
        self.heavy: list[HeavyEntry] = []

    def copy(self) -> Refinement:
        """A copy with its own lists (ring and heavy tensors are replaced, never written in place)."""
        new = _copy.copy(self)
        new.ladder, new.ladder2, new.heavy = list(self.ladder), list(self.ladder2), list(self.heavy)
        return new

    def reset(self) -> None:
        """No refinement rows held."""
        self.clear_ladder()
        self.heavy = []

    def index_batch(self, idx: torch.Tensor) -> None:
        """Rows reordered / selected / repeated (``idx`` on the device): each row's refinement rows follow it."""
        self.map_rings(lambda t, _: t.index_select(0, idx))
        self.heavy = [tuple(None if x is None else x.index_select(0, idx) if isinstance(x, torch.Tensor)
                            else {n: t.index_select(0, idx) for n, t in x.items()} for x in h)  # type: ignore[misc]
                      for h in self.heavy]  # fmt: skip

    def crop(self, tokens: int, q_end: int) -> None:
        """The pool ``[0, q_end)`` keeps its first ``tokens``: the rings keep their rows below it, and heavy rows cut
        off are no longer refined (-1)."""
        if self.ladder_n:
            cut = q_end - tokens
            keep = [0, max(0, self.ladder_n - cut), max(0, self.ladder2_n - cut)]
            self.map_rings(lambda t, rung: t[:, :, : keep[rung]])
            self.ladder_n, self.ladder2_n = keep[1], keep[2]
        self.heavy = [(None if at is None else torch.where(at < tokens, at, -1).to(at.dtype), kr, vr)
                      for at, kr, vr in self.heavy]  # fmt: skip

    # ---------------------------------------------------------------- accounting
    def heavy_bytes(self) -> int:
        """Bytes of the heavy rows held: refinement parts and positions (0 without them)."""
        return sum(t.numel() * t.element_size() for h in self.heavy for x in h if x is not None
                   for t in (x.values() if isinstance(x, dict) else (x,)))  # fmt: skip

    def ladder_bytes(self) -> int:
        """Bytes of the age ladder's refinement rows held, both rungs (0 without a ladder)."""
        return sum(_nbytes(r) for _, r in self.ring_parts())

    def count(self, out: dict[str, int]) -> None:
        """Add the bytes held to ``out``'s ``keys`` / ``values`` (refinement parts) and ``index`` (positions)."""
        for kind, r in self.ring_parts():
            out[kind] += _nbytes(r)
        for at, kr, vr in self.heavy:
            out["keys"] += _nbytes(kr)
            out["values"] += _nbytes(vr)
            out["index"] += 0 if at is None else at.numel() * at.element_size()

    def heavy_width(self) -> int:
        """Heavy rows a head (0: none)."""
        return max([0, *(at.shape[-1] for at, _, _ in self.heavy if at is not None)])

    # ---------------------------------------------------------------- heavy rows
    def heavy_range(self, pos: int, t: int, scores: HeavyScores) -> tuple[int, int]:
        """The positions ``[lo, hi)`` among a pool write of ``t`` rows at ``pos`` that heavy rows are picked from:
        scored ones, below the rows the ladder holds after the scored chunk's own write (``limit``: where that write
        ends; None: this one)."""
        s0, sc, limit = scores
        end = pos + t if limit is None else min(pos + t, limit)
        return max(pos, s0), min(end, s0 + sc.shape[2], end - self.ladder_tokens)

    def heavy_picks(self, lo: int, hi: int, scores: HeavyScores, first: torch.Tensor) -> torch.Tensor:
        """Per (row, KV head), the ``heavy_tokens`` positions ``[lo, hi)`` of highest score, as offsets from ``lo``
        ``[B, H, n]`` (-1: none), below each row's ``first[B]`` eligible position (pads and sinks) excepted."""
        s0, sc, _ = scores
        p = torch.arange(lo, hi, device=self.device)
        eligible = p[None, :] >= first[:, None]  # [B, t]: not a pad, not a sink
        return pick_rows(sc[:, :, lo - s0:hi - s0].to(self.device), eligible, self.heavy_tokens)

    def pick_heavy(
        self, groups: list[HeadGroup], masked: dict, quantized: list, pos: int, scores: HeavyScores,
        first: torch.Tensor,
    ) -> None:
        """Pick the heavy rows among the chunk just written at ``pos`` (``masked``: its K and V per sink masking,
        ``quantized``: each group's quantized K and V): per (row, KV head), the ``heavy_tokens`` rows of highest
        score, sinks and the rows the ladder holds after the scored chunk's write excepted (:meth:`heavy_range`),
        and keep their first-rung refinement parts."""
        t = next(iter(masked.values()))[0].shape[2]
        lo, hi = self.heavy_range(pos, t, scores)
        if hi <= lo:
            return
        idx = self.heavy_picks(lo, hi, scores, first)  # [B, H, n]
        heavy: list[HeavyEntry] = []
        for g, q_kv in zip(groups, quantized, strict=True):
            gidx = group_rows(idx, g)
            rel = torch.where(gidx >= 0, gidx + (lo - pos), -1)  # rows of the chunk
            sides = []
            for s, x, q in zip((g.key, g.value), masked[g.per_block], q_kv, strict=True):
                if not s.quantizer.rung_parts(1):
                    sides.append(None)
                    continue
                x = take_rows(group_rows(x, g), rel)
                sides.append(s.quantizer.refine(x, s.state, {n: take_rows(v, rel) for n, v in q.parts.items()}))
            at = None if all(x is None for x in sides) else torch.where(gidx >= 0, gidx + lo, -1).to(position_dtype(hi))
            heavy.append((at, sides[0], sides[1]))
        self.heavy = heavy

    def held_heavy(
        self, group: HeadGroup, xk: torch.Tensor, xv: torch.Tensor, pooled: int, q0: int, scores: HeavyScores,
        first: torch.Tensor,
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """The heavy rows held tokens ``[q0, q0 + pooled)`` (``xk`` / ``xv``: what the pool will be quantized from)
        pick when they reach the pool (:meth:`pick_heavy`, by the held prompt's ``scores``): their positions
        ``[B, Hg, n]`` (-1: none) and, per side, their refined decode (float32 storage space; None: no
        refinement)."""
        lo, hi = self.heavy_range(q0, pooled, scores)
        at = torch.full((xk.shape[0], len(group.heads), 1), -1, dtype=torch.long, device=self.device)
        rows: list[torch.Tensor | None] = [None, None]
        if hi > lo:
            gidx = group_rows(self.heavy_picks(lo, hi, scores, first), group)
            rel = torch.where(gidx >= 0, gidx + (lo - q0), -1)
            at = torch.where(gidx >= 0, gidx + lo, -1)
            for i, (s, x) in enumerate(((group.key, xk), (group.value, xv))):
                q = s.quantizer
                if q.rung_parts(1):
                    r = take_rows(group_rows(x[:, :, :pooled], group), rel)
                    parts = q.quantize(r, s.state)
                    y = q.decode_refined(parts, q.refine(r, s.state, parts), s.state).float()
                    rows[i] = q.from_space(y, s.state) if q.space else y
        return at, rows

    def heavy_rows(
        self, group: HeadGroup, table: torch.Tensor, base: bool = False
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None], list[torch.Tensor | None]]:
        """``group``'s heavy rows (:mod:`kvquant.heavy`) through the block ``table``: their positions ``[B, Hg, n]``
        (-1: none; None: the group holds none) and, per side (K, V), their refined decode (float32, the space the
        attention reads; None: a side without refinement) and, with ``base``, their base decode (what the pool's
        codes read; else None). Each side's parts are gathered from the blocks once."""
        at, kr, vr = self.heavy[group.key.group]
        refined: list[torch.Tensor | None] = [None, None]
        based: list[torch.Tensor | None] = [None, None]
        if at is None:
            return None, refined, based
        for i, (s, r) in enumerate(((group.key, kr), (group.value, vr))):
            if r is None and not base:
                continue
            parts = gather_parts(s.parts, table, at)
            if r is not None:
                refined[i] = s.quantizer.decode_refined(parts, r, s.state).float()
            if base:
                based[i] = s.decode(parts)
        return at, refined, based

    def put_heavy(
        self, group: HeadGroup, start: int, end: int, k: Any, v: Any, table: torch.Tensor
    ) -> tuple[Any, Any]:
        """``k``, ``v`` (tokens ``[start, end)`` of ``group``'s pool: tensors ``[B, Hg, t, D]`` or dense
        :class:`Factored`) with the group's heavy rows among them read refined."""
        at, rows, _ = self.heavy_rows(group, table)
        out = []
        for x, r in zip((k, v), rows, strict=True):
            if r is not None:
                x = Factored(put_rows(x.codes, r, at, start, end)) if isinstance(x, Factored) else \
                    put_rows(x, r, at, start, end)
            out.append(x)
        return out[0], out[1]

    # ---------------------------------------------------------------- the age ladder
    def push(self, groups: list[HeadGroup], masked: dict, quantized: list, pos: int, q_end: int) -> None:
        """Add the refinement parts of the chunk just written at ``pos`` to the ladder's rings and keep their newest
        ``ladder_tokens`` (``ladder2_tokens``) rows: the rings cover ``[q_end - ladder_n, q_end)`` and
        ``[q_end - ladder2_n, q_end)`` (``q_end``: the pool's end before this write)."""
        if pos != q_end:  # (not a suffix of the pool: start the rings again)
            self.clear_ladder()
        none = [(None, None)] * len(groups)
        ring1, ring2 = [], []
        for g, (qk, qv), old1, old2 in zip(groups, quantized, self.ladder or none, self.ladder2 or none,
                                           strict=True):  # fmt: skip
            gk, gv = masked[g.per_block]
            p1, p2 = [], []
            for s, x, q, prev1, prev2 in zip((g.key, g.value), (gk, gv), (qk, qv), old1, old2, strict=True):
                if not s.quantizer.rung_parts(1):
                    p1.append(None)
                    p2.append(None)
                    continue
                x = group_rows(x, g)
                t0 = max(0, x.shape[2] - self.ladder_tokens)  # only the rows the ring keeps (a long prefill)
                x, parts = x[:, :, t0:], _rows(q.parts, t0)
                r = s.quantizer.refine(x, s.state, parts)
                p1.append(_ring_push(prev1 if self.ladder_n else None, r, self.ladder_tokens))
                if not (self.ladder2_tokens and s.quantizer.rung_parts(2)):
                    p2.append(None)
                    continue
                t2 = max(0, x.shape[2] - self.ladder2_tokens)
                r2 = s.quantizer.refine2(x[:, :, t2:], s.state, _rows(parts, t2), _rows(r, t2))
                p2.append(_ring_push(prev2 if self.ladder2_n else None, r2, self.ladder2_tokens))
            ring1.append((p1[0], p1[1]))
            ring2.append((p2[0], p2[1]))
        t = next(iter(masked.values()))[0].shape[2]
        self.ladder = ring1
        self.ladder_n = min(self.ladder_tokens, self.ladder_n + t)
        if self.ladder2_tokens:
            self.ladder2 = ring2
            self.ladder2_n = min(self.ladder2_tokens, self.ladder2_n + t)

    def clear_ladder(self) -> None:
        """Drop the ladder's refinement rows (the pool's tokens then read at their base width)."""
        self.ladder, self.ladder_n = [], 0
        self.ladder2, self.ladder2_n = [], 0

    def map_rings(self, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
        """Apply ``fn(tensor, rung)`` to every tensor of the ladder's rings (rung 1 or 2), replacing them."""
        for rung in (1, 2):
            rings = self.ladder if rung == 1 else self.ladder2
            new = [tuple(None if r is None else {n: fn(t, rung) for n, t in r.items()} for r in pair) for pair in rings]
            if rung == 1:
                self.ladder = new
            else:
                self.ladder2 = new

    def ring_parts(self) -> list[tuple[str, dict[str, torch.Tensor]]]:
        """``(kind, parts)`` of every ring entry held (kind: ``keys`` / ``values``), both rungs."""
        return [(kind, r) for pair in (*self.ladder, *self.ladder2)
                for kind, r in zip(("keys", "values"), pair, strict=True) if r is not None]  # fmt: skip

    def read_ladder(
        self, group: HeadGroup, start: int, end: int, table: torch.Tensor, q_end: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """K and V of ``group``'s young pool tokens ``[start, end)`` (inside the ladder's ring) decoded with their
        refinement bits, float32 head space ``[B, Hg, t, D]`` (None: that side is read at its base width); rows
        inside the second rung's ring ``[q_end - ladder2_n, q_end)`` with both rungs."""
        gi = group.key.group  # (the index of the group in the layer's groups)
        bs = self.block_size
        j0, j1 = start // bs, -(-end // bs)
        tbl = table[:, j0:j1]
        off = start - (q_end - self.ladder_n)
        b2 = max(start, q_end - self.ladder2_n)  # the first row with a second rung (end: none)
        rings2 = self.ladder2[gi] if self.ladder2_n and b2 < end else (None, None)
        out = []
        for s, ring, ring2 in zip((group.key, group.value), self.ladder[gi], rings2, strict=True):
            if ring is None:
                out.append(None)
                continue
            parts = s._window(tbl, start - j0 * bs, end - start, None, None)
            rp = {n: t[:, :, off:off + end - start] for n, t in ring.items()}
            y = s.quantizer.decode_refined(parts, rp, s.state).float()
            if ring2 is not None:  # the youngest rows: through the second rung too
                a, o2 = b2 - start, b2 - (q_end - self.ladder2_n)
                r2 = {n: t[:, :, o2:o2 + end - b2] for n, t in ring2.items()}
                y2 = s.quantizer.add_rung2(y[:, :, a:], _rows(parts, a), _rows(rp, a), r2, s.state).float()
                y = torch.cat([y[:, :, :a], y2], dim=2)
            out.append(y)
        return out[0], out[1]


    def ladder_rows(self, store: QuantizedTensorStore, x: torch.Tensor) -> torch.Tensor:
        """The pool's newest rows ``x[B, Hg, n1, D]`` as the age ladder reads them (refined; the newest
        ``ladder2_tokens`` through both rungs), float32 storage space."""
        q = store.quantizer
        parts = q.quantize(x, store.state)
        r = q.refine(x, store.state, parts)
        y = q.decode_refined(parts, r, store.state).float()
        n1 = x.shape[2]
        n2 = min(self.ladder2_tokens, n1) if q.rung_parts(2) else 0
        if n2:
            p2, r1 = _rows(parts, n1 - n2), _rows(r, n1 - n2)
            y2 = q.add_rung2(y[:, :, n1 - n2:], p2, r1, q.refine2(x[:, :, n1 - n2:], store.state, p2, r1), store.state)
            y = torch.cat([y[:, :, :n1 - n2], y2.float()], dim=2)
        return q.from_space(y, store.state) if q.space else y
