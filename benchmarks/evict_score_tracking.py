"""The cost of per-key score tracking (H2O / TOVA) on decode tok/s, against the same cache without it.

    python benchmarks/evict_score_tracking.py                      # 6 layers, head_dim 64, 2K context, keep 0.5
    python benchmarks/evict_score_tracking.py --policies h2o --context 4096 --clock cpu --json out.json

For each decode-time policy, three caches with the same config (precision, keep, sinks, window) and the same
prefill selection (the policy's own prompt scores), timed in interleaved rounds on the same model and tokens:

* ``untracked``: the kept tokens, new tokens appended (the policy's tracking switched off after prefill);
* ``mass only``: the attention also returns each kept key's probability mass and the scores are updated,
  but nothing is replaced (the budget lifted);
* ``tracked``: the full policy: mass + one token replaced per (row, KV head) and step (``choose_slots``, an
  in-place quantized write per head, one host read of the targets per layer).

Ratios are tok/s relative to ``untracked`` (median over rounds, and the best round). The torch attention
path (CPU); on CUDA tracked layers take the torch path too (the Triton kernels do not return per-key mass).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

import kvquant

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_throughput import CLOCKS, build, decode_tps  # noqa: E402

VARIANTS = ("untracked", "mass only", "tracked")


def make_cache(model, config: kvquant.KVQuantConfig, variant: str) -> kvquant.QuantizedKVCache:
    """A cache whose layers run ``variant`` of their policy (see the module doc)."""
    cache = kvquant.QuantizedKVCache(model, config)
    if variant == "tracked":
        return cache
    for layer in cache.layers:
        if layer.policy is not None:
            layer.policy = _Variant(layer.policy, variant)
    return cache


class _Variant:
    """A policy that scores the prompt like ``policy``, then (``untracked``) stops tracking or (``mass only``)
    tracks without a budget: the switch is applied after the prompt's write, by :func:`after_prefill`."""

    def __init__(self, policy, variant: str) -> None:
        self.policy, self.variant = policy, variant

    def __getattr__(self, name):
        return getattr(self.policy, name)


def after_prefill(cache: kvquant.QuantizedKVCache) -> None:
    for layer in cache.layers:
        p = layer.policy
        if not isinstance(p, _Variant):
            continue
        slots = layer.store.slots
        if p.variant == "untracked":
            layer.policy = dataclasses.replace(p.policy, tracking=None)
            slots.tracking, slots.score, slots.cap = None, None, None
        else:
            layer.policy = p.policy
            slots.cap = torch.full_like(slots.cap, torch.iinfo(slots.cap.dtype).max)


def timed(model, config, variant: str, args) -> tuple[float, int]:
    """(decode tok/s, tokens held by layer 0, head 0 of row 0 at the end)."""
    cache = make_cache(model, config, variant)
    real_forward = model.forward
    calls = {"n": 0}

    def forward(*a, **k):  # switch the variant on right after the prefill forward
        out = real_forward(*a, **k)
        calls["n"] += 1
        if calls["n"] == 1:
            after_prefill(cache)
        return out

    model.forward = forward
    try:
        tps = decode_tps(model, cache, args.context, args.tokens, args.batch, args.clock)
    finally:
        del model.forward
    return tps, int(cache.layers[0].store.slots.counts()[0, 0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--precision", default="int8-token")
    ap.add_argument("--keep", type=float, default=0.5)
    ap.add_argument("--policies", default="h2o,tova")
    ap.add_argument("--clock", choices=list(CLOCKS), default="cpu")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    model = build(args.layers, args.head_dim, args.heads, args.kv_heads, args.vocab)
    kvquant.wrap(model, args.precision)
    head = (f"model: {args.layers} layers, {args.heads} heads / {args.kv_heads} KV heads, head_dim {args.head_dim}; "
            f"{args.precision}, keep {args.keep}; context {args.context}, batch {args.batch}, {args.tokens} timed "
            f"steps, {args.repeats} interleaved rounds, torch threads {torch.get_num_threads()}, clock {args.clock}")
    print(head)
    results = {"setup": head, "args": vars(args), "policies": {}}
    for policy in args.policies.split(","):
        config = kvquant.KVQuantConfig.from_dict(
            {"default": args.precision, "evict": {"policy": policy, "keep": args.keep}})
        tps: dict[str, list[float]] = {v: [] for v in VARIANTS}
        held = {}
        for _ in range(args.repeats):  # interleaved: fair on a machine whose load changes
            for v in VARIANTS:
                torch.manual_seed(0)
                t, held[v] = timed(model, config, v, args)
                tps[v].append(t)
        row = {}
        for v in VARIANTS:
            ratios = [a / b for a, b in zip(tps[v], tps["untracked"], strict=True)]
            row[v] = {"tok_s": tps[v], "median_ratio": statistics.median(ratios),
                      "best_ratio": max(tps[v]) / max(tps["untracked"]), "tokens_held_layer0_head0": held[v]}
            print(f"{policy:5s} {v:10s} {statistics.median(tps[v]):8.2f} tok/s (median)  "
                  f"{row[v]['median_ratio']:.3f}x untracked (median of per-round ratios; "
                  f"best-of {row[v]['best_ratio']:.3f}x)"
                  f"  rounds: {', '.join(f'{x:.1f}' for x in tps[v])}; holds {held[v]} tokens (layer 0, head 0)")
        results["policies"][policy] = row
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
