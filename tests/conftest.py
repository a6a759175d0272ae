"""Shared fixtures: the shared data folder (skip on a user's machine, fail in CI) and tiny models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run under the interpreter on CPU (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvquant.paths import shared_dir

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny models run fastest on one thread; a second one mostly contends on a shared 2-core machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _shared_path(*parts: str) -> Path:
    p = shared_dir().joinpath(*parts)
    if not p.exists():
        msg = f"{p} missing: set KVQUANT_SHARED to the shared data folder"
        if IN_CI:
            pytest.fail(f"CI=true and {msg}")
        pytest.skip(msg)
    return p


@pytest.fixture(scope="session")
def shared():
    """The shared data folder (``KVQUANT_SHARED``, default ``../shared``)."""
    return _shared_path()


@pytest.fixture(scope="session")
def stories_path():
    return _shared_path("models", "stories260K", "hf")


@pytest.fixture(scope="session")
def stories(stories_path):
    """(model, tokenizer) of the real stories260K Llama (GQA: 8 query heads, 4 KV heads, head_dim 8), with
    the ``kvquant`` attention installed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvquant.attention import install_attention

    model = AutoModelForCausalLM.from_pretrained(stories_path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(stories_path)
    install_attention(model)  # QuantizedKVCache needs it (as kvquant.wrap does); other caches still run SDPA
    return model, tok


@pytest.fixture(scope="session")
def tinystories_text():
    return _shared_path("data", "tinystories-valid-sample.txt").read_text()


def tiny_model(arch: str = "llama", kv_heads: int = 2, heads: int = 4, head_dim: int = 64, layers: int = 2,
               vocab: int = 128, seed: int = 0, kvquant_attention: bool = True, **extra):
    """A random tiny decoder of the given architecture (fp32, eval mode).

    ``kvquant_attention``: switch it to the ``kvquant`` attention (what :func:`kvquant.wrap` does, without
    changing ``generate``), so that a ``QuantizedKVCache`` can be built for it; other caches still run SDPA."""
    import transformers

    cls_cfg, cls_model = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    }[arch]
    cfg = getattr(transformers, cls_cfg)(
        vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=2 * heads * head_dim,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, cls_model)(cfg).eval()
    # a sharper output distribution than the default init, so that greedy decoding is not a coin toss
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = None  # decode the full length: random weights may emit "eos"
    if kvquant_attention:
        from kvquant.attention import install_attention

        install_attention(model)
    return model
