"""Pieces of a layer's :class:`~kvquant.snapshot.KVSnapshot` built from the store's own objects: a K or V store as
a :class:`~kvquant.snapshot.PartSnapshot`."""

from __future__ import annotations

from .snapshot import PartSnapshot
from .tensor_store import QuantizedTensorStore


def part_snapshot(store: QuantizedTensorStore) -> PartSnapshot:
    """``store``'s quantizer, static state and part tensors as they are now (references, nothing copied), with the
    rows memo that stays with it across snapshots."""
    return PartSnapshot(store.quantizer, store.parts, store.state, store.batch, store.heads, store.block_size,
                        store.device, store.memo)  # fmt: skip
