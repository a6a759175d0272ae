"""Outlier stress variants of real models: the key statistics that break coarse KV quantization.

A recipe (or ``load_model``) names a variant by appending ``+VARIANT`` to a model, e.g.
``smollm2-135m+kbias`` or ``${KVQUANT_SHARED}/models/stories260K/hf+koutlier+wide256``. Each variant
is built in place from the loaded model and is its own FP16 reference (the eval compares a
quantized cache of the variant with the unquantized variant). The constructions reproduce what
real families do to keys, measured on the model itself (one forward over :data:`PROBE_TEXT`):

``koutlier``
    A few key channels with large magnitude (the outlier channels of Llama-class models). In every
    KV head, the ``OUTLIER_PAIRS`` lowest-frequency RoPE channel pairs ``(i, i + D/2)`` of ``k_proj``
    are scaled so that their RMS is ``OUTLIER_RATIO`` x the head's median channel RMS, and the matching
    ``q_proj`` rows of every query head of the group by the inverse. RoPE rotates each pair as a
    whole, so every score ``q.k`` is unchanged: the model computes the same function, its keys do not.
``kbias``
    A per-channel key offset, as q/k/v-bias models (Qwen2 class) show: ``k_proj`` gets a bias of
    ``BIAS_RATIO`` x the head's median key channel RMS on the first channel of up to ``BIAS_PAIRS``
    low-frequency pairs (signs alternate), those that RoPE turns by less than ``BIAS_MAX_TURN``
    radians over ``BIAS_CONTEXT`` tokens (at least the lowest one). A bias adds ``q.R_t b`` to a
    score; on channels that RoPE barely rotates this is nearly the same for every key of a query,
    so the model stays a working language model (it is its own reference either way).
``wide256``
    head_dim 256 by construction, function-preserving: head channel ``i`` of the original pair
    ``(i, i + D/2)`` moves to ``(r*i, 128 + r*i)`` with ``r = 256 / D``, which RoPE (head_dim 256)
    rotates at exactly the original frequency; the query is scaled by ``sqrt(r)`` to undo the new
    ``1/sqrt(256)`` scaling. The other channels hold keys and values of the same statistics
    (random mixtures of the head's own rows, matched in RMS) that the model ignores: queries are 0
    there and ``o_proj`` reads nothing from them. Per-token scales then span 256 channels of real-looking
    data, as in a wide-head model (Gemma class).

Variants compose left to right (``+wide256+kbias``). Only Llama-style attention modules (``q_proj``,
``k_proj``, ``v_proj``, ``o_proj``, full rotary) are supported; anything else raises ``ValueError``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from kvquant.errors import InputError

OUTLIER_PAIRS = 2
OUTLIER_RATIO = 20.0
BIAS_PAIRS = 4
BIAS_RATIO = 30.0
BIAS_MAX_TURN = 0.5
BIAS_CONTEXT = 1024
WIDE_HEAD_DIM = 256
SEED = 0

#: A short probe text: key statistics (per-channel RMS) are measured on it.
PROBE_TEXT = (
    "The old lighthouse keeper climbed the stairs each evening, counting the steps as his father had "
    "taught him. In 1887 the light was converted from oil to kerosene; the lens, made in Paris, weighed "
    "nearly two tons. Ships passing the northern reef relied on its flash every ten seconds. When the "
    "storm of that winter broke the windows, he kept the flame burning with a lantern and a mirror, and "
    "wrote in the log: 'No vessel lost.'"
)


def split_spec(spec: str) -> tuple[str, list[str]]:
    """``"smollm2-135m+kbias+wide256"`` -> ``("smollm2-135m", ["kbias", "wide256"])``; unknown variants raise."""
    base, *variants = str(spec).split("+")
    for v in variants:
        if v not in VARIANTS:
            raise InputError(f"model: unknown stress variant {v!r} in {spec!r} (known: {', '.join(VARIANTS)})")
    return base, variants


def _attn_modules(model: Any) -> list[Any]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise InputError(f"model: {type(model).__name__} has no model.layers; stress variants need a Llama-style model")
    attns = [layer.self_attn for layer in layers]
    for a in attns:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not isinstance(getattr(a, name, None), torch.nn.Linear):
                raise InputError(f"model: attention {type(a).__name__} has no Linear {name}; not a Llama-style model")
    return attns


def _shape(model: Any) -> tuple[int, int, int]:
    cfg = model.config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if getattr(cfg, "partial_rotary_factor", 1.0) not in (None, 1.0):
        raise InputError("model: partial rotary embeddings are not supported by the stress variants")
    return heads, kv, d


@torch.no_grad()
def key_channel_rms(model: Any, tokenizer: Any) -> list[torch.Tensor]:
    """Per-layer ``[kv_heads, head_dim]`` RMS of ``k_proj``'s output (before RoPE) over :data:`PROBE_TEXT`."""
    _, kv, d = _shape(model)
    out: list[torch.Tensor] = []
    hooks = [
        a.k_proj.register_forward_hook(
            lambda _m, _i, o: out.append(o.detach().float().reshape(-1, kv, d).pow(2).mean(0).sqrt())
        )
        for a in _attn_modules(model)
    ]
    try:
        ids = tokenizer(PROBE_TEXT, return_tensors="pt").input_ids.to(model.get_input_embeddings().weight.device)
        model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return out


def _low_freq_pairs(d: int, n: int) -> list[int]:
    """First channels ``i`` of the ``n`` lowest-frequency RoPE pairs ``(i, i + d/2)``."""
    return list(range(d // 2 - 1, d // 2 - 1 - min(n, d // 2), -1))


@torch.no_grad()
def add_key_outliers(model: Any, tokenizer: Any) -> None:
    """``koutlier``: scale a few key channel pairs up and the matching query channels down (exact)."""
    heads, kv, d = _shape(model)
    rep = heads // kv
    rms = key_channel_rms(model, tokenizer)
    for a, r in zip(_attn_modules(model), rms, strict=True):
        for h in range(kv):
            target = OUTLIER_RATIO * r[h].median()
            for i in _low_freq_pairs(d, OUTLIER_PAIRS):
                pair = [i, i + d // 2]
                s = float(target / r[h, pair].max().clamp_min(1e-6))
                rows = [h * d + c for c in pair]
                a.k_proj.weight[rows] *= s
                if a.k_proj.bias is not None:
                    a.k_proj.bias[rows] *= s
                for qh in range(h * rep, (h + 1) * rep):
                    qrows = [qh * d + c for c in pair]
                    a.q_proj.weight[qrows] /= s
                    if a.q_proj.bias is not None:
                        a.q_proj.bias[qrows] /= s


@torch.no_grad()
def add_key_bias(model: Any, tokenizer: Any) -> None:
    """``kbias``: give ``k_proj`` a large bias on a few low-frequency channels (q/k/v-bias families)."""
    _, kv, d = _shape(model)
    rms = key_channel_rms(model, tokenizer)
    inv_freq = getattr(getattr(model.model, "rotary_emb", None), "inv_freq", None)
    pairs = [
        i for i in _low_freq_pairs(d, BIAS_PAIRS)
        if inv_freq is None or float(inv_freq[i]) * BIAS_CONTEXT < BIAS_MAX_TURN
    ] or _low_freq_pairs(d, 1)
    for a, r in zip(_attn_modules(model), rms, strict=True):
        old = a.k_proj
        if old.bias is None:
            new = torch.nn.Linear(old.in_features, old.out_features, bias=True, device=old.weight.device,
                                  dtype=old.weight.dtype)
            new.weight.copy_(old.weight)
            new.bias.zero_()
            a.k_proj = new
        for h in range(kv):
            size = BIAS_RATIO * float(r[h].median())
            for j, i in enumerate(pairs):
                a.k_proj.bias[h * d + i] += size if j % 2 == 0 else -size


def _matched_mixture(rows: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` random mixtures of ``rows[d, in]`` whose norms match the rows' RMS norm."""
    mix = torch.randn(n, rows.shape[0], generator=gen, dtype=torch.float64) / math.sqrt(rows.shape[0])
    return (mix.to(rows.dtype) @ rows).to(rows.dtype)


@torch.no_grad()
def widen_heads(model: Any, tokenizer: Any) -> None:
    """``wide256``: head_dim 256 by an exact embedding of each head (see the module doc)."""
    heads, kv, d = _shape(model)
    new_d = WIDE_HEAD_DIM
    if new_d % d or new_d <= d or d % 2:
        raise InputError(f"model: head_dim {d} cannot be widened to {new_d} (needs an even divisor of {new_d})")
    r = new_d // d
    gen = torch.Generator().manual_seed(SEED)
    half, new_half = d // 2, new_d // 2
    place = torch.tensor([r * i for i in range(half)] + [new_half + r * i for i in range(half)])
    free = torch.tensor(sorted(set(range(new_d)) - set(place.tolist())))

    def widen(lin: torch.nn.Linear, n_heads: int, scale: float, fill: bool) -> torch.nn.Linear:
        w = lin.weight.view(n_heads, d, -1)
        b = lin.bias.view(n_heads, d) if lin.bias is not None else None
        nw = torch.zeros(n_heads, new_d, w.shape[-1], dtype=w.dtype, device=w.device)
        nb = torch.zeros(n_heads, new_d, dtype=w.dtype, device=w.device) if b is not None else None
        for h in range(n_heads):
            nw[h, place] = w[h] * scale
            if nb is not None:
                nb[h, place] = b[h] * scale
            if fill:
                nw[h, free] = _matched_mixture(w[h].cpu(), free.numel(), gen).to(w.device)
                if nb is not None:
                    nb[h, free] = _matched_mixture(b[h].cpu().unsqueeze(1), free.numel(), gen).squeeze(1).to(w.device)
        out = torch.nn.Linear(lin.in_features, n_heads * new_d, bias=b is not None, device=w.device, dtype=w.dtype)
        out.weight.copy_(nw.reshape(n_heads * new_d, -1))
        if nb is not None:
            out.bias.copy_(nb.reshape(-1))
        return out

    for a in _attn_modules(model):
        a.q_proj = widen(a.q_proj, heads, math.sqrt(r), fill=False)
        a.k_proj = widen(a.k_proj, kv, 1.0, fill=True)
        a.v_proj = widen(a.v_proj, kv, 1.0, fill=True)
        o = a.o_proj
        ow = o.weight.view(o.out_features, heads, d)
        nw = torch.zeros(o.out_features, heads, new_d, dtype=ow.dtype, device=ow.device)
        nw[:, :, place] = ow
        new_o = torch.nn.Linear(heads * new_d, o.out_features, bias=o.bias is not None, device=ow.device,
                                dtype=ow.dtype)
        new_o.weight.copy_(nw.reshape(o.out_features, -1))
        if o.bias is not None:
            new_o.bias.copy_(o.bias)
        a.o_proj = new_o
        a.head_dim = new_d
        a.scaling = new_d**-0.5
    model.config.head_dim = new_d
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is None:
        raise InputError("model: no model.rotary_emb; cannot widen heads")
    model.model.rotary_emb = type(rotary)(config=model.config).to(rotary.inv_freq.device)


VARIANTS: dict[str, Callable[[Any, Any], None]] = {
    "koutlier": add_key_outliers,
    "kbias": add_key_bias,
    "wide256": widen_heads,
}


def apply_variants(model: Any, tokenizer: Any, variants: list[str]) -> Any:
    """Build the named stress variants in place, left to right; returns the model."""
    for v in variants:
        VARIANTS[v](model, tokenizer)
    return model
