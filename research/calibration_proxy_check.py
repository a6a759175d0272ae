"""Does the Fisher estimate rank heads like the measured KL? Spearman correlation on real calibration text.

Measures ``method="kl"`` (one forward per unit: exact, slow) on a subset of layers and ``method="fisher"``
(a few backward passes for all units) on the same calibration tokens (the END of the corpus), and prints
the rank correlation per candidate, over K and V units together and apart::

    python research/calibration_proxy_check.py --layers-every 3 --window 512
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from kvquant.models import load_model
from kvquant.outputs import write_text  # atomic: a re-run replaces results whole, never half
from kvquant.sensitivity import calibration_windows, estimate_fisher, measure_kl, spearman
from kvquant.text import load_text, tokenize


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default="wikitext-2")
    ap.add_argument("--candidates", default="int4,fp16", help="the most precise one is the base")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--layers-every", type=int, default=3, help="measure KL on every N-th layer (1: all)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="research/notes/calibration/proxy_check.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype="float32")
    model, tok = loaded.model, loaded.tokenizer
    text = load_text(args.data)
    tokens = calibration_windows(tokenize(text.text, tok), args.window, args.windows)
    cands = args.candidates.split(",")
    base = cands[-1]
    L = model.config.num_hidden_layers
    subset = list(range(0, L, args.layers_every))
    t = time.perf_counter()
    fisher = estimate_fisher(model, tokens.ids, cands, base, samples=args.samples)
    t_f = time.perf_counter() - t
    t = time.perf_counter()
    kl = measure_kl(model, tokens.ids, cands, base, layers_subset=subset,
                    progress=lambda d, n: print(f"kl {d}/{n}", flush=True) if d % 10 == 0 else None)
    t_k = time.perf_counter() - t
    result = {"model": args.model, "data": args.data, "tokens": tokens.describe(), "layers": subset,
              "fisher_seconds": round(t_f, 1), "kl_seconds": round(t_k, 1), "samples": args.samples, "spearman": {}}
    for c in cands:
        if c == base:
            continue
        a, b = kl.values[c][subset], fisher.values[c][subset]
        result["spearman"][c] = {
            "all": spearman(a, b),
            "K": spearman(a[..., 0], b[..., 0]),
            "V": spearman(a[..., 1], b[..., 1]),
            "units": int(a.numel()),
        }
        top = max(1, a.numel() // 5)
        ka = set(torch.topk(a.flatten(), top).indices.tolist())
        kb = set(torch.topk(b.flatten(), top).indices.tolist())
        result["spearman"][c]["top20pct_overlap"] = len(ka & kb) / top
    result["kl"] = {c: kl.values[c].tolist() for c in cands}
    result["fisher"] = {c: fisher.values[c].tolist() for c in cands}
    write_text(args.out, json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("kl", "fisher")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
