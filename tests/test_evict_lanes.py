"""AdaKV layers hold per-(row, KV head) block lanes: exact bytes, each head reads its own lanes, and beams,
bounded pools, release, offload and generate() stay right (kvquant.blocks lanes, LayerStore lane tables)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import kvquant.cache as kc
from kvquant import KVCacheFull, KVQuantConfig, PagedKVPool, QuantizedKVCache
from kvquant.blocks import LayerBlocks
from kvquant.errors import ConfigError
from kvquant.kernels.attention_torch import dequantize_history
from kvquant.store import LayerStore, block_specs, make_groups
from kvquant.transformers_compat import cache_kw

from conftest import tiny_model

BS = 16  # small blocks, so that heads' counts differ by whole blocks on short prompts


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", kv_heads=2, heads=4, head_dim=32, layers=2, vocab=128)


@pytest.fixture(scope="module")
def model4():
    return tiny_model("llama", kv_heads=4, heads=8, head_dim=32, layers=2, vocab=128, seed=3)


class Peaked:
    """kvpress-style scorer: head 0 attends to a few tokens, the others evenly (AdaKV moves budget away from
    head 0); ``tracking`` makes it a decode-time policy."""

    def __init__(self, tracking: str | None = None) -> None:
        self.tracking = tracking

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        s = keys.float().norm(dim=-1) * 1e-3  # distinct scores for the flat heads
        s[:, 0] = 0.0
        s[:, 0, 10:14] = 20.0
        return s


def cfg(policy="snapkv", keep=0.4, default="int4", budget="adakv", **extra):
    top = {k: extra.pop(k) for k in ("heads", "offload", "check_finite") if k in extra}
    return KVQuantConfig.from_dict({"default": default, "block_size": BS, **top,
                                    "evict": {"policy": policy, "keep": keep, "window": 8, "sinks": 2,
                                              "budget": budget, **extra}})  # fmt: skip


def no_lanes(monkeypatch):
    """Build every store with per-row blocks (the layout before lanes): the reference."""
    real = kc.LayerStore
    monkeypatch.setattr(kc, "LayerStore", lambda *a, **k: real(*a, **{**k, "plan": replace(k["plan"], lanes=False)}))


def run(model, config, ids, cont, mask=None):
    """Prefill ``ids``, then feed ``cont`` one token at a time: (cache, logits of every step)."""
    cache = QuantizedKVCache(model, config)
    logits = []
    with torch.no_grad():
        pos = None if mask is None else (mask.cumsum(-1) - 1).clamp_min(0)
        logits.append(model(ids, attention_mask=mask, position_ids=pos, **cache_kw(cache)).logits[:, -1])
        for i in range(cont.shape[1]):
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                pos = (mask.cumsum(-1) - 1)[:, -1:]
            out = model(cont[:, i:i + 1], attention_mask=mask, position_ids=pos, **cache_kw(cache))
            logits.append(out.logits[:, -1])
    return cache, torch.stack(logits, dim=1)


def exact_bytes(store: LayerStore) -> int:
    """sum over (row, head) of ceil(n / block_size) lanes, each the bytes of one head of one block."""
    counts = store.slots.counts().tolist()
    total = 0
    for row in counts:
        for h, n in enumerate(row):
            gi, _ = store.lanes.head_lane[h]
            total += math.ceil(n / BS) * store.blocks.lane_bytes(gi)
    return total


def held(store: LayerStore) -> int:
    mem = store.memory()
    states = sum(s.state_nbytes() for g in store.groups for s in (g.key, g.value))
    return mem["keys"] + mem["values"] + mem["scales"] - states


def check_own_lanes(store: LayerStore) -> None:
    """Every (row, head) holds ceil(n / block_size) lanes of its own group; no lane is held by two heads of a row."""
    counts = store.slots.counts().tolist()
    H = store.num_heads
    for b, row in enumerate(counts):
        seen = set()
        for h, n in enumerate(row):
            lanes = store.tables[b * H + h]
            assert len(lanes) == math.ceil(n / BS)
            for e in lanes:
                assert store.blocks.lane_where(e)[1] == store.lanes.head_lane[h][0]
                assert e not in seen
                seen.add(e)


POLICIES = ["snapkv", "knorm", "peaked", "peaked-h2o", "peaked-tova"]


def policy_of(name: str):
    """A policy name, or the peaked scorer (``-h2o`` / ``-tova``: as a decode-time policy, scores tracked)."""
    if name.startswith("peaked"):
        return Peaked({"peaked": None, "peaked-h2o": "accumulate", "peaked-tova": "last"}[name])
    return name


@pytest.mark.parametrize("policy", POLICIES)
def test_lanes_hold_exact_bytes_and_match_per_row_blocks(model, policy, monkeypatch):
    """Left-padded batch, prompt then decode: each (row, head) holds exactly ceil(n / block) lanes (never more
    bytes than per-row blocks sized by the largest head; fewer when counts differ by blocks), and every logit
    equals the per-row-block layout's."""
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (2, 90))
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    cont = torch.randint(3, 128, (2, 20))
    config = cfg(policy_of(policy))
    cache, got = run(model, config, ids, cont, mask)
    for layer in cache.layers:
        st = layer.store
        assert st.lanes
        check_own_lanes(st)
        assert held(st) == exact_bytes(st)
    with monkeypatch.context() as m:
        no_lanes(m)
        ref_cache, ref = run(model, config, ids, cont, mask)
    assert not ref_cache.layers[0].store.lanes
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for layer, ref_layer in zip(cache.layers, ref_cache.layers, strict=True):
        assert torch.equal(layer.store.slots.counts(), ref_layer.store.slots.counts())
        assert held(layer.store) <= held(ref_layer.store)
        if policy.startswith("peaked"):  # head 0 keeps blocks fewer than head 1
            assert held(layer.store) < held(ref_layer.store)
    report = cache.memory_report()
    assert report["bytes_total"] <= ref_cache.memory_report()["bytes_total"]
    # per precision: the lanes held, as in the totals
    assert sum(report["per_precision"].values()) == sum(report[f"bytes_{k}"] for k in ("keys", "values", "scales",
                                                                                       "dense"))  # fmt: skip


def test_uneven_heads_hold_their_own_counts_not_the_largest(model):
    """The scorer gives head 0 few tokens: its lanes follow its count while head 1 holds many more."""
    torch.manual_seed(1)
    cache, _ = run(model, cfg(Peaked(), keep=0.5), torch.randint(3, 128, (1, 200)), torch.randint(3, 128, (1, 5)))
    for layer in cache.layers:
        st = layer.store
        n0, n1 = st.slots.counts()[0].tolist()
        assert math.ceil(n0 / BS) + 2 <= math.ceil(n1 / BS)
        assert [len(t) for t in st.tables] == [math.ceil(n0 / BS), math.ceil(n1 / BS)]
        assert held(st) == exact_bytes(st)


def test_each_head_reads_its_own_lanes(model4, monkeypatch):
    """Per-head precision (two head groups, interleaved) and uneven counts: each head's dequantized history equals
    the per-row-block layout's on its kept slots, and scribbling over one head's lanes changes no other head."""
    torch.manual_seed(2)
    config = cfg(Peaked(), keep=0.5, heads={"0.1": "int8-token", "0.3": "int8-token",
                                            "1.1": "int8-token", "1.3": "int8-token"})  # fmt: skip
    ids, cont = torch.randint(3, 128, (2, 120)), torch.randint(3, 128, (2, 7))
    cache, got = run(model4, config, ids, cont)
    with monkeypatch.context() as m:
        no_lanes(m)
        ref_cache, ref = run(model4, config, ids, cont)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for layer, ref_layer in zip(cache.layers, ref_cache.layers, strict=True):
        st, rs = layer.store, ref_layer.store
        assert len(st.groups) == 2 and not st.groups[0].all_heads
        check_own_lanes(st)
        filled = (st.slots.pos >= 0).unsqueeze(-1)
        k, v = dequantize_history(st, st.cache_pos)
        rk, rv = dequantize_history(rs, rs.cache_pos)
        for b in range(2):  # the same (position -> K, V) per head; decode tokens sit at other slots
            for h in range(st.num_heads):
                assert torch.equal(by_position(st, k, b, h), by_position(rs, rk, b, h))
                assert torch.equal(by_position(st, v, b, h), by_position(rs, rv, b, h))
        for h in range(st.num_heads):  # scribble over (row 0, head h)'s lanes: only that head's history moves
            gi, _ = st.lanes.head_lane[h]
            for e in st.tables[h]:
                b, _, i = st.blocks.lane_where(e)
                for t in st.blocks.parts[gi]["key"].values():
                    t[b, i] = 7 if t.dtype != torch.float16 else 3.0
            k2, _ = dequantize_history(st, st.cache_pos)
            moved = (torch.where(filled, k2, 0) != torch.where(filled, k, 0)).any(dim=-1).any(dim=-1)  # [B, H]
            assert moved[0, h] and moved.sum() == 1
            k = k2


def by_position(store: LayerStore, x: torch.Tensor, b: int, h: int) -> torch.Tensor:
    """Rows of ``x[B, H, S, D]`` of (row b, head h)'s kept slots, in the order of their original positions."""
    pos = store.slots.pos[b, h, : x.shape[2]]
    slots = (pos >= 0).nonzero().flatten()
    return x[b, h, slots[pos[slots].argsort()]]


@pytest.mark.parametrize("policy", ["snapkv", "peaked-h2o"])
def test_beams_share_lanes_and_copy_on_write(model, policy):
    """A row repeated (beams) shares its lanes (counted once); rows then written with different tokens copy the
    shared partial lanes first: each row equals its own single-row run."""
    torch.manual_seed(3)
    ids = torch.randint(3, 128, (1, 100))
    cont = torch.randint(3, 128, (2, 10))
    config = cfg(policy_of(policy))
    cache, _ = run(model, config, ids, cont[:1, :0])
    before = [held(la.store) for la in cache.layers]
    cache.batch_repeat_interleave(2)
    for la, b in zip(cache.layers, before, strict=True):
        assert held(la.store) == b  # shared lanes count once
        assert la.store.memory()["shared"] == b
    logits = []
    with torch.no_grad():
        for i in range(cont.shape[1]):
            logits.append(model(cont[:, i:i + 1], **cache_kw(cache)).logits[:, -1])
    got = torch.stack(logits, dim=1)
    for row in range(2):
        _, ref = run(model, config, ids, cont[row:row + 1])
        torch.testing.assert_close(got[row:row + 1], ref[:, 1:], rtol=1e-5, atol=1e-5)
    for la in cache.layers:
        check_own_lanes(la.store)
        assert la.store.bytes_moved > 0  # shared partial lanes were copied before being written
    cache.reorder_cache(torch.tensor([1, 1]))  # both rows follow row 1: row 0's lanes are released
    for la in cache.layers:
        st = la.store
        assert st.tables[0:2] == st.tables[2:4]
        assert all(st.blocks.lane_refs[e] == 2 for t in st.tables for e in t)
    d = cache.dump()["layers"][0]  # the debug dump lists lane tables and the shared lanes
    assert d["lanes"] and len(d["block_tables"]) == 4 and sorted(d["shared_blocks"]) == cache.layers[0].store.lane_ids()


@pytest.mark.parametrize("default", ["int4", "int8"])  # int8: static per-(row, head) scales
def test_generate_greedy_beam_and_left_padded_equal_per_row_blocks(model, monkeypatch, default):
    ids = torch.randint(3, 128, (2, 80))
    mask = torch.ones_like(ids)
    mask[0, :10] = 0
    config = cfg("snapkv", 0.5, default=default)
    outs = []
    for lanes in (True, False):
        with monkeypatch.context() as m:
            if not lanes:
                no_lanes(m)
            greedy = model.generate(ids, attention_mask=mask, **cache_kw(QuantizedKVCache(model, config)),
                                    max_new_tokens=8, do_sample=False)  # fmt: skip
            beams = model.generate(ids, attention_mask=mask, **cache_kw(QuantizedKVCache(model, config)),
                                   max_new_tokens=8, num_beams=3, do_sample=False)  # fmt: skip
            outs.append((greedy, beams))
    assert outs[0][0].shape == (2, 88) and outs[0][1].shape == (2, 88)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def lane_store(config, batch=1, num_blocks=0, fixed=False, lanes=True, kv_heads=2):
    row = [config.default] * kv_heads
    blocks = LayerBlocks(block_specs(make_groups(row, config, 32)), BS, torch.device("cpu"), num_blocks=num_blocks,
                         fixed=fixed)  # fmt: skip
    return LayerStore(row, config, 32, batch, torch.device("cpu"), blocks=blocks, lanes=lanes)


def step(st: LayerStore, x: torch.Tensor, y: torch.Tensor) -> None:
    """One decode token through a lane store (what the cache does for an AdaKV layer)."""
    target, appended = st.lanes.grow()
    S = st.cache_pos
    if appended:
        st.append(x, y)
    st.overwrite(x, y, target, target < S)


def decode_until_full(model, ids: torch.Tensor, cache, state, steps: int) -> tuple:
    """Prefill ``ids``, then decode random tokens until the bounded pool refuses a step: ``state()`` before the
    refused step and after it (they must be equal: a refused step changes nothing)."""
    with torch.no_grad():
        model(ids, **cache_kw(cache))
        for _ in range(steps):
            before = state()
            try:
                model(torch.randint(3, 128, (1, 1)), **cache_kw(cache))
            except KVCacheFull:
                return before, state()
    raise AssertionError("the pool never filled")


def snapshot(st: LayerStore):
    b = st.blocks
    return ([list(t) for t in st.tables], [list(r) for r in st.lanes.fill], list(b.refs), list(b.lane_refs),
            sorted(b.free), [sorted(f) for f in b.lane_free], st.cache_pos, st.q_end)  # fmt: skip


def test_bounded_arena_full_changes_nothing_and_release_frees_every_lane():
    """A bounded arena (3 blocks = 6 lanes): free lanes of a block serve another head; a step that needs more
    lanes than are free raises KVCacheFull with tables, fills and reference counts unchanged; release returns
    every block."""
    torch.manual_seed(4)
    st = lane_store(cfg(), num_blocks=3, fixed=True)
    T = 60
    keep = torch.zeros(1, 2, T, dtype=torch.bool)
    keep[0, 0, :20] = True  # head 0: 20 tokens -> 2 lanes; head 1: 40 tokens -> 3 lanes
    keep[0, 1, :40] = True
    st.append_kept(torch.randn(1, 2, T, 32), torch.randn(1, 2, T, 32), keep)
    assert [len(t) for t in st.tables] == [2, 3] and st.blocks.used == 3 and not st.blocks.free
    for _ in range(12):  # head 1 takes the last free lane at 48; head 0 fills its second lane up to 32
        step(st, torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32))
    assert st.lanes.fill == [[32, 52]] and [len(t) for t in st.tables] == [2, 4]
    assert st.blocks_needed(1) > len(st.blocks.free)  # the pool's admission check sees it too
    before = snapshot(st)
    with pytest.raises(KVCacheFull):
        step(st, torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32))  # head 0 needs a new lane: none free
    assert snapshot(st) == before
    st.release()
    assert st.blocks.used == 0 and sorted(st.blocks.free) == [0, 1, 2]
    assert not any(st.blocks.lane_refs) and not any(st.blocks.lane_free)


def test_static_scales_held_dense_until_calibrated(monkeypatch):
    """Static int8 scales wait for 16 real tokens: a short prompt is held dense, each head then grows at its own
    slot in the dense buffer, and after the flush every head's history equals the per-row-block layout's."""
    torch.manual_seed(5)
    config = cfg(default="int8")
    stores = []
    for lanes in (True, False):
        st = lane_store(config, lanes=lanes)
        T = 12
        keep = torch.zeros(1, 2, T, dtype=torch.bool)
        keep[0, 0, :4] = True
        keep[0, 1, :9] = True
        gen = torch.Generator().manual_seed(6)
        st.append_kept(torch.randn(1, 2, T, 32, generator=gen), torch.randn(1, 2, T, 32, generator=gen), keep)
        assert st.q_end == 0 and not st.dense.calibrated
        for _ in range(20):
            x, y = torch.randn(1, 2, 1, 32, generator=gen), torch.randn(1, 2, 1, 32, generator=gen)
            if lanes:
                step(st, x, y)
            else:  # per-row blocks: every head appends at the end (heads keep their holes)
                st.append(x, y)
        stores.append(st)
    st, rs = stores
    assert st.lanes and st.dense.calibrated and st.q_end == st.cache_pos == 29 and st.lanes.fill == [[24, 29]]
    assert [len(t) for t in st.tables] == [2, 2]
    k, v = dequantize_history(st, st.cache_pos)
    rk, rv = dequantize_history(rs, rs.cache_pos)
    # lanes: head 0 holds prompt slots [0, 4) then its 20 new tokens at [4, 24); per-row: at [9, 29)
    torch.testing.assert_close(k[0, 0, :4], rk[0, 0, :4], rtol=0, atol=0)
    torch.testing.assert_close(k[0, 0, 4:24], rk[0, 0, 9:29], rtol=0, atol=0)
    torch.testing.assert_close(v[0, 1], rv[0, 1], rtol=0, atol=0)


def test_pool_caches_share_an_arena_through_free_lanes(model):
    """Two requests on one pool: lanes freed by the first serve the second; pool blocks stay whole blocks."""
    torch.manual_seed(7)
    pool = PagedKVPool(model, cfg(Peaked(), keep=0.5))
    ids = torch.randint(3, 128, (1, 150))
    a = QuantizedKVCache.from_pool(pool, ids)  # (bound to ids: a forward with other ids is refused)
    with torch.no_grad():
        model(ids, **cache_kw(a))
    used = pool.stats()["blocks_used"]
    lanes = sum(la.store.memory()["lanes"] for la in a.layers)
    assert used * 2 >= lanes and used < lanes  # two lanes per block (2 KV heads), few blocks partly used
    for la in a.layers:
        la.store.release()
    assert pool.stats()["blocks_used"] == 0


def test_offload_with_adakv_is_a_one_line_config_error():
    """``offload`` moves whole blocks of per-row tables; with eviction (AdaKV lanes included) it is refused."""
    with pytest.raises(ConfigError, match="offload") as e:
        cfg("snapkv", offload={"device": "cpu", "keep_recent_blocks": 2})
    assert "\n" not in str(e.value)


def test_uniform_budget_layers_keep_per_row_blocks(model):
    ids, cont = torch.randint(3, 128, (1, 60)), torch.randint(3, 128, (1, 2))
    cache, _ = run(model, cfg("snapkv", budget="uniform"), ids, cont)
    assert not any(la.store.lanes for la in cache.layers)
    assert all(len(la.store.tables) == 1 for la in cache.layers)


@pytest.mark.parametrize("policy", ["peaked", "peaked-h2o", "peaked-kchannel"])
def test_lane_decode_reads_nothing_back_from_the_device(model, monkeypatch, policy):
    """One sequence, no shared lane: a decode step's lane bookkeeping (Lanes.grow) and per-head write (overwrite)
    read no tensor on the host: which lanes a step needs follows from the host's fills (``-kchannel``: per-channel
    keys, each head's tail written on the device and its full blocks flushed into lanes from the host's counts)."""
    import kvquant.lanes as kl
    import kvquant.store as ks

    def boom(*_a, **_k):
        raise AssertionError("a lane decode step read a tensor on the host")

    calls = []
    for owner, name in ((kl.Lanes, "grow"), (ks.LayerStore, "overwrite")):
        orig = getattr(owner, name)

        def guarded(self, *a, _orig=orig, _name=name, **k):
            with monkeypatch.context() as m:
                for attr in ("tolist", "item", "__bool__"):
                    m.setattr(torch.Tensor, attr, boom)
                out = _orig(self, *a, **k)
            calls.append(_name)
            return out

        monkeypatch.setattr(owner, name, guarded)
    kchannel = policy.endswith("-kchannel")
    default = {"key": "int8-channel", "value": "int8-token"} if kchannel else "int4"
    # (the finiteness check of stored values is a host read)
    config = cfg(policy_of(policy.removesuffix("-kchannel")), default=default, check_finite=False)
    steps = 40 if kchannel else 6  # (kchannel: heads' tails cross block boundaries: flushes)
    cache, _ = run(model, config, torch.randint(3, 128, (1, 70)), torch.randint(3, 128, (1, steps)))
    assert calls.count("grow") == calls.count("overwrite") == steps * len(cache.layers)
    for layer in cache.layers:
        if kchannel:
            assert layer.store.tail_lanes and layer.store.memory()["lanes"] > 2
        else:
            check_own_lanes(layer.store)


def test_bounded_pool_refuses_a_step_before_any_layer_writes_and_reset_reuses(model):
    """A bounded pool: decode until a step does not fit; KVCacheFull leaves every layer's lanes, fills and the
    pool's counts as they were; reset() returns every block and the cache runs a new prompt as a fresh one."""
    torch.manual_seed(9)
    config = cfg(Peaked(), keep=0.5)
    per_block = sum(LayerBlocks(block_specs(make_groups([config.default] * 2, config, 32)), BS,
                                torch.device("cpu")).bytes_per_block for _ in range(2))  # fmt: skip
    pool = PagedKVPool(model, config, max_bytes=per_block * 8)  # 8 blocks = 16 lanes per layer
    ids = torch.randint(3, 128, (1, 120))
    cache = QuantizedKVCache.from_pool(pool, ids)
    before, after = decode_until_full(model, ids, cache, lambda: [snapshot(la.store) for la in cache.layers], 200)
    assert after == before
    for la in cache.layers:
        check_own_lanes(la.store)
        assert la.store.memory()["lanes"] > 12  # the arena's lanes were used, across heads
    cache.reset()
    assert pool.stats()["blocks_used"] == 0
    new = torch.randint(3, 128, (1, 90))
    with torch.no_grad():
        got = model(new, **cache_kw(cache)).logits
        ref = model(new, **cache_kw(QuantizedKVCache(model, config))).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("default", ["int4", "int8"])
def test_identical_prompt_rows_share_their_lanes_once(model, default):
    """generate()'s beams start from identical prompt rows: each head's lanes are written once and shared."""
    torch.manual_seed(10)
    ids = torch.randint(3, 128, (1, 100))
    config = cfg(Peaked(), keep=0.5, default=default)
    single, _ = run(model, config, ids, ids[:, :0])
    beams, _ = run(model, config, ids.repeat(3, 1), ids[:, :0])
    for one, three in zip(single.layers, beams.layers, strict=True):
        assert three.store.memory()["lanes"] == one.store.memory()["lanes"]
        assert held(three.store) == held(one.store) == three.store.memory()["shared"]
        H = three.store.num_heads
        assert three.store.tables[:H] == three.store.tables[H:2 * H] == three.store.tables[2 * H:]


@pytest.mark.parametrize("budget", ["even", "peaked"])
def test_one_sequence_reads_runs_of_lanes_in_place(model, monkeypatch, budget):
    """One sequence: a row's heads take lane j side by side in one block when that lane is free, so heads that
    grow together form runs the attention reads in place (``Lanes.runs``); uneven heads are gathered. Logits
    equal the per-row-block layout's across block boundaries either way."""
    torch.manual_seed(11)
    ids, cont = torch.randint(3, 128, (1, 100)), torch.randint(3, 128, (1, 40))
    config = cfg(Peaked() if budget == "peaked" else "streaming")  # streaming: every head keeps the same tokens
    cache, got = run(model, config, ids, cont)
    for layer in cache.layers:
        st = layer.store
        st.table()
        assert (st.lanes.runs[0] is not None) == (budget != "peaked")
        check_own_lanes(st)
        assert held(st) == exact_bytes(st) and st.memory()["reserved"] == st.blocks.nbytes()
    with monkeypatch.context() as m:
        no_lanes(m)
        _, ref = run(model, config, ids, cont)
    # (40 steps: a 1e-6 difference of summation order upstream may round one int4 code of a later token the
    # other way, ~1e-4 on the logits; a head reading wrong lanes moves them by orders of magnitude more)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=5e-4)


def test_lane_layers_take_the_torch_path_even_without_holes(model, monkeypatch):
    """Triton kernels read per-row block tables: a lane layer goes to the torch path even when its heads keep
    as many tokens (no empty slot, ``holes`` False), with the same result as the torch backend."""
    import kvquant.kernels.triton_attention as ta

    served = []
    real = ta.attend_triton

    def counting(query, *args, **kwargs):
        served.append(query.shape[2])
        return real(query, *args, **kwargs)

    monkeypatch.setattr(ta, "attend_triton", counting)
    ids, cont = torch.randint(3, 128, (1, 60)), torch.randint(3, 128, (1, 3))
    config = cfg("streaming", 0.5, default="int8-token")  # every head keeps the same tokens: no holes
    monkeypatch.setenv("KVQUANT_ATTENTION", "torch")
    _, ref = run(model, config, ids, cont)
    monkeypatch.setenv("KVQUANT_ATTENTION", "triton")
    cache, got = run(model, config, ids, cont)
    st = cache.layers[0].store
    assert st.lanes and not st.slots.holes
    assert served.count(1) == 0  # no decode step was served by the kernels
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("default", ["fp16", "int2", "fp8-e4m3", "tq4"])
def test_lanes_for_every_per_token_precision(model, monkeypatch, default):
    """Passthrough, 2-bit, static fp8 and codebook (head-space) precisions: exact lanes, and logits equal the
    per-row-block layout's."""
    torch.manual_seed(12)
    ids, cont = torch.randint(3, 128, (2, 70)), torch.randint(3, 128, (2, 6))
    config = cfg(Peaked(), keep=0.5, default=default)
    cache, got = run(model, config, ids, cont)
    for layer in cache.layers:
        assert layer.store.lanes
        check_own_lanes(layer.store)
        assert held(layer.store) == exact_bytes(layer.store)
    with monkeypatch.context() as m:
        no_lanes(m)
        _, ref = run(model, config, ids, cont)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
