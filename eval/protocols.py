"""The two perplexity protocols, and free-generation drift. Every number a report shows names its protocol.

``simulated`` (the KVQuant paper's protocol)
    The window goes through a cache whose ``update`` returns quantize-then-dequantized K/V at every position,
    the current chunk included: every attention layer sees quantized K/V everywhere, even for the token's own
    position. Targets from the window's ``score_from`` on are scored. Static scales (``int8``, ``fp8-*``, the
    fp8 baseline) must not see the future: the first ``calibrate`` tokens go through as one forward (the
    "prefill", where static scales are taken, as a real cache takes them), the rest as a second forward that
    reuses them; a config's ``scales_file`` replaces the prefill's scales. The reference runs the same two
    forwards. Cheap: two forwards.

``decode`` (as generation uses the cache)
    Prefill the first ``prefill`` tokens, then feed the rest ``chunk`` tokens at a time through the real cache
    and score the next-token predictions of those steps only (targets ``prefill + 1 ...``). A prefill's own
    logits are not scored: kvquant attends its fresh chunk in full precision and transformers' QuantizedCache
    returns unquantized K/V on its first call, so they would measure nothing. With ``chunk = 1`` this is exactly
    token-by-token generation; with ``chunk > 1`` tokens inside one chunk see each other unquantized (kvquant) —
    faster, and slightly optimistic. The reference runs the same steps with an unquantized ``DynamicCache``.
    Windows run one at a time (batch 1): batching them would change numbers (reference logits move slightly with
    the batch size, and a quantized cache's more once a rounding flips), and static scales, baselines such as HQQ
    axis 0 and HQQ's optimizer look at the whole batch.

``generation`` (reported, not asserted)
    Greedy continuations of N prompts with each method's real cache against the reference's continuations:
    token agreement and the distribution of the first divergence position.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from kvquant.models import model_device
from kvquant.text import Window
from kvquant.transformers_compat import cache_kw

PROTOCOLS = {
    "simulated": "fake-quantized K/V at every position; static scales from the prefill (or a scales file), "
    "never from later tokens",
    "decode": "prefill, then score the remaining tokens step by step through the real cache",
}


@dataclass
class Scored:
    """Logits [n, vocab] (float32, CPU) of the scored positions, their targets [n], and the forward time."""

    logits: torch.Tensor
    targets: torch.Tensor
    seconds: float
    cache: Any


@torch.no_grad()
def simulated_logits(model: Any, window: Window, cache: Any, calibrate: int = 0) -> Scored:
    """The window through ``cache`` in two forwards: tokens ``[0, calibrate)``, then the rest (see module doc).

    ``calibrate = 0`` (or >= the window) runs one forward over the whole window: static scales then come from
    every token of it, later ones included; the eval runner always passes the recipe's prefill.
    """
    dev = model_device(model)
    ids = window.ids.unsqueeze(0).to(dev)
    n = ids.shape[1]
    cuts = [0, calibrate, n] if 0 < calibrate < n else [0, n]
    t0 = time.perf_counter()
    pieces = [
        model(ids[:, a:b], **cache_kw(cache), use_cache=True).logits[0].float().cpu()
        for a, b in zip(cuts, cuts[1:], strict=False)
    ]
    logits = torch.cat(pieces)[window.score_from - 1 : -1]
    dt = time.perf_counter() - t0
    return Scored(logits, window.ids[window.score_from :].clone(), dt, cache)


@torch.no_grad()
def decode_logits(model: Any, window: Window, cache: Any, prefill: int, chunk: int = 1, progress: Any = None) -> Scored:
    """Prefill ``prefill`` tokens, then score the rest ``chunk`` tokens per forward (see module doc)."""
    n = int(window.ids.numel())
    if not 1 <= prefill < n - 1:
        raise ValueError(f"prefill: {prefill} must be >= 1 and < window - 1 ({n - 1})")
    if window.score_from < prefill + 1:
        raise ValueError(f"decode: window {window.index} scores from {window.score_from}, before prefill + 1")
    dev = model_device(model)
    ids = window.ids.unsqueeze(0).to(dev)
    t0 = time.perf_counter()
    model(ids[:, :prefill], **cache_kw(cache), use_cache=True, logits_to_keep=1)
    pieces = []
    for s in range(prefill, n - 1, chunk):
        e = min(s + chunk, n - 1)
        out = model(ids[:, s:e], **cache_kw(cache), use_cache=True)
        pieces.append(out.logits[0].float().cpu())
        if progress is not None:
            progress.update(e - s)
    dt = time.perf_counter() - t0
    logits = torch.cat(pieces)  # predictions for targets prefill+1 .. n-1
    first = window.score_from - (prefill + 1)
    return Scored(logits[first:], window.ids[window.score_from :].clone(), dt, cache)


@torch.no_grad()
def greedy_continuation(model: Any, prompt: torch.Tensor, new_tokens: int, cache: Any) -> list[int]:
    """``new_tokens`` greedy tokens after ``prompt`` (1-D), EOS suppressed so all runs have the same length."""
    dev = model_device(model)
    ids = prompt.unsqueeze(0).to(dev)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        **cache_kw(cache),
        pad_token_id=getattr(model.generation_config, "pad_token_id", None)
        or getattr(model.generation_config, "eos_token_id", None)
        or 0,
    )
    return out[0, ids.shape[1] :].tolist()
