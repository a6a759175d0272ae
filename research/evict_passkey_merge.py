"""Merge the retrieval rows of several ``kvquant eval`` runs of one recipe (e.g. the short lengths and, as a second
run, the longest) into one heatmap per (task, config) and one markdown table.

Each run's ``results.json`` holds its rows (``retrieval``: one per config and case) and the config families
(``meta.retrieval[task]``). Cells a run did not cover are drawn "not run". The table gives, per config, the
accuracy over all cases with its standard error, the reference's accuracy on the same cases, the fraction of
cases where the config is right exactly when the reference is, the mean KV bytes held vs FP16, and the accuracy
per context length.

    python research/evict_passkey_merge.py RUN_A/results.json RUN_B/results.json --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvquant.eval.longcontext import heatmap, summary
from kvquant.eval.retrieval_task import safe_name


def merge(paths: list[Path]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """All retrieval rows of the runs (a case run twice: the later run wins) and each config's family."""
    rows: dict[tuple[Any, ...], dict[str, Any]] = {}
    families: dict[str, str] = {}
    for p in paths:
        data = json.loads(Path(p).read_text())
        for r in data.get("retrieval", []):
            rows[(r["task"], r["config"], r["length"], r["depth"], r["trial"])] = r
        for lines in data.get("meta", {}).get("retrieval", {}).values():
            if isinstance(lines, list):
                families.update({x["config"]: x.get("family", "") for x in lines})
    return list(rows.values()), families


def table(rows: list[dict[str, Any]], families: dict[str, str], task: str) -> str:
    """The markdown table of ``task`` (configs in their first-seen order, the reference first)."""
    mine = [r for r in rows if r["task"] == task]
    lengths = sorted({r["length"] for r in mine})
    configs = list(dict.fromkeys(r["config"] for r in mine))
    ref = next((c for c in configs if families.get(c) == "reference"), configs[0])
    ordered = [ref] + [c for c in configs if c != ref]
    mine.sort(key=lambda r: ordered.index(r["config"]))  # summary() takes the first config as the reference
    stats = {s["config"]: s for s in summary(mine)}
    ref_rows = [r for r in mine if r["config"] == ref]
    head = ["config", "family", "cases", "accuracy", "reference acc.", "same as reference", "KV held vs FP16"]
    head += [f"acc @{n}" for n in lengths]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for c in ordered:
        s, rs = stats[c], [r for r in mine if r["config"] == c]
        held = [r["kv_vs_fp16"] for r in rs if r.get("kv_vs_fp16") is not None]
        per_len = []
        for n in lengths:
            at = [r["correct"] for r in rs if r["length"] == n]
            per_len.append(f"{sum(at) / len(at):.2f}" if at else "-")
        ref_acc = sum(r["correct"] for r in ref_rows) / len(ref_rows)
        cells = [f"`{c}`", families.get(c, ""), str(s["cases"]), f"{s['accuracy']:.3f} ± {s['accuracy_se']:.3f}",
                 f"{ref_acc:.3f}", f"{s['agrees_with_reference']:.3f}",
                 f"{sum(held) / len(held):.3f}x" if held else "-", *per_len]  # fmt: skip
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="results.json of each run")
    p.add_argument("--out", type=Path, required=True, help="folder for heatmap-all-TASK-CONFIG.png")
    args = p.parse_args(argv)
    rows, families = merge(args.results)
    args.out.mkdir(parents=True, exist_ok=True)
    for task in dict.fromkeys(r["task"] for r in rows):
        print(f"## {task}\n\n{table(rows, families, task)}\n")
        mine = [r for r in rows if r["task"] == task]
        for c in dict.fromkeys(r["config"] for r in mine):
            cases = [r for r in mine if r["config"] == c]
            acc = sum(r["correct"] for r in cases) / len(cases)
            name = f"heatmap-all-{task}-{safe_name(c)}.png"
            short = Path(c).stem if c.endswith((".yaml", ".yml", ".json")) else c
            heatmap(mine, c, args.out / name, title=f"{task}: {short}\nacc {acc:.2f} ({len(cases)} cases)")
            print(f"![{name}]({name})")


if __name__ == "__main__":
    main()
