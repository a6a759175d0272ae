"""Which tokens carry a config's Δppl: per-token exact-decode drift on chosen windows of a recipe.

    python research/token_drift.py research/recipes/lowbit-smollm2.yaml --windows 6,2 \\
        --configs research/configs/tqc3-r3l64s1-u.yaml,hf-hqq-int4 --top 8 --json drift.json

Runs the recipe's protocol as ``kvquant eval`` does (same windows, prefill, decode steps, reference), but only on
the listed windows (numbered from 1, as in the reports), and prints per window and config the mean
``nll_q - nll_ref`` (the window's log-ppl change), KL and the change of the output distribution's entropy
(positive: flatter than the reference's), then the ``--top`` tokens with the largest
``nll_q - nll_ref`` of any config, each config's value beside them. A window's Δppl is the mean over its ~63
scored tokens: a few tokens often make most of it. ``--json`` keeps every token's values. ``--by-copy`` also splits
each config's summed nll change by how far back the target's bigram last occurred in the window (an induction
head's copy: within the fp16 residual, further back, or never), to tell copied tokens from the rest.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from kvquant.eval.metrics import token_drift
from kvquant.eval.protocols import decode_logits
from kvquant.eval.recipe import RecipeError, load_recipe
from kvquant.eval.runner import _AttnGuard, _quiet_transformers, build_methods
from kvquant.models import load_model
from kvquant.text import load_text, token_windows, tokenize

COPY_BINS = ((1, 16), (16, 256), (256, 1 << 30))  # distances to the bigram's previous occurrence (--by-copy)


def copy_distance(ids: list[int], p: int) -> int | None:
    """Distance from target position ``p`` back to the last earlier position ``j`` with the same bigram
    (``ids[j - 1: j + 1] == ids[p - 1: p + 1]``: what an induction head copies from), or None."""
    for j in range(p - 1, 0, -1):
        if ids[j] == ids[p] and ids[j - 1] == ids[p - 1]:
            return p - j
    return None


def copy_bin(dist: int | None) -> str:
    if dist is None:
        return "no earlier bigram"
    lo, hi = next((lo, hi) for lo, hi in COPY_BINS if lo <= dist < hi)
    return f"copied from {lo}-{hi - 1} back" if hi < 1 << 30 else f"copied from >= {lo} back"


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of each row's next-token distribution, float64 ``[n]``."""
    lp = torch.log_softmax(logits.double(), -1)
    return -(lp.exp() * lp).sum(-1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--windows", required=True, help="comma list of window numbers (from 1), e.g. 6,2")
    ap.add_argument("--configs", required=True, help="comma list of configs (files, presets, baselines)")
    ap.add_argument("--model", default=None, help="override the recipe's model (e.g. smollm2-135m+kbias)")
    ap.add_argument("--top", type=int, default=8, help="tokens to list per window")
    ap.add_argument("--json", default=None, help="write every token's values here")
    ap.add_argument("--by-copy", action="store_true",
                    help="also split each config's summed nll change by how far back the target's bigram last "
                         "occurred in the window (copied tokens vs the rest)")
    args = ap.parse_args(argv)
    wins = [int(x) for x in args.windows.split(",")]
    if any(w < 1 for w in wins):
        raise SystemExit("--windows: window numbers start at 1")
    over = {"max_windows": max(wins), "configs": ["reference", *args.configs.split(",")]}
    if args.model:
        over["model"] = args.model
    r = load_recipe(args.recipe, over)
    if r.protocol != ["decode"]:
        raise RecipeError(f"protocol: {r.protocol} given; this tool runs the decode protocol only")
    torch.manual_seed(r.seed)
    if r.threads:
        torch.set_num_threads(r.threads)
    text = load_text(r.data)
    lm = load_model(r.model, dtype=r.dtype, device=r.device, progress=False)
    model, tok = lm.model, lm.tokenizer
    ids = tokenize(text.text, tok)
    methods, skipped = build_methods(r)
    if skipped:
        raise SystemExit(f"--configs: {skipped[0]['config']} is unavailable: {skipped[0]['reason']}")
    guard = _AttnGuard(model)
    windows = token_windows(ids, r.window, r.stride, r.max_windows, tok.bos_token_id if r.bos else None,
                            r.prefill + 1)  # fmt: skip
    out: dict[str, dict] = {}
    by_copy: dict[str, dict[str, list[float]]] = {}
    with _quiet_transformers():
        for n in wins:
            w = windows[n - 1]
            ref, per = None, {}
            for m in methods:
                sc = decode_logits(model, w, m.decode_cache(model), r.prefill, r.decode_chunk)
                if m.uses_kvquant_attention:
                    guard.restore()
                if ref is None:
                    ref = sc.logits
                    continue
                d = token_drift(ref, sc.logits, sc.targets)
                d["entropy_ref"], d["entropy_q"] = entropy(ref), entropy(sc.logits)
                per[m.name] = d
                out[f"{n}|{m.name}"] = {"targets": [tok.decode([t]) for t in sc.targets.tolist()],
                                        **{k: d[k].tolist() for k in ("nll_ref", "nll_q", "kl", "top1", "entropy_ref",
                                                                      "entropy_q")}}  # fmt: skip
                if args.by_copy:
                    x = w.ids.tolist()
                    for i, delta in enumerate((d["nll_q"] - d["nll_ref"]).tolist()):
                        by_copy.setdefault(m.name, {}).setdefault(copy_bin(copy_distance(x, w.score_from + i)),
                                                                  []).append(delta)  # fmt: skip
                dn = float((d["nll_q"] - d["nll_ref"]).mean())
                dh = float((d["entropy_q"] - d["entropy_ref"]).mean())
                print(f"window {n} {m.name}: mean nll_q - nll_ref {dn:+.4f} (Δppl {100 * math.expm1(dn):+.2f}%), "
                      f"KL {d['kl'].mean():.4f}, entropy {dh:+.4f} nats vs the reference", flush=True)  # fmt: skip
            targets = out[f"{n}|{methods[1].name}"]["targets"]
            worst = torch.stack([d["nll_q"] - d["nll_ref"] for d in per.values()]).amax(0)
            for i in worst.argsort(descending=True)[: args.top].tolist():
                vals = "  ".join(f"{Path(k).stem} {float(d['nll_q'][i] - d['nll_ref'][i]):+.3f}"
                                 for k, d in per.items())  # fmt: skip
                nref = float(next(iter(per.values()))["nll_ref"][i])
                print(f"   token {i:3d} {targets[i]!r:14} nll_ref {nref:5.2f}   {vals}")
    for name, bins in by_copy.items():
        total = sum(len(v) for v in bins.values())
        print(f"{name}: nll change by copy distance (sum over tokens; / all {total} scored tokens)")
        for b in sorted(bins, key=lambda b: (b.startswith("no"), len(b), b)):
            v = bins[b]
            print(f"   {b:28} {len(v):5d} tokens  sum {sum(v):+8.3f}  mean {sum(v) / len(v):+.4f}  "
                  f"share {sum(v) / total:+.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
