"""Block-granular quantized KV storage for one layer.

Layout: the KV heads of a layer are split into *head groups* (:mod:`kvquant.groups`), one per (key, value)
precision pair, each storing its K and V as the parts of its quantizers in the layer's blocks (:mod:`kvquant.blocks`).
Each batch row has a *block table*; blocks are taken on demand (memory follows the real length), shared by reference
between rows (beams) and caches (a :class:`~kvquant.PagedKVPool`'s requests), written once (a full block is
immutable) and copied before a shared partial block is written (copy-on-write).

The store is a small core (the block tables and the ``cache_pos`` / ``q_end`` cursor; append, read, crop, copy,
reorder; the attention's :class:`~kvquant.snapshot.KVSnapshot`) that owns one component per job, each built from
the layer's :class:`~kvquant.plan.LayerPlan`:

* :class:`~kvquant.rows.RowStarts`: each row's first real token, its sink tokens, an evicting layer's real slots;
* :class:`~kvquant.space.Space`: the storage space (rotation, key centering; codebook head spaces);
* :class:`~kvquant.dense.DenseRows`: the dense segments (sinks, residual window, the calibration hold);
* :class:`~kvquant.refine.Refinement`: refinement rows (the age ladder, its second rung, heavy rows);
* table strategies: per-row blocks (:mod:`kvquant.tables`; on each row's own grid, :class:`~kvquant.grid.RowGrid`),
  per-head lanes (:class:`~kvquant.lanes.Lanes`), the host tier for offload (:class:`~kvquant.host_tier.HostTier`).
"""

from __future__ import annotations

import contextlib
import copy as _copy
import functools
import math
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from .blocks import LayerBlocks
from .config import KVPrecision, KVQuantConfig
from .dense import DenseRows
from .errors import ArgumentError
from .grid import RowGrid, shifts_grid
from .groups import (
    HeadGroup,
    block_specs,
    build_groups,
    copy_groups,
    count_parts,
    fake_quantize_groups,
    group_rows,
    index_groups,
    make_groups,
)
from .host_tier import HostTier, has_host_blocks, stage_tables
from .lanes import Lanes
from .offload import host_id, is_host
from .plan import LayerPlan, Plan, layer_plan
from .quantizers.base import Factored, require_finite
from .refine import HeavyScores, Refinement
from .rows import RowStarts
from .shape import held_dtype
from .slots import SlotMap, compact_kept
from .snapshot import GroupSnapshot, KVSnapshot
from .space import Space, dense_to_group_space, has_head_space
from .tables import block_ids, blocks_for, place, release_blocks, row_index, write_pairs, write_targets
from .tensor_store import (
    QuantizedTensorStore,
    quantize_pair,
)


class LayerStore:
    """All K/V of one layer of one cache: head groups, one block table per batch row over the layer's
    :class:`~kvquant.blocks.LayerBlocks` (shared with other caches of a pool), the ``cache_pos`` cursor.

    Args:
        blocks: the layer's blocks in a :class:`~kvquant.PagedKVPool` (a private arena when None).
        window: sliding-window length of this layer (``None``: full attention). Blocks wholly outside
            the window of every later query are released.
        lanes: the layer's KV heads keep different token counts (an AdaKV budget): hold per-head block lanes,
            one table per (row, KV head), so that each head holds ``ceil(n_h / block_size)`` lanes of its own
            (:meth:`kvquant.lanes.Lanes.grow`); with a full-precision residual window or per-channel keys, whole
            lanes and a full-precision tail per (row, head) (:mod:`kvquant.lanes`). Ignored (per-row blocks, sized
            by the largest head) with a sliding window or ``offload``.
    """

    def __init__(
        self,
        row: list[KVPrecision],
        config: KVQuantConfig,
        head_dim: int,
        batch: int,
        device: torch.device,
        static_amax: dict[str, torch.Tensor] | None = None,
        capacity: int | None = None,
        blocks: LayerBlocks | None = None,
        window: int | None = None,
        lanes: bool = False,
        plan: LayerPlan | None = None,
    ) -> None:
        if plan is not None and lanes:
            raise ArgumentError("lanes: the plan decides (LayerPlan.lanes); pass lanes only without a plan")
        if plan is None:  # a store made on its own (tests, calibration): planned here, its drops reported
            plan = layer_plan(config, row, window=window)
            plan = replace(plan, lanes=lanes and plan.window is None and not plan.offload)
            Plan((plan,)).report()
        self.plan = plan
        self.config = config
        self.block_size = config.block_size
        self.head_dim = head_dim
        self.num_heads = len(row)
        self.batch = batch
        self.device = device
        self.cache_pos = 0
        self.q_end = 0  # tokens [0, q_end) are in the quantized pool
        self.starts = RowStarts(batch, plan.sink_tokens, device)  # each row's first real token, its sinks
        self.grid: RowGrid | None = None  # per-row block grids (kvquant.grid), set by the first write
        self.space = Space(plan.rotate_keys, plan.rotate_values, plan.center_keys)  # rotation, key centering
        self.sink_tokens = plan.sink_tokens
        self.window = plan.window
        made = make_groups(row, config, head_dim)
        if blocks is None:
            blocks = LayerBlocks(block_specs(made), self.block_size, device)
        if blocks.block_size != self.block_size:
            raise ValueError(f"block_size: pool blocks hold {blocks.block_size} tokens, the config {self.block_size}")
        self.blocks = blocks
        self.tables: list[list[int]] = [[] for _ in range(batch)]  # block ids per row (-1: released)
        self.first_live = 0  # blocks [0, first_live) of every row were released (sliding window)
        self.bytes_moved = 0  # quantized bytes copied by copy-on-write (beam reorders, shared partial blocks)
        # the host tier of cold blocks (``offload``, kvquant.host_tier)
        self.host = HostTier(blocks, config.offload["keep_recent_blocks"]) if plan.offload else None
        self._table_cache: torch.Tensor | None = None
        self.slots: SlotMap | None = None  # an evicting layer: its token axis holds slots (see kvquant.slots)
        self.groups = build_groups(made, blocks, self.num_heads, batch, device)
        # CPU, and every quantizer rejects NaN / Inf while quantizing (see _checked_by_quantizers)
        self._quantizers_check = device.type == "cpu" and all(
            s.quantizer.checks_finite for g in self.groups for s in (g.key, g.value))
        per_block = any(g.key.quantizer.per_block or g.value.quantizer.per_block for g in self.groups)
        self.has_block_parts = any(spec.per_block for g in self.groups for s in (g.key, g.value)
                                   for spec in s.specs.values())  # fmt: skip
        self.per_block = per_block
        # residual mode: newest tokens in full precision, quantized a whole block at a time
        self.residual_tokens = plan.residual_tokens
        self.residual_mode = plan.residual_tokens > 0 or per_block
        self.residual_step = plan.residual_step
        # sinks, the residual window, the calibration hold (kvquant.dense); flush points per row only without
        # per-channel blocks, lanes, a sliding window, the age ladder, heavy rows or offload
        row_flush = not (per_block or plan.lanes or plan.window is not None or plan.ladder_tokens or plan.heavy_tokens
                         or plan.offload)  # fmt: skip
        self._grids = shifts_grid(self.groups, plan, static_amax is not None)  # (kvquant.grid)
        self.dense = DenseRows(self.groups, static_amax, plan.sink_tokens, plan.residual_tokens, plan.residual_step,
                               self.residual_mode, row_flush, config.headroom, config.share_kv_scale, batch, device)
        # per-head block lanes (AdaKV, kvquant.lanes): ``tables[b * H + h]`` holds the lane ids of (row b, KV head h)
        self.lanes = Lanes(self, blocks, self.groups, batch, self.num_heads, head_dim, self.residual_tokens,
                           self.residual_mode, config.check_finite, device) if plan.lanes else None  # fmt: skip
        if self.lanes:
            self.tables = [[] for _ in range(batch * self.num_heads)]
        # refinement rows (kvquant.refine): the age ladder's rings, the second rung, heavy rows
        self.refine = Refinement(plan.ladder_tokens, plan.ladder2_tokens, plan.heavy_tokens, self.block_size, device)
        if capacity:
            self.reserve(capacity)

    @property
    def has_dense_segments(self) -> bool:
        """True when some history is read from full-precision buffers (sinks, residual, or tokens held
        while static-scale calibration is deferred)."""
        return self.sink_tokens > 0 or self.residual_mode or self.q_end < self.cache_pos

    def _reads_held(self) -> bool:
        """Some row reads held tokens as its pool will (:meth:`DenseRows.reads_held`)."""
        return self.dense.reads_held(self.cache_pos, self.q_end, self.starts, self.tail_lanes)

    def _held_rows(self, group: HeadGroup, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``group``'s held tokens ``[start, end)`` as each row reads them (:meth:`DenseRows.held_rows`)."""
        return self.dense.held_rows(group, start, end, self.q_end, self.cache_pos, self.starts, self.refine)

    @property
    def holds_fitted_rows(self) -> bool:
        """True while some rows' static scales are fitted and a batch-mate's are not (:meth:`DenseRows.held_rows`)."""
        return self.dense.holds_fitted_rows(self.tail_lanes)

    @property
    def tail_lanes(self) -> bool:
        """True when this is a lane layer whose heads keep their own full-precision tails (:mod:`kvquant.lanes`)."""
        return self.lanes is not None and self.lanes.tails

    def tables_changed(self) -> None:
        """The block tables changed: the table tensor is built again on the next :meth:`table`."""
        self._table_cache = None

    def has_host_blocks(self, j0: int = 0, j1: int | None = None) -> bool:
        """True when some row's blocks ``[j0, j1)`` are in the host tier (``offload``, :mod:`kvquant.host_tier`)."""
        return has_host_blocks(self.blocks, self.tables, j0, j1)

    @contextlib.contextmanager
    def staged(self) -> Iterator[None]:
        """For kernels that read the arena through :meth:`table` (Triton): copy every host block of the rows into
        free device blocks and point the tables at them for the duration of the block; then release them."""
        if not self.has_host_blocks():
            yield
            return
        saved, self._table_cache = self.tables, None
        self.tables, dev = stage_tables(self.blocks, saved, self.device)
        try:
            yield
        finally:
            self.tables, self._table_cache = saved, None
            self.blocks.decref(dev)

    # ---------------------------------------------------------------- capacity
    @property
    def capacity(self) -> int:
        """Tokens the rows' block tables cover plus the free blocks, per row (whole blocks)."""
        return (self._table_width() + len(self.blocks.free) // max(1, self.batch)) * self.block_size

    def _table_width(self) -> int:
        """Entries of the longest block table (0 without any)."""
        return max([0, *(len(t) for t in self.tables)])  # (not max(default=): torch.compile traces this)

    def reserve(self, tokens: int) -> None:
        """Make room for ``tokens`` tokens per row (whole blocks) in the arena."""
        need = self.batch * math.ceil(tokens / self.block_size) - sum(len(t) for t in self.tables)
        if need > 0:
            self.blocks.ensure_free(need)

    def blocks_needed(self, tokens: int) -> int:
        """Free blocks a write of ``tokens`` more tokens per row may need (an upper bound, no dedup)."""
        if tokens <= 0:
            return 0
        if self.lanes and self.cache_pos:  # lanes each (row, head) may take: new ones, and a copy of a shared one
            return self.lanes.blocks_needed(tokens)
        if self.grid is not None:  # per-row block grids: slots up to the earliest row's own flush point
            return self.grid.blocks_needed(self.batch, self.cache_pos + tokens)
        if self.residual_mode:
            pending = (self.dense.res_k.shape[2] if self.dense.res_k is not None else 0) + tokens
            flush = self.dense.flush_len(pending, self.q_end, self.starts)
            if flush <= 0:
                return 0
            start, end = self.q_end, self.q_end + flush
        else:
            start, end = self.cache_pos, self.cache_pos + tokens
        return blocks_for(self.tables, self.blocks, self.batch, start, end, in_place=not self.residual_mode)

    # ---------------------------------------------------------------- writing
    def append(
        self, keys: torch.Tensor, values: torch.Tensor, row_start: torch.Tensor | None = None,
        key_scores: torch.Tensor | None = None,
    ) -> int:
        """Quantize and write ``keys/values[B, H, T, D]`` at the cursor; returns the past length.

        ``row_start[B]`` (first append only): each row's first real token; the positions before it are
        left padding. Sink tokens are then each row's first real tokens, and static scales ignore pads.
        ``key_scores[B, H, T]``: the attention weight each new token received from the chunk's queries; with
        ``heavy_tokens`` set and no heavy rows picked yet, the pool rows this append writes pick them by it (a
        chunk held for calibration keeps its scores: its rows pick them when they reach the pool, as alone, and
        are read so meanwhile, :meth:`held_rows`).
        """
        past = self.cache_pos
        largest = None  # max |K|, |V| when the finiteness check found it (CPU)
        if self.config.check_finite and not self._checked_by_quantizers():
            largest = require_finite(keys, values)
        if self.lanes:  # the fills set by append_kept / grow_lanes, or every head holds the chunk
            self.lanes.begin_append(past, keys.shape[2])
        if past == 0:
            self._set_row_start(row_start)
        if self.space.center_keys and self.space.key_mean is None:
            self.space.fix_key_mean(keys, self.starts.fit_tokens(past, keys.shape[2]))
        if self.space.transforms:
            keys, values = self.space.to_storage(keys, values)
            largest = None  # (a rotation or centering changes the magnitudes)
        T = keys.shape[2]
        if self.dense.dtype is None:
            self.dense.dtype = held_dtype(keys.dtype)
        if self.config.check_finite and (self.has_dense_segments or not self.dense.calibrated):
            self.dense.fit(keys, values, largest)
        if past < self.starts.sink_end:
            self.dense.keep_sinks(keys, values, past, self.starts)
        held = self.dense.res_k.shape[2] if self.dense.res_k is not None and not self.dense.calibrated else 0
        scores = None
        if key_scores is not None and self.refine.heavy_tokens and not self.refine.heavy:
            scores = (past, key_scores, None)
        if not self.dense.calibrated and self.dense.hold(self.groups, keys, values, past, self.q_end, self.starts):
            self.cache_pos = past + T
            if scores is not None and self.dense.held_scores is None:  # picked when the held tokens reach the pool
                self.dense.held_scores = (past, key_scores, self.dense.virtual_q_end(self.cache_pos, self.q_end))
            return past
        self.release_window()
        saved, self.dense.held_scores = self.dense.held_scores, None
        if self.residual_mode:
            self._append_residual(keys, values, saved or scores)
        else:
            if held:  # tokens held while calibration was deferred go to the pool first (see _hold_for_calibration)
                if self.dense.exact_k is not None and self.dense.exact_v is not None:
                    self._write_pool(self.dense.exact_k, self.dense.exact_v, self.q_end, saved)
                else:
                    dense = self.dense
                    self._write_pool(dense.res_k.to(keys.dtype), dense.res_v.to(values.dtype), self.q_end, saved)
                self.dense.res_k = self.dense.res_v = self.dense.exact_k = self.dense.exact_v = None
                ln = self.lanes
                if ln and ln.overwrite_pending and ln.grows is not None:  # this step's token (written by
                    # overwrite()) may start a lane that grow_lanes did not plan while the layer was held
                    ln.plan({(b, h): (ln.fill[b][h] - 1, ln.fill[b][h])
                             for b, row in enumerate(ln.grows) for h, grow in enumerate(row) if grow})
            self._write_pool(keys, values, past, scores)
        self.cache_pos = past + T
        if self.host and self.host.offload_cold(self.tables, self.q_end, self.first_live, self.starts.sink_end):
            self._table_cache = None
        return past

    def _checked_by_quantizers(self) -> bool:
        """True when an appended chunk goes straight to the pool's quantizers, before any state
        changes, and they all reject NaN / Inf themselves (:attr:`Quantizer.checks_finite`, CPU): no
        separate pass over it is needed. Calibration, sink, residual, dense-segment, key-mean and lane
        writes keep raw values first, so they are checked up front."""
        return self._quantizers_check and self.dense.calibrated and not (self.lanes or self.has_dense_segments)

    def append_kept(
        self, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, row_start: torch.Tensor | None = None,
        score: torch.Tensor | None = None, tracking: str | None = None, cap: torch.Tensor | None = None,
    ) -> None:
        """First write of an evicting layer: store only the tokens ``keep[B, H, T]`` selects, compacted onto
        slots ``[0, S)`` (``S``: the most any head keeps; a head that keeps fewer leaves its last slots empty,
        zero-filled) in their original order, and start the layer's :class:`~kvquant.slots.SlotMap`.

        ``row_start[B]``: each row's first real position (pads are never kept); ``score[B, H, T]``: the policy's
        scores (kept for decode-time policies, ``tracking``), ``cap[B, H]``: the tokens each head keeps while
        decoding."""
        if self.cache_pos or self.slots is not None:
            raise AssertionError("append_kept: the first write of an empty store")
        ck, cv, n, order, filled = compact_kept(keys, values, keep)
        if self.lanes:  # each (row, head) holds the lanes of its own kept count
            self.lanes.keep(n.tolist(), None if cap is None else cap.tolist())
        self.starts.slot_real = filled.any(dim=1).to(self.device)  # a short row's empty slots: not real tokens
        self.append(ck, cv, None)
        self.slots = SlotMap.of_kept(order, filled, keys.shape[2], row_start, score, tracking, cap, self.device)

    def overwrite(self, keys: torch.Tensor, values: torch.Tensor, target: torch.Tensor, write: torch.Tensor) -> None:
        """Write the one-token ``keys/values[B, H, 1, D]`` of (row ``b``, head ``h``) at slot ``target[b, h]``
        (an existing slot) where ``write[b, h]``: each head replaces its own token (decode-time eviction).
        Where ``write[b, h]`` is False, ``target[b, h]`` must be the slot :meth:`append` just filled with this
        same token (it may be rewritten, unchanged).

        Quantized slots are written in place (a block shared with another row or cache is copied first);
        slots still held in full precision (``[q_end, cache_pos)``) are written there. When every slot is
        quantized and no row shares a block (one sequence, or beams before a reorder), the write is one
        scatter per part with no host synchronisation (the targets stay on the device)."""
        keys, values = self.space.to_storage(keys, values)
        if self.lanes:
            self.lanes.overwrite(keys, values, target)
            return
        if self.q_end == self.cache_pos and all(b >= 0 and self.blocks.refs[b] == 1 for t in self.tables for b in t):
            write_targets(self.groups, self.table(), keys, values, target, self.block_size, self.config.check_finite)
            return
        tl, wl = target.tolist(), write.tolist()
        pairs = [(b, h, tl[b][h]) for b in range(len(tl)) for h in range(len(tl[b])) if wl[b][h]]
        dense = [p for p in pairs if p[2] >= self.q_end]
        pool = [p for p in pairs if p[2] < self.q_end]
        if dense:
            b, h, t = (torch.tensor(x, device=self.device) for x in zip(*dense, strict=True))
            self.dense.write_held(keys, values, b, h, t, self.q_end)
        if not pool:
            return
        moved = write_pairs(self.tables, self.blocks, self.groups, keys, values, pool, self.config.check_finite,
                            self.device)  # (copy-on-write of shared blocks first)
        self.bytes_moved += moved
        if moved:
            self._table_cache = None

    def residual_rows(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The history ``[q_end, end)`` held in full precision, every KV head ``[B, H, t, D]``, as the attention
        reads it (storage space): the residual buffers, or each row's pool and next block on per-row block grids,
        or while static scales wait for a row, :meth:`DenseRows.held_rows`."""
        read = self._read_shifted if self.grid is not None else self._held_rows if self._reads_held() else None
        return self.dense.residual_rows(self.groups, self.q_end, end, read)

    def _set_row_start(self, row_start: torch.Tensor | None) -> None:
        """The first write: each row's first real token (:meth:`RowStarts.set`), and a left-padded batch's own
        block grids where the layer takes them (:func:`~kvquant.grid.shifts_grid`; not an evicting layer)."""
        self.starts.set(row_start)
        shift = [-r % self.block_size for r in self.starts.host]
        if any(shift) and self._grids and self.starts.slot_real is None:
            self.grid = RowGrid(shift, self.block_size, self.residual_tokens, self.device)

    def _append_shifted(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Residual mode on per-row block grids: the slots every row's own flush point has passed reach the pool
        (:meth:`RowGrid.flush`)."""
        assert self.grid is not None
        dk, dv = keys.to(self.dense.dtype), values.to(self.dense.dtype)
        if self.dense.res_k is not None and self.dense.res_v is not None and self.dense.res_k.shape[2]:
            dk, dv = torch.cat([self.dense.res_k, dk], dim=2), torch.cat([self.dense.res_v, dv], dim=2)
        q0 = self.q_end
        flushed = self.grid.flush(dk, dv, q0, self.cache_pos + keys.shape[2])
        if flushed is not None:
            ck, cv, s0, q_end = flushed
            self._write_pool(ck.to(keys.dtype), cv.to(values.dtype), s0, slots=True)
            dk, dv = dk[:, :, q_end - q0:], dv[:, :, q_end - q0:]
            self.q_end = q_end
        self.dense.memo = {}
        self.dense.res_k, self.dense.res_v = dk.contiguous(), dv.contiguous()

    def _read_shifted(self, group: HeadGroup, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``group``'s held positions ``[start, end)`` on per-row block grids (:meth:`RowGrid.read_held`)."""
        assert self.grid is not None and self.dense.res_k is not None and self.dense.res_v is not None
        return self.grid.read_held(group, start, end, (self.dense.res_k, self.dense.res_v), self.q_end, self.cache_pos,
                                   self.table(), self.starts, self.dense.memo)  # fmt: skip

    def _heavy_first(self) -> torch.Tensor:
        """``[B]``: each row's first position a heavy row may be picked at (past its pads and sinks)."""
        return self.starts.row_start + self.sink_tokens

    def _write_pool(
        self, keys: torch.Tensor, values: torch.Tensor, pos: int, scores: HeavyScores | None = None,
        slots: bool = False,
    ) -> None:
        """Quantize a chunk into the pool at ``pos`` (sink rows masked: they are read from the sink buffer).
        ``scores``: ``(first position, key scores [B, H, T], limit)`` of the append, to pick heavy rows by (see
        :meth:`Refinement.pick_heavy`). ``slots``: the chunk holds slots ``[pos, pos + T)`` of per-row block grids
        (:mod:`kvquant.grid`), not positions."""
        if self.lanes:
            sinks_done = pos >= self.starts.sink_end
            if self.lanes.overwrite_pending and pos == self.cache_pos and keys.shape[2] == 1 and sinks_done:
                self.lanes.overwrite_pending = False  # grow_lanes' token: overwrite() writes every head at its slot
                self.q_end = pos + 1
                return
            self.lanes.write(*self.starts.mask_sinks(keys, values, pos, False), pos)
            return
        starts = self.grid.slot_starts(self.starts.row_start) if slots and self.grid else None
        masked = {c: self.starts.mask_sinks(keys, values, pos, c, starts) for c in {g.per_block for g in self.groups}}
        real = self.starts.real_tokens(pos, pos + keys.shape[2], starts) if pos < self.starts.pad_end or slots else None
        quantized = []  # every group quantized (which may raise) before any block or table changes
        for g in self.groups:
            gk, gv = masked[g.per_block]
            k = gk if g.all_heads else gk.index_select(1, g.head_index)
            v = gv if g.all_heads else gv.index_select(1, g.head_index)
            quantized.append(quantize_pair(g.key, g.value, k, v, self.config.check_finite, real))
        plan, changed, moved = place(self.tables, self.blocks, *next(iter(masked.values())), pos, self.has_block_parts,
                                     self.per_block, self.device)  # (rows that differ only in sinks share blocks)
        self.bytes_moved += moved
        if changed:
            self._table_cache = None
        for g, (qk, qv) in zip(self.groups, quantized, strict=True):
            g.key.commit(qk, plan)
            g.value.commit(qv, plan)
        if self.refine.ladder_tokens:
            self.refine.push(self.groups, masked, quantized, pos, self.q_end)
        if scores is not None and not self.refine.heavy:
            self.refine.pick_heavy(self.groups, masked, quantized, pos, scores, self._heavy_first())
        self.q_end = pos + keys.shape[2]

    def release_window(self) -> None:
        """Sliding window: release the blocks no later query can see.

        The next query sits at ``cache_pos`` and sees keys ``> cache_pos - window``; a block whose last
        token is ``<= cache_pos - window`` (and is in the quantized pool) is dead for every later query.
        """
        if self.window is None:
            return
        dead = min(self.cache_pos - self.window + 1, self.q_end) // self.block_size
        if dead > self.first_live:
            release_blocks(self.tables, self.blocks, self.first_live, dead)
            self.first_live = dead
            self._table_cache = None

    def _append_residual(self, keys: torch.Tensor, values: torch.Tensor, scores: HeavyScores | None = None) -> None:
        """Residual mode: keep the newest tokens dense; quantize whole blocks beyond ``residual_tokens``
        (``scores``: see :meth:`_write_pool`)."""
        if self.lanes:  # each head its own tail (kvquant.lanes)
            self.lanes.append_tails(keys, values)
            return
        if self.grid is not None:  # each row's own block grid
            self._append_shifted(keys, values)
            return
        dk, dv, flush = self.dense.append_residual(keys, values, self.q_end, self.starts)
        if flush > 0:
            # tokens reach the pool through the residual buffer's dtype (exact for 16-bit models)
            self._write_pool(dk[:, :, :flush].to(keys.dtype), dv[:, :, :flush].to(values.dtype), self.q_end, scores)
        keep = max(flush, 0)
        self.dense.res_k, self.dense.res_v = dk[:, :, keep:].contiguous(), dv[:, :, keep:].contiguous()

    def fake_quantize(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize-then-dequantize ``keys/values[B, H, T, D]`` without storing them (``simulated`` protocol).

        Centering, rotation and sink tokens apply; the residual window does not (it is a property of
        decoding).
        """
        if self.cache_pos == 0:
            self._set_row_start(None)
        if self.space.center_keys and self.space.key_mean is None:
            self.space.fix_key_mean(keys, self.starts.fit_tokens(self.cache_pos, keys.shape[2]))
        ks, vs = self.space.to_storage(keys, values)
        if not self.dense.calibrated:
            self.dense.calibrate(self.groups, ks, vs, self.cache_pos, self.starts)
        k_out, v_out = fake_quantize_groups(self.groups, ks, vs)
        sel = self.starts.sink_slots(self.cache_pos, self.cache_pos + ks.shape[2])
        if sel is not None:
            rows, offs, _ = sel
            k_out[rows, :, offs], v_out[rows, :, offs] = ks[rows, :, offs], vs[rows, :, offs]
        self.cache_pos += ks.shape[2]
        return self.space.from_storage(k_out, v_out)

    @property
    def has_head_space(self) -> bool:
        """True when some head's K or V is read in a rotated head space (:func:`kvquant.space.has_head_space`)."""
        return has_head_space(self.groups, self.dense.calibrated)

    # ---------------------------------------------------------------- reading (storage space)
    def tiles(self, past_len: int, size: int) -> list[tuple[int, int]]:
        """Key ranges covering ``[0, past_len)`` that never straddle the pool / residual boundary."""
        q_end = min(self.q_end, past_len)
        first = min(self.first_live * self.block_size, q_end)  # released blocks (sliding window) are skipped
        out = [(s, min(q_end, s + size)) for s in range(first, q_end, size)]
        out += [(s, min(past_len, s + size)) for s in range(q_end, past_len, size)]
        return out

    def read(self, group: HeadGroup, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``group`` for tokens ``[start, end)`` as float32 ``[B, Hg, t, D]`` (storage space; for
        codebook K or V, that head space: the attention maps queries / outputs, see ``query_to_head_space``)."""
        if start < self.q_end < end:
            k1, v1 = self.read(group, start, self.q_end)
            k2, v2 = self.read(group, self.q_end, end)
            return torch.cat([k1, k2], dim=2), torch.cat([v1, v2], dim=2)
        if start >= self.q_end and self.tail_lanes:  # each head's lanes, then its own tail
            return self.lanes.read_tails(group, start, end)
        if start >= self.q_end and self.grid is not None:  # per-row block grids: see _read_shifted
            return self._read_shifted(group, start, end)
        if start >= self.q_end:  # residual buffer (dense)
            if self._reads_held():  # some rows fitted, a batch-mate not yet, or past their own flush: as the residual
                return dense_to_group_space(group, *self._held_rows(group, start, end), self.dense.calibrated)
            a, b = start - self.q_end, end - self.q_end
            k, v = self.dense.res_k[:, :, a:b], self.dense.res_v[:, :, a:b]
            return dense_to_group_space(group, group_rows(k, group), group_rows(v, group), self.dense.calibrated)
        return self.read_quantized(group, start, end)

    def read_quantized(self, group: HeadGroup, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``group``'s pool tokens ``[start, end)`` (:meth:`read_pool`), sink rows from the sink buffer."""
        ladder_n = self.refine.ladder_n
        a = max(start, self.q_end - ladder_n)  # (end <= q_end: read() splits at it)
        if ladder_n and a < end:  # the ladder's young rows, refined (each row decoded once)
            rk, rv = self.refine.read_ladder(group, a, end, self.table(), self.q_end)
            if rk is None or rv is None:  # a side without refinement: its base rows
                bk, bv = self.read_pool(group, a, end)
                rk, rv = bk if rk is None else rk, bv if rv is None else rv
            if a > start:
                k, v = self.read_pool(group, start, a)
                k, v = torch.cat([k, rk], dim=2), torch.cat([v, rv], dim=2)
            else:
                k, v = rk, rv
        else:
            k, v = self.read_pool(group, start, end)
        if self.dense.sink_k is not None and start < self.starts.sink_end:  # each row's sinks from the sink buffer
            is_sink, sk, sv = self.dense.sink_rows(start, end, self.starts.row_start)
            sk, sv = dense_to_group_space(group, group_rows(sk, group), group_rows(sv, group), self.dense.calibrated)
            k, v = torch.where(is_sink, sk.float(), k), torch.where(is_sink, sv.float(), v)
        return k, v

    def table(self) -> torch.Tensor:
        """The rows' block tables as a ``[B, max_blocks]`` int64 tensor on the device (released and
        missing entries point at block 0: they are never visible). Lanes: the lane ids of every (row, head),
        ``[B, H, max_lanes]`` (missing entries point at the head's first lane: never visible)."""
        if self._table_cache is None and self.lanes:
            self._table_cache = self.lanes.table(self._table_width())
        if self._table_cache is None:
            width = self._table_width()
            rows = [[max(b, 0) for b in t] + [0] * (width - len(t)) for t in self.tables]
            self._table_cache = torch.tensor(rows, dtype=torch.long, device=self.device).view(self.batch, width)
        return self._table_cache

    def read_factored(self, group: HeadGroup, start: int, end: int) -> list[tuple[int, int, Factored, Factored]]:
        """``group``'s K and V of tokens ``[start, end)`` as ``(a, b, K, V)`` pieces covering the range in order:
        pool tokens as codes and scales where the quantizer factors them (:class:`Factored`; attention then
        scales queries or probabilities, not the history), sink and residual tokens dequantized. Same values
        as :meth:`read`."""
        pieces = []
        lanes_end = self.lanes.lane_top(group) if self.lanes and self.tail_lanes else self.q_end  # (kvquant.lanes)
        pool_end = min(end, lanes_end)
        pool_end = min(pool_end, self.q_end - self.refine.ladder_n)  # the ladder's young rows: read() refines them
        a = start
        if a < pool_end and self.dense.sink_k is not None and a < self.starts.sink_end:
            if self.starts.pad_end == 0 and self.grid is None and not group.per_block:
                # every row's sinks are [0, sink_end) (no padding): from the sink buffer, the pool factored after them
                b = min(pool_end, self.starts.sink_end)
                k, v = (group_rows(t[:, :, a:b], group) for t in (self.dense.sink_k, self.dense.sink_v))
                k, v = dense_to_group_space(group, k, v, self.dense.calibrated)
            else:  # sinks at each row's own first tokens, or per-block parts: read() merges them into their blocks
                b = min(pool_end, -(-self.starts.sink_end // self.block_size) * self.block_size)
                k, v = self.read(group, a, b)
            pieces.append((a, b, Factored(k.float()), Factored(v.float())))
            a = b
        if a < pool_end:  # (offloaded blocks: read_pool stages them, as for read)
            if self.tail_lanes and pool_end > self.q_end:  # heads whose lanes end sooner: their tails merged in
                pieces.append((a, pool_end, *self.lanes.factored_tails(group, a, pool_end)))
            else:
                pieces.append((a, pool_end, *self.read_pool(group, a, pool_end, factored=True)))
            a = pool_end
        if a < end:
            k, v = self.read(group, a, end)
            pieces.append((a, end, Factored(k), Factored(v)))
        return pieces

    def read_pool(self, group: HeadGroup, start: int, end: int, factored: bool = False) -> tuple[Any, Any]:
        """Dequantized K and V of ``group``'s pool tokens ``[start, end)`` (float32 ``[B, Hg, t, D]``),
        read through the block tables; released blocks read as 0. ``factored``: as :class:`Factored` pieces
        (tokens of released blocks are not read: ``start`` must be at or after the first live block). With per-row
        block grids (:mod:`kvquant.grid`) the rows are gathered per row and ``factored`` gives them dequantized."""
        if self.grid is not None:
            k, v = self.grid.read_pool(group, start, end, self.table())
            return (Factored(k), Factored(v)) if factored else (k, v)
        bs = self.block_size
        j0, j1 = start // bs, -(-end // bs)
        run = kparts = vparts = None
        if self.lanes:  # per-head lanes: (block, head slot) of every (row, head, block), or a run read in place
            tbl, run = self.lanes.pool_table(group, self.table()[:, :, j0:j1], j0)
        elif self.host and self.has_host_blocks(j0, j1):  # offload: the tile staged from the host tier
            tbl, kparts, vparts = self.host.fetch(self.tables, group.key.group, j0, j1, self.q_end, self.device)
        else:
            tbl = self.table()[:, j0:j1]
            if self.batch == 1:  # one row whose blocks are consecutive: read them in place
                ids = self.tables[0][j0:j1]
                if ids and ids[0] >= 0 and ids[-1] - ids[0] == len(ids) - 1 and ids == list(range(ids[0], ids[-1] + 1)):
                    run = ids[0]
        if factored:
            if start < self.first_live * bs:
                raise AssertionError("read_pool(factored=True) starts in a released block")
            k = group.key.read_factored(tbl, start - j0 * bs, end - start, run=run, parts=kparts)
            v = group.value.read_factored(tbl, start - j0 * bs, end - start, run=run, parts=vparts)
            return self.refine.put_heavy(group, start, end, k, v, self.table()) if self.refine.heavy else (k, v)
        k = group.key.read(tbl, start - j0 * bs, end - start, run=run, parts=kparts)
        v = group.value.read(tbl, start - j0 * bs, end - start, run=run, parts=vparts)
        if self.refine.heavy:
            k, v = self.refine.put_heavy(group, start, end, k, v, self.table())
        dead = self.first_live * bs - start
        if dead > 0:
            k[:, :, :dead] = 0
            v[:, :, :dead] = 0
        return k, v

    # ---------------------------------------------------------------- cache operations
    def crop(self, tokens: int) -> None:
        """Keep the first ``tokens`` tokens; blocks wholly past them go back to the pool.

        Nothing is quantized again: kept tokens are read exactly as before. In residual mode a crop
        that reaches into the quantized pool empties the residual window and keeps the pool's first
        ``tokens`` tokens (the window refills with new tokens). Per-channel (``int*-channel``) blocks
        share one scale per block, so their pool can only be cut at a block boundary: a crop to the
        middle of a quantized block is refused (keeping its head would mean re-quantizing it).
        """
        tokens = self.check_crop(tokens)
        if tokens < self.q_end:
            # (offload: may raise KVCacheFull, before anything changed)
            if tokens % self.block_size and self.host and self.host.bring_back(self.tables, tokens // self.block_size,
                                                                                self.device):  # fmt: skip
                self._table_cache = None
            self.refine.crop(tokens, self.q_end)  # (rings keep their rows below ``tokens``, heavy rows theirs)
            self.q_end = tokens
            self._truncate(-(-tokens // self.block_size))
            if self.host:
                self.host.crop(tokens // self.block_size)
        self.dense.crop(tokens - self.q_end, tokens)
        self.cache_pos = tokens

    def check_crop(self, tokens: int) -> int:
        """The token count :meth:`crop` keeps for ``tokens`` (clamped to ``[0, cache_pos]``), or the ValueError it
        would raise; nothing changes."""
        if self.slots is not None:
            raise ValueError("crop: this layer evicts tokens (its store holds kept tokens, not a prefix); "
                             "it cannot be cropped")
        tokens = max(0, min(tokens, self.cache_pos))
        if self.grid is not None:
            self.grid.check_crop(tokens)
        if tokens < self.first_live * self.block_size:
            raise ValueError(f"crop: tokens before {self.first_live * self.block_size} left the sliding window")
        if tokens < self.q_end and self.per_block and tokens % self.block_size:
            raise ValueError(
                f"crop: keeping {tokens} tokens would split a quantized per-channel block of {self.block_size} "
                f"(its scales cover the whole block); keep a multiple of {self.block_size} tokens or at "
                f"least {self.q_end} (the full-precision window)"
            )
        return tokens

    def _truncate(self, blocks: int) -> None:
        for t in self.tables:
            self.blocks.decref_entries(t[blocks:], self.lanes is not None)
            del t[blocks:]
        self._table_cache = None

    def release(self) -> None:
        """Give every block back to the pool (the rows become empty)."""
        self._truncate(0)
        self.first_live = 0

    def reset(self) -> None:
        """Forget all tokens and static scales; the blocks go back to the pool."""
        self.release()
        self.cache_pos = self.q_end = 0
        if self.host:
            self.host.reset()
        self.grid = None
        self.starts.reset(self.batch)
        self.dense.reset(self.batch)
        self.space.reset()
        self.refine.reset()
        self.slots = None
        if self.lanes:
            self.lanes.reset()
        for g in self.groups:
            for s in (g.key, g.value):
                s.reset()

    def adopt(self, tables: list[list[int]], tokens: int) -> None:
        """Start from shared whole blocks (prefix reuse): ``tables[b]`` holds ``tokens / block_size`` ids
        per row, already referenced for this store."""
        if self.cache_pos or tokens % self.block_size:
            raise AssertionError("adopt: an empty store and whole blocks")
        self.tables = [list(t) for t in tables]
        self.cache_pos = self.q_end = tokens
        self._table_cache = None

    def copy(self) -> LayerStore:
        """A copy that shares the blocks (references taken), with its own tables, state and dense buffers."""
        new = _copy.copy(self)
        new.tables = [list(t) for t in self.tables]
        for t in new.tables:
            self.blocks.incref_entries(t, self.lanes is not None)
        new.lanes = None if self.lanes is None else self.lanes.copy(new)
        new._table_cache = None
        new.dense = self.dense.copy()
        new.host = None if self.host is None else self.host.copy()
        new.groups = copy_groups(self.groups)
        new.space = self.space.copy()
        new.starts = self.starts.copy()
        new.grid = None if self.grid is None else self.grid.copy()
        new.slots = None if self.slots is None else self.slots.copy()
        new.refine = self.refine.copy()
        return new

    def index_batch(self, idx: torch.Tensor) -> None:
        """Reorder / select / repeat batch rows (beam search): the tables change, no quantized byte moves.
        ``idx`` is checked first (:func:`row_index`): a bad one raises and changes nothing."""
        idx = row_index(idx, self.batch, "idx")
        old = self.tables
        rows = idx.tolist()
        if self.lanes:  # one table per (row, head): rows move with all their heads' tables
            self.tables = self.lanes.index_batch(rows)
        else:
            self.tables = [list(old[i]) for i in rows]
        for t in self.tables:
            self.blocks.incref_entries(t, self.lanes is not None)
        for t in old:
            self.blocks.decref_entries(t, self.lanes is not None)
        self._table_cache = None
        if self.host:
            self.host.history_changed()
        idx = idx.to(self.device)
        self.dense.index_batch(idx, rows)
        self.space.index_batch(idx)
        self.starts.index_batch(idx, rows)
        if self.grid is not None:  # each row's block grid follows it
            self.grid.index_batch(idx, rows)
        self.refine.index_batch(idx)
        if self.slots is not None:  # each row's own kept tokens (per head) follow it
            self.slots.index_batch(idx)
        index_groups(self.groups, idx)  # per-sequence static state (scales [B, H], codebook means ...) follows
        self.batch = int(idx.numel())

    # ---------------------------------------------------------------- accounting
    def block_ids(self) -> list[int]:
        """The distinct live device blocks of all rows (a shared block once; lanes: the blocks holding them)."""
        return block_ids(self.tables, self.blocks.lanes_per_block if self.lanes else None)

    def lane_ids(self) -> list[int]:
        """Lanes: the distinct lanes of all (row, head) pairs (a shared lane once); empty without lanes."""
        return sorted({e for t in self.tables for e in t}) if self.lanes else []

    def host_block_ids(self) -> list[int]:
        """The distinct host-tier blocks of all rows (``offload``), as host ids."""
        return sorted({host_id(b) for t in self.tables for b in t if is_host(b)})

    def held_bytes(self, store: QuantizedTensorStore) -> int:
        """Bytes of the blocks (lanes: of the lanes of its group) that this layer holds in one K or V store's
        parts, its static state included (each distinct block or lane once)."""
        per_block = sum(store.block_nbytes().values())
        if self.lanes:
            lanes = sum(self.blocks.lane_where(e)[1] == store.group for e in self.lane_ids())
            return per_block // store.heads * lanes + store.state_nbytes()
        return per_block * (len(self.block_ids()) + len(self.host_block_ids())) + store.state_nbytes()

    def dense_buffers(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The full-precision buffers held (:meth:`DenseRows.buffers`)."""
        return self.dense.buffers()

    def memory(self) -> dict[str, int]:
        """Bytes held (each distinct block once, + scales state + full-precision buffers), shared and reserved.

        ``shared``: bytes of blocks referenced more than once (by several rows, caches or the prefix index).
        ``reserved``: the layer's whole device arena (for a pool, shared with its other caches). ``host``: the
        bytes of the blocks held in the host tier (``offload``; included in keys / values / scales), ``blocks_host``
        their number, ``moved_to_host`` the bytes moved there so far. Lanes: every distinct lane once (``lanes``:
        their number, ``blocks``: the blocks they lie in, ``shared``: lanes held more than once)."""
        index = self.slots.nbytes() if self.slots is not None else 0
        if self.lanes:
            per_group, shared = self.lanes.lane_counts(self.lane_ids())
            out = {"keys": 0, "values": 0, "scales": 0, "dense": 0, "blocks": len(self.block_ids()),
                   "lanes": sum(per_group), "blocks_host": 0, "host": 0, "moved_to_host": 0, "shared": shared,
                   "reserved": self.blocks.nbytes(), "index": index}  # fmt: skip
            count_parts(self.groups, out, lambda gi, s, b: b // s.heads * per_group[gi])
        else:
            ids, hids, bpb = self.block_ids(), self.host_block_ids(), self.blocks.bytes_per_block
            n, host = len(ids) + len(hids), self.blocks.host
            shared = sum(self.blocks.refs[b] > 1 for b in ids) + sum(host.refs[h] > 1 for h in hids)  # type: ignore[union-attr]
            out = {"keys": 0, "values": 0, "scales": 0, "dense": 0, "blocks": n, "blocks_host": len(hids),
                   "host": len(hids) * bpb, "moved_to_host": self.host.bytes_offloaded if self.host else 0,
                   "index": index, "shared": shared * bpb, "reserved": self.blocks.nbytes()}  # fmt: skip
            count_parts(self.groups, out, lambda gi, s, b: b * n)
        out["scales"] += self.space.nbytes()
        for k, v in self.dense_buffers().values():
            out["dense"] += k.numel() * k.element_size() + v.numel() * v.element_size()
        self.refine.count(out)  # the ladder's refinement rows (both rungs), heavy rows (parts and positions)
        return out

    def clipped(self) -> int:
        return sum(s.counts.totals()[0] for g in self.groups for s in (g.key, g.value))

    def static_values(self) -> int:
        """Real (non-pad) values written through static scales so far (what :meth:`clipped` counts against)."""
        return sum(s.counts.totals()[1] for g in self.groups for s in (g.key, g.value))

    # ---------------------------------------------------------------- the attention's snapshot
    def snapshot(self) -> KVSnapshot:
        """What one attention call reads of this store, as it is now (:mod:`kvquant.snapshot`): tensors and
        tables by reference, the store's own decode as bound callables; nothing is copied."""
        groups = tuple(
            GroupSnapshot(g.heads, g.head_index, g.all_heads, g.key.snapshot(), g.value.snapshot(),
                          functools.partial(self.read, g), functools.partial(self.read_factored, g),
                          lambda g=g: self.refine.heavy_rows(g, self.table(), True))
            for g in self.groups)  # fmt: skip
        space = self.space.snapshot(self.groups, self.num_heads, self.dense.calibrated)
        sinks, residual = self.dense.snapshot(self.residual_rows)
        heavy = self.refine.heavy_width()
        return KVSnapshot(
            self.batch, self.num_heads, self.head_dim, self.block_size, self.device, self.q_end, self.starts.row_start,
            self.table(), self.capacity, groups, space, self.has_dense_segments, sinks, residual, self.refine.ladder_n,
            heavy, self.lanes is not None, self.slots, self.tiles,
            self._staged_snapshot if self.has_host_blocks() else None,
            None if self.grid is None else self.grid.shift,
        )

    @contextlib.contextmanager
    def _staged_snapshot(self) -> Iterator[KVSnapshot]:
        """The snapshot with every host block staged into a device block (:meth:`staged`), for the block."""
        with self.staged():
            yield self.snapshot()
