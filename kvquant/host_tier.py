"""The host tier of one layer's store (``offload``): cold-block moves, tile staging and the prefetch that reads it.

:class:`HostTier` is a component of :class:`~kvquant.store.LayerStore`, made when its plan offloads. It holds its
own state (the :class:`~kvquant.offload.Prefetcher`, how far blocks were considered, the bytes moved) and acts on
the block tables the store passes it (entries as addressed in :mod:`kvquant.offload`): it moves full blocks older
than the newest ``keep_recent_blocks`` to the layer's :class:`~kvquant.offload.HostBlocks`, stages a tile of them
for a read, and brings one back for a write. A method that changes the tables says so (returns True), so that the
store drops its cached table tensor.
"""

from __future__ import annotations

import torch

from .blocks import LayerBlocks
from .offload import Prefetcher, host_entry, host_id, is_host

# a tile staged for a read: (table [B, nb] into the staged tensors, key parts, value parts)
StagedTile = tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]


def has_host_blocks(blocks: LayerBlocks, tables: list[list[int]], j0: int = 0, j1: int | None = None) -> bool:
    """True when some row's blocks ``[j0, j1)`` of ``tables`` are in the host tier of ``blocks``."""
    if blocks.host is None or not blocks.host.used:
        return False
    return any(is_host(e) for t in tables for e in t[j0:j1])


class HostTier:
    """Cold blocks of one layer's store in host memory (see the module doc).

    Args:
        blocks: the layer's blocks (their host tier is made on the first move).
        keep_recent_blocks: full blocks per row kept on the device, newest first.
    """

    def __init__(self, blocks: LayerBlocks, keep_recent_blocks: int) -> None:
        self.blocks = blocks
        self.keep_recent_blocks = keep_recent_blocks
        self.offload_from = 0  # blocks below this index were considered for offload already
        self.bytes_offloaded = 0  # quantized bytes moved to the host tier
        self.prefetcher: Prefetcher | None = None  # host -> device tile copies, made on first use

    def copy(self) -> HostTier:
        """A copy with the same counters and no prefetch in flight (the copy's reads are its own)."""
        new = HostTier(self.blocks, self.keep_recent_blocks)
        new.offload_from, new.bytes_offloaded = self.offload_from, self.bytes_offloaded
        return new

    def reset(self) -> None:
        """Forget how far blocks were considered (the tables are empty again)."""
        self.offload_from = 0

    def crop(self, blocks: int) -> None:
        """The tables keep their first ``blocks`` blocks: later ones are considered again once written."""
        self.offload_from = min(self.offload_from, blocks)

    def history_changed(self) -> None:
        """Drop the copies started for tiles that were never read (the tables changed under them)."""
        if self.prefetcher is not None:
            self.prefetcher.clear()

    def offload_cold(self, tables: list[list[int]], q_end: int, first_live: int, sink_end: int) -> bool:
        """Move full blocks of ``tables`` below ``q_end`` older than the newest ``keep_recent_blocks`` (from
        ``first_live`` on, none holding a token below ``sink_end``) to the host tier, when every reference to
        them is in ``tables`` (see :mod:`kvquant.offload`); True when a table entry changed."""
        bs = self.blocks.block_size
        last = q_end // bs - self.keep_recent_blocks
        first = max(first_live, self.offload_from, -(-sink_end // bs))
        if last <= first:
            return False
        counts: dict[int, int] = {}
        for t in tables:
            for e in t[first:last]:
                if e >= 0:
                    counts[e] = counts.get(e, 0) + 1
        self.offload_from = last
        movable = [b for b, c in counts.items() if self.blocks.refs[b] == c]
        if not movable:
            return False
        hids = self.blocks.host_tier().put(self.blocks.parts, movable, [counts[b] for b in movable])
        where = dict(zip(movable, hids, strict=True))
        for t in tables:
            for j in range(first, min(last, len(t))):
                if t[j] in where:
                    t[j] = host_entry(where[t[j]])
        for b in movable:  # every reference moved with the block: the device block is free
            self.blocks.refs[b] = 0
            self.blocks.free.append(b)
        self.bytes_offloaded += len(movable) * self.blocks.bytes_per_block
        self.history_changed()
        return True

    def _stage_tile(self, tables: list[list[int]], gi: int, j0: int, j1: int, device: torch.device) -> StagedTile:
        """Blocks ``[j0, j1)`` of every row for group ``gi``: (table ``[B, nb]`` into the staged tensors, key parts,
        value parts), device blocks gathered from the arena and host blocks copied to ``device``."""
        width = j1 - j0
        rows = [[e if e >= 0 or is_host(e) else 0 for e in t[j0:j1]] + [0] * (width - len(t[j0:j1]))
                for t in tables]  # fmt: skip
        dev = sorted({e for r in rows for e in r if e >= 0})
        hst = sorted({e for r in rows for e in r if is_host(e)}, reverse=True)
        pos = {e: i for i, e in enumerate(dev + hst)}
        staged = []
        dev_idx = torch.tensor(dev, dtype=torch.long, device=device)
        for kind in ("key", "value"):
            arena = self.blocks.parts[gi][kind]
            host = self.blocks.host.take(gi, kind, [host_id(e) for e in hst], device)  # type: ignore[union-attr]
            staged.append({n: torch.cat([arena[n].index_select(0, dev_idx), host[n]]) for n in arena})
        table = torch.tensor([[pos[e] for e in r] for r in rows], dtype=torch.long, device=device)
        return table, staged[0], staged[1]

    def fetch(
        self, tables: list[list[int]], gi: int, j0: int, j1: int, q_end: int, device: torch.device
    ) -> StagedTile:
        """Blocks ``[j0, j1)`` of group ``gi`` with host blocks among them, as :meth:`_stage_tile` gives them:
        fetched (prefetched by the previous tile's read, or copied now); starts the copy of the next tile of the same
        size below ``q_end``."""
        if self.prefetcher is None:
            self.prefetcher = Prefetcher(device)
        staged = self.prefetcher.fetch((gi, j0, j1), lambda: self._stage_tile(tables, gi, j0, j1, device))
        n0, n1 = j1, min(j1 + (j1 - j0), -(-q_end // self.blocks.block_size))
        if n1 > n0 and has_host_blocks(self.blocks, tables, n0, n1):
            self.prefetcher.prefetch((gi, n0, n1), lambda: self._stage_tile(tables, gi, n0, n1, device))
        return staged

    def bring_back(self, tables: list[list[int]], j: int, device: torch.device) -> bool:
        """Move block ``j`` of every row of ``tables`` back to the device (a crop made it the partial block, written
        next); True when a table entry changed."""
        counts: dict[int, int] = {}
        for t in tables:
            if j < len(t) and is_host(t[j]):
                counts[t[j]] = counts.get(t[j], 0) + 1
        if not counts:
            return False
        entries = sorted(counts)
        where = dict(zip(entries, host_to_device(self.blocks, entries, [counts[e] for e in entries], device),
                         strict=True))  # fmt: skip
        for t in tables:
            if j < len(t) and t[j] in where:
                self.blocks.decref([t[j]])
                t[j] = where[t[j]]
        return True


def host_to_device(blocks: LayerBlocks, entries: list[int], refs: list[int], device: torch.device) -> list[int]:
    """Copy host blocks (table ``entries``) into newly allocated device blocks of ``blocks`` with ``refs``
    references each; returns their device ids."""
    blocks.ensure_free(len(entries))  # may raise KVCacheFull: nothing changed yet
    dev = [blocks.allocate(r) for r in refs]
    idx = torch.tensor(dev, dtype=torch.long, device=device)
    for gi, group in enumerate(blocks.parts):
        for kind, parts in group.items():
            host = blocks.host.take(gi, kind, [host_id(e) for e in entries], device)  # type: ignore[union-attr]
            for name, t in parts.items():
                t.index_copy_(0, idx, host[name])
    return dev


def stage_tables(
    blocks: LayerBlocks, tables: list[list[int]], device: torch.device
) -> tuple[list[list[int]], list[int]]:
    """``tables`` with every host block copied into a free device block of ``blocks`` (one reference each), and
    those device blocks (to be released when the staged read is over)."""
    entries = sorted({e for t in tables for e in t if is_host(e)})
    dev = host_to_device(blocks, entries, [1] * len(entries), device)
    where = dict(zip(entries, dev, strict=True))
    return [[where.get(e, e) for e in t] for t in tables], dev
