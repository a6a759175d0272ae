"""Eviction stored in the paged pool: budgets, positions, composition with quantization, generate()."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

import kvquant.kernels.attention_torch as at
from kvquant import KVQuantConfig, QuantizedKVCache
from kvquant.evict import Budget
from kvquant.kernels.attention_torch import attend_naive, attend_torch
from kvquant.slots import SlotMap
from kvquant.transformers_compat import cache_kw

from conftest import tiny_model

POLICIES = ["streaming", "snapkv", "knorm", "h2o", "tova"]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", kv_heads=2, heads=4, head_dim=32, layers=2, vocab=128)


def cfg(policy, keep=0.5, default="int4", **extra):
    return KVQuantConfig.from_dict({"default": default, "evict": {"policy": policy, "keep": keep, **extra}})


def prefill(model, config, ids, mask=None):
    cache = QuantizedKVCache(model, config)
    pos = None if mask is None else (mask.cumsum(-1) - 1).clamp_min(0)  # as generate() numbers left-padded rows
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=pos, **cache_kw(cache))
    return cache, out.logits


def teacher_forced(model, cache, cont, mask=None):
    """Next-token logits for each token of ``cont[B, n]``, fed one at a time after the prompt."""
    logits = []
    with torch.no_grad():
        for i in range(cont.shape[1]):
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                pos = (mask.cumsum(-1) - 1)[:, -1:]
            else:
                pos = None
            out = model(cont[:, i:i + 1], attention_mask=mask, position_ids=pos, **cache_kw(cache))
            logits.append(out.logits[:, -1])
    return torch.stack(logits, dim=1)


@pytest.mark.parametrize("policy", POLICIES)
def test_each_policy_stores_exactly_its_budget_per_layer_and_head(model, policy):
    T, keep, sinks, window = 300, 0.3, 4, 16
    ids = torch.randint(3, 128, (2, T))
    config = cfg(policy, keep, sinks=sinks, window=window)
    cache, _ = prefill(model, config, ids)
    budget = Budget(keep=keep, sinks=sinks, window=window)
    n = budget.tokens(T)
    assert n == math.ceil(keep * T)
    bs = config.block_size
    for layer in cache.layers:
        st = layer.store
        assert (st.slots.counts() == n).all()  # every (row, head)
        assert st.cache_pos == n and layer.get_seq_length() == T
        pos = st.slots.pos.long()
        assert (pos.sort(dim=-1).values == pos).all() and (pos >= 0).all()
        assert (pos[..., :sinks] == torch.arange(sinks)).all()  # sinks
        assert (pos[..., -window:] == torch.arange(T - window, T)).all()  # the recent window
        mem = st.memory()
        assert mem["blocks"] == 2 * math.ceil(n / bs)  # two rows, whole blocks of n slots
        per_block = sum(sum(s.block_nbytes().values()) for g in st.groups for s in (g.key, g.value))
        assert mem["keys"] + mem["values"] + mem["scales"] == mem["blocks"] * per_block  # int4: no static state
        if policy in ("h2o", "tova"):  # + a float32 score per slot and an int64 cap per (row, head)
            assert mem["index"] == 2 * 2 * n * (4 + 4) + 2 * 2 * 8
        else:
            assert mem["index"] == 2 * 2 * n * 4  # an int32 position per (row, head, slot)
    if policy in ("h2o", "tova"):  # decode-time: the budget holds while decoding, sinks and window kept
        cont = torch.randint(3, 128, (2, 20))
        teacher_forced(model, cache, cont)
        for layer in cache.layers:
            st = layer.store
            assert (st.slots.counts() == n).all() and layer.get_seq_length() == T + 20
            pos = st.slots.pos.long()
            for p in [*range(sinks), *range(T + 20 - window, T + 20)]:
                assert (pos == p).any(dim=-1).all(), p


def test_adakv_spreads_the_layer_budget_and_stores_each_head_its_own_count(model):
    T, keep = 200, 0.4
    ids = torch.randint(3, 128, (1, T))
    config = cfg("snapkv", keep, budget="adakv", window=8)
    cache, _ = prefill(model, config, ids)
    n = Budget(keep=keep, sinks=4, window=8).tokens(T)
    for layer in cache.layers:
        counts = layer.store.slots.counts()
        assert int(counts.sum()) == 2 * n  # the layer's total, spread over its 2 heads
        assert layer.store.cache_pos == int(counts.max())  # slots: the most any head keeps
    out = teacher_forced(model, cache, torch.randint(3, 128, (1, 4)))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("policy", POLICIES)
def test_keep_one_equals_the_policy_free_cache(model, policy):
    ids = torch.randint(3, 128, (2, 150))
    cont = torch.randint(3, 128, (2, 6))
    base, l0 = prefill(model, "int4", ids)
    ref = teacher_forced(model, base, cont)
    cache, l1 = prefill(model, cfg(policy, 1.0), ids)
    got = teacher_forced(model, cache, cont)
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)


def test_positions_keep_counting_original_positions_after_eviction(model):
    """Decode logits with a streaming cache (fp32: exact storage) equal full attention whose mask hides the
    evicted positions, at the original rotary positions. Would fail if new tokens were placed at the number
    of kept tokens instead."""
    T, keep, sinks, window = 120, 0.25, 4, 20
    ids = torch.randint(3, 128, (1, T))
    cont = torch.randint(3, 128, (1, 5))
    cache, _ = prefill(model, cfg("streaming", keep, default="fp32", sinks=sinks, window=window), ids)
    got = teacher_forced(model, cache, cont)
    n = math.ceil(keep * T)
    kept = torch.zeros(T, dtype=torch.bool)
    kept[:sinks] = True
    kept[T - (n - sinks):] = True
    dyn = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **cache_kw(dyn))
        ref = []
        mask = kept.view(1, -1).long()
        for i in range(cont.shape[1]):
            mask = torch.cat([mask, torch.ones(1, 1, dtype=torch.long)], dim=1)
            pos = torch.tensor([[T + i]])
            out = model(cont[:, i:i + 1], attention_mask=mask, position_ids=pos, **cache_kw(dyn),
                        cache_position=pos[0])
            ref.append(out.logits[:, -1])
    ref = torch.stack(ref, dim=1)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # the same check with the positions shifted to the count of kept tokens fails
    shifted = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, kept], **cache_kw(shifted))
        out = model(cont[:, :1], **cache_kw(shifted))
    assert (out.logits[:, -1] - ref[:, 0]).abs().max() > 1e-2


def test_int4_snapkv_half_holds_at_most_055x_of_int4_at_2k():
    model = tiny_model("llama", kv_heads=2, heads=4, head_dim=128, layers=2, vocab=128)
    ids = torch.randint(3, 128, (1, 2048))
    base, _ = prefill(model, "int4", ids)
    cache, _ = prefill(model, cfg("snapkv", 0.5), ids)
    b0, b1 = base.memory_report()["bytes_total"], cache.memory_report()["bytes_total"]
    assert cache.memory_report()["bytes_index"] > 0
    assert b1 <= 0.55 * b0, (b1, b0, b1 / b0)


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_left_padded_batch_rows_equal_their_own_runs(model, policy):
    torch.manual_seed(1)
    a, b = torch.randint(3, 128, (1, 90)), torch.randint(3, 128, (1, 70))
    ids = torch.cat([a, torch.cat([torch.zeros(1, 20, dtype=torch.long), b], dim=1)])
    mask = torch.ones_like(ids)
    mask[1, :20] = 0
    cont = torch.randint(3, 128, (2, 8))
    config = cfg(policy, 0.5, default="int8-token", window=8)
    cache, _ = prefill(model, config, ids, mask)
    got = teacher_forced(model, cache, cont, mask)
    for row, x in ((0, a), (1, b)):
        single, _ = prefill(model, config, x)
        ref = teacher_forced(model, single, cont[row:row + 1])
        torch.testing.assert_close(got[row:row + 1], ref, rtol=1e-4, atol=1e-4)
        assert (cache.layers[0].store.slots.counts()[row] == single.layers[0].store.slots.counts()[0]).all()


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_beam_reorder_moves_each_rows_per_head_kept_tokens(model, policy):
    ids = torch.randint(3, 128, (2, 100))
    cont = torch.randint(3, 128, (2, 6))
    config = cfg(policy, 0.4, default="int8-token", window=8)
    cache, _ = prefill(model, config, ids)
    teacher_forced(model, cache, cont[:, :3])  # h2o: rows have replaced different tokens by now
    cache.reorder_cache(torch.tensor([1, 1]))
    got = teacher_forced(model, cache, cont[1:2, 3:].expand(2, -1))
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=0)
    ref_cache, _ = prefill(model, config, ids[1:])
    teacher_forced(model, ref_cache, cont[1:2, :3])
    torch.testing.assert_close(got[:1], teacher_forced(model, ref_cache, cont[1:2, 3:]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "tova"])
def test_generate_greedy_and_beam_search(model, policy):
    ids = torch.randint(3, 128, (2, 80))
    mask = torch.ones_like(ids)
    mask[0, :10] = 0
    config = cfg(policy, 0.5, default="int8-token", window=8)
    out = model.generate(ids, attention_mask=mask, **cache_kw(QuantizedKVCache(model, config)), max_new_tokens=6,
                         do_sample=False)
    assert out.shape == (2, 86)
    beams = model.generate(ids, attention_mask=mask, **cache_kw(QuantizedKVCache(model, config)), max_new_tokens=6,
                           num_beams=3, do_sample=False)
    assert beams.shape == (2, 86)
    # keep 1.0: beam search equals the policy-free cache's
    full = model.generate(ids, attention_mask=mask, **cache_kw(QuantizedKVCache(model, "int8-token")), max_new_tokens=6,
                          num_beams=3, do_sample=False)
    kept = model.generate(ids, attention_mask=mask, **cache_kw(QuantizedKVCache(model, cfg(policy, 1.0, "int8-token"))),
                          max_new_tokens=6, num_beams=3, do_sample=False)
    assert torch.equal(full, kept)


def test_a_kvpress_style_scorer_object_is_a_policy(model):
    class FirstChannel:  # kvpress's signature; nothing from kvquant
        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            return keys[..., 0].float()

    T, keep, sinks, window = 90, 0.4, 2, 6
    ids = torch.randint(3, 128, (1, T))
    config = KVQuantConfig.from_dict(
        {"default": "fp32", "evict": {"policy": FirstChannel(), "keep": keep, "sinks": sinks, "window": window}}
    )
    cache, _ = prefill(model, config, ids)
    dyn = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **cache_kw(dyn))
    n = Budget(keep=keep, sinks=sinks, window=window).tokens(T)
    for i, layer in enumerate(cache.layers):
        keys = dyn.layers[i].keys  # post-rotary keys, as the cache saw them
        for h in range(2):
            mid = keys[0, h, sinks:T - window, 0]
            best = (mid.topk(n - sinks - window).indices + sinks).tolist()
            want = sorted([*range(sinks), *best, *range(T - window, T)])
            assert layer.store.slots.pos[0, h].tolist() == want
    with pytest.raises(ValueError, match="^evict.policy:"):
        config.save("/tmp/never-written.yaml")


@pytest.mark.parametrize("tile", [None, 16])
def test_attention_returns_per_key_probability_mass(model, tile, monkeypatch):
    if tile:  # force the online-softmax walk over several tiles
        monkeypatch.setattr(at, "WORKSPACE_BYTES", 1)
    cache, _ = prefill(model, "int8-token", torch.randint(3, 128, (2, 300)))
    store = cache.layers[0].store
    torch.manual_seed(3)
    q = torch.randn(2, 4, 1, 32)
    fk, fv = torch.randn(2, 2, 1, 32), torch.randn(2, 2, 1, 32)
    mass = torch.zeros(2, 2, 300)
    out = attend_torch(q, fk, fv, store, 300, None, 32**-0.5, key_mass=mass)
    torch.testing.assert_close(out, attend_naive(q, fk, fv, store, 300, None, 32**-0.5), rtol=1e-4, atol=1e-5)
    hk, _ = at.dequantize_history(store, 300)
    k = torch.cat([hk, fk], dim=2).repeat_interleave(2, dim=1)
    p = torch.softmax(q @ k.transpose(-1, -2) * 32**-0.5, dim=-1)[..., :300]  # [2, 4, 1, 300]
    torch.testing.assert_close(mass, p.view(2, 2, 2, 300).sum(dim=(2,)), rtol=1e-4, atol=1e-6)


def test_eviction_refusals_are_one_line_errors(model):
    with pytest.raises(ValueError, match="^evict.policy:"):
        KVQuantConfig.from_dict({"default": "int8", "evict": {"policy": "h2o"}, "layers": {0: "int8-channel"}})
    from kvquant import ModelShape

    bare = QuantizedKVCache(ModelShape(2, 2, 32), cfg("snapkv"))
    with pytest.raises(ValueError, match="^evict.policy:"):
        bare.update(torch.randn(1, 2, 40, 32), torch.randn(1, 2, 40, 32), 0)
    cache, _ = prefill(model, cfg("streaming"), torch.randint(3, 128, (1, 60)))
    with pytest.raises(ValueError, match="^crop:"):
        cache.crop(30)


def test_triton_reads_uniformly_evicted_layers_and_hands_tracked_ones_to_torch(model, monkeypatch, caplog):
    """Uniform budgets keep the same number of slots in every head: the Triton kernels read them through the
    block tables like any history (interpreted here). H2O layers (per-key mass) take the torch path, logged."""
    import kvquant.kernels.triton_attention as ta

    served = []
    real = ta.attend_triton

    def counting(query, *args, **kwargs):
        out = real(query, *args, **kwargs)
        served.append(query.shape[2])  # reached only when the kernels served the call
        return out

    monkeypatch.setattr(ta, "attend_triton", counting)
    from kvquant.kernels import dispatch

    monkeypatch.setattr(dispatch, "_logged", set())  # logged once per process: an earlier test may have logged it
    ids = torch.randint(3, 128, (1, 60))
    cont = torch.randint(3, 128, (1, 2))
    for policy in ("snapkv", "h2o"):
        served.clear()
        config = cfg(policy, 0.5, default="int8-token", window=8)
        monkeypatch.setenv("KVQUANT_ATTENTION", "torch")
        ref = teacher_forced(model, prefill(model, config, ids)[0], cont)
        monkeypatch.setenv("KVQUANT_ATTENTION", "triton")
        with caplog.at_level("WARNING", logger="kvquant"):
            got = teacher_forced(model, prefill(model, config, ids)[0], cont)
        torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
        tracked_notice = any("per-key score mass" in r.getMessage() for r in caplog.records)
        assert tracked_notice == (policy == "h2o")
        decode_calls = served.count(1)
        assert decode_calls == (0 if policy == "h2o" else 2 * 2)  # 2 layers x 2 decode steps
        caplog.clear()


@pytest.mark.parametrize("extra", [{}, {"residual_tokens": 16, "block_size": 16}])
def test_decode_time_replacement_stores_each_slot_the_key_of_its_position(model, extra):
    """After H2O has replaced tokens while decoding, every kept (row, head, slot) of the first layer holds
    exactly the key and value of the position the slot map says (fp32 storage: exact; through the residual
    window: its fp16), in the pool and in the residual window. (The first layer's K/V depend on the token and
    its position only; deeper layers' also on the evicted attention below them.)"""
    ids = torch.randint(3, 128, (2, 70))
    cont = torch.randint(3, 128, (2, 12))
    config = KVQuantConfig.from_dict({"default": "fp32", **extra, "evict": {"policy": "h2o", "keep": 0.4, "window": 4}})
    cache, _ = prefill(model, config, ids)
    teacher_forced(model, cache, cont)
    dyn = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.cat([ids, cont[:, :-1]], dim=1), **cache_kw(dyn))
        model(cont[:, -1:], **cache_kw(dyn))
    st = cache.layers[0].store
    k, v = at.dequantize_history(st, st.cache_pos)
    pos = st.slots.pos.long()
    filled = pos >= 0
    assert (pos.amax(dim=-1) == 70 + 11).all() and st.cache_pos < 70 + 12  # decoded tokens replaced others
    idx = pos.clamp_min(0).unsqueeze(-1).expand(-1, -1, -1, 32)
    ref_k, ref_v = dyn.layers[0].keys.gather(2, idx), dyn.layers[0].values.gather(2, idx)
    tol = 1e-6  # the reference's one-forward matmuls round differently (measured: 2e-7)
    if extra:  # stored through the fp16 residual window: one fp16 ulp may flip (values |x| < 2)
        ref_k, ref_v, tol = ref_k.half().float(), ref_v.half().float(), 2e-3
    torch.testing.assert_close(k[filled], ref_k[filled], rtol=0, atol=tol)
    torch.testing.assert_close(v[filled], ref_v[filled], rtol=0, atol=tol)


class _PeakedAndFlat:
    """kvpress-style scorer: head 0 attends to a few tokens, head 1 evenly (AdaKV gives head 1 most of the budget)."""

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        s = torch.zeros(keys.shape[:3])
        s[:, 0, 100:110] = 20.0
        return s


def test_adakv_holds_bytes_for_each_heads_own_count(model):
    T, keep = 600, 0.4
    config = KVQuantConfig.from_dict({"default": "int4", "evict": {"policy": _PeakedAndFlat(), "keep": keep,
                                                                   "budget": "adakv"}})  # fmt: skip
    cache, _ = prefill(model, config, torch.randint(3, 128, (1, T)))
    bs = config.block_size
    for layer in cache.layers:
        st = layer.store
        counts = st.slots.counts()[0].tolist()
        assert sum(counts) == 2 * Budget(keep=keep).tokens(T) and counts[0] < counts[1] - bs  # uneven by design
        per_block = sum(sum(s.block_nbytes().values()) for g in st.groups for s in (g.key, g.value))
        per_head_block = per_block // 2  # int4 on both KV heads: a block is two equal head lanes
        mem = st.memory()
        want = sum(math.ceil(c / bs) for c in counts) * per_head_block
        assert mem["keys"] + mem["values"] + mem["scales"] == want


@pytest.mark.parametrize("policy", ["h2o", "tova"])
def test_tracked_overwrite_reads_no_target_on_the_host(model, monkeypatch, policy):
    """One sequence, every slot quantized: the per-head replacement is written without reading the chosen
    slots back to the host (no ``tolist`` / ``item`` / ``bool`` of a tensor inside ``overwrite``)."""
    import kvquant.store as ks

    def boom(*_a, **_k):
        raise AssertionError("overwrite read a tensor on the host")

    calls = []
    orig = ks.LayerStore.overwrite

    def guarded(self, *a, **k):
        with monkeypatch.context() as m:
            for name in ("tolist", "item", "__bool__"):
                m.setattr(torch.Tensor, name, boom)
            orig(self, *a, **k)
        calls.append(self.slots.seen)

    monkeypatch.setattr(ks.LayerStore, "overwrite", guarded)
    reads = []  # "does some head append?" is read on the host once per layer, not at every step
    full = SlotMap.full.fget
    monkeypatch.setattr(SlotMap, "full", property(lambda self: reads.append(self._full is None) or full(self)))
    config = KVQuantConfig.from_dict({"default": "int4", "check_finite": False,
                                      "evict": {"policy": policy, "keep": 0.4, "window": 4}})  # fmt: skip
    cache, _ = prefill(model, config, torch.randint(3, 128, (1, 70)))
    teacher_forced(model, cache, torch.randint(3, 128, (1, 6)))
    assert len(calls) == 6 * len(cache.layers)
    assert len(reads) == 6 * len(cache.layers) and sum(reads) == len(cache.layers)
    for layer in cache.layers:  # each head stayed at its prompt budget: its newest token replaced an old one
        assert (layer.store.slots.counts() == Budget(keep=0.4, window=4).tokens(70)).all()
        assert (layer.store.slots.pos.amax(dim=-1) == 75).all()
