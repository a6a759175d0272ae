"""How much of a config's Δppl its KL predicts: per window, the change of mean nll against the mean KL.

    python research/nll_excess.py "tqc4 1-24=R3/results.json=tqc4-v72-r15s1-s" \\
        "tqc4 1-24=R1/results.json=tqc4-v72-r15s1-s" "kivi 1-8=U8/results.json=int4-kivi"

Each argument is ``LABEL=RESULTS_JSON=CONFIG`` (a ``kvquant eval`` results file and a config name in it, without
``.yaml``); arguments with the same label are pooled (e.g. three runs over windows 1-8, 9-16 and 17-24).

Why: if the scored text were drawn from the reference model's own next-token distribution ``p``, the expected
change of nll under a quantized model ``q`` would be exactly ``KL(p || q)``, the recipe's KL column. So a window's
``Δnll = log(ppl_q / ppl_ref)`` is ``KL`` plus an *excess*: how the quantized model's change happens to line up with
the real text. The excess averages to zero for a change unrelated to the text, and it has a sign when the change is
systematically closer to the text (negative) or further from it (positive). ``Δppl % ~ 100 * (KL + excess)``: with
zero excess, a target of ``Δppl <= +0.25%`` needs ``KL <= ~0.0025``.

Prints, per label: the number of windows, mean ± SE of Δnll, KL, and Δnll - KL.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from kvquant.eval.metrics import standard_error


def windows_of(path: str, config: str) -> list[dict]:
    """The per-window rows of ``config`` (file name without ``.yaml``, or a baseline name) in a results file."""
    data = json.loads(Path(path).read_text())
    for row in data["results"]:
        if row["kind"] != "reference" and Path(row["config"]).name.removesuffix(".yaml") == config:
            if not row.get("windows"):
                raise SystemExit(f"{path}: {config} has no per-window values")
            return row["windows"]
    names = [Path(r["config"]).name.removesuffix(".yaml") for r in data["results"] if r["kind"] != "reference"]
    raise SystemExit(f"{path}: no config {config!r} (it has {', '.join(names)})")


def mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and standard error (:func:`kvquant.eval.metrics.standard_error`, the eval's own; NaN for one value)."""
    se = standard_error(xs)
    return sum(xs) / len(xs), float("nan") if se is None else se


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="LABEL=RESULTS_JSON=CONFIG (same label: pooled)")
    args = ap.parse_args(argv)
    pooled: dict[str, list[dict]] = {}
    for spec in args.runs:
        parts = spec.split("=", 2)  # a baseline's name may hold '=' itself (hf-hqq-int4:residual=8)
        if len(parts) != 3:
            raise SystemExit(f"{spec!r}: expected LABEL=RESULTS_JSON=CONFIG")
        label, path, config = parts
        pooled.setdefault(label, []).extend(windows_of(path, config))
    print("| label | windows | Δnll | KL | Δnll - KL (excess) |")
    print("|---|---:|---:|---:|---:|")
    for label, rows in pooled.items():
        dnll = [math.log(w["ppl"] / w["ppl_ref"]) for w in rows]
        kl = [w["kl_mean"] for w in rows]
        cols = [mean_se(dnll), mean_se(kl), mean_se([a - b for a, b in zip(dnll, kl, strict=True)])]
        print(f"| {label} | {len(rows)} | " + " | ".join(f"{m:+.4f} ± {s:.4f}" for m, s in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
