"""Attention logit softcapping (Gemma 2): torch walk, Triton kernels (interpreted on CPU) and a tiny Gemma 2.

Also: Gemma 3 and a sliding-window Mistral still run through the kvquant attention (the mask carries
the window; kvquant keeps every token, it does not evict).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import kvquant  # noqa: E402
from kvquant.config import KVPrecision, KVQuantConfig  # noqa: E402
from kvquant.errors import ConfigError  # noqa: E402
from kvquant.kernels.attention_torch import attend_naive, attend_torch  # noqa: E402
from kvquant.quantizers import PRECISIONS  # noqa: E402
from kvquant.store import LayerStore  # noqa: E402
from kvquant.transformers_compat import cache_kw

SOFTCAP = 0.7  # small: random scores reach several units, so capping changes the output clearly


def _store(pair, past, tq=1, B=2, H=2, D=64, seed=0, **options):
    g = torch.Generator().manual_seed(seed)
    layer = LayerStore([KVPrecision(*pair)] * H, KVQuantConfig(block_size=16, **options), D, B, torch.device("cpu"))
    k = torch.randn(B, H, past + tq, D, generator=g) * 2
    v = torch.randn(B, H, past + tq, D, generator=g)
    if past:
        layer.append(k[:, :, :past], v[:, :, :past])
    layer.append(k[:, :, past:], v[:, :, past:])
    q = torch.randn(B, 2 * H, tq, D, generator=g) * 3
    return layer, q, k[:, :, past:], v[:, :, past:]


def test_naive_softcap_formula():
    """The reference applies ``c * tanh(s / c)`` to the scaled scores (checked against an explicit softmax)."""
    layer, q, fk, fv = _store(("fp32", "fp32"), past=0, tq=5)
    got = attend_naive(q, fk, fv, layer, 0, None, 0.125, SOFTCAP)
    k, v = fk.repeat_interleave(2, 1), fv.repeat_interleave(2, 1)
    s = SOFTCAP * torch.tanh(q @ k.transpose(-1, -2) * 0.125 / SOFTCAP)
    s = s.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    assert (got - torch.softmax(s, -1) @ v).abs().max() < 1e-6
    assert (got - attend_naive(q, fk, fv, layer, 0, None, 0.125)).abs().max() > 1e-2  # capping matters


@pytest.mark.parametrize("pair", [("int8", "int8"), ("int4", "int8-token"), ("int8-token", "fp16")])
@pytest.mark.parametrize("past,tq", [(37, 1), (300, 9), (20, 140)])
def test_torch_walk_softcap(pair, past, tq):
    layer, q, fk, fv = _store(pair, past, tq)
    got = attend_torch(q, fk, fv, layer, past, None, 0.125, SOFTCAP)
    want = attend_naive(q, fk, fv, layer, past, None, 0.125, SOFTCAP)
    assert (got - want).abs().max() < 1e-5


pytest.importorskip("triton")


@pytest.mark.parametrize("pair", [("int8", "int4"), ("int8-token", "fp8-e4m3"), ("int4-channel", "int8")])
@pytest.mark.parametrize("tq", [1, 6])
@pytest.mark.parametrize("option", [{}, {"sink_tokens": 3, "residual_tokens": 16}], ids=["pool", "dense"])
def test_triton_softcap(pair, tq, option):
    """Decode (Tq=1) and chunk kernels with SOFTCAP, also with dense segments merged by log-sum-exp."""
    from kvquant.kernels.triton_attention import attend_triton

    layer, q, fk, fv = _store(pair, 40, tq, **option)
    out = attend_triton(q, fk, fv, layer, 40, None, 0.125, softcap=SOFTCAP, splits=2, block_m=16)
    want = attend_naive(q, fk, fv, layer, 40, None, 0.125, SOFTCAP)
    assert (out - want).abs().max() < 2e-3
    uncapped = attend_naive(q, fk, fv, layer, 40, None, 0.125)
    assert (out - uncapped).abs().max() > 1e-2


# ------------------------------------------------------------------------------------ tiny models
def _tiny(arch: str, **extra):
    import transformers

    cfg_cls, model_cls = {
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
    }[arch]
    cfg = getattr(transformers, cfg_cls)(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, **extra,
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    return model


def _gemma2():
    # softcap 2.0 (Gemma 2 uses 50): random tiny weights give small scores, a small cap makes it bite;
    # sliding window 8 on alternate layers, shorter than the prompt
    model = _tiny("gemma2", attn_logit_softcapping=2.0, final_logit_softcapping=None, sliding_window=8,
                  query_pre_attn_scalar=32)
    with torch.no_grad():  # random init gives scores ~1e-3: sharpen q/k so that scores reach the cap
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(12.0)
            layer.self_attn.k_proj.weight.mul_(12.0)
    # eager by name: some transformers 5.x releases default Gemma 2 to SDPA, which drops the softcap
    model.set_attn_implementation("eager")
    return model


PROMPT = torch.tensor([[1, 5, 9, 17, 33, 4, 70, 12, 44, 3, 8, 91]])


def _quantized(model, config):
    """A QuantizedKVCache for ``model``, after switching it to the kvquant attention (as kvquant.wrap does;
    building a cache no longer does it)."""
    from kvquant.attention import install_attention

    install_attention(model)
    return kvquant.QuantizedKVCache(model, config)


def _greedy(model, cache, n=10):
    out = model.generate(PROMPT, max_new_tokens=n, do_sample=False, **cache_kw(cache), output_logits=True,
                         return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.fixture(scope="module")
def gemma2_reference():
    """(model, DynamicCache greedy tokens, logits) with transformers' own eager softcapped attention."""
    from transformers import DynamicCache

    model = _gemma2()
    seq, logits = _greedy(model, DynamicCache(config=model.config))
    return model, seq, logits


def test_gemma2_passthrough_equals_dynamic_cache(gemma2_reference):
    """fp32 passthrough through the kvquant store + attention == DynamicCache with the eager softcap path."""
    model, seq, logits = gemma2_reference
    got_seq, got_logits = _greedy(model, _quantized(model, "fp32"))
    assert torch.equal(got_seq, seq)
    assert (got_logits - logits).abs().max() < 1e-4
    # and softcapping is really applied: without it the logits move
    model.config.attn_logit_softcapping = None
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    try:
        _, uncapped = _greedy(model, _quantized(model, "fp32"))
    finally:
        model.config.attn_logit_softcapping = 2.0
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = 2.0
    assert (uncapped - logits).abs().max() > 1e-2


def test_gemma2_fp16_passthrough_equals_dynamic_cache():
    """fp16 model + fp16 preset: greedy tokens equal DynamicCache's (logits to fp16 rounding)."""
    from transformers import DynamicCache

    model = _gemma2().half()
    seq, logits = _greedy(model, DynamicCache(config=model.config), n=6)
    got_seq, got_logits = _greedy(model, _quantized(model, "fp16"), n=6)
    assert torch.equal(got_seq, seq)
    assert (got_logits.float() - logits.float()).abs().max() < 2e-2


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_gemma2_every_precision_generates(gemma2_reference, precision):
    """Every precision generates on Gemma 2 (softcap + sliding layers), teacher-forced close to DynamicCache."""
    model, seq, logits = gemma2_reference
    config = KVQuantConfig.from_dict({"default": precision, "block_size": 16})
    if precision.startswith("tq"):  # codebook keys drop a per-channel key mean: exact for softmax, not for tanh
        with pytest.raises(ConfigError, match="^softcap:"):  # refused by the plan, before anything runs
            _quantized(model, config)
        return
    cache = _quantized(model, config)
    with torch.no_grad():
        got = model(seq[:, :-1], **cache_kw(cache)).logits[:, PROMPT.shape[1] - 1:]
    assert torch.isfinite(got).all()
    top1 = (got.argmax(-1) == logits.argmax(-1)).float().mean().item()
    assert top1 >= 0.5, f"{precision}: teacher-forced top-1 agreement {top1:.2f}"


@pytest.mark.parametrize("arch,extra", [
    ("gemma3", {"sliding_window": 8, "query_pre_attn_scalar": 32}),
    ("mistral", {"sliding_window": 8}),
], ids=["gemma3", "mistral-sliding"])
def test_sliding_window_models_still_run(arch, extra):
    """Sliding-window layers: the window lives in the mask, kvquant (fp32) equals DynamicCache."""
    from transformers import DynamicCache

    model = _tiny(arch, **extra)
    seq, logits = _greedy(model, DynamicCache(config=model.config))
    got_seq, got_logits = _greedy(model, _quantized(model, "fp32"))
    assert torch.equal(got_seq, seq)
    assert (got_logits - logits).abs().max() < 1e-4
