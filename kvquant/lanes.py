"""Per-head full-precision tails of AdaKV lane layers that quantize whole blocks (per-channel keys, or a
``residual_tokens`` window): :class:`TailLanes`, mixed into :class:`~kvquant.store.LayerStore`.

A lane layer (:mod:`kvquant.blocks` lanes, one table per (row, KV head)) fills each head's slots from 0 without
holes, each head at its own pace. A layer whose quantizers need whole blocks (per-channel key scales over a
block's tokens) or that keeps its newest tokens in full precision cannot quantize a row's block of every head at
once: each (row, head) then has its own *tail*. Slots ``[0, qfill[b][h])`` of (row ``b``, head ``h``) are in
its lanes (whole lanes, ``qfill`` a multiple of ``block_size``), slots ``[qfill[b][h], fill[b][h])`` in full
precision, at ``res_k[b, h, slot - qfill[b][h]]`` (``res_k`` / ``res_v``: ``[B, H, W, D]``, ``W`` the longest
tail; a head's entries past its own tail are unused). When a head's tail reaches ``residual_tokens +
block_size`` tokens, its oldest ``block_size`` tokens are quantized into a new lane of that head alone (per-channel
scales of that lane: that head's tokens only), once. So a (row, head) holding ``n`` tokens holds
``max(0, (n - residual_tokens) // block_size)`` lanes and ``n`` minus that many blocks' tokens in its tail.

The layer's ``q_end`` is the smallest ``qfill`` (slots below it are in every head's lanes): reads of
``[0, q_end)`` are plain lane reads, reads past it merge each head's lanes and tail by its own ``qfill``.
While static scales wait for calibration every ``qfill`` is 0: the tails are then the layer's held tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .tensor_store import LanePlan, write_pair

if TYPE_CHECKING:
    from .store import HeadGroup


class TailLanes:
    """Per-(row, head) tails of a lane layer in residual mode (see the module doc); ``LayerStore`` methods."""

    # attributes of LayerStore that these methods use
    lanes: bool
    residual_mode: bool
    calibrated: bool
    batch: int
    num_heads: int
    head_dim: int
    block_size: int
    residual_tokens: int
    cache_pos: int
    q_end: int
    sink_end: int
    device: torch.device
    dense_dtype: torch.dtype | None
    fill: list[list[int]]  # slots per (row, head)
    qfill: list[list[int]]  # of which in lanes (a multiple of block_size)
    res_k: torch.Tensor | None
    res_v: torch.Tensor | None
    _tail_base_cache: torch.Tensor | None
    _lane_grows: list[list[bool]] | None  # grow_lanes: which heads take their next slot this step
    _lane_overwrite: bool

    @property
    def tail_lanes(self) -> bool:
        """True when this is a lane layer whose heads keep their own full-precision tails."""
        return self.lanes and self.residual_mode

    def tail_lengths(self) -> list[list[int]]:
        """Tokens each (row, head) holds in its tail (full precision)."""
        return [[f - q for f, q in zip(fr, qr, strict=True)] for fr, qr in zip(self.fill, self.qfill, strict=True)]

    def _tail_base(self) -> torch.Tensor:
        """``qfill`` as a ``[B, H]`` int64 tensor on the device (cached until a flush or a row change)."""
        if self._tail_base_cache is None:
            self._tail_base_cache = torch.tensor(self.qfill, dtype=torch.long, device=self.device).view(
                self.batch, self.num_heads)
        return self._tail_base_cache

    def _set_qfill(self, qfill: list[list[int]]) -> None:
        self.qfill = qfill
        self._tail_base_cache = None
        if self.tail_lanes:
            self.q_end = min((q for r in qfill for q in r), default=0)

    def _tail_room(self) -> None:
        """Widen the tails to the longest one (zeros), so that every head's next slot has a place."""
        width = max((n for r in self.tail_lengths() for n in r), default=0)
        have = 0 if self.res_k is None else self.res_k.shape[2]
        if width <= have:
            return
        shape = (self.batch, self.num_heads, width - have, self.head_dim)
        pad = torch.zeros(shape, dtype=self.dense_dtype, device=self.device)
        self.res_k = pad if self.res_k is None else torch.cat([self.res_k, pad], dim=2)
        self.res_v = pad.clone() if self.res_v is None else torch.cat([self.res_v, pad], dim=2)

    def lanes_to_add(self, b: int, h: int, tokens: int) -> int:
        """New lanes (row ``b``, head ``h``) takes when ``tokens`` more tokens reach it (flushed tail blocks)."""
        f, q = self.fill[b][h], self.qfill[b][h]
        return max(0, (f + tokens - q - self.residual_tokens) // self.block_size)

    def _flush_counts(self) -> list[list[int]]:
        """Blocks each (row, head) quantizes now (0 while static scales wait for calibration)."""
        if not self.calibrated:
            return [[0] * self.num_heads for _ in range(self.batch)]
        return [[self.lanes_to_add(b, h, 0) for h in range(self.num_heads)] for b in range(self.batch)]

    def flush_ranges(self, grows: list[list[bool]] | None = None) -> dict[tuple[int, int], tuple[int, int]]:
        """The slot ranges of the lanes the next flush writes (``grows[b][h]``: that head's tail takes one more
        token first), for :meth:`~kvquant.store.LayerStore._lane_plan` to reserve before anything changes."""
        if not self.calibrated:
            return {}
        bs, out = self.block_size, {}
        for b in range(self.batch):
            for h in range(self.num_heads):
                m = self.lanes_to_add(b, h, int(grows[b][h]) if grows is not None else 0)
                if m:
                    out[(b, h)] = (self.qfill[b][h], self.qfill[b][h] + m * bs)
        return out

    def _append_tails(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Residual mode of a lane layer: a chunk at the common slot end (every head's next slot: the prompt's
        kept tokens, compacted) joins the tails, then full tail blocks are quantized. A decode token announced by
        ``grow_lanes`` is written by ``overwrite`` instead (each head at its own slot)."""
        if self._lane_overwrite and keys.shape[2] == 1:
            return
        if any(q != self.q_end for r in self.qfill for q in r):
            raise AssertionError("lanes: a chunk joins the tails only while every head's tail starts at one slot")
        dk, dv = keys.to(self.dense_dtype), values.to(self.dense_dtype)
        held = self.cache_pos - self.q_end
        if self.res_k is not None and held:
            dk = torch.cat([self.res_k[:, :, :held], dk], dim=2)
            dv = torch.cat([self.res_v[:, :, :held], dv], dim=2)
        self.res_k, self.res_v = dk.contiguous(), dv.contiguous()
        first = not any(self.tables)  # nothing in lanes yet: identical prompt rows share their lanes
        self.flush_tails(self._identical_heads(dk, dv, dk.shape[2]) if first else [])

    def _write_tails(self, keys: torch.Tensor, values: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
        """Write the one-token ``keys/values[B, H, 1, D]`` of every (row, head) whose slot ``target[b, h]`` is in
        its tail (no host read); returns the ``[B, H]`` mask of the targets that are in lanes instead (a
        decode-time policy's victim), or None when none can be (every head grew: its target is its next slot)."""
        self._tail_room()
        base = self._tail_base()
        B, H = target.shape
        D = keys.shape[-1]
        in_tail = target >= base
        idx = (target - base).clamp(0, self.res_k.shape[2] - 1).view(B, H, 1, 1).expand(B, H, 1, D)
        for buf, x in ((self.res_k, keys), (self.res_v, values)):
            old = buf.gather(2, idx)
            buf.scatter_(2, idx, torch.where(in_tail.view(B, H, 1, 1), x.to(buf.dtype), old))
        grows = self._lane_grows
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
        self._lane_plan({k: r for k, r in self.flush_ranges().items() if k not in sharing})
        self._share_lanes(same or [])
        dev = self.device
        mt = torch.tensor(m, dtype=torch.long, device=dev)  # [B, H] blocks flushed
        wt = torch.tensor([[x * ((b, h) not in sharing) for h, x in enumerate(r)] for b, r in enumerate(m)],
                          dtype=torch.long, device=dev)  # blocks written  # fmt: skip
        use = torch.arange(M * bs, device=dev).view(1, 1, -1) < (wt * bs).unsqueeze(-1)  # [B, H, M * bs]
        buse = torch.arange(M, device=dev).view(1, 1, -1) < wt.unsqueeze(-1)  # [B, H, M]
        base = self._tail_base()
        k, v = self.res_k[:, :, :M * bs], self.res_v[:, :, :M * bs]
        table, L = self.table(), self.blocks.lanes_per_block
        for gi, g in enumerate(self.groups):
            sel = (lambda t: t) if g.all_heads else (lambda t, i=g.head_index: t.index_select(1, i))
            gk, gv = self._mask_tail_sinks(g, sel(k), sel(v), sel(base))
            gt, gb, gu, gbu = sel(table), sel(base), sel(use), sel(buse)
            rows, heads, toks = gu.nonzero(as_tuple=True)
            if not rows.numel():
                continue
            slots = gb[rows, heads] + toks
            e = gt[rows, heads, slots // bs]
            off = self.lane_offset[gi]
            brows, bheads, bj = gbu.nonzero(as_tuple=True)
            be = gt[brows, bheads, gb[brows, bheads] // bs + bj]
            blocks = LanePlan(brows, bheads, bj, be // L, be % L - off, torch.zeros_like(bj))
            plan = LanePlan(rows, heads, toks, e // L, e % L - off, slots % bs, blocks)
            write_pair(g.key, g.value, gk.to(k.dtype), gv.to(v.dtype), plan, self.config.check_finite, gu)
        # shift: each head's tail now starts m[b][h] blocks later
        qfill = [[q + x * bs for q, x in zip(qr, mr, strict=True)] for qr, mr in zip(self.qfill, m, strict=True)]
        width = max(f - q for fr, qr in zip(self.fill, qfill, strict=True) for f, q in zip(fr, qr, strict=True))
        have = self.res_k.shape[2]
        idx = (torch.arange(width, device=dev).view(1, 1, -1) + mt.unsqueeze(-1) * bs).clamp_max(max(have - 1, 0))
        idx = idx.unsqueeze(-1).expand(B, H, width, self.res_k.shape[3])
        self.res_k, self.res_v = self.res_k.gather(2, idx), self.res_v.gather(2, idx)
        self._set_qfill(qfill)

    def _mask_tail_sinks(
        self, group: HeadGroup, k: torch.Tensor, v: torch.Tensor, base: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The flushed chunk of ``group`` with the sink slots of heads whose first lane it is masked as the
        per-row pool write masks them (sinks are read from the sink buffer)."""
        if not self.sink_end:
            return k, v
        mk, mv = self._mask_sinks(k, v, 0, group.per_block)
        first = (base == 0).view(*base.shape, 1, 1)
        return torch.where(first, mk, k), torch.where(first, mv, v)

    def _read_tails(self, group: HeadGroup, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``group``'s slots ``[start, end)`` (``start >= q_end``) as float32 ``[B, Hg, t, D]``: each
        (row, head) from its lanes below its ``qfill``, from its tail above."""
        sel = (lambda t: t) if group.all_heads else (lambda t, i=group.head_index: t.index_select(1, i))
        base = sel(self._tail_base())
        B, Hg, D, t = self.batch, base.shape[1], self.head_dim, end - start
        slot = torch.arange(start, end, device=base.device)
        if self.res_k is not None and self.res_k.shape[2]:
            idx = (slot.view(1, 1, -1) - base.unsqueeze(-1)).clamp(0, self.res_k.shape[2] - 1)
            idx = idx.unsqueeze(-1).expand(B, Hg, t, D)
            k = sel(self.res_k).gather(2, idx)
            v = sel(self.res_v).gather(2, idx)
            k, v = self._dense_to_group_space(group, k, v)
        else:
            k = torch.zeros((B, Hg, t, D), device=base.device)
            v = torch.zeros_like(k)
        top = max(self.qfill[b][h] for b in range(B) for h in group.heads)
        if top > start:  # some head holds some of these slots in lanes
            bs = self.block_size
            a0, e = start // bs * bs, min(end, top)
            lk, lv = self._read_quantized(group, a0, -(-e // bs) * bs)
            n = e - start
            lanes = (slot[:n].view(1, 1, -1) < base.unsqueeze(-1)).unsqueeze(-1)
            k[:, :, :n] = torch.where(lanes, lk[:, :, start - a0:start - a0 + n], k[:, :, :n])
            v[:, :, :n] = torch.where(lanes, lv[:, :, start - a0:start - a0 + n], v[:, :, :n])
        return k, v
