"""Serving arithmetic: what a KV format buys a server, from first principles (no measurement).

Three figures a capacity plan needs, each a stated formula:

* **prefix reuse**: a request whose first ``shared`` of ``prompt`` tokens are already cached skips their
  prefill. Hit rate = ``shared / prompt``; prefill FLOPs saved = the FLOPs of those tokens, with the usual
  estimate ``2 x params`` per token for the matrix products plus ``4 x layers x q_heads x head_dim x position``
  for the attention scores and weighted sum (causal, so the position of each token).
* **decode speed bound**: one decode step reads every weight once and the whole KV cache of every sequence
  once, so at memory bandwidth ``bw`` a step takes at least ``(weight bytes + batch x context x KV bytes per
  token) / bw`` and the server makes at most ``batch / that`` tokens/s. The bound ignores compute and launch
  overheads (decode is bandwidth-bound at these sizes); it is a ceiling, not a prediction.
  A config's KV bytes are those a cache holds (:func:`kvquant.memory.sequence_bytes`: whole blocks, fp16 sinks and
  residual window, ladder rows, scale state); FP16's are the formula's.
* **the batch that fits**: at the P99 request length, ``(memory - weight bytes) // KV bytes per sequence``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import KVQuantConfig
from .errors import ArgumentError
from .memory import human, kv_bytes, largest_fitting, layouts, sequence_bytes
from .shape import ModelShape


@dataclass(frozen=True)
class ModelCost:
    """What the arithmetic needs beyond the KV shape: parameter count, bytes per weight, query heads."""

    params: float
    weight_bytes_per_param: float = 2.0
    q_heads: int | None = None  # defaults to the KV heads (no GQA)

    @property
    def weight_bytes(self) -> float:
        return self.params * self.weight_bytes_per_param


def params_from_config(config: Any) -> float:
    """Parameter count of a decoder from its transformers config (dense Llama-style blocks, gated MLP).

    Attention (q, k, v, o), a gated MLP (gate, up, down), the input embedding and, unless tied, the output
    head. Norms and biases are ignored (under 0.1% for real models). Mixture-of-experts configs are not
    counted correctly; pass ``params`` explicitly for them.
    """
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    h, n_layers = cfg.hidden_size, cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or h // heads
    inter = getattr(cfg, "intermediate_size", 4 * h)
    attn = h * hd * (2 * heads + 2 * kv)
    mlp = 3 * h * inter
    emb = cfg.vocab_size * h * (1 if getattr(cfg, "tie_word_embeddings", False) else 2)
    return float(n_layers * (attn + mlp) + emb)


def prefill_flops(tokens: int, start: int, shape: ModelShape, cost: ModelCost) -> float:
    """FLOPs to prefill positions ``start .. start + tokens`` (matrix products + causal attention)."""
    q_heads = cost.q_heads or shape.num_kv_heads
    # sum over positions p of 4 * layers * q_heads * head_dim * (p + 1)
    pos_sum = tokens * (2 * start + tokens + 1) / 2
    return 2.0 * cost.params * tokens + 4.0 * shape.num_layers * q_heads * shape.head_dim * pos_sum


def decode_bound(cost: ModelCost, kv: float, batch: int, bandwidth: float) -> dict[str, float]:
    """Bytes one decode step of ``batch`` sequences reads (the weights and ``kv`` bytes of KV cache) and the
    tokens/s ceiling they allow at ``bandwidth`` bytes/s."""
    step = cost.weight_bytes + kv
    return {"kv_bytes_per_step": float(kv), "bytes_per_step": float(step),
            "tokens_per_s_bound": batch * bandwidth / step, "kv_share_of_step": kv / step}


def serving_estimate(
    shape: ModelShape,
    config: KVQuantConfig,
    cost: ModelCost,
    context: int,
    batch: int,
    bandwidth: float | None = None,
    memory: float | None = None,
    p99: int | None = None,
    prompt_tokens: int | None = None,
    shared_prefix: int | None = None,
) -> dict[str, Any]:
    """FP16 vs ``config`` for the three figures of the module docstring (only those whose inputs are given)."""
    layout = layouts(shape, config)
    formats = {  # KV bytes of b sequences of t tokens: fp16 by the formula, the config as a cache holds it
        "fp16": lambda t, b: kv_bytes(b, t, shape, 2.0),
        "config": lambda t, b: sequence_bytes(shape, config, t, b, layout)["total"],
    }
    out: dict[str, Any] = {"params": cost.params, "weight_bytes": cost.weight_bytes}
    if bandwidth:
        out["bandwidth"] = bandwidth
        for name, held in formats.items():
            out[f"{name}_decode"] = decode_bound(cost, held(context, batch), batch, bandwidth)
        out["decode_speedup_bound"] = (
            out["config_decode"]["tokens_per_s_bound"] / out["fp16_decode"]["tokens_per_s_bound"]
        )
    if memory and p99:
        free = memory - cost.weight_bytes
        if free <= 0:
            raise ArgumentError(f"budget: {memory:.0f} bytes do not even hold the weights ({cost.weight_bytes:.0f})")
        for name, held in formats.items():
            out[f"{name}_batch_at_p99"] = largest_fitting(lambda b, held=held: held(p99, b) <= free)
        out["p99"] = p99
    if prompt_tokens:
        shared = min(shared_prefix or 0, prompt_tokens)
        full = prefill_flops(prompt_tokens, 0, shape, cost)
        rest = prefill_flops(prompt_tokens - shared, shared, shape, cost)
        out["prefix"] = {
            "prompt_tokens": prompt_tokens,
            "shared_prefix": shared,
            "hit_rate": shared / prompt_tokens,
            "prefill_flops": full,
            "prefill_flops_saved": full - rest,
            "saved_fraction": (full - rest) / full,
        }
    return out


def serving_lines(est: dict[str, Any], context: int, batch: int) -> list[str]:
    """The figures of :func:`serving_estimate` as the text ``kvquant estimate`` prints."""
    out = [f"serving (ceilings from the formulas in --help; params {est['params']:.3g}, "
           f"weights {human(est['weight_bytes'])}):"]  # fmt: skip
    if "prefix" in est:
        p = est["prefix"]
        out.append(f"  prefix cache: {p['shared_prefix']} of {p['prompt_tokens']} prompt tokens hit "
                   f"(hit rate {p['hit_rate']:.1%}): prefill {p['prefill_flops']:.3g} FLOPs, "
                   f"{p['prefill_flops_saved']:.3g} saved ({p['saved_fraction']:.1%})")  # fmt: skip
    if "bandwidth" in est:
        out.append(f"  decode at {est['bandwidth'] / 1e12:.3g} TB/s, context {context}, batch {batch}: "
                   "bytes read per step, tokens/s ceiling")  # fmt: skip
        for name in ("fp16", "config"):
            d = est[f"{name}_decode"]
            out.append(f"    {name:6s}  {human(d['bytes_per_step']):>12} per step (KV {d['kv_share_of_step']:.0%})  "
                       f"<= {d['tokens_per_s_bound']:,.0f} tok/s")  # fmt: skip
        out.append(f"    config / fp16 ceiling: {est['decode_speedup_bound']:.2f}x")
    if "p99" in est:
        out.append(f"  batch that fits at P99 = {est['p99']} tokens: fp16 {est['fp16_batch_at_p99']}, "
                   f"config {est['config_batch_at_p99']}")  # fmt: skip
    return out
