"""Eviction policies (kvquant/evict.py): scorers and budgets, checked against brute force."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from kvquant.evict import Budget, KeyNormScorer, SnapKVScorer, StreamingScorer, make_scorer
from kvquant.transformers_compat import cache_kw

from conftest import tiny_model


def test_uniform_budget_keeps_exact_counts_sinks_window_and_no_pads():
    torch.manual_seed(0)
    B, H, T = 3, 4, 100
    scores = torch.randn(B, H, T)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :20] = False  # a left-padded row
    budget = Budget(keep=0.4, sinks=4, window=8)
    mask = budget.keep_mask(scores, valid)
    for b in range(B):
        n = int(valid[b].sum())
        real = valid[b].nonzero().flatten()
        assert (mask[b].sum(dim=-1) == budget.tokens(n)).all()
        assert not mask[b][:, ~valid[b]].any()
        assert mask[b][:, real[:4]].all() and mask[b][:, real[-8:]].all()
        # the rest are the best scores of each head
        free = real[4:-8]
        for h in range(H):
            kept = free[mask[b, h, free]]
            dropped = free[~mask[b, h, free]]
            assert scores[b, h, kept].min() >= scores[b, h, dropped].max()
    assert Budget(keep=1.0).keep_mask(scores, valid).eq(valid.unsqueeze(1)).all()


def test_adakv_budget_spreads_the_layer_total_over_heads():
    T, H = 64, 2
    scores = torch.zeros(1, H, T)
    scores[0, 0, 10] = 50.0  # head 0: all attention on one token
    scores[0, 1] = torch.linspace(0, 1, T)  # head 1: spread
    budget = Budget(keep=0.5, sinks=2, window=4, per_head=True)
    mask = budget.keep_mask(scores)
    assert int(mask.sum()) == H * budget.tokens(T)
    counts = mask[0].sum(dim=-1)
    assert counts[1] > counts[0] >= 2 + 4 + 1  # the spread head gets more; each keeps sinks, window, its peak
    assert mask[0, 0, 10]


def test_streaming_keeps_sinks_and_the_most_recent():
    keys = torch.randn(1, 2, 50, 8)
    scores = StreamingScorer().score(None, None, keys, keys, None, {})
    mask = Budget(keep=0.3, sinks=4, window=4).keep_mask(scores)
    kept = mask[0, 0].nonzero().flatten().tolist()
    assert kept == list(range(4)) + list(range(50 - 11, 50))


def test_keynorm_prefers_small_keys():
    keys = torch.ones(1, 1, 10, 4)
    keys[0, 0, 5] *= 0.01
    assert KeyNormScorer().score(None, None, keys, keys, None, {}).argmax() == 5


def test_snapkv_scores_equal_eager_attention_of_the_observation_window():
    model = tiny_model("llama", kv_heads=2, heads=4, head_dim=16, layers=1)
    model.set_attn_implementation("eager")
    captured = {}

    def hook(module, args, kwargs):
        captured["hidden"] = kwargs["hidden_states"]
        captured["kwargs"] = kwargs

    attn = model.model.layers[0].self_attn
    handle = attn.register_forward_pre_hook(hook, with_kwargs=True)
    ids = torch.randint(3, 128, (2, 40))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(ids, **cache_kw(cache), output_attentions=True)
    handle.remove()
    keys = cache.layers[0].keys
    w, kernel = 8, 5
    got = SnapKVScorer(window=w, kernel=kernel).score(attn, captured["hidden"], keys, keys, None, captured["kwargs"])
    weights = out.attentions[0]  # [B, Hq, T, T], softmax over keys, causal
    ref = weights[:, :, -w:].mean(dim=2).view(2, 2, 2, 40).mean(dim=2)
    ref = F.avg_pool1d(ref, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
    assert torch.isinf(got[..., -w:]).all()
    torch.testing.assert_close(got[..., :-w], ref[..., :-w], atol=1e-6, rtol=1e-5)


def test_a_kvpress_style_scorer_plugs_in():
    class MyScorer:  # the kvpress signature, nothing else
        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            return values.float().mean(dim=-1)

    values = torch.arange(30, dtype=torch.float32).view(1, 1, 30, 1).expand(1, 1, 30, 4)
    mask = Budget(keep=0.5, sinks=0, window=0).keep_mask(MyScorer().score(None, None, values, values, None, {}))
    assert mask[0, 0].nonzero().flatten().tolist() == list(range(15, 30))


def test_bad_policy_settings_are_one_line_errors():
    with pytest.raises(ValueError, match="^evict.policy:"):
        make_scorer("h3o")
    with pytest.raises(ValueError, match="^evict:"):
        make_scorer("snapkv", windw=3)
    with pytest.raises(ValueError, match="^evict.keep:"):
        Budget(keep=0.0)
    assert isinstance(make_scorer("snapkv", window=16), SnapKVScorer)


def test_evict_config_round_trips_and_names_the_bad_field(tmp_path):
    from kvquant import KVQuantConfig

    data = {"default": "int4", "evict": {"policy": "tova", "keep": 0.25, "window": 16, "sinks": 2,
                                         "layers": {1: {"keep": 1.0}, 2: None}}}  # fmt: skip
    cfg = KVQuantConfig.from_dict(data)
    path = tmp_path / "c.yaml"
    cfg.save(path)
    back = KVQuantConfig.load(str(path))
    assert back.to_dict() == {"name": "c", **cfg.to_dict()}
    assert back.evict.for_layer(0).budget == Budget(keep=0.25, sinks=2, window=16)
    assert back.evict.for_layer(0).tracking == "last"
    assert back.evict.for_layer(1).budget.keep == 1.0 and back.evict.for_layer(2) is None
    bad = {
        "evict.policy": {"policy": "h3o"},
        "evict.keep": {"keep": 1.5},
        "evict.window": {"window": -1},
        "evict.sinks": {"sinks": "4"},
        "evict.budget": {"budget": "global"},
        "evict.layers.x": {"layers": {"x": {}}},
        "evict.layers.0.keep": {"layers": {0: {"keep": 0}}},
        "evict.colour": {"colour": 1},
    }
    for field_name, spec in bad.items():
        with pytest.raises(ValueError, match=f"^{field_name}[:.]?") as e:
            KVQuantConfig.from_dict({"default": "int4", "evict": spec})
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="^evict.policy:"):  # replaced in place: per-channel keys cannot
        KVQuantConfig.from_dict({"default": "int4-channel", "evict": {"policy": "h2o"}})
    with pytest.raises(ValueError, match="^evict.sinks:"):
        KVQuantConfig.from_dict({"default": "int4", "sink_tokens": 8, "evict": {"policy": "h2o", "sinks": 4}})
    with pytest.raises(ValueError, match="^evict.layers.5:"):
        KVQuantConfig.from_dict({"default": "int4", "evict": {"layers": {5: None}}}).resolve(
            tiny_model("llama", layers=2))


def test_per_layer_overrides_and_sliding_window_layers(tmp_path):
    from kvquant import KVQuantConfig, QuantizedKVCache

    model = tiny_model("llama", kv_heads=2, heads=4, head_dim=16, layers=2)
    cfg = KVQuantConfig.from_dict({"default": "int8-token", "evict": {"policy": "knorm", "layers": {1: None}}})
    cache = QuantizedKVCache(model, cfg)
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 100)), **cache_kw(cache))
    assert cache.layers[0].store.slots is not None and cache.layers[0].store.cache_pos == 50
    assert cache.layers[1].store.slots is None and cache.layers[1].store.cache_pos == 100
    mistral = tiny_model("mistral", kv_heads=2, heads=4, head_dim=16, layers=2, sliding_window=32)
    cache = QuantizedKVCache(mistral, cfg)
    assert cache.layers[0].policy is None  # a sliding-window layer keeps its window instead
