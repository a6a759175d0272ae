"""The model support matrix (docs/guide.md): random tiny configs of the dense decoder families transformers ships here
that use its AttentionInterface. For each: passthrough (fp32) equals ``DynamicCache`` token for token under
generate(); every kvquant precision runs prefill + one-token decode steps (what generate() does with the cache)
on the reference's tokens with finite logits that track the FP32 run, and generate() runs with an int4 cache."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DynamicCache

from kvquant import PRECISIONS, ConfigError, KVQuantConfig, QuantizedKVCache
from kvquant.attention import install_attention
from kvquant.transformers_compat import cache_kw

# family -> (config class, model class, extra config fields). The support matrix in docs/guide.md lists these names.
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "Llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "Mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "Qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "Phi-3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "Phi-2": ("PhiConfig", "PhiForCausalLM", {}),
    "Gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "Gemma 2 (logit softcapping)": ("Gemma2Config", "Gemma2ForCausalLM", {}),
    "Gemma 3 (sliding window 8)": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": 8}),
    "OLMo 2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "Granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "Cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "Starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {}),
    "GLM": ("GlmConfig", "GlmForCausalLM", {}),
    "SmolLM3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}),
}

PROMPT, NEW = 9, 10


def family_model(name: str):
    cfg_cls, model_cls, extra = FAMILIES[name]
    cfg = getattr(transformers, cfg_cls)(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # a sharper output distribution than the default init: greedy is not a coin toss
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    return model


def teacher_forced(model, seq, cache):
    with torch.no_grad():
        out = [model(seq[:, :PROMPT], **cache_kw(cache), use_cache=True).logits[0, -1]]
        for t in range(PROMPT, seq.shape[1] - 1):
            out.append(model(seq[:, t:t + 1], **cache_kw(cache), use_cache=True).logits[0, -1])
    return torch.stack(out).float().log_softmax(-1)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family(family):
    model = family_model(family)
    install_attention(model)  # DynamicCache calls below still run the model's own attention math
    ids = torch.randint(3, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, **cache_kw(DynamicCache(config=model.config)), **kw)
        out = model.generate(ids, **cache_kw(QuantizedKVCache(model, "fp32")), **kw)
    assert torch.equal(out, ref)  # passthrough == DynamicCache
    lp_ref = teacher_forced(model, ref, DynamicCache(config=model.config))
    with torch.no_grad():
        assert model.generate(ids, **cache_kw(QuantizedKVCache(model, "int4")), **kw).shape == ref.shape
    softcap = getattr(model.config, "attn_logit_softcapping", None) is not None
    for precision in PRECISIONS:
        if softcap and precision.startswith("tq"):  # codebook keys drop a key mean: not exact under tanh capping
            with pytest.raises(ConfigError, match="^softcap:"):  # refused by the plan, before any work
                QuantizedKVCache(model, KVQuantConfig.from_dict({"default": precision}))
            continue
        lp = teacher_forced(model, ref, QuantizedKVCache(model, KVQuantConfig.from_dict({"default": precision})))
        assert torch.isfinite(lp).all(), precision
        kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).mean().item()
        # random weights: quality is not the point (static per-head int8 reaches KL 0.34 on OLMo 2, whose
        # QK-norm keys have outlier channels); a precision that read the wrong history would be far above 1
        bound = 1e-3 if precision in ("fp16", "bf16", "fp32") else 1.0
        assert kl < bound, (family, precision, kl)


def test_guide_matrix_lists_what_is_tested():
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[1] / "docs" / "guide.md").read_text(encoding="utf-8")
    section = guide.split("## Model support", 1)[1].split("\n## ", 1)[0]
    listed = [line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| ")][1:]
    assert listed == list(FAMILIES)
