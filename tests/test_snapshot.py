"""The attention's snapshot of a layer store (kvquant/snapshot.py, ``LayerStore.snapshot``): it holds the store's
tensors and tables by reference (nothing copied), cannot be changed, says what the history holds (sinks, residual,
refinement rows), stages offloaded blocks for the kernels and gives them back, and keeps the kernels' rows memo
per K / V store across snapshots."""

from __future__ import annotations

import pytest
import torch

from kvquant import KVQuantConfig
from kvquant.config import KVPrecision
from kvquant.snapshot import KVSnapshot, RowsMemo, SnapshotSource, as_snapshot
from kvquant.store import LayerStore

CPU = torch.device("cpu")


def _filled(config: KVQuantConfig, row: list, tokens: int, batch: int = 2, seed: int = 0) -> LayerStore:
    store = LayerStore(row, config, 32, batch, CPU)
    g = torch.Generator().manual_seed(seed)
    for n in (tokens - 1, 1):
        store.append(torch.randn(batch, len(row), n, 32, generator=g), torch.randn(batch, len(row), n, 32, generator=g))
    return store


def test_snapshot_holds_the_store_by_reference():
    """Parts, static state, tables, sink and residual rows are the store's own objects; the layout and the pool end
    are the store's; a field cannot be assigned."""
    row = [KVPrecision("int4", "int8"), KVPrecision("int8-token", "int8-token")]
    store = _filled(KVQuantConfig(block_size=16, sink_tokens=4, residual_tokens=8), row, 60)
    snap = store.snapshot()
    assert isinstance(store, SnapshotSource) and as_snapshot(snap) is snap
    assert (snap.batch, snap.num_heads, snap.head_dim, snap.block_size) == (2, 2, 32, 16)
    assert snap.q_end == store.q_end < 60 and snap.table is store.table() and snap.row_start is store.starts.row_start
    assert len(snap.groups) == len(store.groups) == 2
    for part, group in zip(snap.groups, store.groups, strict=True):
        assert part.heads == group.heads and part.head_index is group.head_index
        for p, s in ((part.key, group.key), (part.value, group.value)):
            assert p.quantizer is s.quantizer and p.state is s.state
            assert all(p.parts[n] is t for n, t in s.parts.items())
    assert snap.sinks is not None and snap.sinks.k is store.dense.sink_k and snap.sinks.tokens == 4
    assert snap.residual is not None and snap.residual.held == 60 - store.q_end
    assert snap.has_dense_segments and snap.ladder_n == 0 and snap.heavy_rows == 0 and snap.slots is None
    with pytest.raises(AttributeError):
        snap.q_end = 0  # type: ignore[misc]


def test_snapshot_reads_as_the_store():
    """A group's ``read`` / ``read_factored`` are the store's decode of that group (sinks and residual merged)."""
    row = [KVPrecision("int4", "int8")] * 2
    store = _filled(KVQuantConfig(block_size=16, sink_tokens=2, residual_tokens=8), row, 50)
    g, group = store.snapshot().groups[0], store.groups[0]
    for a, b in ((0, 50), (3, 40), (store.q_end, 50)):
        k, v = g.read(a, b)
        rk, rv = store.read(group, a, b)
        assert torch.equal(k, rk) and torch.equal(v, rv)
        pieces = g.read_factored(a, b)
        assert [(x, y) for x, y, *_ in pieces] == [(x, y) for x, y, *_ in store.read_factored(group, a, b)]


def test_staged_snapshot_brings_offloaded_blocks_to_the_device_and_back():
    """With blocks in the host tier the snapshot stages them for the block (the kernels' tables then address device
    blocks only) and releases them after; without, ``staged()`` gives the snapshot itself."""
    cfg = KVQuantConfig.load({**KVQuantConfig.load("int4").to_dict(), "name": None, "block_size": 16,
                              "offload": {"keep_recent_blocks": 1}})  # fmt: skip
    store = _filled(cfg, [cfg.default] * 2, 90, batch=1)
    assert store.has_host_blocks()
    snap = store.snapshot()
    used = store.blocks.used
    with snap.staged() as staged:
        assert isinstance(staged, KVSnapshot) and staged is not snap
        assert not store.has_host_blocks() and store.blocks.used > used
        assert staged.table.shape == snap.table.shape and not torch.equal(staged.table, snap.table)
    assert store.has_host_blocks() and store.blocks.used == used
    plain = _filled(KVQuantConfig(block_size=16), [KVPrecision("int4", "int4")] * 2, 40)
    snap = plain.snapshot()
    with snap.staged() as staged:
        assert staged is snap


def test_rows_memo_rebuilds_when_its_state_changes():
    """The memo builds once per (state objects by identity, shape by value) and again when either changes; every
    snapshot of one K / V store carries the same memo."""
    built = []

    def build() -> torch.Tensor:
        built.append(1)
        return torch.zeros(len(built))

    memo, a = RowsMemo(), torch.ones(2)
    first = memo.get((a,), (2, CPU), build)
    assert memo.get((a,), (2, CPU), build) is first and len(built) == 1
    assert memo.get((a.clone(),), (2, CPU), build) is not first and len(built) == 2
    memo.get((a,), (3, CPU), build)
    assert len(built) == 3
    store = _filled(KVQuantConfig(block_size=16), [KVPrecision("int4", "int4")] * 2, 20)
    assert store.snapshot().groups[0].key.memo is store.snapshot().groups[0].key.memo
    assert store.snapshot().groups[0].key.memo is not store.snapshot().groups[0].value.memo
