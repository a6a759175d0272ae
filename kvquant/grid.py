"""Per-row block grids of one layer's store: each left-padded row's blocks start at its own first real token.

A layer with per-block (``int*-channel``) parts in residual mode, flushed a block at a time, cuts a left-padded
batch's blocks on each row's own grid (:func:`shifts_grid` says when): row ``b``'s position ``p`` lives at slot
``p + shift[b]`` of its blocks, so that its per-channel key blocks hold the tokens they hold alone. The pool holds
slots ``[0, slot_end)`` of every row, ``q_end = slot_end - max(shift)`` (0 while no block is written) is where every
row's pool positions end, and the residual holds positions ``[q_end, cache_pos)`` of every row (a row's first ones
may be its pool's already; reads take them from there).

:class:`RowGrid` is the component of a :class:`~kvquant.store.LayerStore` that holds the shifts and the slot end;
what it reads of the store (the table tensor, the held rows, each row's starts) comes as arguments.
"""

from __future__ import annotations

import copy as _copy
from typing import Any

import torch

from .groups import HeadGroup, group_rows
from .plan import LayerPlan
from .rows import RowStarts
from .tensor_store import pool_rows


def shifts_grid(groups: list[HeadGroup], plan: LayerPlan, scales_file: bool) -> bool:
    """True when a left-padded batch cuts this layer's blocks on each row's own grid (see the module doc): a layer
    with per-block (``int*-channel``) parts in residual mode whose blocks are flushed a block at a time, without
    static scales fitted on the data (``scales_file``: they come from a file) or codebook quantizers, lanes, a
    sliding window, the age ladder, heavy rows or offload (those keep the batch's grid, and so does an evicting
    layer's first write; see docs/batch-independence.md)."""
    qs = [q for g in groups for q in (g.key.quantizer, g.value.quantizer)]
    return (any(q.per_block for q in qs) and plan.residual_step == groups[0].key.block_size and not plan.lanes
            and plan.window is None and not plan.ladder_tokens and not plan.heavy_tokens and not plan.offload
            and not any(q.space for q in qs) and (scales_file or not any(q.static for q in qs)))  # fmt: skip


class RowGrid:
    """The rows' own block grids (see the module doc): ``shift[b]`` slots before row ``b``'s position 0.

    Args:
        shift: per row, ``-row_start[b] mod block_size``.
        block_size, residual_tokens: the layer's block and full-precision window.
        device: the layer's device.
    """

    def __init__(self, shift: list[int], block_size: int, residual_tokens: int, device: torch.device) -> None:
        self.shift = shift
        self.shift_t = torch.tensor(shift, dtype=torch.long, device=device)  # (shift on the device)
        self.slot_end = 0  # the pool holds slots [0, slot_end) of every row
        self.block_size = block_size
        self.residual_tokens = residual_tokens
        self.device = device

    def copy(self) -> RowGrid:
        """A copy with its own shifts (tensors are replaced, never written in place)."""
        new = _copy.copy(self)
        new.shift = list(self.shift)
        return new

    def index_batch(self, idx: torch.Tensor, rows: list[int]) -> None:
        """Rows reordered / selected / repeated: each row's grid follows it."""
        self.shift, self.shift_t = [self.shift[i] for i in rows], self.shift_t.index_select(0, idx)

    def pool_end(self) -> int:
        """Where every row's pool positions end (0 while no block is written)."""
        return max(0, self.slot_end - max(self.shift))

    def crop_floor(self) -> int:
        """The fewest tokens a crop may keep (fewer would cut a quantized block of some row)."""
        return self.slot_end - min(self.shift)

    def check_crop(self, tokens: int) -> None:
        """The ValueError a crop to ``tokens`` raises when it would cut a quantized block of some row."""
        if tokens < self.crop_floor():
            raise ValueError(
                f"crop: keeping {tokens} tokens would cut a quantized per-channel block of a left-padded row (each "
                f"row's blocks start at its own first real token); keep at least {self.crop_floor()}"
            )

    def slot_ends(self, cache_pos: int) -> list[int]:
        """Per row, the slot its own pool would end at with ``cache_pos`` tokens written (its residual window counted
        from its first real token, whole blocks of its own grid, as alone)."""
        bs, R = self.block_size, self.residual_tokens
        return [max(self.slot_end, (cache_pos + d - R) // bs * bs) for d in self.shift]

    def blocks_needed(self, batch: int, cache_pos: int) -> int:
        """Free blocks a write reaching ``cache_pos`` tokens needs: slots ``[slot_end, the earliest row's own flush
        point)`` of every row."""
        return batch * max(0, min(self.slot_ends(cache_pos)) - self.slot_end) // self.block_size

    def slot_starts(self, row_start: torch.Tensor) -> torch.Tensor:
        """Per row, the slot of its first real token ``row_start[b]`` (a block boundary)."""
        return row_start + self.shift_t

    def slot_chunk(self, x: torch.Tensor, base: int, s0: int, s1: int) -> torch.Tensor:
        """Slots ``[s0, s1)`` of every row from ``x[B, H, t, D]``, which holds positions ``[base, base + t)``; slots
        before a row's position 0 are zeros (slots past ``x``: any of its rows)."""
        B, H, _, D = x.shape
        idx = torch.arange(s0, s1, device=x.device)[None, :] - self.shift_t.to(x.device)[:, None] - base  # [B, F]
        out = x.gather(2, idx.clamp(0, x.shape[2] - 1)[:, None, :, None].expand(B, H, s1 - s0, D))
        return torch.where((idx >= 0)[:, None, :, None], out, torch.zeros((), dtype=x.dtype, device=x.device))

    def flush(
        self, dk: torch.Tensor, dv: torch.Tensor, q0: int, cache_pos: int
    ) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
        """The residual ``dk/dv`` (positions ``[q0, cache_pos)`` of every row; a row's first ones may be in its pool
        already) past every row's own flush point: ``(its slots [slot_end, s1) of every row, K and V, slot_end, the
        pool's end after them)``, the slot end moved to ``s1``; None while some row's flush point is not past the
        slot end. A row whose own flush point is further reads its next block as its pool will (:meth:`read_held`)."""
        s0, s1 = self.slot_end, min(self.slot_ends(cache_pos))
        if s1 <= s0:
            return None
        ck, cv = self.slot_chunk(dk, q0, s0, s1), self.slot_chunk(dv, q0, s0, s1)
        self.slot_end = s1
        return ck, cv, s0, self.pool_end()  # (every row holds its positions below the pool's end in the pool)

    def read_pool(
        self, group: HeadGroup, start: int, end: int, table: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V of ``group``'s pool positions ``[start, end)`` (``end <=`` :meth:`pool_end`): each
        row's slots ``[start + shift, end + shift)``, read as whole blocks and gathered per row (float32)."""
        bs = self.block_size
        j0, j1 = start // bs, -(-(end + max(self.shift)) // bs)
        tbl = table[:, j0:j1]
        rel = torch.arange(start - j0 * bs, end - j0 * bs, device=self.device)[None, :] + self.shift_t[:, None]
        out = []
        for s in (group.key, group.value):
            y = s.read(tbl, 0, (j1 - j0) * bs)
            out.append(y.gather(2, rel[:, None, :, None].expand(-1, y.shape[1], -1, y.shape[3])))
        return out[0], out[1]

    def read_held(
        self, group: HeadGroup, start: int, end: int, held: tuple[torch.Tensor, torch.Tensor], q0: int,
        cache_pos: int, table: torch.Tensor, starts: RowStarts, memo: dict[Any, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``group`` for positions ``[start, end)``, ``start >= q0`` (the pool's end; ``held``: the full
        precision K, V of positions ``[q0, cache_pos)``): per row from its pool where its slot is below the pool's
        end, quantized as its pool will hold it where its own flush point has passed the slot (:meth:`slot_ends`),
        else (and its sink tokens) as held (float32). ``memo`` keeps the quantized next blocks until the held rows
        change."""
        bs, S = self.block_size, self.slot_end
        dense = [group_rows(x[:, :, start - q0:end - q0], group).float() for x in held]
        slot = torch.arange(start, end, device=self.device)[None, :] + self.shift_t[:, None]  # [B, t]
        out = [d.clone() for d in dense]
        if start + min(self.shift) < S:  # some rows' first ones are in their pool
            j0 = (start + min(self.shift)) // bs
            tbl = table[:, j0:S // bs]
            rel = (slot - j0 * bs).clamp(0, (S // bs - j0) * bs - 1)
            for i, s in enumerate((group.key, group.value)):
                y = s.read(tbl, 0, (S // bs - j0) * bs)
                y = y.gather(2, rel[:, None, :, None].expand(-1, y.shape[1], -1, y.shape[3]))
                out[i] = torch.where((slot < S)[:, None, :, None], y, out[i])
        ends = self.slot_ends(cache_pos)
        top = max(ends)
        if top > S:  # rows past their own flush point: their next block as their pool will hold it
            key = ("shift", group.key.group, S, top)
            block = memo.get(key)
            if block is None:
                ck, cv = (self.slot_chunk(x, q0, S, top) for x in held)
                ck, cv = starts.mask_sinks(ck, cv, S, group.per_block, self.slot_starts(starts.row_start))
                block = tuple(pool_rows(s, group_rows(x, group)) for s, x in ((group.key, ck), (group.value, cv)))
                memo[key] = block
            own = (slot >= S) & (slot < torch.tensor(ends, device=self.device)[:, None])
            rel = (slot - S).clamp(0, top - S - 1)
            for i in range(2):
                y = block[i].gather(2, rel[:, None, :, None].expand(-1, block[i].shape[1], -1, block[i].shape[3]))
                out[i] = torch.where(own[:, None, :, None], y, out[i])
        sel = starts.sink_slots(start, end)
        if sel is not None:  # sinks: as held (the sink buffer holds the same values)
            r, o, _ = sel
            for i in range(2):
                out[i][r, :, o] = dense[i][r, :, o]
        return out[0], out[1]
