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

Every decode step is timed on its own; the ratio is the median step time of ``untracked`` over that of the
variant (medians over all steps of all rounds: robust to the bursts of a shared machine), with the
interquartile range of the step times. Then, per layer and step, the cost of each operation tracking adds
(min over repeats). The torch attention path (CPU); on CUDA tracked layers take the torch path too (the
Triton kernels do not return per-key mass).
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
from decode_throughput import CLOCKS, build  # noqa: E402

from kvquant.transformers_compat import cache_kw

VARIANTS = ("untracked", "mass only", "tracked")


def after_prefill(cache: kvquant.QuantizedKVCache, variant: str) -> None:
    """Switch every evicting layer of ``cache`` (already holding the policy's prompt selection) to ``variant``:
    ``untracked`` stops tracking (new tokens appended), ``mass only`` lifts the budget (scores updated, nothing
    replaced), ``tracked`` changes nothing."""
    for layer in cache.layers:
        slots = layer.store.slots if layer.store is not None else None
        if layer.policy is None or slots is None or variant == "tracked":
            continue
        if variant == "untracked":
            layer.policy = dataclasses.replace(layer.policy, tracking=None)
            slots.tracking, slots.score, slots.cap = None, None, None
        else:
            slots.cap = torch.full_like(slots.cap, torch.iinfo(slots.cap.dtype).max)


def step_times(model, config, variant: str, args) -> tuple[list[float], int]:
    """Seconds of each timed decode step (after a prefill of --context tokens and one warm-up step), and the
    tokens layer 0 / KV head 0 / row 0 holds at the end."""
    cache = kvquant.QuantizedKVCache(model, config)
    now = CLOCKS[args.clock]
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.context))
    times = []
    with torch.no_grad():
        out = model(ids, **cache_kw(cache), use_cache=True)
        after_prefill(cache, variant)
        nxt = out.logits[:, -1:].argmax(-1)
        for i in range(args.tokens + 1):
            t0 = now()
            out = model(nxt, **cache_kw(cache), use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            if i:  # the first step is a warm-up
                times.append(now() - t0)
    return times, int(cache.layers[0].store.slots.counts()[0, 0])


def op_costs(args) -> dict[str, float]:
    """Per layer and step, the operations tracking adds (min over repeats: robust to a loaded machine), at
    --context x keep history slots: the attention with and without per-key mass, choosing the replaced slots,
    writing one token in place per head vs appending it."""
    from kvquant.config import KVPrecision
    from kvquant.evict import choose_slots
    from kvquant.kernels.attention_torch import attend_torch
    from kvquant.store import LayerStore

    cfg = kvquant.KVQuantConfig.load(args.precision)
    H, D, rep = args.kv_heads, args.head_dim, args.heads // args.kv_heads
    S = int(args.context * args.keep)
    now = CLOCKS[args.clock]

    def cost(fn, n: int = 200) -> float:
        fn()
        best = float("inf")
        for _ in range(n):
            t0 = now()
            fn()
            best = min(best, now() - t0)
        return best * 1e6

    def store() -> LayerStore:
        st = LayerStore([KVPrecision(args.precision, args.precision)] * H, cfg, D, 1, torch.device("cpu"))
        k = torch.randn(1, H, S, D)
        st.append_kept(k, k, torch.ones(1, H, S, dtype=torch.bool), score=torch.rand(1, H, S), tracking="accumulate",
                       cap=torch.full((1, H), S))  # fmt: skip
        return st

    st = store()
    q, x = torch.randn(1, H * rep, 1, D), torch.randn(1, H, 1, D)
    mass = torch.zeros(1, H, S)
    s = st.slots
    target = torch.randint(8, S - 64, (1, H))
    write = torch.ones(1, H, dtype=torch.bool)
    appending = store()
    return {
        "attention_us": cost(lambda: attend_torch(q, x, x, st, S, None, D**-0.5)),
        "attention_with_mass_us": cost(lambda: attend_torch(q, x, x, st, S, None, D**-0.5, key_mass=mass)),
        "choose_slots_us": cost(lambda: choose_slots(s.pos, s.score, s.cap, s.first, s.seen + 1, 4, 32)),
        "overwrite_us": cost(lambda: st.overwrite(x, x, target, write)),
        "append_us": cost(lambda: appending.append(x, x), n=64),
    }


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
        steps: dict[str, list[float]] = {v: [] for v in VARIANTS}
        held = {}
        for _ in range(args.repeats):  # interleaved: fair on a machine whose load changes
            for v in VARIANTS:
                torch.manual_seed(0)
                t, held[v] = step_times(model, config, v, args)
                steps[v] += t
        row = {}
        base = statistics.median(steps["untracked"])
        for v in VARIANTS:
            med = statistics.median(steps[v])
            q1, _, q3 = statistics.quantiles(steps[v], n=4)
            row[v] = {"median_step_ms": med * 1e3, "iqr_step_ms": [q1 * 1e3, q3 * 1e3], "tok_s": args.batch / med,
                      "ratio_vs_untracked": base / med, "steps": len(steps[v]),
                      "tokens_held_layer0_head0": held[v]}  # fmt: skip
            print(f"{policy:5s} {v:10s} {args.batch / med:8.2f} tok/s  {base / med:.3f}x untracked  (median of "
                  f"{len(steps[v])} steps {med * 1e3:.2f} ms, IQR {q1 * 1e3:.2f}-{q3 * 1e3:.2f}); "
                  f"holds {held[v]} tokens (layer 0, head 0)")
        results["policies"][policy] = row
    results["op_costs_per_layer_step"] = costs = op_costs(args)
    print("per layer and step (min of repeats): " + ", ".join(f"{k} {v:.0f}" for k, v in costs.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
