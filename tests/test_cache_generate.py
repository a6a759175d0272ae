"""QuantizedKVCache inside transformers' generate(): passthrough equals DynamicCache token for token."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvquant
from kvquant import QuantizedKVCache

from conftest import tiny_model

ARCHS = [
    ("llama", dict(heads=4, kv_heads=2, head_dim=64)),   # GQA
    ("llama", dict(heads=4, kv_heads=4, head_dim=128)),  # MHA, head_dim 128
    ("qwen2", dict(heads=6, kv_heads=2, head_dim=64)),
    ("mistral", dict(heads=4, kv_heads=1, head_dim=128)),
    ("qwen3", dict(heads=4, kv_heads=2, head_dim=64)),
]


def greedy(model, ids, cache=None, n=24, **kw):
    kwargs = dict(max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
    if cache is not None:
        kwargs["cache"] = cache
    with torch.no_grad():
        return model.generate(ids, **kwargs)


ARCH_IDS = [f"{a}-{d['heads']}q{d['kv_heads']}kv-d{d['head_dim']}" for a, d in ARCHS]


@pytest.mark.parametrize("arch,dims", ARCHS, ids=ARCH_IDS)
@pytest.mark.parametrize("preset", ["fp32", "fp16"])
def test_passthrough_equals_dynamic_cache(arch, dims, preset):
    model = tiny_model(arch, **dims)
    ids = torch.randint(3, 128, (1, 11), generator=torch.Generator().manual_seed(1))
    ref = greedy(model, ids, DynamicCache(config=model.config))
    cache = QuantizedKVCache(model, preset)
    out = greedy(model, ids, cache)
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == ref.shape[1] - 1


def test_stories260k_passthrough_and_documented_text(stories):
    model, tok = stories
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    ref = greedy(model, ids, DynamicCache(config=model.config), n=40)
    out = greedy(kvquant.wrap(model, "fp16"), ids, n=40)  # wrap: generate() builds the cache itself
    assert torch.equal(out, ref)
    assert "there was a little girl named Lily" in tok.decode(out[0])


def test_beam_search_matches_under_passthrough():
    model = tiny_model("llama", heads=4, kv_heads=2, head_dim=64)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    ref = greedy(model, ids, DynamicCache(config=model.config), n=12, num_beams=4, num_return_sequences=2)
    out = greedy(model, ids, QuantizedKVCache(model, "fp32"), n=12, num_beams=4, num_return_sequences=2)
    assert torch.equal(out, ref)
    # beam search through a quantized store runs and returns the right shape
    q = greedy(model, ids, QuantizedKVCache(model, "int4"), n=12, num_beams=4)
    assert q.shape == (2, 21)


def test_left_padded_batch_of_three_matches_under_passthrough():
    model = tiny_model("qwen2", heads=4, kv_heads=2, head_dim=64)
    g = torch.Generator().manual_seed(3)
    lengths = [12, 7, 3]
    ids = torch.zeros(3, 12, dtype=torch.long)
    att = torch.zeros(3, 12, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, 12 - n:] = torch.randint(3, 128, (n,), generator=g)
        att[i, 12 - n:] = 1
    ref = greedy(model, ids, DynamicCache(config=model.config), attention_mask=att)
    out = greedy(model, ids, QuantizedKVCache(model, "fp32"), attention_mask=att)
    assert torch.equal(out, ref)
    # each row equals that prompt decoded alone (padding really is ignored)
    for i, n in enumerate(lengths):
        alone = greedy(model, ids[i:i + 1, 12 - n:], QuantizedKVCache(model, "fp32"))
        assert torch.equal(alone[0, n:], out[i, 12:])


def test_sampling_runs_with_quantized_cache():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(4))
    torch.manual_seed(0)
    out = model.generate(ids, cache=QuantizedKVCache(model, "int8"), do_sample=True, top_k=20, max_new_tokens=10,
                         pad_token_id=0)
    assert out.shape == (2, 15)


def test_crop_reset_and_repr():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(5))
    cache = QuantizedKVCache(model, "int8-token")
    with torch.no_grad():
        model(ids[:, :15], cache=cache, use_cache=True)
        first = model(ids[:, 15:], cache=cache, use_cache=True).logits
    assert cache.cache_pos == 20 and "cache_pos=20" in repr(cache) and "session_id=" in repr(cache)
    cache.crop(-5)
    assert cache.get_seq_length() == 15
    with torch.no_grad():  # re-feeding the cropped tokens gives the same logits as the first time
        again = model(ids[:, 15:], cache=cache, use_cache=True).logits
    torch.testing.assert_close(again, first, atol=1e-5, rtol=0)
    cache.reset()
    assert cache.get_seq_length() == 0
    with torch.no_grad():  # after reset the cache serves a new prompt from scratch
        fresh = model(ids[:, :15], cache=cache, use_cache=True).logits
        ref = model(ids[:, :15]).logits
    torch.testing.assert_close(fresh, ref, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="negative"):
        cache.crop(3)


def test_attention_must_read_the_store():
    model = tiny_model("llama")
    cache = QuantizedKVCache(model, "int8")
    model.set_attn_implementation("sdpa")  # a user switching attention back behind kvquant's back
    ids = torch.randint(3, 128, (1, 4))
    with torch.no_grad(), pytest.raises(RuntimeError, match="kvquant.wrap"):
        model(ids, cache=cache, use_cache=True)  # caught within the first forward (layer 1's update)
    with pytest.raises(ValueError, match="kvquant.wrap"):  # building a cache changes nothing on the model
        QuantizedKVCache(model, "int8")


def test_wrapped_model_still_serves_dynamic_cache():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(6))
    ref = greedy(model, ids, DynamicCache(config=model.config))
    kvquant.wrap(model, "int8")
    assert torch.equal(greedy(model, ids, DynamicCache(config=model.config)), ref)


def test_unsupported_model_gives_clear_error():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=50))
    if getattr(model, "_supports_attention_backend", False):
        pytest.skip("GPT-2 uses the AttentionInterface in this transformers version")
    with pytest.raises(TypeError, match="AttentionInterface"):
        kvquant.wrap(model, "int8")
