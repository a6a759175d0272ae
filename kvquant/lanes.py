"""Per-head block lanes of AdaKV layers: :class:`Lanes`, the component of a :class:`~kvquant.store.LayerStore` that
holds them.

A layer whose KV heads keep different token counts (``budget: adakv``) holds *lanes* (one head's rows of one
block, :mod:`kvquant.blocks`) through one table per (row, KV head) (``tables[b * H + h]``). Each head fills its
slots from 0 without holes, at its own pace (``fill[b][h]``): the prompt's kept tokens compacted per head
(:meth:`Lanes.write`), each decoded token at the head's own next slot or, for a decode-time policy at
its budget, over its victim (:meth:`Lanes.grow`, then :meth:`Lanes.overwrite`). Lanes shared by rows (beams) are
copied before a write; the lanes a step needs are reserved before anything changes.

*Tails.* A layer whose quantizers need whole blocks (per-channel key scales over a block's tokens) or that keeps
its newest tokens in full precision (``residual_tokens``) cannot quantize a row's block of every head at once:
each (row, head) then has its own tail. Slots ``[0, qfill[b][h])`` of (row ``b``, head ``h``) are in its lanes
(whole lanes, ``qfill`` a multiple of ``block_size``), slots ``[qfill[b][h], fill[b][h])`` in full precision, at
``res_k[b, h, slot - qfill[b][h]]`` (``res_k`` / ``res_v``: ``[B, H, W, D]``, ``W`` the longest tail; a head's
entries past its own tail are unused). When a head's tail reaches ``residual_tokens + block_size`` tokens, its
oldest ``block_size`` tokens are quantized into a new lane of that head alone (per-channel scales of that lane:
that head's tokens only), once. So a (row, head) holding ``n`` tokens holds ``max(0, (n - residual_tokens) //
block_size)`` lanes and the rest of its tokens in its tail. The layer's ``q_end`` is the smallest ``qfill``
(slots below it are in every head's lanes): reads of ``[0, q_end)`` are plain lane reads, reads past it merge
each head's lanes and tail by its own ``qfill``. While static scales wait for calibration every ``qfill`` is 0:
the tails are then the layer's held tokens.

The component owns the lane state (fills, tails' bases, decode budgets, the step's plan) and reaches the store that
owns it only through :class:`LaneHost`: its tables and cursor, its full-precision rows (the tails live in its
residual buffers) and its pool reads.
"""

from __future__ import annotations

import copy as _copy
from typing import Any, Protocol

import torch

from .blocks import LayerBlocks
from .dense import DenseRows
from .groups import HeadGroup, group_rows
from .quantizers.base import Factored
from .rows import RowStarts
from .space import dense_to_group_space
from .tensor_store import LanePlan, write_pair


class LaneHost(Protocol):
    """What :class:`Lanes` uses of the store that owns it."""

    tables: list[list[int]]  # lane ids per (row, head): tables[b * H + h]
    groups: list[HeadGroup]
    q_end: int  # slots below it are in every head's lanes
    cache_pos: int
    starts: RowStarts  # each row's first real token and its sinks
    bytes_moved: int
    dense: DenseRows  # its res_k / res_v hold the tails (residual mode) or the held tokens (calibration wait)

    def table(self) -> torch.Tensor: ...

    def tables_changed(self) -> None: ...

    def read_pool(self, group: HeadGroup, start: int, end: int, factored: bool = False) -> tuple[Any, Any]: ...

    def read_quantized(self, group: HeadGroup, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]: ...




class Lanes:
    """The per-head block lanes of one layer's store (lane tables, fills, tails: see the module doc).

    Args:
        host: the store that owns the lanes (:class:`LaneHost`).
        blocks: the layer's blocks (lanes are allocated there).
        groups: the layer's head groups (their order fixes each head's lane slot in a block).
        batch, num_heads, head_dim: the layer's rows, KV heads and head size.
        residual_tokens: the full-precision window of each head's tail.
        tails: each (row, head) keeps its own full-precision tail (residual mode: per-channel keys or a window).
        check_finite: writes reject NaN / Inf.
    """

    def __init__(
        self, host: LaneHost, blocks: LayerBlocks, groups: list[HeadGroup], batch: int, num_heads: int,
        head_dim: int, residual_tokens: int, tails: bool, check_finite: bool, device: torch.device,
    ) -> None:
        self.host = host
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.batch, self.num_heads, self.head_dim = batch, num_heads, head_dim
        self.residual_tokens = residual_tokens
        self.tails = tails
        self.check_finite = check_finite
        self.device = device
        self.fill: list[list[int]] = [[0] * num_heads for _ in range(batch)]  # slots per (row, head)
        # in residual mode: of which in lanes (a multiple of block_size; the rest in the head's tail)
        self.qfill: list[list[int]] = [[0] * num_heads for _ in range(batch)]
        self._tail_base_cache: torch.Tensor | None = None
        self.cap_host: list[list[int]] | None = None  # decode budget per (row, head) (H2O / TOVA)
        self.step = False  # append_kept / grow set the fills of this append
        self.overwrite_pending = False  # grow: overwrite() writes this step's token (append need not)
        self.grows: list[list[bool]] | None = None  # grow: the heads that take their next slot
        self.runs: list[int | None] = []  # per group, the in-place run of one sequence (see run())
        self.lane_offset = [blocks.lane_of.index((gi, 0)) for gi in range(len(groups))]
        self.head_lane = {h: (gi, i) for gi, g in enumerate(groups) for i, h in enumerate(g.heads)}

    def copy(self, host: LaneHost) -> Lanes:
        """A copy for the store ``host`` (a copy of this one's): its own fills and budgets."""
        new = _copy.copy(self)
        new.host = host
        new.fill = [list(r) for r in self.fill]
        new.qfill = [list(r) for r in self.qfill]
        new.cap_host = None if self.cap_host is None else [list(r) for r in self.cap_host]
        new._tail_base_cache = None
        return new

    def reset(self) -> None:
        """Every head empty again."""
        self.fill = [[0] * self.num_heads for _ in range(self.batch)]
        self.set_qfill([[0] * self.num_heads for _ in range(self.batch)])
        self.cap_host = None
        self.step = False

    def index_batch(self, rows: list[int]) -> list[list[int]]:
        """Reorder / select / repeat rows (beam search): each row's fills and budget follow it; returns the
        store's tables reordered alike (one table per (row, head): a row moves with all its heads' tables)."""
        H = self.num_heads
        tables = [list(self.host.tables[i * H + h]) for i in rows for h in range(H)]
        self.fill = [list(self.fill[i]) for i in rows]
        self.batch = len(rows)
        self.set_qfill([list(self.qfill[i]) for i in rows])
        if self.cap_host is not None:
            self.cap_host = [list(self.cap_host[i]) for i in rows]
        return tables

    def begin_append(self, past: int, tokens: int) -> None:
        """An append of ``tokens`` slots at ``past``: the fills set by :meth:`keep` / :meth:`grow` stand, or (a
        plain append) every head holds the chunk."""
        if self.step:
            self.step = False
            return
        if any(f != past for r in self.fill for f in r):
            raise AssertionError("append: new tokens of a per-head-lane layer whose heads hold different counts "
                                 "go through grow (each head at its own next slot)")
        self.fill = [[past + tokens] * self.num_heads for _ in range(self.batch)]

    def keep(self, counts: list[list[int]], cap: list[list[int]] | None) -> None:
        """The first write of an evicting layer: (row ``b``, head ``h``) holds ``counts[b][h]`` slots and keeps
        ``cap[b][h]`` while decoding."""
        self.fill = counts
        self.cap_host = cap
        self.step = True

    def table(self, width: int) -> torch.Tensor:
        """The lane ids of every (row, head), ``[B, H, width]`` (missing entries point at the head's first lane:
        never visible); the groups' in-place runs are found again (:meth:`run`)."""
        rows = []
        for i, t in enumerate(self.host.tables):
            pad = t[0] if t else self.lane_offset[self.head_lane[i % self.num_heads][0]]
            rows.append(t + [pad] * (width - len(t)))
        out = torch.tensor(rows, dtype=torch.long, device=self.device).view(self.batch, self.num_heads, width)
        self.runs = [self.run(gi) for gi in range(len(self.lane_offset))]
        return out

    def blocks_needed(self, tokens: int) -> int:
        """Free blocks a write of ``tokens`` more tokens per (row, head) may need: the lanes each (row, head) may
        take, new ones and a copy of a shared one (an upper bound)."""
        bs, H, groups = self.block_size, self.num_heads, self.host.groups
        need = [0] * len(groups)
        for b, row in enumerate(self.fill):
            for h, f in enumerate(row):
                t = self.host.tables[b * H + h]
                shared = any(self.blocks.lane_refs[e] > 1 for e in t)
                new = self.lanes_to_add(b, h, tokens) if self.tails else -(-(f + tokens) // bs) - len(t)
                need[self.head_lane[h][0]] += max(0, new) + shared
        return max(0, *(-(-(n - len(self.blocks.lane_free[g])) // len(groups[g].heads))
                        for g, n in enumerate(need)))  # fmt: skip

    # ---------------------------------------------------------------- per-head tails (residual mode)
    def tail_lengths(self) -> list[list[int]]:
        """Tokens each (row, head) holds in its tail (full precision)."""
        return [[f - q for f, q in zip(fr, qr, strict=True)] for fr, qr in zip(self.fill, self.qfill, strict=True)]

    def tail_base(self) -> torch.Tensor:
        """``qfill`` as a ``[B, H]`` int64 tensor on the device (cached until a flush or a row change)."""
        if self._tail_base_cache is None:
            self._tail_base_cache = torch.tensor(self.qfill, dtype=torch.long, device=self.device).view(
                self.batch, self.num_heads)
        return self._tail_base_cache

    def set_qfill(self, qfill: list[list[int]]) -> None:
        """Slots each (row, head) holds in lanes; with tails the store's pool ends at the smallest."""
        self.qfill = qfill
        self._tail_base_cache = None
        if self.tails:
            self.host.q_end = min((q for r in qfill for q in r), default=0)

    def _tail_room(self) -> None:
        """Widen the tails to the longest one (zeros), so that every head's next slot has a place."""
        width = max((n for r in self.tail_lengths() for n in r), default=0)
        have = 0 if self.host.dense.res_k is None else self.host.dense.res_k.shape[2]
        if width <= have:
            return
        shape = (self.batch, self.num_heads, width - have, self.head_dim)
        pad = torch.zeros(shape, dtype=self.host.dense.dtype, device=self.device)
        dense = self.host.dense
        dense.res_k = pad if dense.res_k is None else torch.cat([dense.res_k, pad], dim=2)
        dense.res_v = pad.clone() if dense.res_v is None else torch.cat([dense.res_v, pad], dim=2)

    def lanes_to_add(self, b: int, h: int, tokens: int) -> int:
        """New lanes (row ``b``, head ``h``) takes when ``tokens`` more tokens reach it (flushed tail blocks)."""
        f, q = self.fill[b][h], self.qfill[b][h]
        return max(0, (f + tokens - q - self.residual_tokens) // self.block_size)

    def _flush_counts(self) -> list[list[int]]:
        """Blocks each (row, head) quantizes now (0 while static scales wait for calibration)."""
        if not self.host.dense.calibrated:
            return [[0] * self.num_heads for _ in range(self.batch)]
        return [[self.lanes_to_add(b, h, 0) for h in range(self.num_heads)] for b in range(self.batch)]

    def flush_ranges(self, grows: list[list[bool]] | None = None) -> dict[tuple[int, int], tuple[int, int]]:
        """The slot ranges of the lanes the next flush writes (``grows[b][h]``: that head's tail takes one more
        token first), for :meth:`plan` to reserve before anything changes."""
        if not self.host.dense.calibrated:
            return {}
        bs, out = self.block_size, {}
        for b in range(self.batch):
            for h in range(self.num_heads):
                m = self.lanes_to_add(b, h, int(grows[b][h]) if grows is not None else 0)
                if m:
                    out[(b, h)] = (self.qfill[b][h], self.qfill[b][h] + m * bs)
        return out

    def append_tails(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Residual mode of a lane layer: a chunk at the common slot end (every head's next slot: the prompt's
        kept tokens, compacted) joins the tails, then full tail blocks are quantized. A decode token announced by
        :meth:`grow` is written by :meth:`overwrite` instead (each head at its own slot)."""
        if self.overwrite_pending and keys.shape[2] == 1:
            return
        if any(q != self.host.q_end for r in self.qfill for q in r):
            raise AssertionError("lanes: a chunk joins the tails only while every head's tail starts at one slot")
        dk, dv = keys.to(self.host.dense.dtype), values.to(self.host.dense.dtype)
        held = self.host.cache_pos - self.host.q_end
        if self.host.dense.res_k is not None and held:
            dk = torch.cat([self.host.dense.res_k[:, :, :held], dk], dim=2)
            dv = torch.cat([self.host.dense.res_v[:, :, :held], dv], dim=2)
        self.host.dense.res_k, self.host.dense.res_v = dk.contiguous(), dv.contiguous()
        first = not any(self.host.tables)  # nothing in lanes yet: identical prompt rows share their lanes
        self.flush_tails(self.identical_heads(dk, dv, dk.shape[2]) if first else [])

    def write_tails(self, keys: torch.Tensor, values: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
        """Write the one-token ``keys/values[B, H, 1, D]`` of every (row, head) whose slot ``target[b, h]`` is in
        its tail (no host read); returns the ``[B, H]`` mask of the targets that are in lanes instead (a
        decode-time policy's victim), or None when none can be (every head grew: its target is its next slot)."""
        self._tail_room()
        base = self.tail_base()
        B, H = target.shape
        D = keys.shape[-1]
        in_tail = target >= base
        idx = (target - base).clamp(0, self.host.dense.res_k.shape[2] - 1).view(B, H, 1, 1).expand(B, H, 1, D)
        for buf, x in ((self.host.dense.res_k, keys), (self.host.dense.res_v, values)):
            old = buf.gather(2, idx)
            buf.scatter_(2, idx, torch.where(in_tail.view(B, H, 1, 1), x.to(buf.dtype), old))
        grows = self.grows
        return None if grows is not None and all(all(r) for r in grows) else ~in_tail

    def flush_tails(self, same: list[tuple[int, int, int]] | None = None) -> None:
        """Quantize each (row, head)'s full tail blocks beyond ``residual_tokens`` into new lanes of its own
        (lanes reserved first: :class:`~kvquant.blocks.KVCacheFull` before anything changes), then shift the
        tails. One quantization per head group for all flushing heads; only their tokens are written.
        ``same``: ``(row b, head h, row r)`` whose tails are equal (the first flush of identical prompt rows):
        ``(b, h)`` shares the lanes ``(r, h)`` writes."""
        m = self._flush_counts()
        M = max((x for r in m for x in r), default=0)
        if not M:
            return
        bs, B, H = self.block_size, self.batch, self.num_heads
        sharing = {(b, h) for b, h, _ in same or []}
        self.plan({k: r for k, r in self.flush_ranges().items() if k not in sharing})
        self.share(same or [])
        # which (row, head, token) pairs are written: from the host's counts (index tensors built on the host)
        dev = self.device
        wt = torch.tensor([[x * ((b, h) not in sharing) for h, x in enumerate(r)] for b, r in enumerate(m)])
        use = torch.arange(M * bs).view(1, 1, -1) < (wt * bs).unsqueeze(-1)  # [B, H, M * bs]: tokens written
        buse = torch.arange(M).view(1, 1, -1) < wt.unsqueeze(-1)  # [B, H, M]: blocks written
        qf = torch.tensor(self.qfill)
        k, v = self.host.dense.res_k[:, :, :M * bs], self.host.dense.res_v[:, :, :M * bs]
        table, L = self.host.table(), self.blocks.lanes_per_block
        for gi, g in enumerate(self.host.groups):
            sel = (lambda t: t) if g.all_heads else (lambda t, i=g.head_index: t.index_select(1, i))
            gu, gbu, gq = use[:, g.heads], buse[:, g.heads], qf[:, g.heads]
            rows, heads, toks = gu.nonzero(as_tuple=True)
            if not rows.numel():
                continue
            brows, bheads, bj = gbu.nonzero(as_tuple=True)
            slots, bslots = gq[rows, heads] + toks, gq[brows, bheads] + bj * bs
            rows, heads, toks, slots, brows, bheads, bj, bslots = (
                x.to(dev) for x in (rows, heads, toks, slots, brows, bheads, bj, bslots))
            gt, off = sel(table), self.lane_offset[gi]
            e, be = gt[rows, heads, slots // bs], gt[brows, bheads, bslots // bs]
            blocks = LanePlan(brows, bheads, bj, be // L, be % L - off, torch.zeros_like(bj))
            plan = LanePlan(rows, heads, toks, e // L, e % L - off, slots % bs, blocks)
            gk, gv = self._mask_tail_sinks(g, sel(k), sel(v), sel(self.tail_base()))
            write_pair(g.key, g.value, gk.to(k.dtype), gv.to(v.dtype), plan, self.check_finite, gu.to(dev))
        # shift: each head's tail now starts m[b][h] blocks later
        qfill = [[q + x * bs for q, x in zip(qr, mr, strict=True)] for qr, mr in zip(self.qfill, m, strict=True)]
        width = max(f - q for fr, qr in zip(self.fill, qfill, strict=True) for f, q in zip(fr, qr, strict=True))
        have = self.host.dense.res_k.shape[2]
        mt = torch.tensor(m, dtype=torch.long, device=dev)  # [B, H] blocks flushed
        idx = (torch.arange(width, device=dev).view(1, 1, -1) + mt.unsqueeze(-1) * bs).clamp_max(max(have - 1, 0))
        idx = idx.unsqueeze(-1).expand(B, H, width, self.host.dense.res_k.shape[3])
        dense = self.host.dense
        dense.res_k, dense.res_v = dense.res_k.gather(2, idx), dense.res_v.gather(2, idx)
        self.set_qfill(qfill)

    def _mask_tail_sinks(
        self, group: HeadGroup, k: torch.Tensor, v: torch.Tensor, base: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The flushed chunk of ``group`` with the sink slots of heads whose first lane it is masked as the
        per-row pool write masks them (sinks are read from the sink buffer)."""
        if not self.host.starts.sink_end:
            return k, v
        mk, mv = self.host.starts.mask_sinks(k, v, 0, group.per_block)
        first = (base == 0).view(*base.shape, 1, 1)
        return torch.where(first, mk, k), torch.where(first, mv, v)

    def lane_top(self, group: HeadGroup) -> int:
        """The largest ``qfill`` of ``group``'s heads: slots past it are in no lane of the group."""
        return max(self.qfill[b][h] for b in range(self.batch) for h in group.heads)

    def _tail_rows(self, group: HeadGroup, start: int, end: int, out: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Write each (row, head)'s tail rows of ``group`` that fall in slots ``[start, end)`` into ``out`` (K and V,
        float32 ``[B, Hg, end - start + 1, D]``: the last row takes the tail rows outside the range) at their slots."""
        W = 0 if self.host.dense.res_k is None else self.host.dense.res_k.shape[2]
        if not W:
            return
        sel = (lambda t: t) if group.all_heads else (lambda t, i=group.head_index: t.index_select(1, i))
        base = sel(self.tail_base())
        B, Hg, t = base.shape[0], base.shape[1], end - start
        dense = self.host.dense
        dk, dv = dense_to_group_space(group, sel(dense.res_k), sel(dense.res_v), dense.calibrated)
        at = base.unsqueeze(-1) + torch.arange(W, device=base.device) - start  # [B, Hg, W]: each tail row's slot
        at = torch.where((at >= 0) & (at < t), at, t).unsqueeze(-1).expand(B, Hg, W, self.head_dim)
        out[0].scatter_(2, at, dk)
        out[1].scatter_(2, at, dv)

    def read_tails(self, group: HeadGroup, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``group``'s slots ``[start, end)`` (``start >= q_end``) as float32 ``[B, Hg, t, D]``: each
        (row, head) from its lanes below its ``qfill``, from its tail above. The lanes of the range are read for
        every head, then each head's tail (at most the buffer's width) is written over its own slots: a head's
        slots past its lanes are its tail, or empty (never visible)."""
        t = end - start
        k = torch.zeros((self.batch, len(group.heads), t + 1, self.head_dim), device=self.device)
        v = torch.zeros_like(k)
        top = self.lane_top(group)
        if top > start:  # some head holds some of these slots in lanes
            bs = self.block_size
            a0, n = start // bs * bs, min(end, top) - start
            lk, lv = self.host.read_quantized(group, a0, -(-(start + n) // bs) * bs)
            k[:, :, :n], v[:, :, :n] = lk[:, :, start - a0:start - a0 + n], lv[:, :, start - a0:start - a0 + n]
        self._tail_rows(group, start, end, (k, v))
        return k[:, :, :t], v[:, :, :t]

    def factored_tails(self, group: HeadGroup, start: int, end: int) -> tuple[Factored, Factored]:
        """``group``'s slots ``[start, end)`` (``end <=`` :meth:`lane_top`, block-aligned ``start``) as factored K and
        V: each (row, head, block) either in the head's lanes (codes and scales) or in its tail or empty (the tail's
        values as codes, scale 1, zero 0). Dequantized (:meth:`_read_tails`) when a scale is one per head."""
        kf, vf = self.host.read_pool(group, start, end, factored=True)
        if any(f.scale is not None and not f.block and f.scale.shape[2] == 1 for f in (kf, vf)):
            k, v = self.read_tails(group, start, end)
            return Factored(k), Factored(v)
        t = end - start
        # a copy of the codes (+ 1 row for the tail rows outside the range) with each head's tail rows written over
        # its own slots past its lanes (its tail, or empty slots: never visible)
        rows = tuple(torch.cat([f.codes, f.codes.new_zeros(*f.codes.shape[:2], 1, f.codes.shape[3])], dim=2)
                     for f in (kf, vf))  # fmt: skip
        self._tail_rows(group, start, end, rows)
        sel = (lambda x: x) if group.all_heads else (lambda x, i=group.head_index: x.index_select(1, i))
        base = sel(self.tail_base()).unsqueeze(-1)  # [B, Hg, 1]
        tail = torch.arange(start, end, device=base.device) >= base  # [B, Hg, t]: not in the head's lanes
        out = []
        for f, r in zip((kf, vf), rows, strict=True):
            codes = r[:, :, :t]
            if f.block:  # per (block, channel): a block is wholly in the lanes or wholly past them
                tb = (torch.arange(start, end, f.block, device=base.device) >= base).unsqueeze(-1)
                out.append(Factored(codes, torch.where(tb, 1.0, f.scale), torch.where(tb, 0.0, f.zero), f.block))
            elif f.scale is not None:  # per token
                out.append(Factored(codes, torch.where(tail.unsqueeze(-1), 1.0, f.scale)))
            else:
                out.append(Factored(codes))
        return out[0], out[1]

    # ---------------------------------------------------------------- per-head block lanes (AdaKV layers)
    def plan(self, ranges: dict[tuple[int, int], tuple[int, int]]) -> None:
        """Lanes: make the lanes that slots ``[a, e)`` of every (row ``b``, head ``h``) in ``ranges`` touch exist
        and be held by this (row, head) alone (new lanes allocated, shared ones copied first). Every lane is
        reserved before any table changes, so :class:`KVCacheFull` leaves everything as it was."""
        bs, H = self.block_size, self.num_heads
        need = [0] * len(self.host.groups)
        todo = []
        for (b, h), (a, e) in ranges.items():
            t = self.host.tables[b * H + h]
            g = self.head_lane[h][0]
            if a // bs > len(t):
                raise AssertionError(f"lanes: row {b} head {h} would skip block {len(t)}")
            for j in range(a // bs, -(-e // bs)):
                if j >= len(t) or self.blocks.lane_refs[t[j]] > 1:
                    todo.append((b, h, j, g))
                    need[g] += 1
        if not todo:
            return
        self.blocks.ensure_lanes(need)  # may raise KVCacheFull: nothing changed yet
        L = self.blocks.lanes_per_block
        for b, h, j, g in sorted(todo, key=lambda w: (w[0], w[2], w[1])):  # block index first: heads side by side
            t = self.host.tables[b * H + h]
            if j >= len(t):  # in order: j == len(t); at the head's slot of the row's block j if that lane is free
                k = self.lane_offset[g] + self.head_lane[h][1]
                rb = next((x[j] // L for x in self.host.tables[b * H:(b + 1) * H] if j < len(x)), None)
                t.append(self.blocks.allocate_lane(g, prefer=None if rb is None else rb * L + k))
            else:  # copy-on-write (beams share lanes after a reorder)
                old = t[j]
                t[j] = self.blocks.copy_lane(old)
                self.blocks.decref_lanes([old])
                self.host.bytes_moved += self.blocks.lane_bytes(g)
        self.host.tables_changed()

    def write(self, keys: torch.Tensor, values: torch.Tensor, pos: int) -> None:
        """Lanes: quantize a chunk at slots ``[pos, pos + T)`` into the lanes of the (row, head) pairs that hold
        those slots (``fill``); empty slots take no lane. On the first write, rows whose head holds the same
        tokens share its lanes (beam search's identical prompts: written once)."""
        B, H, T, _ = keys.shape
        bs, end = self.block_size, pos + T
        same = self.identical_heads(keys, values, end) if pos == 0 else []
        writer = [[True] * H for _ in range(B)]
        for b, h, _ in same:
            writer[b][h] = False
        ranges = {(b, h): (pos, min(end, self.fill[b][h]))
                  for b in range(B) for h in range(H) if writer[b][h] and self.fill[b][h] > pos}  # fmt: skip
        self.plan(ranges)
        self.share(same)
        # which (row, head, token) pairs are written: from the host's fills (no device read)
        slot = torch.arange(pos, end)
        use = (slot.view(1, 1, -1) < torch.tensor(self.fill).unsqueeze(-1)) & torch.tensor(writer).unsqueeze(-1)
        table = self.host.table()
        for gi, g in enumerate(self.host.groups):
            gu = use if g.all_heads else use[:, g.heads]
            rows, heads, toks = (x.to(self.device) for x in gu.nonzero(as_tuple=True))
            if not rows.numel():
                continue
            s = toks + pos
            gt = table if g.all_heads else table.index_select(1, g.head_index)
            self.put(gi, keys, values, rows, heads, toks, gt[rows, heads, s // bs], s)
        self.host.q_end = end

    def identical_heads(self, keys: torch.Tensor, values: torch.Tensor, end: int) -> list[tuple[int, int, int]]:
        """``(row b, head h, row r)``: row ``b``'s head ``h`` holds the same slots ``[0, end)`` as row ``r < b``'s (same
        fill, static state, K and V), so it can share ``r``'s lanes (beam search's identical prompt rows)."""
        B, H = keys.shape[:2]
        same: list[tuple[int, int, int]] = []
        for h in range(H if B > 1 else 0):
            reps: list[int] = []
            for b in range(B):
                f = min(end, self.fill[b][h])
                for r in reps:
                    if (self.fill[r][h] == self.fill[b][h] and self._same_state(b, r)
                            and torch.equal(keys[b, h, :f], keys[r, h, :f])
                            and torch.equal(values[b, h, :f], values[r, h, :f])):  # fmt: skip
                        same.append((b, h, r))
                        break
                else:
                    reps.append(b)
        return same

    def share(self, same: list[tuple[int, int, int]]) -> None:
        """Give each ``(row b, head h)`` of ``same`` the lanes of ``(row r, head h)`` (references taken)."""
        H = self.num_heads
        for b, h, r in same:
            t = list(self.host.tables[r * H + h])
            self.blocks.incref_lanes(t)
            self.blocks.decref_lanes(self.host.tables[b * H + h])
            self.host.tables[b * H + h] = t
        if same:
            self.host.tables_changed()

    def put(
        self, gi: int, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, heads: torch.Tensor,
        toks: torch.Tensor, entries: torch.Tensor, slots: torch.Tensor,
    ) -> None:
        """Quantize and write token ``toks[i]`` of (row ``rows[i]``, group-local head ``heads[i]``) of head group
        ``gi`` at lane entry ``entries[i]`` (``block * lanes_per_block + lane``), slot ``slots[i]``."""
        g, L = self.host.groups[gi], self.blocks.lanes_per_block
        k = keys if g.all_heads else keys.index_select(1, g.head_index)
        v = values if g.all_heads else values.index_select(1, g.head_index)
        plan = LanePlan(rows, heads, toks, entries // L, entries % L - self.lane_offset[gi], slots % self.block_size)
        write_pair(g.key, g.value, k, v, plan, self.check_finite)

    def _same_state(self, b: int, r: int) -> bool:
        """Rows ``b`` and ``r`` have the same per-sequence static state (scales) in every head group."""
        return all(torch.equal(t[b], t[r]) for g in self.host.groups for st in (g.key, g.value)
                   for n, t in st.state.items() if st.quantizer.per_sequence(n, t))  # fmt: skip

    def grow(self, victim: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
        """Lanes, one new token per row: where each head writes it, ``(target[B, H], appended)``.

        Heads fill their slots from 0 without holes, so a (row, head) holding ``n`` tokens holds slots
        ``[0, n)`` and ``ceil(n / block_size)`` lanes. A head below its decode budget (``cap``; none for
        prefill-time policies) or without ``victim`` writes the token at its next slot ``n``; a head at its
        budget writes it over ``victim[b, h]`` (a decode-time policy's choice, :func:`~kvquant.evict.choose_slots`).
        ``appended``: some head's next slot is the slot axis' end, which then grows by one (call :meth:`append`,
        which writes only those heads, then :meth:`overwrite` with ``target``). The lanes these writes need are
        allocated (or copied, when shared) here, before anything changes."""
        B, H, S = self.batch, self.num_heads, self.host.cache_pos
        cap = self.cap_host if victim is not None else None
        grows = [[cap is None or self.fill[b][h] < cap[b][h] for h in range(H)] for b in range(B)]
        if self.tails:  # the token joins the head's tail; the lanes are those of the tail blocks it fills
            ranges = self.flush_ranges(grows)
        else:  # (slots past q_end are held dense while static scales wait for calibration: lanes when flushed)
            ranges = {(b, h): (self.fill[b][h], self.fill[b][h] + 1) for b in range(B) for h in range(H)
                      if grows[b][h] and (self.host.dense.calibrated or self.fill[b][h] < self.host.q_end)}  # fmt: skip
        replace = victim is not None and not all(all(r) for r in grows)
        if replace and any(self.blocks.lane_refs[e] > 1 for t in self.host.tables for e in t):
            vt = victim.tolist()  # a shared lane may be written: copy it first (host read only then)
            lim = self.qfill if self.tails else [[self.host.q_end] * H] * B
            ranges.update({(b, h): (vt[b][h], vt[b][h] + 1) for b in range(B) for h in range(H)
                           if not grows[b][h] and vt[b][h] < lim[b][h]})  # fmt: skip
        self.plan(ranges)  # may raise KVCacheFull: nothing changed yet
        self.grows = grows
        old = torch.tensor(self.fill, dtype=torch.long, device=self.device)
        appended = any(self.fill[b][h] == S for b in range(B) for h in range(H) if grows[b][h])
        for b in range(B):
            for h in range(H):
                self.fill[b][h] += grows[b][h]
        self.step = self.overwrite_pending = appended
        if not replace:
            return old, appended
        return torch.where(torch.tensor(grows, device=self.device), old, victim.to(old.device)), appended

    def overwrite(self, keys: torch.Tensor, values: torch.Tensor, target: torch.Tensor) -> None:
        """Lanes: write the one-token ``keys/values`` of every (row, head) at its slot ``target[b, h]`` (lanes
        made ready by :meth:`grow`; a head whose slot :meth:`append` wrote is written again, unchanged)."""
        self.overwrite_pending = False
        t = target.long()
        pool = None
        if self.tails:  # each head's tail takes its token, unless its target is in its lanes (a victim)
            pool = self.write_tails(keys, values, t)
            if pool is not None and self.host.tables and max(len(x) for x in self.host.tables):
                self.put_token(keys, values, torch.where(pool, t, 0), pool)
            self.flush_tails()
            return
        if self.host.q_end < self.host.cache_pos:  # static scales not calibrated yet: slots past q_end are held dense
            dense = t >= self.host.q_end
            b, h = dense.nonzero(as_tuple=True)
            self.host.dense.write_held(keys, values, b, h, t[b, h], self.host.q_end)
            pool = ~dense
            t = torch.where(dense, 0, t)
        if self.host.tables and max(len(x) for x in self.host.tables):
            self.put_token(keys, values, t, pool)

    def put_token(
        self, keys: torch.Tensor, values: torch.Tensor, t: torch.Tensor, pool: torch.Tensor | None
    ) -> None:
        """Write the one-token ``keys/values`` of every (row, head) at lane slot ``t[b, h]`` (only where
        ``pool[b, h]``, when given)."""
        B, bs = self.batch, self.block_size
        e = self.host.table().gather(2, (t // bs).unsqueeze(-1)).squeeze(-1)  # [B, H] lane ids
        for gi, g in enumerate(self.host.groups):
            n = len(g.heads)
            eg, tg = (e, t) if g.all_heads else (e.index_select(1, g.head_index), t.index_select(1, g.head_index))
            rows = torch.arange(B, device=self.device).repeat_interleave(n)
            heads = torch.arange(n, device=self.device).repeat(B)
            eg, tg = eg.reshape(-1), tg.reshape(-1)
            if pool is not None:
                sel = (pool if g.all_heads else pool.index_select(1, g.head_index)).reshape(-1).nonzero().flatten()
                rows, heads, eg, tg = rows[sel], heads[sel], eg[sel], tg[sel]
            self.put(gi, keys, values, rows, heads, torch.zeros_like(rows), eg, tg)

    def run(self, gi: int) -> int | None:
        """One sequence whose heads of group ``gi`` hold lanes ``j`` at blocks ``run + j``, each at its own head
        slot: ``run`` (the attention then reads the group's blocks ``[run, run + width)`` in place; a head's
        slots past its count are masked), else None."""
        if self.batch != 1:
            return None
        L, off, run = self.blocks.lanes_per_block, self.lane_offset[gi], None
        for i, h in enumerate(self.host.groups[gi].heads):
            t = self.host.tables[h]
            if not t:
                continue
            run = t[0] // L if run is None else run
            if any(e != (run + j) * L + off + i for j, e in enumerate(t)):
                return None
        width = max(len(t) for t in self.host.tables)
        return run if run is not None and run + width <= self.blocks.num_blocks else None

    def pool_table(self, group: HeadGroup, lt: torch.Tensor, j0: int) -> tuple[Any, int | None]:
        """What ``group``'s pool read takes for lane blocks ``lt`` (``[B, H, nb]``, from block ``j0``): ``(the head's
        first lane's block, run)`` for one sequence whose lanes lie in a run (read in place), else ``((block, head
        slot) of every (row, head, block), None)``."""
        run = self.runs[group.key.group]
        if run is not None:
            return lt[:, 0], run + j0
        lt = group_rows(lt, group)
        L = self.blocks.lanes_per_block
        return (lt // L, lt % L - self.lane_offset[group.key.group]), None

    def lane_counts(self, lanes: list[int]) -> tuple[list[int], int]:
        """Of the distinct lanes ``lanes``: how many each group holds, and the bytes of those referenced more than
        once."""
        per_group = [0] * len(self.lane_offset)
        shared = 0
        for e in lanes:
            g = self.blocks.lane_where(e)[1]
            per_group[g] += 1
            if self.blocks.lane_refs[e] > 1:
                shared += self.blocks.lane_bytes(g)
        return per_group, shared
