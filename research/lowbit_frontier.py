"""Frontier of KV bytes held vs quality from one or more ``kvquant eval`` runs of the same recipe.

    python research/lowbit_frontier.py RUN_DIR [RUN_DIR ...] --out research/notes/lowbit-smollm2

Merges the runs' ``results.json`` (they must score the same tokens: each run's reference row must have
the same per-window perplexities), then writes ``results.json`` (merged rows), ``frontier.md`` (a table
sorted by bytes held, with standard errors over windows) and ``frontier.png`` (Δppl % and KL against
the KV bytes the cache held at the scored length, as a fraction of an FP16 cache of the same tokens).

``--budget X`` (repeatable) adds, for each budget, the best config (lowest KL) of each family that holds
at most ``X`` times FP16's bytes, and the paired per-window difference of the two best (A - B: mean and
standard error over windows), i.e. whether one beats the other beyond one standard error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any


def load(runs: list[Path]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Merged (meta, ok decode rows) of the runs; raises ValueError when they did not score the same tokens."""
    meta: dict[str, Any] = {}
    rows: dict[str, dict[str, Any]] = {}
    ref_windows = None
    for run in runs:
        payload = json.loads((run / "results.json").read_text(encoding="utf-8"))
        meta = meta or payload["meta"]
        for r in payload["results"]:
            if r.get("status") != "ok":
                continue
            if r["kind"] == "reference":
                w = [x["ppl"] for x in r.get("windows", [])]
                # same tokens: equal up to float32 summation order (other tokens move a window's ppl by far more)
                if ref_windows is not None and (
                    len(w) != len(ref_windows)
                    or any(abs(a - b) > 1e-5 * abs(b) for a, b in zip(w, ref_windows, strict=False))
                ):
                    raise ValueError(f"{run}: its reference scored other tokens than the first run's")
                ref_windows = w
            rows.setdefault(r["config"], r)
    return meta, list(rows.values())


def paired(a: dict[str, Any], b: dict[str, Any], key: str) -> tuple[float, float | None]:
    """Mean and standard error over windows of the per-window difference ``a - b`` of ``key``."""
    d = [wa[key] - wb[key] for wa, wb in zip(a["windows"], b["windows"], strict=True)]
    n = len(d)
    mean = sum(d) / n
    if n < 2:
        return mean, None
    var = sum((x - mean) ** 2 for x in d) / (n - 1)
    return mean, math.sqrt(var / n)


def family(r: dict[str, Any]) -> str:
    name = Path(r["config"]).stem
    if r["kind"] != "kvquant":
        return r["kind"]
    return "codebook" if name.startswith("tq") else "uniform"


def label(r: dict[str, Any]) -> str:
    return Path(r["config"]).stem if r["config"].endswith((".yaml", ".yml", ".json")) else r["config"]


def table(rows: list[dict[str, Any]], ref_ppl: float) -> str:
    out = [
        "| config | family | bits/elem (long ctx) | KV held vs FP16 | Δppl % | KL mean | top-1 |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: r["kv_vs_fp16"]):
        if r["kind"] == "reference":
            continue
        dp = 100 * r["delta_ppl"] / ref_ppl
        dse = r.get("delta_ppl_se")
        kse = r.get("kl_mean_se")
        tse = r.get("top1_se")
        out.append(
            f"| {label(r)} | {family(r)} | {r['avg_bits']:.2f} | {r['kv_vs_fp16']:.3f}x | "
            f"{dp:+.2f}{'' if dse is None else f' ± {100 * dse / ref_ppl:.2f}'} | "
            f"{r['kl_mean']:.4f}{'' if kse is None else f' ± {kse:.4f}'} | "
            f"{r['top1']:.3f}{'' if tse is None else f' ± {tse:.3f}'} |"
        )
    return "\n".join(out)


def budgets(rows: list[dict[str, Any]], limits: list[float]) -> str:
    lines = []
    for x in limits:
        best = {}
        for r in rows:
            if r["kind"] == "reference" or r["kv_vs_fp16"] > x:
                continue
            f = family(r)
            if f not in best or r["kl_mean"] < best[f]["kl_mean"]:
                best[f] = r
        names = ", ".join(f"{f}: {label(r)} (KL {r['kl_mean']:.4f}, {r['kv_vs_fp16']:.3f}x)" for f, r in best.items())
        lines.append(f"- at <= {x:.2f}x FP16 bytes, best per family: {names or 'none'}")
        if "codebook" in best and "uniform" in best:
            a, b = best["codebook"], best["uniform"]
            for key in ("kl_mean", "ppl"):
                m, se = paired(a, b, key)
                verdict = "n/a" if se is None else ("beyond one SE" if abs(m) > se else "within one SE")
                lines.append(
                    f"  - {label(a)} - {label(b)}, {key}: {m:+.4f} ± {se if se is not None else float('nan'):.4f} "
                    f"(paired over {len(a['windows'])} windows; {verdict})"
                )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], ref_ppl: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"codebook": "tab:green", "uniform": "tab:blue", "baseline": "tab:orange"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, ylabel in ((axes[0], "delta_ppl", "Δppl % vs reference"), (axes[1], "kl_mean", "KL(ref ‖ q) mean")):
        for r in rows:
            if r["kind"] == "reference":
                continue
            scale = 100 / ref_ppl if key == "delta_ppl" else 1.0
            y = r[key] * scale
            se = r.get(f"{key}_se")
            if key == "kl_mean":
                y = max(y, 1e-6)
                yerr = None if se is None else [[min(se, 0.999 * y)], [se]]
            else:
                yerr = None if se is None else [[se * scale], [se * scale]]
            ax.errorbar(r["kv_vs_fp16"], y, yerr=yerr, marker="o", linestyle="", capsize=2,
                        color=colors.get(family(r), "gray"))  # fmt: skip
            ax.annotate(label(r), (r["kv_vs_fp16"], y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("KV bytes held at the scored length / FP16 cache of the same tokens")
        ax.set_ylabel(ylabel)
        if key == "kl_mean":
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    from matplotlib.lines import Line2D

    axes[1].legend(handles=[Line2D([], [], marker="o", linestyle="", color=c, label=k) for k, c in colors.items()],
                   fontsize=8)  # fmt: skip
    fig.suptitle(f"{title} (lower-left is better; bars: ± 1 standard error over windows)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="eval output folders (with results.json)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget", type=float, action="append", default=[], help="bytes budget, x FP16 (repeatable)")
    args = p.parse_args(argv)
    meta, rows = load(args.runs)
    rows = [r for r in rows if r.get("protocol", "decode") == "decode"]
    ref = next(r for r in rows if r["kind"] == "reference")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2, default=str) + "\n")
    plot(rows, ref["ppl"], args.out / "frontier.png", meta.get("recipe", {}).get("name", "frontier"))
    text = f"reference ppl {ref['ppl']:.3f}\n\n{table(rows, ref['ppl'])}\n\n{budgets(rows, args.budget)}\n"
    (args.out / "frontier.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
