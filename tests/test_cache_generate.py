"""QuantizedKVCache inside transformers' generate(): passthrough equals DynamicCache token for token."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvquant
from kvquant import QuantizedKVCache
from kvquant.transformers_compat import cache_kw

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
        kwargs |= cache_kw(cache)
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


def teacher_forced_logits(model, seq, prompt_len, cache):
    """Logits [T, vocab] predicting ``seq[prompt_len:]`` (1 x T), fed one token at a time after the prompt."""
    with torch.no_grad():
        out = [model(seq[:, :prompt_len], **cache_kw(cache), use_cache=True).logits[:, -1]]
        for t in range(prompt_len, seq.shape[1] - 1):
            out.append(model(seq[:, t:t + 1], **cache_kw(cache), use_cache=True).logits[:, -1])
    return torch.cat(out).float()


def check_against_teacher_forcing(model, seqs, prompt_len, step_logprobs, preset):
    """Each generated row: the log-probs generate() used equal those of the same tokens teacher-forced through a
    fresh cache of ``preset`` one row at a time (so the cache was reordered / extended right), and the quantized
    distributions track the FP16 path (DynamicCache) on those tokens. Returns (KL mean, top-1 agreement)."""
    kls, agree = [], []
    for i in range(seqs.shape[0]):
        row = seqs[i:i + 1]
        lq = teacher_forced_logits(model, row, prompt_len, QuantizedKVCache(model, preset)).log_softmax(-1)
        lr = teacher_forced_logits(model, row, prompt_len, DynamicCache(config=model.config)).log_softmax(-1)
        tokens = row[0, prompt_len:]
        # measured: <= 1.2e-6 for int4 (per-token scales, rows quantized alike alone or batched); a beam whose
        # history came from another beam would be off by O(0.1)
        torch.testing.assert_close(step_logprobs[i], lq.gather(1, tokens[:, None])[:, 0], atol=1e-3, rtol=0)
        kls.append((lr.exp() * (lr - lq)).sum(-1))
        agree.append(lr.argmax(-1) == lq.argmax(-1))
    return torch.cat(kls).mean().item(), torch.cat(agree).float().mean().item()


def test_beam_search_matches_under_passthrough():
    model = tiny_model("llama", heads=4, kv_heads=2, head_dim=64)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    ref = greedy(model, ids, DynamicCache(config=model.config), n=12, num_beams=4, num_return_sequences=2)
    out = greedy(model, ids, QuantizedKVCache(model, "fp32"), n=12, num_beams=4, num_return_sequences=2)
    assert torch.equal(out, ref)


def test_beam_search_through_int4_equals_teacher_forcing():
    model = tiny_model("llama", heads=4, kv_heads=2, head_dim=64)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        g = model.generate(ids, **cache_kw(QuantizedKVCache(model, "int4")), max_new_tokens=12, num_beams=4,
                           num_return_sequences=4, do_sample=False, pad_token_id=0, output_scores=True,
                           return_dict_in_generate=True)
    steps = model.compute_transition_scores(g.sequences, g.scores, g.beam_indices, normalize_logits=False)
    kl, top1 = check_against_teacher_forcing(model, g.sequences, ids.shape[1], steps, "int4")
    assert kl < 0.02 and top1 >= 0.9, (kl, top1)  # measured: KL 0.0040, top-1 0.969


def test_sampling_through_int4_equals_teacher_forcing():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(4))
    torch.manual_seed(0)
    with torch.no_grad():
        g = model.generate(ids, **cache_kw(QuantizedKVCache(model, "int4")), do_sample=True, top_k=20,
                           max_new_tokens=10, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    raw = torch.stack(g.logits, 1).float().log_softmax(-1)  # [batch, new tokens, vocab], before top-k
    steps = raw.gather(2, g.sequences[:, ids.shape[1]:, None])[..., 0]
    kl, top1 = check_against_teacher_forcing(model, g.sequences, ids.shape[1], steps, "int4")
    assert kl < 0.02 and top1 >= 0.9, (kl, top1)


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


def test_crop_reset_and_repr():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(5))
    cache = QuantizedKVCache(model, "int8-token")
    with torch.no_grad():
        model(ids[:, :15], **cache_kw(cache), use_cache=True)
        first = model(ids[:, 15:], **cache_kw(cache), use_cache=True).logits
    assert cache.cache_pos == 20 and "cache_pos=20" in repr(cache) and "session_id=" in repr(cache)
    cache.crop(-5)
    assert cache.get_seq_length() == 15
    with torch.no_grad():  # re-feeding the cropped tokens gives the same logits as the first time
        again = model(ids[:, 15:], **cache_kw(cache), use_cache=True).logits
    torch.testing.assert_close(again, first, atol=1e-5, rtol=0)
    cache.reset()
    assert cache.get_seq_length() == 0
    with torch.no_grad():  # after reset the cache serves a new prompt from scratch
        fresh = model(ids[:, :15], **cache_kw(cache), use_cache=True).logits
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
        model(ids, **cache_kw(cache), use_cache=True)  # caught within the first forward (layer 1's update)
    with pytest.raises(ValueError, match="kvquant.wrap"):  # building a cache changes nothing on the model
        QuantizedKVCache(model, "int8")


def test_wrapped_model_still_serves_dynamic_cache():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(6))
    ref = greedy(model, ids, DynamicCache(config=model.config))
    kvquant.wrap(model, "int8")
    assert torch.equal(greedy(model, ids, DynamicCache(config=model.config)), ref)


def test_unsupported_model_gives_clear_error():
    model = tiny_model("llama")
    model._supports_attention_backend = False  # a model whose attention does not go through AttentionInterface
    with pytest.raises(TypeError, match="AttentionInterface"):
        kvquant.wrap(model, "int8")
