"""CPU offload of cold blocks: a host tier beside a layer's device blocks, and the prefetch that reads it back.

Config: ``offload: {device: cpu, keep_recent_blocks: N}``. After each write, a :class:`~kvquant.store.LayerStore`
(its :class:`~kvquant.host_tier.HostTier`) moves its full blocks older than the newest ``N`` (and not holding sink
tokens) from the compute device to :class:`HostBlocks` (host memory, pinned when the compute device is CUDA), vLLM's
``swap_space`` for quantized blocks. A block moves only when every reference to it is in that store's own block
tables (a block shared with another cache or the prefix index stays on the device; a block moved before the prefix
index saw it is not indexed: prefix reuse covers device blocks only).

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

from collections.abc import Iterable
from typing import Any

import torch


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
