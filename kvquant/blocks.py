"""The blocks of one layer: preallocated block tensors, a free list and reference counts.

For every head group of the layer (heads sharing a (key, value) precision pair) and for K and V,
one tensor per quantizer part, indexed by block id (vLLM's layout)::

    per-token part:  [num_blocks, heads_in_group, block_size, *part_shape]
    per-block part:  [num_blocks, heads_in_group, 1, *part_shape]     (per-channel scales/zeros)

(stored head-major: the memory is ``[heads_in_group, num_blocks, ...]``, so that one head's run of
consecutive blocks is contiguous; kernels address it through strides.)

A block id addresses the same slot in every group and part of the layer, so one block table per
sequence row serves them all. Reference counts let rows (beams), caches (requests) and the prefix
index share a block; a block returns to the free list when its count drops to 0.

Lanes (layers whose KV heads keep different token counts, AdaKV budgets): the allocation unit is then one
*lane*, the rows of one head of one block. Lane id ``e = block * lanes_per_block + k`` with ``k`` the head's
position in the layer's group order (group ``g``'s lane ``i`` is ``k = sum(heads of groups before g) + i``);
any lane of a group can hold any head of that group (same part shapes). A block taken for lanes counts its
lanes in use in ``refs`` (so it is never free while one is), its free lanes serve other heads, rows and caches
(``lane_free`` per group), and it returns to the block free list when its last lane is released. Each lane
has its own reference count (``lane_refs``: beams and copies share lanes like blocks).

Growth: an unbounded arena grows by whole blocks (at least a quarter more each time: amortised O(1)
per token, the quantized bytes copied O(log n) times); a bounded arena (``fixed``) never grows and
raises :class:`KVCacheFull` instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from .offload import HostBlocks, host_id
from .quantizers.base import PartSpec

GROWTH = 1.25


class KVCacheFull(RuntimeError):
    """A bounded :class:`~kvquant.PagedKVPool` has fewer free blocks than a write needs.

    Nothing was written: the pool and every cache on it are as they were before the call.
    """

    def __init__(self, needed: int, free: int, layer: int | None = None) -> None:
        where = f" in layer {layer}" if layer is not None else ""
        super().__init__(
            f"KV cache full: the write needs {needed} blocks{where}, {free} are free "
            "(release sequences, or give the pool a larger max_bytes)"
        )
        self.needed, self.free, self.layer = needed, free, layer


def part_rows(spec: PartSpec, block_size: int) -> int:
    """Rows of a part held per block: ``block_size`` per-token rows, or one per-block row."""
    return 1 if spec.per_block else block_size


def block_bytes(groups: Iterable[tuple[int, dict[str, PartSpec], dict[str, PartSpec]]], block_size: int) -> int:
    """Bytes of one block over all ``(heads, key specs, value specs)`` groups of a layer."""
    total = 0
    for heads, *kinds in groups:
        for specs in kinds:
            for spec in specs.values():
                n = heads * part_rows(spec, block_size) * math.prod(spec.shape)
                total += n * torch.empty((), dtype=spec.dtype).element_size()
    return total


class LayerBlocks:
    """Block tensors, free list and reference counts of one layer (see the module doc)."""

    def __init__(
        self,
        groups: list[tuple[int, dict[str, PartSpec], dict[str, PartSpec]]],
        block_size: int,
        device: torch.device,
        num_blocks: int = 0,
        fixed: bool = False,
        layer: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.fixed = fixed
        self.layer = layer
        self.specs = groups
        self.bytes_per_block = block_bytes(groups, block_size)
        # parts[group]["key" | "value"][part name]
        self.parts: list[dict[str, dict[str, torch.Tensor]]] = [
            {kind: {name: self._empty(heads, spec, 0) for name, spec in specs.items()}
             for kind, specs in (("key", kspecs), ("value", vspecs))}
            for heads, kspecs, vspecs in groups
        ]  # fmt: skip
        self.refs: list[int] = []
        self.free: list[int] = []
        self.on_full: Callable[[int], None] | None = None  # the pool's eviction hook (bounded pools)
        self.host: HostBlocks | None = None  # the host tier (``offload``), made by :meth:`host_tier`
        # lanes (see the module doc): lane k of a block -> (group, head slot in the group)
        self.lane_of: list[tuple[int, int]] = [(g, i) for g, (heads, *_) in enumerate(groups) for i in range(heads)]
        self.lanes_per_block = len(self.lane_of)
        self.lane_refs: list[int] = []
        self.lane_free: list[list[int]] = [[] for _ in groups]
        self.lane_blocks: set[int] = set()  # blocks split into lanes
        if num_blocks:
            self._grow(num_blocks)

    def _empty(self, heads: int, spec: PartSpec, n: int) -> torch.Tensor:
        # head-major in memory ([heads, num_blocks, rows, ...]), seen as [num_blocks, heads, rows, ...]:
        # a head's consecutive blocks are one contiguous run (the torch path reads them without a copy)
        shape = (heads, n, part_rows(spec, self.block_size), *spec.shape)
        return torch.zeros(shape, dtype=spec.dtype, device=self.device).transpose(0, 1)

    @property
    def num_blocks(self) -> int:
        return len(self.refs)

    @property
    def used(self) -> int:
        return len(self.refs) - len(self.free)

    def _grow(self, total: int) -> None:
        old = self.num_blocks
        for g, (heads, kspecs, vspecs) in enumerate(self.specs):
            for kind, specs in (("key", kspecs), ("value", vspecs)):
                for name, spec in specs.items():
                    t = self.parts[g][kind][name]
                    grown = self._empty(heads, spec, total)
                    grown[:old] = t
                    self.parts[g][kind][name] = grown
        self.refs.extend([0] * (total - old))
        self.lane_refs.extend([0] * ((total - old) * self.lanes_per_block))
        self.free.extend(range(total - 1, old - 1, -1))  # pop() hands out low ids first

    def ensure_free(self, n: int) -> None:
        """Make ``n`` blocks free (grow, or evict through ``on_full``), else raise :class:`KVCacheFull`."""
        if n <= len(self.free):
            return
        if self.fixed:
            if self.on_full is not None:
                self.on_full(n - len(self.free))
            if n > len(self.free):
                raise KVCacheFull(n, len(self.free), self.layer)
            return
        self._grow(max(self.num_blocks + n - len(self.free), math.ceil(self.num_blocks * GROWTH)))

    def allocate(self, refs: int = 1) -> int:
        """A free block id with ``refs`` references (call :meth:`ensure_free` first)."""
        self.ensure_free(1)
        b = self.free.pop()
        self.refs[b] = refs
        return b

    # ---------------------------------------------------------------- lanes (one head of one block)
    def lane_where(self, lane: int) -> tuple[int, int, int]:
        """``(block, group, head slot in the group)`` of a lane id."""
        b, k = divmod(lane, self.lanes_per_block)
        return (b, *self.lane_of[k])

    def lane_bytes(self, group: int) -> int:
        """Bytes of one lane of ``group`` (one head's rows of one block, every K/V part)."""
        heads, *kinds = self.specs[group]
        return block_bytes([(1, *kinds)], self.block_size)

    def ensure_lanes(self, need: list[int]) -> None:
        """Make ``need[g]`` lanes of every group ``g`` free (taking whole free blocks, growing or evicting as
        :meth:`ensure_free` does), else raise :class:`KVCacheFull` with nothing changed."""
        blocks = 0
        for g, n in enumerate(need):
            heads = self.specs[g][0]
            blocks = max(blocks, -(-(n - len(self.lane_free[g])) // heads))
        if blocks > 0:
            self.ensure_free(blocks)

    def _split(self) -> int:
        """Take a free block for lanes (growing or evicting as :meth:`ensure_free` does): its lanes join the
        free lists of their groups."""
        self.ensure_free(1)
        b = self.free.pop()
        self.refs[b] = 0
        self.lane_blocks.add(b)
        base = b * self.lanes_per_block
        for k in range(self.lanes_per_block - 1, -1, -1):  # pop() hands out low lanes first
            self.lane_free[self.lane_of[k][0]].append(base + k)
        return b

    def allocate_lane(self, group: int, refs: int = 1, prefer: int | None = None) -> int:
        """A free lane of ``group`` with ``refs`` references (call :meth:`ensure_lanes` first); a new block is
        split into lanes when the group has no free lane. ``prefer``: a lane id taken if it is free (a layout
        wish: a row's heads side by side in one block, which lets one sequence's lanes form runs read in place;
        never at the cost of a block: free lanes are used first)."""
        L = self.lanes_per_block
        if prefer is not None and prefer // L in self.lane_blocks and self.lane_refs[prefer] == 0:
            self.lane_free[group].remove(prefer)
            e = prefer
        else:
            if not self.lane_free[group]:
                self._split()
            e = self.lane_free[group].pop()
        self.lane_refs[e] = refs
        self.refs[e // L] += 1
        return e

    def incref_entries(self, ids: Iterable[int], lanes: bool) -> None:
        """One more reference to each table entry of ``ids``: lanes (:meth:`incref_lanes`) or blocks."""
        (self.incref_lanes if lanes else self.incref)(ids)

    def decref_entries(self, ids: Iterable[int], lanes: bool) -> None:
        """One reference less to each table entry of ``ids``: lanes (:meth:`decref_lanes`) or blocks."""
        (self.decref_lanes if lanes else self.decref)(ids)

    def incref_lanes(self, ids: Iterable[int]) -> None:
        """One more reference to each lane id."""
        for e in ids:
            self.lane_refs[e] += 1

    def decref_lanes(self, ids: Iterable[int]) -> None:
        """One reference less to each lane id; a lane whose count reaches 0 is free again, and a block whose
        last lane is freed goes back to the block free list."""
        for e in ids:
            self.lane_refs[e] -= 1
            if self.lane_refs[e] > 0:
                continue
            if self.lane_refs[e] < 0:
                raise AssertionError(f"lane {e}: reference count below zero")
            b, g, _ = self.lane_where(e)
            self.lane_free[g].append(e)
            self.refs[b] -= 1
            if self.refs[b] == 0:  # every lane of the block is free: the block is free
                lo, hi = b * self.lanes_per_block, (b + 1) * self.lanes_per_block
                self.lane_free = [[x for x in free if not lo <= x < hi] for free in self.lane_free]
                self.lane_blocks.discard(b)
                self.free.append(b)

    def copy_lane(self, src: int, refs: int = 1) -> int:
        """Copy-on-write of one lane: a new lane of the same group holding lane ``src``'s rows (every K/V part)."""
        sb, g, si = self.lane_where(src)
        dst = self.allocate_lane(g, refs)
        db, _, di = self.lane_where(dst)
        for parts in self.parts[g].values():
            for t in parts.values():
                t[db, di].copy_(t[sb, si])
        return dst

    def host_tier(self) -> HostBlocks:
        """The host tier of these blocks (created on the first use; pinned when the blocks are on CUDA)."""
        if self.host is None:
            self.host = HostBlocks(self.parts, pin=self.device.type == "cuda")
        return self.host

    def incref(self, ids: Iterable[int]) -> None:
        """One more reference to each id (``-1``: released, ignored; ``<= -2``: a host block, see kvquant.offload)."""
        for b in ids:
            if b >= 0:
                self.refs[b] += 1
            elif b < -1:
                self.host.incref([host_id(b)])  # type: ignore[union-attr]

    def decref(self, ids: Iterable[int]) -> None:
        """One reference less to each id; a block whose count reaches 0 is free again (device or host tier)."""
        for b in ids:
            if b < 0:
                if b < -1:
                    self.host.decref([host_id(b)])  # type: ignore[union-attr]
                continue
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)
            elif self.refs[b] < 0:
                raise AssertionError(f"block {b}: reference count below zero")

    def copy(self, src: int, refs: int = 1) -> int:
        """Copy-on-write: a new block holding block ``src``'s bytes (every group and part)."""
        dst = self.allocate(refs)
        for group in self.parts:
            for parts in group.values():
                for t in parts.values():
                    t[dst].copy_(t[src])
        return dst

    def retype(self, group: int, kind: str, name: str, spec: PartSpec) -> None:
        """Give one part the dtype of ``spec`` (fp16 scales widened to fp32 after an overflow: values kept
        exactly, for every cache on these blocks)."""
        t = self.parts[group][kind][name]
        if t.dtype == spec.dtype:
            return
        heads = self.specs[group][0]
        new = self._empty(heads, spec, self.num_blocks)
        new.copy_(t)
        self.parts[group][kind][name] = new
        kspecs, vspecs = self.specs[group][1:]
        specs = dict(kspecs if kind == "key" else vspecs)
        specs[name] = spec
        self.specs[group] = (heads, specs, vspecs) if kind == "key" else (heads, kspecs, specs)
        self.bytes_per_block = block_bytes(self.specs, self.block_size)

    def nbytes(self) -> int:
        """Bytes of every block tensor (allocated capacity)."""
        return self.num_blocks * self.bytes_per_block
