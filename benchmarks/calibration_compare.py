"""Calibrated per-head precisions vs layer-by-layer widening and random per-head assignment, same bits.

Issue 5's acceptance check. On a model and corpus (default SmolLM2-135M on WikiText-2):

1. ``kvquant.calibrate.calibrate`` measures sensitivities on the LAST calibration tokens of the corpus
   and allocates for each budget (K and V together per head, and ``--kv-separate``);
2. every config is evaluated with ``kvquant.eval`` (``simulated`` protocol: fake-quantized K/V at every
   position, one forward per window) on the FIRST windows of the corpus, which the calibration did not
   see (the script checks that the ranges do not overlap), against the unquantized model;
3. baselines at each budget: (a) uniform int4 widened by upgrading whole layers 0, 1, 2, ... to int8,
   (b) random per-head assignment of the same candidates and budget, 3 seeds (mean and each seed).

Writes a markdown table (and JSON) and prints it::

    python benchmarks/calibration_compare.py --out results/calibration
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kvquant import KVQuantConfig, ModelShape
from kvquant.allocate import candidate_bits, layer_upgrade, plan_to_config, random_allocation
from kvquant.calibrate import calibrate
from kvquant.eval.metrics import DriftAccumulator, token_drift
from kvquant.eval.protocols import simulated_logits
from kvquant.models import load_model
from kvquant.outputs import write_text  # atomic: a re-run replaces results whole, never half
from kvquant.simulate import SimulatedQuantCache
from kvquant.text import load_text, token_windows, tokenize


def evaluate(model, windows, ref, cfg) -> dict[str, float]:
    acc = DriftAccumulator()
    for w, r in zip(windows, ref, strict=True):
        s = simulated_logits(model, w, SimulatedQuantCache(model, cfg))
        acc.add(token_drift(r.logits, s.logits, r.targets))
    out = acc.summary()
    # paired standard error of delta ppl (tokens treated as independent, so a lower bound)
    d = torch.cat(acc.parts["nll_q"]) - torch.cat(acc.parts["nll_ref"])
    out["delta_ppl_se"] = out["ppl"] * float(d.std() / d.numel() ** 0.5)
    out["_dnll"] = d
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default="wikitext-2")
    ap.add_argument("--budgets", default="5.5,6.0", help="average bits per element, comma-separated")
    ap.add_argument("--candidates", default="int4,int8,fp16")
    ap.add_argument("--method", default="fisher", choices=["fisher", "kl"])
    ap.add_argument("--calib-window", type=int, default=512)
    ap.add_argument("--calib-windows", type=int, default=2)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--eval-window", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=3, help="random baselines per budget (0: none)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a busy 2-core machine)")
    ap.add_argument("--out", default="results/calibration")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    loaded = load_model(args.model, dtype="float32", attn_implementation="sdpa")
    model, tok = loaded.model, loaded.tokenizer
    shape = ModelShape.of(model)
    text = load_text(args.data)
    ids = tokenize(text.text, tok)
    windows = token_windows(ids, args.eval_window, max_windows=args.eval_windows)
    eval_end = windows[-1].start + args.eval_window
    print(f"model {loaded.source}\ndata {text.source}: {ids.numel()} tokens; eval windows "
          f"{len(windows)} x {args.eval_window} = tokens [0, {eval_end})", flush=True)

    ref = [simulated_logits(model, w, None) for w in windows]  # unquantized reference, same windows
    budgets = [float(b) for b in args.budgets.split(",")]
    bits = candidate_bits(args.candidates.split(","), KVQuantConfig(), shape.head_dim)
    rows: list[dict] = []
    dnll: dict[tuple, torch.Tensor] = {}  # per-token NLL rise of each config, for paired comparisons

    def add(budget, name, cfg, note=""):
        t = time.perf_counter()
        m = evaluate(model, windows, ref, cfg)
        row = {"budget": budget, "config": name, "avg_bits": cfg.avg_bits(shape), **m, "note": note}
        dnll[(budget, name)] = row.pop("_dnll")
        rows.append(row)
        print(f"  {budget!s:>5} {name:28s} bits {row['avg_bits']:.3f}  KL {m['kl_mean']:.5f}  "
              f"dppl {m['delta_ppl']:+.4f}  top1 {m['top1']:.4f}  ({time.perf_counter() - t:.0f}s)", flush=True)
        return row

    for c in sorted(bits, key=bits.get)[:2]:
        add("-", f"uniform {c}", KVQuantConfig.load({"default": c}))
    calib_info = {}
    for budget in budgets:
        for sep in (False, True):
            name = f"calibrated{' --kv-separate' if sep else ''}"
            path = out / f"{args.model}-{budget:g}bits{'-kvsep' if sep else ''}.yaml"
            res = calibrate(model, tok, text.text, budget, candidates=args.candidates, kv_separate=sep,
                            method=args.method, calib_window=args.calib_window, calib_windows=args.calib_windows,
                            samples=args.samples, output=path, model_name=args.model, data_name=args.data,
                            command=" ".join(sys.argv), progress=True)
            if res.tokens.start < eval_end:
                raise SystemExit(f"calibration tokens [{res.tokens.start}, {res.tokens.end}) overlap the eval windows")
            calib_info = {"tokens": res.tokens.describe(), "sensitivity_seconds": res.sensitivity.meta.get("seconds"),
                          "method": res.sensitivity.method}
            add(budget, name, KVQuantConfig.from_file(path), note=path.name)
        low, high = sorted(bits, key=bits.get)[:2]
        add(budget, f"{low}, layers upgraded to {high} in order",
            plan_to_config(layer_upgrade(shape, bits, budget, low, high), shape=shape))
        rand = [add(budget, f"random seed {s}", plan_to_config(random_allocation(shape, bits, budget, s), shape=shape))
                for s in range(args.seeds)]
        if not rand:
            continue
        keys = ("avg_bits", "kl_mean", "kl_p99", "delta_ppl", "top1")
        mean = {k: statistics.fmean(r[k] for r in rand) for k in keys}
        mean["delta_ppl_se"] = statistics.fmean(r["delta_ppl_se"] for r in rand) / len(rand) ** 0.5
        rows.append({"budget": budget, "config": f"random (mean of {args.seeds})", **mean, "note": ""})

    elapsed = time.perf_counter() - t0
    ppl_ref = rows[0]["ppl_ref"]
    lines = [
        f"model: {args.model}; data: {args.data}; protocol: simulated (fake-quantized K/V at every position); "
        f"reference: the unquantized model (fp32), ppl {ppl_ref:.3f}",
        f"eval: {len(windows)} windows x {args.eval_window} tokens from the start of the corpus "
        f"(tokens [0, {eval_end})); calibration: {calib_info.get('tokens')}, "
        f"method {calib_info.get('method')} ({calib_info.get('sensitivity_seconds')} s)",
        "",
        "| budget | config | avg bits | KL mean | KL p99 | delta ppl (± 1 SE) | top-1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['budget']} | {r['config']} | {r['avg_bits']:.3f} | {r['kl_mean']:.5f} | "
                     f"{r['kl_p99']:.4f} | {r['delta_ppl']:+.3f} ± {r['delta_ppl_se']:.3f} | {r['top1']:.4f} |")
    lines += ["", "Paired on the same tokens: mean NLL rise of the calibrated config minus the baseline's, in "
              "nats/token (negative: calibrated better), ± 1 SE (tokens treated as independent):", ""]
    for budget in budgets:
        base_names = [n for (b, n) in dnll if b == budget and "layers upgraded" in n]
        rand_names = [n for (b, n) in dnll if b == budget and n.startswith("random seed")]
        for cal in ("calibrated", "calibrated --kv-separate"):
            c = dnll[(budget, cal)]
            parts = []
            for label, names in (("layers in order", base_names), (f"random ({len(rand_names)} seeds)", rand_names)):
                if not names:
                    continue
                other = torch.stack([dnll[(budget, n)] for n in names]).mean(0)
                diff = c - other
                parts.append(f"vs {label} {float(diff.mean()):+.4f} ± {float(diff.std() / diff.numel() ** 0.5):.4f}")
            lines.append(f"- {budget} bits, {cal}: " + "; ".join(parts))
    lines.append("")
    lines.append(f"total {elapsed:.0f} s; command: python benchmarks/calibration_compare.py {' '.join(sys.argv[1:])}")
    table = "\n".join(lines)
    print(table)
    write_text(out / "compare.md", table + "\n")
    write_text(out / "compare.json", json.dumps({"args": vars(args), "rows": rows, "seconds": elapsed}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
