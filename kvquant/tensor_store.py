"""The K (or V) of one head group of a layer: its quantizer, static state and part tensors in the layer's
block arena (:class:`QuantizedTensorStore`), and how a chunk is written there (:class:`WritePlan`,
:func:`quantize_pair`: K and V of a pairable group in one pass, then :meth:`QuantizedTensorStore.commit`).
:mod:`kvquant.store` composes these per layer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .blocks import LayerBlocks, part_rows
from .quantizers import Quantizer
from .quantizers.base import Factored, Parts
from .snapshot import PartSnapshot, RowsMemo


class ClipCounts:
    """Values clipped by a static scale and real (non-pad) values written through it (the clip rate's
    numerator and denominator): device tensors for counts that live on the device (adding them never
    synchronises), host ints for counts already known on the host."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.clipped_dev = torch.zeros((), dtype=torch.int64, device=device)
        self.values_dev = torch.zeros((), dtype=torch.int64, device=device)
        self.clipped_host = self.values_host = 0

    def add(self, clipped: torch.Tensor | int, values: torch.Tensor | int) -> None:
        if isinstance(clipped, torch.Tensor):
            self.clipped_dev += clipped
        else:
            self.clipped_host += clipped
        if isinstance(values, torch.Tensor):
            self.values_dev += values
        else:
            self.values_host += values

    def totals(self) -> tuple[int, int]:
        """``(clipped, values)`` as ints (synchronises with the device)."""
        return int(self.clipped_dev) + self.clipped_host, int(self.values_dev) + self.values_host

    def copy(self) -> ClipCounts:
        new = ClipCounts(self.device)
        new.clipped_dev, new.values_dev = self.clipped_dev.clone(), self.values_dev.clone()
        new.clipped_host, new.values_host = self.clipped_host, self.values_host
        return new


class StoredOverflow(ValueError):
    """K/V values that the configured storage cannot hold (e.g. |x| > 65504 in fp16 passthrough)."""


def stored_finite(parts: dict[str, torch.Tensor]) -> bool:
    """True when every 16/32-bit float part is finite (fp8 parts saturate and integer codes cannot overflow)."""
    wide = (torch.float16, torch.bfloat16, torch.float32)
    checks = [torch.isfinite(t).all() for t in parts.values() if t.dtype in wide]
    return bool(torch.stack(checks).all()) if checks else True


class QuantizedTensorStore:
    """The K (or V) of one head group: quantizer, static state, and the group's part tensors in the
    layer's :class:`~kvquant.blocks.LayerBlocks` (``[num_blocks, heads, block_size or 1, *shape]``)."""

    def __init__(self, quantizer: Quantizer, blocks: LayerBlocks, group: int, kind: str) -> None:
        self.quantizer = quantizer
        self.blocks = blocks
        self.group, self.kind = group, kind
        self.block_size = blocks.block_size
        self.state: dict[str, torch.Tensor] = {}
        self.specs = quantizer.parts()
        self.heads = blocks.specs[group][0]
        self.batch = 0  # rows of the owning LayerStore (kept in step by it)
        self.device = blocks.device
        self.counts = ClipCounts(blocks.device)  # static-scale clipping (see LayerStore.clipped)
        self._pair: tuple[dict, dict, dict[str, torch.Tensor] | None] | None = None  # paired_state's cache
        self.memo = RowsMemo()  # the kernels' rows built from the state (copies share it: keyed on its tensors)

    def reset(self) -> None:
        """Forget the static state and the clip counts (the layer's tokens are gone)."""
        self.counts = ClipCounts(self.device)
        self.state = {}

    @property
    def parts(self) -> dict[str, torch.Tensor]:
        """The block tensors of every part (looked up each time: the arena may have grown)."""
        return self.blocks.parts[self.group][self.kind]

    def snapshot(self) -> PartSnapshot:
        """The quantizer, static state and part tensors as they are now, for the attention (references, nothing
        copied), with the rows memo that stays with this store across snapshots."""
        return PartSnapshot(self.quantizer, self.parts, self.state, self.batch, self.heads, self.block_size,
                            self.device, self.memo)  # fmt: skip

    def write(
        self, x: torch.Tensor, plan: WritePlan | LanePlan, check: bool = True, real: torch.Tensor | None = None
    ) -> None:
        """Quantize ``x[B, H, T, D]`` and scatter the planned (row, token) pairs into their blocks (or, with a
        :class:`LanePlan`, the planned (row, head, token) triples into their lanes); see :meth:`quantize`."""
        self.commit(self.quantize(x, check, real), plan)

    def commit(self, q: Quantized, plan: WritePlan | LanePlan) -> None:
        """Store what :meth:`quantize` returned where ``plan`` says, and count its clipping."""
        self.scatter(q.parts, plan)
        if q.counted is not None:
            self.counts.add(q.clipped, q.counted)

    def scatter(self, q: Parts, plan: WritePlan | LanePlan) -> None:
        """Write quantized parts ``q`` (``[B, H, T or blocks, *shape]``) where ``plan`` says."""
        for name, t in q.items():
            dst = self.parts[name]
            if isinstance(plan, LanePlan):
                p = plan.per_block if self.specs[name].per_block else plan
                if p is None:
                    raise AssertionError(f"part {name!r}: a per-block part needs a LanePlan with per_block rows")
                dst[p.blk, p.lanes, p.off] = t[p.rows, p.heads, p.toks].to(dst.dtype)
            elif self.specs[name].per_block:
                if plan.blk_src_b.numel():
                    dst[plan.blk_dst, :, 0] = t.transpose(1, 2)[plan.blk_src_b, plan.blk_src_j].to(dst.dtype)
            elif plan.single is not None:
                b, t_, blk, off = plan.single
                dst[blk, :, off] = t[b, :, t_]
            else:
                dst[plan.dst_blk, :, plan.dst_off] = t.transpose(1, 2)[plan.src_b, plan.src_t].to(dst.dtype)

    def write_heads(
        self, x: torch.Tensor, rows: torch.Tensor, heads: torch.Tensor, blk: torch.Tensor, off: torch.Tensor,
        check: bool = True,
    ) -> None:
        """Quantize the one-token ``x[B, H, 1, D]`` and write the pairs ``(rows[i], heads[i])`` (group-local head
        indices) at block ``blk[i]``, offset ``off[i]``: each head to its own slot (decode-time eviction
        replaces a different token in every head). Per-token parts only."""
        q = self.quantize(x, check, None)
        for name, t in q.parts.items():
            dst = self.parts[name]
            dst[blk, heads, off] = t[rows, heads, 0].to(dst.dtype)
        if q.counted is not None:
            self.counts.add(q.clipped, q.counted)

    def quantize(
        self, x: torch.Tensor, check: bool, real: torch.Tensor | None, state: dict[str, torch.Tensor] | None = None
    ) -> Quantized:
        """The parts of ``x`` and, for static scales, its clipped and counted values (nothing is stored or
        counted yet: :meth:`commit` does both).

        ``check``: verify that what is *stored* is finite (one reduction). fp16 scales / zeros that
        overflow (|x| > 65504) are widened to fp32 for this group's blocks (exact, bytes counted) and
        the chunk quantized again; anything else non-finite (fp16 passthrough storage) raises
        :class:`StoredOverflow`. ``real[B, T]``: False at left-padding positions, which static-scale
        clipping does not count (or ``real[B, H, T]``: False where a (row, head)'s token is not written;
        those values are zeroed first). ``state``: the quantizer state to use instead of this store's (K and V
        side by side, see :func:`quantize_pair`)."""
        state = self.state if state is None else state
        clipped, counted = 0, None
        if self.quantizer.static:
            if real is not None and real.dim() == 3:  # per (row, head): unwritten values zeroed (never clip)
                x = torch.where(real.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))
                q, clipped = self.quantizer.quantize_counted(x, state)
                counted = real.sum() * x.shape[3]
            else:
                q, clipped = self.quantizer.quantize_counted(x, state, real)
                counted = x.numel() if real is None else real.sum() * x.shape[1] * x.shape[3]
        else:
            q = self.quantizer.quantize(x, state)
        if check and not stored_finite(q):
            if self.quantizer.widen_scales():
                self._widen_parts()
                q = self.quantizer.quantize(x, state)
            if not stored_finite(q):
                raise StoredOverflow(
                    f"precision: {self.quantizer.name} cannot store |K/V| up to {x.abs().max().item():.3g} "
                    "(the stored values overflow); use bf16 or fp32 storage for this layer / head"
                )
        return Quantized(q, clipped, counted)

    def paired_state(self, other: QuantizedTensorStore) -> dict[str, torch.Tensor] | None:
        """This store's state and ``other``'s side by side on the head axis, when both quantizers are the
        same pairable kind (:attr:`Quantizer.pairable`) with states of the same shapes; else None. Cached
        while neither state dict is replaced (state dicts are replaced, never modified in place)."""
        if self._pair is not None and self._pair[0] is self.state and self._pair[1] is other.state:
            return self._pair[2]
        mine, theirs = self.quantizer, other.quantizer
        both = None
        same = mine.pairable and type(mine) is type(theirs) and self.state.keys() == other.state.keys()
        if same and all(self.state[n].shape == other.state[n].shape for n in self.state):
            both = {n: torch.cat([self.state[n], other.state[n]], dim=-1) for n in self.state}
        self._pair = (self.state, other.state, both)
        return both

    def _widen_parts(self) -> None:
        """Re-type the block tensors whose dtype the quantizer changed (fp16 scales -> fp32; values kept)."""
        self.specs = self.quantizer.parts()
        for name, spec in self.specs.items():
            self.blocks.retype(self.group, self.kind, name, spec)

    def gather(
        self, table: torch.Tensor, run: int | None = None, parts: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """The parts of the blocks ``table[B, nb]`` as ``[B, H, nb * rows, *shape]``: one copy of the
        quantized bytes, or a view when ``run`` says the (single) row's blocks are ``run, run + 1, ...``.
        ``parts``: block tensors to index instead of the arena's (a tile staged from the host tier).
        ``table`` may also be a pair ``(blocks, lanes)`` of ``[B, H, nb]`` tensors: per-head block lanes (each
        head of each row reads its own blocks, at its own head slot; see :mod:`kvquant.blocks`)."""
        out = {}
        if isinstance(table, tuple):
            blk, lane = table
            B, H, nb = blk.shape
            for name, t in (self.parts if parts is None else parts).items():
                base = t.transpose(0, 1)  # [H, num_blocks, rows, *shape], contiguous: one index over (head, block)
                flat = base.reshape(-1, *base.shape[2:]).index_select(0, (lane * base.shape[1] + blk).reshape(-1))
                out[name] = flat.reshape(B, H, nb * base.shape[2], *base.shape[3:])
            return out
        B, nb = table.shape
        for name, t in (self.parts if parts is None else parts).items():
            base = t.transpose(0, 1)  # [H, num_blocks, rows, *shape], contiguous
            H, _, rows = base.shape[:3]
            g = base[:, run:run + nb] if run is not None else base.index_select(1, table.reshape(-1))
            out[name] = g.reshape(H, B, nb * rows, *base.shape[3:]).transpose(0, 1)
        return out

    def read(
        self, table: torch.Tensor, offset: int, length: int, dtype: torch.dtype = torch.float32,
        run: int | None = None, parts: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Dequantize ``length`` tokens from ``offset`` of the blocks ``table[B, nb]`` -> ``[B, H, length, D]``.

        Per-block parts need ``offset == 0`` (reads start at a block boundary). ``parts``: see :meth:`gather`."""
        return self.decode(self._window(table, offset, length, run, parts), dtype)

    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``[B, H, T, D]`` of per-row ``parts`` as the attention reads them (codebook rows stay in their head
        space, see ``LayerStore.read``; other rows dequantized)."""
        if self.quantizer.space:
            return self.quantizer.decode_space(parts, self.state).to(dtype)
        return self.quantizer.dequantize(parts, self.state, dtype)

    def read_factored(
        self, table: torch.Tensor, offset: int, length: int, run: int | None = None,
        parts: dict[str, torch.Tensor] | None = None,
    ) -> Factored:
        """Like :meth:`read` (float32), as codes and scales when the quantizer factors them (see
        :class:`~kvquant.quantizers.base.Factored`), else as the dequantized rows with no scale."""
        window = self._window(table, offset, length, run, parts)
        fac = None if self.quantizer.space else self.quantizer.factored(window, self.state)
        return fac if fac is not None else Factored(self.decode(window))

    def _window(
        self, table: torch.Tensor, offset: int, length: int, run: int | None,
        parts: dict[str, torch.Tensor] | None,
    ) -> dict[str, torch.Tensor]:
        """The parts of tokens ``[offset, offset + length)`` of the blocks ``table`` (per-block parts whole)."""
        parts = self.gather(table, run, parts)
        for name in parts:
            if self.specs[name].per_block:
                if offset:
                    raise AssertionError("per-block parts are read from a block boundary")
            else:
                parts[name] = parts[name][:, :, offset:offset + length]
        return parts

    def block_nbytes(self) -> dict[str, int]:
        """Bytes of one block of each part."""
        heads = self.blocks.specs[self.group][0]
        return {
            n: heads * part_rows(spec, self.block_size) * math.prod(spec.shape) * _itemsize(spec.dtype)
            for n, spec in self.specs.items()
        }

    def state_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())


def quantize_pair(
    key: QuantizedTensorStore, value: QuantizedTensorStore, k: torch.Tensor, v: torch.Tensor, check: bool = True,
    real: torch.Tensor | None = None,
) -> tuple[Quantized, Quantized]:
    """A head group's K and V quantized (see :meth:`QuantizedTensorStore.quantize`; nothing stored yet). When
    their quantizers pair (:meth:`QuantizedTensorStore.paired_state`: int8, fp8), both in one pass, side by
    side on the head axis -- half the tensor operations of a decode step's write, the same stored values;
    K's part then carries the clipping of both (a layer reports the sum)."""
    state = key.paired_state(value)
    if state is None:
        return key.quantize(k, check, real), value.quantize(v, check, real)
    H = k.shape[1]
    if real is not None and real.dim() == 3:  # per (row, head): K's heads, then V's
        real = torch.cat([real, real], dim=1)
    q = key.quantize(torch.cat([k, v], dim=1), check, real, state)
    return (Quantized({n: t[:, :H] for n, t in q.parts.items()}, q.clipped, q.counted),
            Quantized({n: t[:, H:] for n, t in q.parts.items()}, 0, None))


def write_pair(
    key: QuantizedTensorStore, value: QuantizedTensorStore, k: torch.Tensor, v: torch.Tensor,
    plan: WritePlan | LanePlan, check: bool = True, real: torch.Tensor | None = None,
) -> None:
    """Quantize (:func:`quantize_pair`) and store a head group's K and V where ``plan`` says."""
    qk, qv = quantize_pair(key, value, k, v, check, real)
    key.commit(qk, plan)
    value.commit(qv, plan)


class Quantized(NamedTuple):
    """A chunk quantized for one store (:meth:`QuantizedTensorStore.quantize`): its parts, and for static
    scales the values clipped and the real values counted (``counted`` None: nothing to count)."""

    parts: Parts
    clipped: torch.Tensor | int
    counted: torch.Tensor | int | None


_NO_INDEX = torch.empty(0, dtype=torch.long)  # the index fields of a one-token plan (unused: see ``single``)


class LanePlan(NamedTuple):
    """Where a write to per-head block lanes (AdaKV layers, :mod:`kvquant.blocks`) goes: token ``toks[i]`` of
    (row ``rows[i]``, group-local head ``heads[i]``) to block ``blk[i]``, lane ``lanes[i]`` (a head slot of the
    group), offset ``off[i]``. ``per_block``: the plan of per-block parts (per-channel scales of whole lanes:
    its ``toks`` index the chunk's blocks, its ``off`` is 0); None when the write has no whole lane."""

    rows: torch.Tensor
    heads: torch.Tensor
    toks: torch.Tensor
    blk: torch.Tensor
    lanes: torch.Tensor
    off: torch.Tensor
    per_block: LanePlan | None = None


@dataclass
class WritePlan:
    """Where one write goes: per-token rows ``(src_b, src_t) -> (dst_blk, dst_off)`` and, for per-block
    parts, ``(blk_src_b, blk_src_j) -> blk_dst`` (``blk_src_j`` counts blocks from the write's start)."""

    src_b: torch.Tensor
    src_t: torch.Tensor
    dst_blk: torch.Tensor
    dst_off: torch.Tensor
    blk_src_b: torch.Tensor
    blk_src_j: torch.Tensor
    blk_dst: torch.Tensor
    single: tuple[int, int, int, int] | None = None  # (src_b, src_t, dst_blk, dst_off) of a one-token write

    @classmethod
    def one(cls, src_b: int, src_t: int, dst_blk: int, dst_off: int) -> WritePlan:
        """The plan of a one-token write of one row (a decode step): basic indexing, no index tensors."""
        return cls(*(_NO_INDEX,) * 7, single=(src_b, src_t, dst_blk, dst_off))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def pool_rows(store: QuantizedTensorStore, x: torch.Tensor) -> torch.Tensor:
    """Rows ``x[B, Hg, t, D]`` quantized and decoded with ``store``'s state as its pool would read them (float32
    storage space)."""
    q = store.quantizer
    y = store.decode(q.quantize(x, store.state))
    return q.from_space(y, store.state) if q.space else y.float()
