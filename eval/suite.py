"""One recipe over several models (``model: [a, b+kbias, ...]``): a run per model, then one summary.

Each model's run is a normal run (``out/<model>/results.json``, ``report.md``, plot); the summary
(``out/results.json``, ``out/report.md``) puts every config side by side over the models, as
relative Δppl (% of that model's reference perplexity) ± its paired standard error over windows,
and KL(reference ‖ config) mean ± its standard error, with the worst model of each config.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from .recipe import Recipe


def model_slug(model: str) -> str:
    """A folder name for a model spec: ``${KVQUANT_SHARED}/models/stories260K/hf+kbias`` -> ``stories260K-hf+kbias``."""
    base, _, variants = model.partition("+")
    parts = [p for p in Path(base).parts if p not in ("/", "models")][-2:]
    slug = "-".join(parts) + (f"+{variants}" if variants else "")
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", slug)


def relative(row: dict[str, Any]) -> dict[str, float | None]:
    """Δppl in % of the reference perplexity, with its standard error (``None`` when unknown)."""
    ref = row["ppl_ref"]
    se = row.get("delta_ppl_se")
    return {
        "delta_ppl_pct": 100.0 * row["delta_ppl"] / ref,
        "delta_ppl_pct_se": None if se is None else 100.0 * se / ref,
    }


def _run_one(recipe: Recipe, model: str, command: str, quiet: bool, progress: bool) -> tuple[dict, list]:
    """One model's run (in this process or a worker): writes its reports, returns (model info, rows)."""
    import torch

    from .report import print_table, write_all
    from .runner import run_recipe

    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    one = replace(recipe, model=model, models=[model], out=str(Path(recipe.out) / model_slug(model)))
    result = run_recipe(one, command=command, quiet=quiet, progress=progress)
    print(f"\n== {model}", flush=True)
    print_table(result)
    write_all(result, Path(one.out))
    info = {
        "source": result.meta["model"],
        "out": one.out,
        "windows": result.meta.get("windows"),
        "seconds": result.meta.get("seconds_total"),
    }
    rows = [{"model": model, **r, **(relative(r) if r["status"] == "ok" else {})} for r in result.rows]
    return info, rows


def run_models(recipe: Recipe, command: str, quiet: bool, progress: bool, jobs: int = 1) -> dict[str, Any]:
    """Run ``recipe`` on each of its models (``jobs`` worker processes at a time), writing each model's
    reports; returns the summary object (models in recipe order)."""
    summary: dict[str, Any] = {"command": command, "recipe": recipe.to_dict(), "models": {}, "rows": []}
    t0 = time.perf_counter()
    if jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = [pool.submit(_run_one, recipe, m, command, quiet, False) for m in recipe.models]
            done = [f.result() for f in futures]
    else:
        done = [_run_one(recipe, m, command, quiet, progress) for m in recipe.models]
    for model, (info, rows) in zip(recipe.models, done, strict=True):
        summary["models"][model] = info
        summary["rows"] += rows
    summary["seconds_total"] = round(time.perf_counter() - t0, 1)
    return summary


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    if row["status"] != "ok":
        return row["status"]
    d, dse = row["delta_ppl_pct"], row["delta_ppl_pct_se"]
    k, kse = row["kl_mean"], row.get("kl_mean_se")
    pm = f" ± {dse:.2f}" if dse is not None else ""
    kpm = f" ± {kse:.1e}" if kse is not None else ""
    return f"{d:+.2f}%{pm}, KL {k:.1e}{kpm}"


def markdown(summary: dict[str, Any]) -> str:
    """The summary table (one per protocol): configs x models, and each config's worst model."""
    rec = summary["recipe"]
    models = list(summary["models"])
    lines = [
        f"# {rec['name']}: every config on every model",
        "",
        rec.get("description") or "",
        "",
        f"Command: `{summary['command']}`  ",
        f"Windows: {rec['max_windows']} x {rec['window']} tokens of {rec['data']}, prefill {rec['prefill']}, "
        f"decode chunk {rec['decode_chunk']}; {summary['seconds_total']:.0f} s in all.",
        "",
        "Cells: Δppl in % of the model's own reference perplexity ± paired standard error over windows, "
        "KL(reference ‖ config) mean ± standard error. Per-model reports: "
        + ", ".join(f"[{m}]({Path(summary['models'][m]['out']).name}/report.md)" for m in models),
        "",
    ]
    for protocol in rec["protocol"]:
        rows = [r for r in summary["rows"] if r["protocol"] == protocol]
        configs = list(dict.fromkeys(r["config"] for r in rows))
        lines += [f"## {protocol} protocol", "", "| config | " + " | ".join(models) + " | worst Δppl | worst KL |",
                  "|---|" + "---|" * (len(models) + 2)]
        for c in configs:
            cells = [next((r for r in rows if r["config"] == c and r["model"] == m), None) for m in models]
            ok = [r for r in cells if r is not None and r["status"] == "ok"]
            worst_d = f"{max(r['delta_ppl_pct'] for r in ok):+.2f}%" if ok else "-"
            worst_k = f"{max(r['kl_mean'] for r in ok):.1e}" if ok else "-"
            lines.append(f"| {c} | " + " | ".join(_cell(r) for r in cells) + f" | {worst_d} | {worst_k} |")
        lines.append("")
    lines += ["## Models", ""] + [f"- `{m}`: {v['source']}" for m, v in summary["models"].items()] + [""]
    return "\n".join(lines)


def write_summary(summary: dict[str, Any], out: str | Path) -> list[Path]:
    """``results.json`` and ``report.md`` of a multi-model run in ``out``."""
    from kvquant.outputs import staged_files

    out = Path(out)
    names = ["results.json", "report.md"]
    texts = [json.dumps(summary, indent=2, default=str) + "\n", markdown(summary)]
    with staged_files(out, names, "out") as stage:  # both replace the earlier run's together
        for name, text in zip(names, texts, strict=True):
            (stage / name).write_text(text, encoding="utf-8")
    return [out / n for n in names]
