"""Pieces of a layer's :class:`~kvquant.snapshot.KVSnapshot` built from the store's own objects: a K or V store as
a :class:`~kvquant.snapshot.PartSnapshot`, with the rows memo that stays with that store across snapshots."""

from __future__ import annotations

import weakref

from .snapshot import PartSnapshot, RowsMemo
from .tensor_store import QuantizedTensorStore

# per K / V store, the memo of the kernel rows built from its state (weak: it goes with the store)
_memos: weakref.WeakKeyDictionary[QuantizedTensorStore, RowsMemo] = weakref.WeakKeyDictionary()


def part_snapshot(store: QuantizedTensorStore) -> PartSnapshot:
    """``store``'s quantizer, static state and part tensors as they are now (references, nothing copied)."""
    memo = _memos.get(store)
    if memo is None:
        memo = _memos[store] = RowsMemo()
    return PartSnapshot(store.quantizer, store.parts, store.state, store.batch, store.heads, store.block_size,
                        store.device, memo)  # fmt: skip
