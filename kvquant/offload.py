"""CPU offload of cold blocks: a host tier beside a layer's device blocks, and the prefetch that reads it back.

Config: ``offload: {device: cpu, keep_recent_blocks: N}``. After each write, a
:class:`~kvquant.store.LayerStore` moves its full blocks older than the newest ``N`` (and not holding sink
tokens) from the compute device to :class:`HostBlocks` (host memory, pinned when the compute device is CUDA),
vLLM's ``swap_space`` for quantized blocks. A block moves only when every reference to it is in that store's
own block tables (a block shared with another cache or the prefix index stays on the device; a block moved
before the prefix index saw it is not indexed: prefix reuse covers device blocks only).

Addressing: a block table entry ``b >= 0`` is a device block, ``-1`` a released one (sliding window) and
``b <= -2`` the host block ``host_id(b) = -2 - b``. :class:`~kvquant.blocks.LayerBlocks` routes reference counts
of host entries to its host tier, so beam reorders, copies, crops and releases work on both tiers unchanged.

Reading: the attention walks the history tile by tile. :class:`Prefetcher` copies a tile's host blocks to the
device when the tile is read and, at the same time, starts the copy of the next tile, so the copy of tile
``k + 1`` overlaps the compute of tile ``k`` (on CUDA: a side stream from pinned memory, ordered by an event; on
CPU both tiers are CPU tensors and the copies are plain, but the moves, the addressing and the accounting are the
same code). Kernels that read the arena directly (Triton) get the layer's host blocks staged into device blocks
for the call (:meth:`~kvquant.store.LayerStore.staged`), released afterwards. Device memory at rest is bounded by
``N`` blocks per sequence and layer (plus sink blocks and the partial block being written); in flight, by one or
two tiles of one layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .blocks import LayerBlocks
    from .config import KVQuantConfig
    from .store import HeadGroup


def is_host(entry: int) -> bool:
    """True when a block table entry addresses the host tier."""
    return entry <= -2


def host_entry(host_id: int) -> int:
    """The block table entry of host block ``host_id``."""
    return -2 - host_id


def host_id(entry: int) -> int:
    """The host block id of a host table entry (inverse of :func:`host_entry`)."""
    return -2 - entry


class HostBlocks:
    """The host tier of one layer's blocks: one host tensor per (group, K/V, part), ``[n, heads, rows, *shape]``,
    with a free list and reference counts (the device tier's layout, indexed by host id)."""

    def __init__(self, device_parts: list[dict[str, dict[str, torch.Tensor]]], pin: bool) -> None:
        self.pin = pin
        self.parts: list[dict[str, dict[str, torch.Tensor]]] = [
            {kind: {name: self._empty(t, 0) for name, t in parts.items()} for kind, parts in group.items()}
            for group in device_parts
        ]
        self.refs: list[int] = []
        self.free: list[int] = []
        self.bytes_per_block = sum(t[0].numel() * t.element_size() for g in device_parts
                                   for parts in g.values() for t in parts.values())  # fmt: skip
        self.bytes_in = 0  # bytes copied device -> host
        self.bytes_out = 0  # bytes copied host -> device (prefetch and staging)

    def _empty(self, like: torch.Tensor, n: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = torch.empty((n, *like.shape[1:]), dtype=dtype or like.dtype, device="cpu")
        return t.pin_memory() if self.pin and n else t

    @property
    def used(self) -> int:
        return len(self.refs) - len(self.free)

    def _grow(self, total: int) -> None:
        old = len(self.refs)
        for group in self.parts:
            for parts in group.values():
                for name, t in parts.items():
                    grown = self._empty(t, total)
                    grown[:old] = t
                    parts[name] = grown
        self.refs.extend([0] * (total - old))
        self.free.extend(range(total - 1, old - 1, -1))

    def put(self, device_parts: list[dict[str, dict[str, torch.Tensor]]], ids: list[int], refs: list[int]) -> list[int]:
        """Copy device blocks ``ids`` (every group and part) into free host blocks with ``refs`` references each;
        returns their host ids. Synchronous: the device blocks can be reused as soon as it returns."""
        if len(self.free) < len(ids):
            self._grow(max(len(self.refs) + len(ids) - len(self.free), len(self.refs) * 5 // 4))
        hids = [self.free.pop() for _ in ids]
        for h, r in zip(hids, refs, strict=True):
            self.refs[h] = r
        src = torch.tensor(ids, dtype=torch.long, device=_device_of(device_parts))
        dst = torch.tensor(hids, dtype=torch.long)
        for g, group in enumerate(device_parts):
            for kind, parts in group.items():
                for name, t in parts.items():
                    host = self.parts[g][kind][name]
                    if host.dtype != t.dtype:  # the device part was widened (fp16 -> fp32 scales): follow it
                        host = self.parts[g][kind][name] = host.to(t.dtype)
                    host.index_copy_(0, dst, t.index_select(0, src).cpu())
        self.bytes_in += len(ids) * self.bytes_per_block
        return hids

    def take(self, group: int, kind: str, hids: list[int], device: torch.device) -> dict[str, torch.Tensor]:
        """Host blocks ``hids`` of one group's K or V parts, copied to ``device`` (``[n, heads, rows, ...]``;
        non-blocking from pinned memory: order it with the stream it was issued on)."""
        idx = torch.tensor(hids, dtype=torch.long)
        out = {}
        for name, t in self.parts[group][kind].items():
            rows = t.index_select(0, idx)
            out[name] = rows.pin_memory().to(device, non_blocking=True) if self.pin else rows.to(device)
            self.bytes_out += rows.numel() * rows.element_size()
        return out

    def incref(self, hids: Iterable[int]) -> None:
        for h in hids:
            self.refs[h] += 1

    def decref(self, hids: Iterable[int]) -> None:
        for h in hids:
            self.refs[h] -= 1
            if self.refs[h] == 0:
                self.free.append(h)
            elif self.refs[h] < 0:
                raise AssertionError(f"host block {h}: reference count below zero")

    def nbytes(self) -> int:
        """Bytes of the host tensors (allocated capacity)."""
        return len(self.refs) * self.bytes_per_block


def _tensors(data: Any) -> list[torch.Tensor]:
    """Every tensor inside nested tuples / lists / dicts."""
    if isinstance(data, torch.Tensor):
        return [data]
    if isinstance(data, dict):
        data = list(data.values())
    if isinstance(data, (list, tuple)):
        return [t for x in data for t in _tensors(x)]
    return []


def _device_of(parts: list[dict[str, dict[str, torch.Tensor]]]) -> torch.device:
    return next(t.device for g in parts for p in g.values() for t in p.values())


class Prefetcher:
    """Host -> device copies of the tiles the attention reads, one tile ahead (see the module doc).

    ``fetch(key, make)`` returns the copy started for ``key`` by an earlier ``prefetch(key, make)`` (waiting for
    it on the current stream), or makes it now; ``make()`` issues the copies and returns the device tensors.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pending: dict[Any, tuple[Any, Any]] = {}
        self.prefetched = 0  # tiles whose copy was started ahead of their read
        self.fetched = 0  # tiles read (prefetched or not)

    def prefetch(self, key: Any, make: Any) -> None:
        if key in self.pending:
            return
        if self.stream is None:
            self.pending[key] = (make(), None)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                data = make()
                event = torch.cuda.Event()
                event.record(self.stream)
            self.pending[key] = (data, event)

    def fetch(self, key: Any, make: Any) -> Any:
        self.fetched += 1
        item = self.pending.pop(key, None)
        if item is None:
            return make()
        self.prefetched += 1
        data, event = item
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            for t in _tensors(data):  # made on the side stream, read on this one: not reused before that
                t.record_stream(stream)
        return data

    def clear(self) -> None:
        """Drop copies started for tiles that were never read (the history changed)."""
        self.pending.clear()


class OffloadedStore:
    """The offload operations of a :class:`~kvquant.store.LayerStore` (mixed into it): moving its cold blocks to
    the host tier, staging them back for a read, and bringing a block back for a write. They act on the
    store's block tables (``tables``), its :class:`~kvquant.blocks.LayerBlocks` (``blocks``) and cursors."""

    # attributes of LayerStore that these methods use
    tables: list[list[int]]  # block ids per row (-1: released, <= -2: a host block)
    blocks: LayerBlocks
    groups: list[HeadGroup]
    config: KVQuantConfig
    device: torch.device
    block_size: int
    q_end: int
    sink_end: int
    sink_tokens: int
    first_live: int
    offload_from: int
    bytes_offloaded: int
    prefetcher: Prefetcher | None
    _table_cache: torch.Tensor | None

    def has_host_blocks(self, j0: int = 0, j1: int | None = None) -> bool:
        """True when some row's blocks ``[j0, j1)`` are in the host tier."""
        if self.blocks.host is None or not self.blocks.host.used:
            return False
        return any(is_host(e) for t in self.tables for e in t[j0:j1])

    def offload_cold(self) -> None:
        """``offload``: move full blocks older than the newest ``keep_recent_blocks`` (and not holding sink tokens)
        to the host tier, when every reference to them is in this store's tables (see :mod:`kvquant.offload`)."""
        cfg = self.config.offload
        if not cfg:
            return
        bs = self.block_size
        last = self.q_end // bs - cfg["keep_recent_blocks"]
        first = max(self.first_live, self.offload_from, -(-self.sink_end // bs) if self.sink_tokens else 0)
        if last <= first:
            return
        counts: dict[int, int] = {}
        for t in self.tables:
            for e in t[first:last]:
                if e >= 0:
                    counts[e] = counts.get(e, 0) + 1
        self.offload_from = last
        movable = [b for b, c in counts.items() if self.blocks.refs[b] == c]
        if not movable:
            return
        hids = self.blocks.host_tier().put(self.blocks.parts, movable, [counts[b] for b in movable])
        where = dict(zip(movable, hids, strict=True))
        for t in self.tables:
            for j in range(first, min(last, len(t))):
                if t[j] in where:
                    t[j] = host_entry(where[t[j]])
        for b in movable:  # every reference moved with the block: the device block is free
            self.blocks.refs[b] = 0
            self.blocks.free.append(b)
        self.bytes_offloaded += len(movable) * self.blocks.bytes_per_block
        self._table_cache = None
        if self.prefetcher is not None:
            self.prefetcher.clear()

    def _stage_tile(self, gi: int, j0: int, j1: int) -> tuple[torch.Tensor, dict, dict]:
        """Blocks ``[j0, j1)`` of every row for group ``gi``: (table ``[B, nb]`` into the staged tensors, key parts,
        value parts), device blocks gathered from the arena and host blocks copied to the device."""
        width = j1 - j0
        rows = [[e if e >= 0 or is_host(e) else 0 for e in t[j0:j1]] + [0] * (width - len(t[j0:j1]))
                for t in self.tables]  # fmt: skip
        dev = sorted({e for r in rows for e in r if e >= 0})
        hst = sorted({e for r in rows for e in r if is_host(e)}, reverse=True)
        pos = {e: i for i, e in enumerate(dev + hst)}
        staged = []
        dev_idx = torch.tensor(dev, dtype=torch.long, device=self.device)
        for kind in ("key", "value"):
            arena = self.blocks.parts[gi][kind]
            host = self.blocks.host.take(gi, kind, [host_id(e) for e in hst], self.device)  # type: ignore[union-attr]
            staged.append({n: torch.cat([arena[n].index_select(0, dev_idx), host[n]]) for n in arena})
        table = torch.tensor([[pos[e] for e in r] for r in rows], dtype=torch.long, device=self.device)
        return table, staged[0], staged[1]

    def _fetch_offloaded(self, group: HeadGroup, j0: int, j1: int) -> tuple[torch.Tensor, dict, dict]:
        """Blocks ``[j0, j1)`` of ``group`` with host blocks among them, as :meth:`_stage_tile` gives them: fetched
        (prefetched by the previous tile's read, or copied now); starts the copy of the next tile of the same size."""
        gi = self.groups.index(group)
        if self.prefetcher is None:
            self.prefetcher = Prefetcher(self.device)
        staged = self.prefetcher.fetch((gi, j0, j1), lambda: self._stage_tile(gi, j0, j1))
        n0, n1 = j1, min(j1 + (j1 - j0), -(-self.q_end // self.block_size))
        if n1 > n0 and self.has_host_blocks(n0, n1):
            self.prefetcher.prefetch((gi, n0, n1), lambda: self._stage_tile(gi, n0, n1))
        return staged

    def _host_to_device(self, entries: list[int], refs: list[int]) -> list[int]:
        """Copy host blocks (table ``entries``) into newly allocated device blocks with ``refs`` references each."""
        self.blocks.ensure_free(len(entries))  # may raise KVCacheFull: nothing changed yet
        dev = [self.blocks.allocate(r) for r in refs]
        idx = torch.tensor(dev, dtype=torch.long, device=self.device)
        for gi, group in enumerate(self.blocks.parts):
            for kind, parts in group.items():
                host = self.blocks.host.take(gi, kind, [host_id(e) for e in entries], self.device)  # type: ignore[union-attr]
                for name, t in parts.items():
                    t.index_copy_(0, idx, host[name])
        return dev

    def _bring_back(self, j: int) -> None:
        """Move block ``j`` of every row back to the device (a crop made it the partial block, written next)."""
        counts: dict[int, int] = {}
        for t in self.tables:
            if j < len(t) and is_host(t[j]):
                counts[t[j]] = counts.get(t[j], 0) + 1
        if not counts:
            return
        entries = sorted(counts)
        where = dict(zip(entries, self._host_to_device(entries, [counts[e] for e in entries]), strict=True))
        for t in self.tables:
            if j < len(t) and t[j] in where:
                self.blocks.decref([t[j]])
                t[j] = where[t[j]]
        self._table_cache = None

    @contextlib.contextmanager
    def staged(self) -> Iterator[None]:
        """For kernels that read the arena through :meth:`table` (Triton): copy every host block of the rows into
        free device blocks and point the tables at them for the duration of the block; then release them."""
        if not self.has_host_blocks():
            yield
            return
        saved = [list(t) for t in self.tables]
        entries = sorted({e for t in self.tables for e in t if is_host(e)})
        dev = self._host_to_device(entries, [1] * len(entries))
        where = dict(zip(entries, dev, strict=True))
        self.tables = [[where.get(e, e) for e in t] for t in self.tables]
        self._table_cache = None
        try:
            yield
        finally:
            self.tables = saved
            self._table_cache = None
            self.blocks.decref(dev)
