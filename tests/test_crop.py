"""crop in residual mode: kept tokens are read exactly as before (nothing is quantized again);
per-channel blocks are cut only at block boundaries (else a one-line refusal with the reason)."""

from __future__ import annotations

import pytest
import torch

from kvquant import KVPrecision, KVQuantConfig, QuantizedKVCache
from kvquant.kernels.attention_torch import attend_naive, attend_torch, dequantize_history
from kvquant.store import LayerStore
from kvquant.transformers_compat import cache_kw

from conftest import tiny_model


def _store(pair, **options):
    cfg = KVQuantConfig(block_size=16, **options)
    return LayerStore([KVPrecision(*pair)] * 2, cfg, 32, 2, torch.device("cpu"))


def _fill(store, n, seed=0, steps=(20, 33)):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, 2, n, 32, generator=g), torch.randn(2, 2, n, 32, generator=g)
    cuts = [0, *steps, n]
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        for t in range(a, b) if b - a < 3 else [a]:  # a few single-token steps and chunks
            end = t + 1 if b - a < 3 else b
            store.append(k[:, :, t:end], v[:, :, t:end])
    return k, v


@pytest.mark.parametrize("pair,options,keep", [
    (("int4", "int8-token"), {"residual_tokens": 8}, 21),          # into the pool, mid block
    (("int8", "int4"), {"residual_tokens": 8, "sink_tokens": 2}, 1),  # into the sinks
    (("int4-channel", "int4"), {"residual_tokens": 8}, 32),        # per-channel: at a block boundary
    (("int4-channel", "int4"), {"residual_tokens": 8}, 60),        # inside the residual window
])
def test_crop_keeps_exactly_what_was_stored(pair, options, keep):
    store = _store(pair, **options)
    _fill(store, 70)
    assert store.q_end > keep or keep == 60
    before_k, before_v = dequantize_history(store, 70)
    store.crop(keep)
    assert store.cache_pos == keep and store.q_end <= keep
    pooled = store.q_end
    k, v = dequantize_history(store, keep)
    assert torch.equal(k, before_k[:, :, :keep]) and torch.equal(v, before_v[:, :, :keep])
    # the store keeps working: new tokens after the crop, attention over the whole history
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        store.append(torch.randn(2, 2, 1, 32, generator=g), torch.randn(2, 2, 1, 32, generator=g))
    fk, fv = torch.randn(2, 2, 1, 32, generator=g), torch.randn(2, 2, 1, 32, generator=g)
    past = store.append(fk, fv)
    k2, _ = dequantize_history(store, keep)
    assert torch.equal(k2[:, :, :pooled], before_k[:, :, :pooled])  # quantized tokens never re-quantized
    q = torch.randn(2, 4, 1, 32, generator=g)
    got = attend_torch(q, fk, fv, store, past, None, 0.2)
    assert (got - attend_naive(q, fk, fv, store, past, None, 0.2)).abs().max() < 1e-5


def test_crop_inside_a_per_channel_block_is_refused():
    store = _store(("int4-channel", "int4"), residual_tokens=8)
    _fill(store, 70)
    with pytest.raises(ValueError, match=r"^crop: keeping 40 tokens would split a quantized per-channel block"):
        store.crop(40)
    assert store.cache_pos == 70  # nothing changed


def test_assisted_generation_with_residual_window():
    """transformers' assisted decoding crops rejected draft tokens: it runs in residual mode."""
    model = tiny_model("llama", seed=0)
    assistant = tiny_model("llama", seed=1)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    cfg = KVQuantConfig.from_dict({"default": "int4", "residual_tokens": 4, "block_size": 16})
    cache = QuantizedKVCache(model, cfg)
    assert all(layer.is_croppable for layer in cache.layers)
    with torch.no_grad():
        out = model.generate(ids, assistant_model=assistant, **cache_kw(cache), max_new_tokens=20, do_sample=False,
                             pad_token_id=0)
    assert out.shape == (1, 60) and cache.get_seq_length() >= 59
