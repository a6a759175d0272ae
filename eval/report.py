"""Reports of a run: the console table, ``results.json``, ``report.md`` and ``kv_vs_quality.png`` (the frontier).

Every table row names its protocol; ``simulated`` and ``decode`` numbers are never put in one table.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from kvquant.outputs import check_output_dir, staged_files, write_text

from .protocols import PROTOCOLS
from .render import finish_figure, md_table

OUTPUT_FILES = ("results.json", "report.md", "kv_vs_quality.png", "frontier.png")  # what write_all writes


def output_files(recipe: Any) -> list[str]:
    """Every file a run of ``recipe`` writes in its out folder (the fixed ones, and a heatmap per task x config)."""
    from .retrieval_task import heatmap_files

    return [*OUTPUT_FILES, *heatmap_files(recipe.tasks, ["reference", *recipe.configs])]

COLUMNS = [
    ("config", "config"),
    ("avg_bits", "bits/value"),
    ("kv_vs_fp16", "KV held vs FP16"),
    ("asymptotic_vs_fp16", "KV/token vs FP16, long ctx"),
    ("ppl", "ppl"),
    ("delta_ppl", "Δppl"),
    ("kl_mean", "KL mean"),
    ("kl_p99", "KL p99"),
    ("top1", "top-1"),
    ("mean_abs_dp", "mean |Δp|"),
    ("tok_per_s", "tok/s"),
]

#: Columns shown as ``value ± standard error`` (the error is the row's ``<key>_se``, over windows, paired).
WITH_SE = ("delta_ppl", "kl_mean", "top1")


def _fmt(key: str, v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if key in ("avg_bits",):
        return f"{v:.2f}"
    if key in ("kv_vs_fp16", "asymptotic_vs_fp16"):
        return f"{v:.3f}x"
    if key == "ppl":
        return f"{v:.3f}"
    if key == "delta_ppl":
        return f"{v:+.4f}"
    if key in ("kl_mean", "kl_p99", "mean_abs_dp"):
        return "0" if v == 0 else (f"{v:.2e}" if abs(v) < 1e-3 else f"{v:.4f}")
    if key == "top1":
        return f"{v:.4f}"
    if key == "tok_per_s":
        return f"{v:.1f}" if v < 100 else f"{v:.0f}"
    if isinstance(v, float) and math.isfinite(v):
        return f"{v:.4g}"
    return str(v)


def _fmt_se(key: str, se: Any) -> str:
    if key == "delta_ppl":
        return f"{se:.4f}"
    return _fmt(key, se)


def cell(row: dict[str, Any], key: str) -> str:
    """One table cell: the value, with ``± se`` for the columns that have a standard error."""
    text = _fmt(key, row.get(key))
    se = row.get(f"{key}_se")
    if key in WITH_SE and se is not None and row.get(key) is not None:
        text += f" ± {_fmt_se(key, se)}"
    return text


def _gen_cell(row: dict[str, Any]) -> tuple[str, str]:
    g = row.get("gen")
    if not g:
        return "-", "-"
    if "error" in g:
        return "error", "-"
    firsts = g["first_divergence"]
    return f"{g['token_agreement']:.3f}", ",".join("-" if f is None else str(f) for f in firsts)


def table_rows(rows: list[dict[str, Any]], protocol: str, with_gen: bool) -> tuple[list[str], list[list[str]]]:
    head = [h for _, h in COLUMNS] + (["gen agree", "first diverge"] if with_gen else [])
    body = []
    for r in rows:
        if r["protocol"] != protocol or r["status"] != "ok":
            continue
        cells = [cell(r, k) for k, _ in COLUMNS]
        if with_gen:
            cells += list(_gen_cell(r))
        body.append(cells)
    return head, body


def text_table(head: list[str], body: list[list[str]]) -> str:
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    line = "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths, strict=True)))
    out = [line, "-" * len(line)]
    for b in body:
        out.append(
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(b, widths, strict=True)))
        )
    return "\n".join(out)


def _not_run(rows: list[dict[str, Any]], protocol: str) -> list[str]:
    return [
        f"{r['config']}: {r['status']} ({r['reason']})"
        for r in rows
        if r["protocol"] == protocol and r["status"] != "ok"
    ]


def _protocol_line(meta: dict[str, Any], protocol: str) -> str:
    """What ran, generated from the effective settings (command-line overrides included), never from free text."""
    rc = meta["recipe"]
    nwin = meta.get("windows", {}).get(protocol, "?")
    first = rc.get("first_window", 0)
    wins = f"{nwin} windows"
    if first and isinstance(nwin, int):
        wins += f" (numbers {first + 1}..{first + nwin} of the text)"
    scored = rc["window"] - 1 - rc["prefill"]
    se = f"; ± is one standard error over the {wins} (paired: same tokens as the reference)"
    if protocol == "decode":
        step = (
            "then one token per step (exact token-by-token decode)"
            if rc["decode_chunk"] == 1
            else f"then {rc['decode_chunk']} tokens per step (fast mode: tokens inside a step see each other "
            "unquantized, so it is optimistic)"
        )
        return (
            f"protocol **decode** ({PROTOCOLS['decode']}): {wins} of {rc['window']} tokens, prefill "
            f"{rc['prefill']}, {step}; scored: the {scored} targets after the prefill of each window" + se
        )
    return (
        f"protocol **simulated** ({PROTOCOLS['simulated']}): {wins} of {rc['window']} tokens, "
        f"stride {rc['stride'] or rc['window']}, prefill {rc['prefill']} (one forward, where static scales are "
        f"taken), then the rest in a second forward; scored: the {scored} targets after the prefill" + se
    )


def print_table(result: Any, file: Any = None) -> None:
    import sys

    f = file or sys.stdout
    rows, meta = result.rows, result.meta
    with_gen = "generation" in meta
    for protocol in result.recipe.protocol:
        print("", file=f)
        print(_protocol_line(meta, protocol).replace("**", ""), file=f)
        print(text_table(*table_rows(rows, protocol, with_gen)), file=f)
        for line in _not_run(rows, protocol):
            print(f"  not run: {line}", file=f)
    from .retrieval_task import retrieval_not_run, retrieval_table, retrieval_tasks

    for task in retrieval_tasks(meta):
        print(f"\ntask {task} (exact-match retrieval accuracy, the same cases for every config)", file=f)
        print(text_table(*retrieval_table(meta, task)), file=f)
        for line in retrieval_not_run(meta, task):
            print(f"  not run: {line}", file=f)


def write_json(result: Any, path: Path) -> None:
    payload = {"meta": result.meta, "results": result.rows, "retrieval": getattr(result, "retrieval", [])}
    write_text(path, json.dumps(payload, indent=2, default=str) + "\n")


def short_name(config: str) -> str:
    """A config entry as a plot label: a config file by its stem, anything else as written."""
    return Path(config).stem if config.endswith((".yaml", ".yml")) else config


def plot(result: Any, path: Path) -> bool:
    """The frontier: KL mean and Δppl against the KV bytes each config held (measured, / FP16 bytes of the
    same tokens), one marker per protocol, ± 1 SE bars, the recipe's recommended configs starred; labels
    never overlap. Returns False if nothing ran to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    from .labels import place_labels

    rows = [r for r in result.ok_rows() if r["kind"] != "reference" and r.get("kv_vs_fp16") is not None]
    if not rows:
        return False
    recommended = set(result.recipe.recommend)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.4))
    markers = {"decode": "o", "simulated": "s"}
    colors = {"kvquant": "tab:blue", "baseline": "tab:orange"}
    panels = ((axes[0], "kl_mean", "KL(ref ‖ q) mean"), (axes[1], "delta_ppl", "Δ perplexity vs reference"))
    for ax, key, label in panels:
        for r in rows:
            y = max(r[key], 1e-7) if key == "kl_mean" else r[key]
            se = r.get(f"{key}_se")
            # one standard error over windows; on the log axis the lower bar is clipped above zero
            yerr = None if se is None else [[min(se, y * 0.999) if key == "kl_mean" else se], [se]]
            star = r["config"] in recommended
            ax.errorbar(r["kv_vs_fp16"], y, yerr=yerr, marker="*" if star else markers.get(r["protocol"], "x"),
                        markersize=12 if star else 6, color=colors.get(r["kind"], "gray"), capsize=2,
                        linestyle="")  # fmt: skip
        ax.set_xlabel("KV bytes held / FP16 bytes of the same tokens (measured); bars: ± 1 SE")
        ax.set_ylabel(label)
        ax.set_yscale("log" if key == "kl_mean" else "symlog", **({} if key == "kl_mean" else {"linthresh": 1e-2}))
        ax.grid(True, alpha=0.3)
        ax.margins(x=0.12, y=0.12)
    handles = [
        Line2D([], [], marker=markers[p], linestyle="", color="gray", label=f"protocol {p}")
        for p in sorted({r["protocol"] for r in rows})
    ]
    handles += [Line2D([], [], marker="o", linestyle="", color=c, label=k) for k, c in colors.items()]
    if recommended:
        handles.append(Line2D([], [], marker="*", markersize=10, linestyle="", color="gray", label="recommended"))
    fig.legend(handles=handles, fontsize=8, loc="lower center", ncol=len(handles), frameon=False)
    rc = result.recipe
    model = "/".join(Path(str(rc.model)).parts[-2:]) if "/" in str(rc.model) else str(rc.model)
    data = Path(rc.data).name if "/" in rc.data else rc.data
    fig.suptitle(f"{rc.name}: {model} on {data} — quality vs KV bytes held (down and left is better)", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))  # the legend sits below the panels, clear of every point
    for ax, key, _ in panels:
        pts = [(r["kv_vs_fp16"], max(r[key], 1e-7) if key == "kl_mean" else r[key], short_name(r["config"]))
               for r in rows]  # fmt: skip
        place_labels(ax, pts, bold={short_name(c) for c in recommended})
    return finish_figure(fig, path, layout=False)


def markdown(result: Any, plot_name: str | None, heatmaps: list[str] = (), frontier: str | None = None) -> str:
    meta, rows, rc = result.meta, result.rows, result.recipe
    with_gen = "generation" in meta
    lines = [f"# kvquant eval: {rc.name}", ""]
    lines += recommendation_lines(result)
    if rc.description:
        lines += [rc.description, ""]
    if meta.get("command"):
        lines += ["Produced by:", "", "```", meta["command"], "```", ""]
    lines += [
        f"- model: {meta['model']} ({meta['dtype']}, {meta['device']})",
        f"- data: {meta['data']} ({meta['corpus_tokens']} tokens)",
        f"- reference: unquantized `DynamicCache` in {meta['dtype']}; every delta, KL and top-1 is against it, "
        "on the same tokens under the same protocol",
        f"- machine: {meta['machine']}; versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        f"- started {meta['started']}, total {meta.get('seconds_total', '?')} s "
        f"(model load {meta['model_load_seconds']} s{', GGUF converted' if meta.get('model_converted') else ''})",
        "",
    ]
    for protocol in rc.protocol:
        lines += [f"## {protocol}", "", _protocol_line(meta, protocol) + ".", ""]
        lines += [md_table(*table_rows(rows, protocol, with_gen)), ""]
        nr = _not_run(rows, protocol)
        if nr:
            lines += ["Not run:", ""] + [f"- {x}" for x in nr] + [""]
    from .retrieval_task import retrieval_markdown

    lines += retrieval_markdown(result, list(heatmaps), frontier)
    lines += [
        "## Columns",
        "",
        "- **bits/value**: bits per stored K/V value at long context, scales and zero-points included "
        "(kvquant: from the config; baselines: measured on the quantized part of their cache).",
        f"- **KV held vs FP16**: bytes the cache actually holds after the last token of a window ({_held(rows)}), "
        "fixed-size full-precision parts (fp16 residual window, sinks) and block rounding included, divided by an "
        "FP16 cache of the same tokens. **KV/token vs FP16, long ctx**: the cost of one more token at long "
        "context (asymptotic bytes per token), where fixed-size parts no longer count.",
        f"- **ppl / Δppl**: perplexity of the scored tokens and its difference to the reference's ({_ref_ppl(rows)}).",
        "- **KL mean / p99**: KL(reference ‖ quantized) of the next-token distributions, mean and 99th percentile "
        "over scored positions. **top-1**: fraction of positions with the same argmax. **mean |Δp|**: mean absolute "
        "change of the probability of the correct next token.",
        "- **±**: one standard error of the per-window values (sample standard deviation over windows / "
        "sqrt(windows)); every window is scored on the same tokens by the reference and each config, so the "
        "differences are paired. Two configs differ beyond noise only if their difference does: "
        "`kvquant eval RESULTS.json --compare A,B` tests that per window.",
        "- **tok/s**: scored tokens per second of forward time on this machine (quantization overhead included; "
        "CPU numbers depend on the machine's load).",
    ]
    if with_gen:
        g = meta["generation"]
        lines += [
            f"- **gen agree / first diverge**: greedy continuations of {g['prompts']} prompts of "
            f"{g['prompt_tokens']} corpus tokens, {g['new_tokens']} new tokens each, through each method's real cache, "
            "vs the reference's: fraction of equal tokens, and per prompt the index of the first differing token "
            "(`-`: identical). Reported, not asserted.",
        ]
    descs = {r["config"]: r.get("description", "") for r in rows}
    lines += ["", "## Methods", ""] + [f"- `{k}`: {v}" for k, v in descs.items()]
    if plot_name:
        lines += ["", "## Quality vs KV bytes held", "", f"![KL and delta ppl against KV bytes held]({plot_name})"]
    return "\n".join(lines) + "\n"


def recommendation_lines(result: Any) -> list[str]:
    """The report's opening: each recommended config, what it is for, and what it measured in this run."""
    rc = result.recipe
    if not rc.recommend:
        return []
    protocol = "decode" if "decode" in rc.protocol else (rc.protocol[0] if rc.protocol else None)
    by_config = {r["config"]: r for r in result.rows if r.get("protocol") == protocol}
    lines = [f"**Which config to use** (measured below: {protocol} protocol, ± 1 SE over windows):", ""]
    for config, use in rc.recommend.items():
        r = by_config.get(config)
        if r is None or r.get("status") != "ok":
            why = r.get("reason", "") if r else "no row"
            lines.append(f"- `{config}`: {use} — not measured in this run ({why})")
            continue
        lines.append(
            f"- `{config}`: {use} — holds {cell(r, 'kv_vs_fp16')} of FP16's KV bytes here "
            f"({cell(r, 'asymptotic_vs_fp16')} per token at long context), "
            f"KL {cell(r, 'kl_mean')}, Δppl {cell(r, 'delta_ppl')}, top-1 {cell(r, 'top1')}"
        )
    return lines + [""]


def _held(rows: list[dict[str, Any]]) -> str:
    tokens = sorted({r["held_tokens"] for r in rows if r.get("held_tokens")})
    return f"{', '.join(map(str, tokens))} tokens" if tokens else "the window's tokens"


def _ref_ppl(rows: list[dict[str, Any]]) -> str:
    parts = [f"{r['protocol']} {r['ppl']:.3f}" for r in rows if r["kind"] == "reference" and r["status"] == "ok"]
    return "reference ppl: " + ", ".join(parts) if parts else "no reference"


def write_all(result: Any, out_dir: str | Path, force: bool = False) -> dict[str, Path]:
    """Write a run's files into ``out_dir`` as one set (:func:`kvquant.outputs.staged_files`): all of them
    replace the earlier run's together, or none does; existing ones are refused unless ``force``."""
    from .retrieval_task import plot_frontier, write_heatmaps

    out = check_output_dir(out_dir, OUTPUT_FILES, "out", force=force)
    with staged_files(out, OUTPUT_FILES, "out") as stage:
        write_json(result, stage / "results.json")
        has_plot = plot(result, stage / "kv_vs_quality.png")
        heatmaps = write_heatmaps(result, stage)
        has_frontier = plot_frontier(result, stage / "frontier.png")
        md = markdown(result, "kv_vs_quality.png" if has_plot else None, heatmaps,
                      "frontier.png" if has_frontier else None)
        write_text(stage / "report.md", md)
    paths = {"json": out / "results.json", "md": out / "report.md"}
    if has_plot:
        paths["png"] = out / "kv_vs_quality.png"
    if has_frontier:
        paths["frontier"] = out / "frontier.png"
    for h in heatmaps:
        paths[h] = out / h
    return paths


def rerender(out_dir: str | Path) -> dict[str, Path]:
    """Rewrite ``report.md`` and the plot of a finished run from its ``results.json`` (no model is run)."""
    from types import SimpleNamespace

    out = Path(out_dir)
    payload = json.loads((out / "results.json").read_text(encoding="utf-8"))
    meta, rows = payload["meta"], payload["results"]
    rc = dict(meta["recipe"])
    rc.setdefault("recommend", {})  # results.json files written before the field existed
    recipe = SimpleNamespace(**rc)
    result = SimpleNamespace(
        recipe=recipe, meta=meta, rows=rows, ok_rows=lambda: [r for r in rows if r["status"] == "ok"]
    )
    paths = {"md": out / "report.md", "png": out / "kv_vs_quality.png"}
    has_plot = plot(result, paths["png"])
    note = (
        f"\n_Re-rendered from results.json on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
        "(kvquant.eval.report.rerender): the run's numbers, the report layout of the current version._\n"
    )
    write_text(paths["md"], markdown(result, paths["png"].name if has_plot else None) + note)
    return paths


README_COLUMNS = [
    ("config", "config"),
    ("avg_bits", "bits/value"),
    ("kv_vs_fp16", "KV held vs FP16"),
    ("asymptotic_vs_fp16", "KV/token vs FP16, long ctx"),
    ("delta_ppl", "Δppl"),
    ("kl_mean", "KL(FP16 ‖ q)"),
    ("top1", "top-1"),
]


def readme_table(results_json: str | Path, protocol: str = "decode") -> str:
    """The README's results table (markdown) from a run's ``results.json``, with the protocol it ran."""
    payload = json.loads(Path(results_json).read_text(encoding="utf-8"))
    meta, rows = payload["meta"], payload["results"]
    ok = [r for r in rows if r["protocol"] == protocol and r["status"] == "ok" and r["kind"] != "reference"]
    head = [h for _, h in README_COLUMNS]
    body = [[f"`{r['config']}`" if k == "config" else cell(r, k) for k, _ in README_COLUMNS] for r in ok]
    ref = next((r for r in rows if r["protocol"] == protocol and r["kind"] == "reference"), None)
    lines = [_protocol_line(meta, protocol).replace("**", "") + ".", ""]
    if ref is not None:
        lines += [f"Reference perplexity {ref['ppl']:.3f} ({ref['n_tokens']} scored tokens).", ""]
    return "\n".join(lines) + "\n" + md_table(head, body)


if __name__ == "__main__":  # python -m kvquant.eval.report RESULTS.json: print the README table
    import sys

    print(readme_table(sys.argv[1]))
