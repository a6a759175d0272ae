"""``passkey`` and ``needle`` as recipe tasks: run every method on the same long-context cases, summarize,
tabulate, and draw a heatmap per config and the quality-vs-bytes frontier.

The cases and their scoring are :mod:`kvquant.eval.longcontext`'s; this module is the recipe glue. Each method of
the run (the reference, kvquant configs -- bits-only, eviction-only or both -- and baselines) answers every
(length, depth, trial) case through its real cache, with greedy decoding; the bytes its cache holds after the
answer are measured the same way as in the ``ppl`` task (``Method.storage``).

A config's *family* places it on the frontier: ``bits`` (quantized, every token kept), ``evict`` (full precision,
fewer tokens), ``bits+evict`` (both), ``full`` (kvquant passthrough: fp16 / bf16 / fp32, every token), ``reference``
and ``baseline`` (transformers' / bitsandbytes' caches).
"""

from __future__ import annotations

import re
from typing import Any

from kvquant.errors import RecipeError
from kvquant.text import window_bos

from .baselines import elements_per_token
from .longcontext import heatmap, run_retrieval, summary
from .render import finish_figure, md_table

RETRIEVAL_TASKS = ("passkey", "needle")
FAMILY_COLORS = {
    "reference": "black",
    "full": "gray",
    "bits": "tab:blue",
    "evict": "tab:green",
    "bits+evict": "tab:purple",
    "baseline": "tab:orange",
}


def check_lengths(model: Any, lengths: list[int]) -> None:
    """Refuse retrieval lengths beyond the model's ``max_position_embeddings`` (one line, before any work)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(cfg, "max_position_embeddings", None)
    too_long = [n for n in lengths if limit and n > limit]
    if too_long:
        raise RecipeError(
            f"retrieval.lengths: {too_long[0]} is beyond the model's max_position_embeddings ({limit})"
        )


def check_cases(tasks: list[str], tokenizer: Any, ids: Any, lengths: list[int], seed: int = 0) -> None:
    """Refuse a grid whose shortest length cannot hold a task's instruction, needle and question, or whose longest
    needs more haystack than the corpus has (one line naming ``retrieval.lengths``, before any work)."""
    from .longcontext import build_case

    for task in tasks:
        if task not in RETRIEVAL_TASKS:
            continue
        for n in (min(lengths), max(lengths)):
            try:
                build_case(task, tokenizer, ids, n, 0.0, 0, seed)
            except RecipeError as e:
                raise RecipeError(f"retrieval.{e}") from None


def family(method: Any, model: Any) -> str:
    """``reference``, ``baseline``, ``full``, ``bits``, ``evict`` or ``bits+evict`` (see the module doc)."""
    if method.kind != "kvquant":
        return method.kind
    cfg = method.config
    as_dict = cfg.to_dict() if hasattr(cfg, "to_dict") else {}
    evicts = getattr(cfg, "evict", None) is not None or bool(as_dict.get("evict"))
    quantized = float(cfg.avg_bits(model)) < 16.0
    if evicts:
        return "bits+evict" if quantized else "evict"
    return "bits" if quantized else "full"


def run_retrieval_task(
    task: str,
    recipe: Any,
    lm: Any,
    ids: Any,
    methods: list[Any],
    skipped: list[dict[str, Any]],
    result: Any,
    guard: Any,
    quiet: bool,
    progress: bool,
) -> None:
    """Run ``task`` over the recipe's retrieval grid with every method; rows go to ``result.retrieval`` and one
    summary line per method to ``result.meta["retrieval"][task]``."""
    from tqdm.auto import tqdm

    model, tok = lm.model, lm.tokenizer
    rt = recipe.retrieval
    by_name = {m.name: m for m in methods}
    fp16_bpt = elements_per_token(model) * 2

    def measure(name: str, cache: Any, tokens: int) -> float:
        return by_name[name].storage(model, cache, tokens).bytes_held

    errors: dict[str, str] = {}
    n_cases = len(rt.lengths) * len(rt.depths) * rt.trials
    bar = tqdm(total=n_cases, desc=task, unit="case", disable=not progress, dynamic_ncols=True)

    def tick(items: Any) -> Any:
        for x in items:
            yield x
            bar.update(1)

    bos_id = window_bos(tok, recipe.bos)
    try:
        rows = run_retrieval(
            model, tok, ids, {m.name: (lambda m=m: m.decode_cache(model)) for m in methods}, task=task,
            lengths=rt.lengths, depths=rt.depths, trials=rt.trials, seed=recipe.seed, bos_id=bos_id,
            progress=tick, measure=measure, errors=errors,
        )  # fmt: skip
    finally:
        bar.close()
        guard.restore()
    for name, msg in errors.items():
        if by_name[name].kind == "reference":
            raise RuntimeError(f"reference failed on {task}: {msg}")
        if not quiet:
            import sys

            print(f"[kvquant eval] {name} failed on {task}: {msg}", file=sys.stderr, flush=True)
    for r in rows:
        r["kv_vs_fp16"] = r["kv_bytes"] / (r["tokens"] * fp16_bpt) if r["kv_bytes"] else None
    result.retrieval.extend(rows)
    lines = []
    ok = {s["config"]: s for s in summary(rows)}
    ref = ok.get(methods[0].name)
    for m in methods:
        line: dict[str, Any] = {"config": m.name, "kind": m.kind, "family": family(m, model), "task": task,
                                "description": m.description}  # fmt: skip
        if m.name in errors:
            line.update(status="error", reason=errors[m.name])
        else:
            s = ok[m.name]
            mine = [r for r in rows if r["config"] == m.name]
            held = [r["kv_vs_fp16"] for r in mine if r["kv_vs_fp16"] is not None]
            line.update(
                status="ok", **{k: v for k, v in s.items() if k != "config"},
                reference_accuracy=ref["accuracy"] if ref else None,
                kv_vs_fp16=sum(held) / len(held) if held else None,
                by_length={str(n): sum(r["correct"] for r in mine if r["length"] == n)
                           / max(1, sum(r["length"] == n for r in mine)) for n in rt.lengths},
            )  # fmt: skip
        lines.append(line)
    lines += [{**sk, "task": task, "status": "skipped"} for sk in skipped]
    meta = result.meta.setdefault("retrieval", {})
    meta["grid"] = {"lengths": rt.lengths, "depths": rt.depths, "trials": rt.trials, "cases": n_cases,
                    "scoring": "exact match of the first number in the greedy answer"}  # fmt: skip
    meta[task] = lines


# ---------------------------------------------------------------------------------------------------- reports
RETRIEVAL_COLUMNS = [
    ("config", "config"),
    ("family", "family"),
    ("accuracy", "accuracy"),
    ("reference_accuracy", "reference acc."),
    ("agrees_with_reference", "same as reference"),
    ("kv_vs_fp16", "KV held vs FP16"),
]


def _cell(line: dict[str, Any], key: str) -> str:
    v = line.get(key)
    if v is None:
        return "-"
    if key == "accuracy":
        return f"{v:.3f} ± {line['accuracy_se']:.3f}"
    if key in ("reference_accuracy", "agrees_with_reference"):
        return f"{v:.3f}"
    if key == "kv_vs_fp16":
        return f"{v:.3f}x"
    return str(v)


def retrieval_table(meta: dict[str, Any], task: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows of one task's table (ok methods), accuracy per length at the end."""
    lines = [x for x in meta.get("retrieval", {}).get(task, []) if x["status"] == "ok"]
    lengths = meta["retrieval"]["grid"]["lengths"]
    head = [h for _, h in RETRIEVAL_COLUMNS] + [f"acc @{n}" for n in lengths]
    body = [[_cell(x, k) for k, _ in RETRIEVAL_COLUMNS] + [f"{x['by_length'][str(n)]:.2f}" for n in lengths]
            for x in lines]  # fmt: skip
    return head, body


def retrieval_not_run(meta: dict[str, Any], task: str) -> list[str]:
    return [f"{x['config']}: {x['status']} ({x['reason']})" for x in meta.get("retrieval", {}).get(task, [])
            if x["status"] != "ok"]  # fmt: skip


def retrieval_tasks(meta: dict[str, Any]) -> list[str]:
    return [t for t in RETRIEVAL_TASKS if t in meta.get("retrieval", {})]


def safe_name(config: str) -> str:
    """A file-name-safe form of a config name (``hf-hqq-int4:axis=0`` -> ``hf-hqq-int4_axis=0``)."""
    return re.sub(r"[^A-Za-z0-9_.=+-]", "_", config)


def heatmap_files(tasks: list[str], configs: list[str]) -> list[str]:
    """Names (relative to the out folder) of the heatmaps a run of ``tasks`` x ``configs`` writes."""
    return [f"heatmap-{t}-{safe_name(c)}.png" for t in tasks if t in RETRIEVAL_TASKS for c in configs]


def write_heatmaps(result: Any, out: Any) -> list[str]:
    """One heatmap (length x depth) per task and config that ran; returns the file names written."""
    names = []
    for task in retrieval_tasks(result.meta):
        rows = [r for r in result.retrieval if r["task"] == task]
        for line in result.meta["retrieval"][task]:
            if line["status"] != "ok":
                continue
            name = heatmap_files([task], [line["config"]])[0]
            title = f"{task}: {line['config']} (acc {line['accuracy']:.2f}, reference {line['reference_accuracy']:.2f})"
            heatmap(rows, line["config"], out / name, title=title)
            names.append(name)
    return names


def plot_frontier(result: Any, path: Any) -> bool:
    """Quality against bytes actually held: retrieval accuracy (each task) and KL mean (``ppl`` task, decode
    protocol when it ran) vs KV bytes held / FP16 bytes of the same tokens, coloured by family."""
    tasks = retrieval_tasks(result.meta)
    if not tasks:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    families = {x["config"]: x["family"] for t in tasks for x in result.meta["retrieval"][t]}
    ppl = [r for r in result.rows if r.get("status") == "ok" and r.get("kind") != "reference"
           and r.get("protocol") == ("decode" if any(x.get("protocol") == "decode" for x in result.rows)
                                     else r.get("protocol"))]  # fmt: skip
    fig, axes = plt.subplots(1, 2 if ppl else 1, figsize=(12 if ppl else 6.5, 4.8), squeeze=False)
    markers = dict(zip(RETRIEVAL_TASKS, ("o", "s"), strict=True))
    ax = axes[0][0]
    labels: list[list[tuple[float, float, str]]] = [[], []]
    for task in tasks:
        for x in result.meta["retrieval"][task]:
            if x["status"] != "ok" or x.get("kv_vs_fp16") is None:
                continue
            ax.errorbar(x["kv_vs_fp16"], x["accuracy"], yerr=x["accuracy_se"], marker=markers[task], capsize=2,
                        color=FAMILY_COLORS.get(x["family"], "gray"), linestyle="")  # fmt: skip
            labels[0].append((x["kv_vs_fp16"], x["accuracy"], x["config"]))
    ax.set_xlabel("KV bytes held / FP16 bytes of the same tokens (measured)")
    ax.set_ylabel("retrieval accuracy (exact match); bars: ± 1 SE")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(True, alpha=0.3)
    handles = [Line2D([], [], marker=markers[t], linestyle="", color="gray", label=t) for t in tasks]
    handles += [Line2D([], [], marker="o", linestyle="", color=c, label=f) for f, c in FAMILY_COLORS.items()
                if f in families.values()]  # fmt: skip
    ax.legend(handles=handles, fontsize=8, loc="best")
    if ppl:
        ax = axes[0][1]
        for r in ppl:
            y = max(r["kl_mean"], 1e-7)
            se = r.get("kl_mean_se")
            ax.errorbar(r["kv_vs_fp16"], y, yerr=None if se is None else [[min(se, y * 0.999)], [se]], marker="^",
                        color=FAMILY_COLORS.get(families.get(r["config"], "baseline"), "gray"), capsize=2,
                        linestyle="")  # fmt: skip
            labels[1].append((r["kv_vs_fp16"], y, r["config"]))
        ax.set_yscale("log")
        ax.set_xlabel("KV bytes held / FP16 bytes of the same tokens (measured)")
        ax.set_ylabel(f"KL(ref ‖ q) mean, ppl task ({ppl[0]['protocol']})")
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{result.recipe.name}: quality vs bytes held (up and left is better)", fontsize=10)
    fig.tight_layout()
    from .labels import place_labels

    for ax, pts in zip(axes[0], labels, strict=False):
        place_labels(ax, pts)

    return finish_figure(fig, path, layout=False)


def retrieval_markdown(result: Any, heatmaps: list[str], frontier: str | None) -> list[str]:
    """The report's retrieval sections (one per task), the heatmaps and the frontier plot."""

    meta = result.meta
    lines: list[str] = []
    for task in retrieval_tasks(meta):
        g = meta["retrieval"]["grid"]
        lines += [
            f"## {task}", "",
            f"Task **{task}**: {g['cases']} cases per config (lengths {g['lengths']} tokens x needle depths "
            f"{[f'{d:.0%}' for d in g['depths']]} x {g['trials']} trial(s)), the same prompts for every config; "
            f"greedy answer through each config's real cache, scored by {g['scoring']}. **reference acc.**: the "
            "unquantized reference cache's accuracy on the same cases; **same as reference**: fraction of cases "
            "where the config is right exactly when the reference is; **KV held vs FP16**: bytes the cache holds "
            "after the answer / an FP16 cache of the same tokens (mean over cases); ± is one standard error over "
            "cases.", "",
            md_table(*retrieval_table(meta, task)), "",
        ]  # fmt: skip
        nr = retrieval_not_run(meta, task)
        if nr:
            lines += ["Not run:", ""] + [f"- {x}" for x in nr] + [""]
        mine = [h for h in heatmaps if h.startswith(f"heatmap-{task}-")]
        if mine:
            lines += ["Heatmaps (accuracy per length x depth):", ""] + [f"![{h}]({h})" for h in mine] + [""]
    if frontier:
        lines += ["## Quality vs bytes held", "", f"![frontier]({frontier})", ""]
    return lines


__all__ = [
    "RETRIEVAL_TASKS", "check_lengths", "family", "heatmap_files", "plot_frontier", "retrieval_markdown",
    "retrieval_table", "run_retrieval_task", "write_heatmaps",
]  # fmt: skip
