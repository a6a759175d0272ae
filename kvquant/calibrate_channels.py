"""Per-channel key widths for ``tqc-<widths>`` keys, measured on any model from calibration text.

After RoPE a few channel pairs of a key head carry most of the query energy. :func:`channel_weights` reads,
per (layer, KV head), ``E[q_j^2]`` of the head's query group times ``var(k_j)`` of its keys (post-RoPE, the
first ``sink_tokens`` of each window left out) from plain forwards over calibration windows, by wrapping the
model's attention function; :func:`tqc_names` turns them into one ``tqc-<widths>`` precision per head at a
given average width with :func:`kvquant.quantizers.allocate_widths` (the same bits per row as ``tq<bits>``).

Library use::

    weights = channel_weights(model, ids)          # ids[n, T]
    names = tqc_names(weights, bits=4)             # names[layer][head] -> "tqc-5444..."
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .errors import InputError
from .quantizers import allocate_widths, channel_precision
from .shape import ModelShape


@contextlib.contextmanager
def _attention_tap(model: Any, tap: Any) -> Iterator[None]:
    """Route the model's attention through ``tap(module, q, k)`` (then the original function), for the block."""
    impl = model.config._attn_implementation
    restore = None
    if impl not in ALL_ATTENTION_FUNCTIONS:  # eager: tap SDPA instead (the same attention, numerically)
        restore, impl = impl, "sdpa"
        model.set_attn_implementation(impl)
    inner = ALL_ATTENTION_FUNCTIONS[impl]

    def hooked(module: Any, q: torch.Tensor, k: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        tap(module, q, k)
        return inner(module, q, k, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[impl] = hooked
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS[impl] = inner
        if restore is not None:
            model.set_attn_implementation(restore)


@torch.no_grad()
def channel_weights(model: Any, ids: torch.Tensor, sink_tokens: int = 4) -> list[torch.Tensor]:
    """Per layer ``[kv_heads, head_dim]``: ``E[q_j^2]`` of each KV head's query group times ``var(k_j)`` of its
    keys, over the windows ``ids[n, T]`` (positions ``sink_tokens`` on). Raises :class:`InputError` when a
    window is too short or a layer's attention was never seen."""
    shape = ModelShape.of(model)
    if ids.dim() != 2 or ids.shape[1] < sink_tokens + 2:
        raise InputError(f"calibration windows: need [n, T] with T > {sink_tokens + 1} tokens, got {list(ids.shape)}")
    sums: dict[int, list[torch.Tensor]] = {}

    def tap(module: Any, q: torch.Tensor, k: torch.Tensor) -> None:
        h, d = k.shape[1], k.shape[-1]
        qq = q[:, :, sink_tokens:].double()
        qq = qq.reshape(qq.shape[0], h, -1, qq.shape[2], d)  # query heads grouped by KV head (GQA order)
        kk = k[:, :, sink_tokens:].double()
        stats = [(qq**2).mean(dim=(0, 2, 3)), kk.var(dim=2).mean(dim=0)]
        prev = sums.get(module.layer_idx)
        sums[module.layer_idx] = stats if prev is None else [a + b for a, b in zip(prev, stats, strict=True)]

    dev = next(model.parameters()).device
    with _attention_tap(model, tap):
        for w in range(ids.shape[0]):
            model(input_ids=ids[w : w + 1].to(dev), use_cache=False)
    missing = [i for i in range(shape.num_layers) if i not in sums]
    if missing:
        raise InputError(f"channel weights: the attention of layers {missing} was not seen (an attention "
                         "implementation kvquant cannot tap)")
    return [(sums[i][0] * sums[i][1]).float().cpu() for i in range(shape.num_layers)]


def tqc_names(weights: list[torch.Tensor], bits: int) -> list[list[str]]:
    """``names[layer][head]``: the ``tqc-<widths>`` precision spending ``bits * head_dim`` bits per key row of
    that head where its :func:`channel_weights` say the scores need them."""
    return [[channel_precision(allocate_widths(w[h], bits * int(w.shape[1]))) for h in range(w.shape[0])]
            for w in weights]
