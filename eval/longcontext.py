"""Long-context retrieval tasks: passkey and needle-in-a-haystack, generated offline from any corpus.

Perplexity over short windows hides what quantization or eviction does to information far back in a long
context. These tasks put one fact (the *needle*) at a chosen depth of a long *haystack* of real text, then ask
for it at the end, and score the model's greedy answer by exact match:

* ``passkey`` (Mohtashami & Jaggi, 2023): "The pass key is 68412. Remember it. 68412 is the pass key." hidden
  in the haystack; the prompt ends with "What is the pass key? The pass key is".
* ``needle`` (RULER's single-needle key-value form, Hsieh et al., 2024): "One of the special magic numbers for
  {key} is: 7139025." with a random key word; the prompt ends with "What is the special magic number for
  {key} mentioned in the provided text? The special magic number for {key} mentioned in the provided text is".

The haystack is a contiguous run of the tokenized corpus (any text the suite reads: WikiText-2, KJV, a file),
so there is no synthetic repetition a model could shortcut. Every case is a pure function of
``(task, length, depth, trial, seed)`` and the corpus: the same cases run for every config, so accuracies are
compared on the same prompts. ``length`` is the exact prompt length in tokens; ``depth`` is where the needle
starts, as a fraction of the haystack (0 = right after the instruction, 1 = right before the question).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvquant.errors import RecipeError
from kvquant.outputs import save_figure

TASKS = ("passkey", "needle")

_INTRO = {
    "passkey": "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n",
    "needle": "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards.\n",
}

# common nouns for the needle's key (RULER draws random words); a fixed list keeps cases reproducible offline
_KEY_WORDS = (
    "apple", "harbor", "violin", "lantern", "meadow", "copper", "falcon", "glacier", "orchard", "pepper",
    "quartz", "saddle", "thunder", "velvet", "walnut", "canyon", "dolphin", "ember", "feather", "garnet",
)


@dataclass(frozen=True)
class RetrievalCase:
    """One prompt: ``ids`` (1-D, exactly ``length`` tokens) and the ``answer`` the model must produce."""

    task: str
    length: int
    depth: float
    trial: int
    ids: torch.Tensor
    answer: str
    needle_start: int  # token index of the needle's first token in ``ids``
    haystack_tokens: int  # corpus tokens around the needle (the needle sits ``round(depth * this)`` into them)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _texts(task: str, rng: random.Random) -> tuple[str, str, str, str]:
    """(intro, needle, question, answer) for one case."""
    if task == "passkey":
        key = str(rng.randint(10000, 99999))
        needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
        question = "\nWhat is the pass key? The pass key is"
        return _INTRO[task], needle, question, key
    if task == "needle":
        word = rng.choice(_KEY_WORDS)
        value = str(rng.randint(1000000, 9999999))
        needle = f" One of the special magic numbers for {word} is: {value}. "
        question = (
            f"\nWhat is the special magic number for {word} mentioned in the provided text? "
            f"The special magic number for {word} mentioned in the provided text is"
        )
        return _INTRO[task], needle, question, value
    raise RecipeError(f"task: {task!r} is not one of {', '.join(TASKS)}")


def build_case(
    task: str,
    tokenizer: Any,
    haystack: torch.Tensor,
    length: int,
    depth: float,
    trial: int = 0,
    seed: int = 0,
    bos_id: int | None = None,
) -> RetrievalCase:
    """The prompt of ``length`` tokens with the needle at ``depth`` of a haystack cut from ``haystack`` ids.

    The haystack's start in the corpus and the needle's key are drawn from ``(task, length, depth, trial, seed)``.
    """
    if not 0.0 <= depth <= 1.0:
        raise RecipeError(f"depths: {depth} is not a fraction in [0, 1]")
    rng = random.Random(f"{task}|{length}|{depth:.4f}|{trial}|{seed}")
    intro, needle, question, answer = _texts(task, rng)
    head = ([bos_id] if bos_id is not None else []) + _encode(tokenizer, intro)
    nd, qu = _encode(tokenizer, needle), _encode(tokenizer, question)
    fill = length - len(head) - len(nd) - len(qu)
    if fill < 1:
        raise RecipeError(f"lengths: {length} tokens cannot hold the {task} instruction, needle and question")
    n = int(haystack.numel())
    if n < fill:
        raise RecipeError(f"data: the corpus has {n} tokens, fewer than the {fill} a {length}-token haystack needs")
    start = rng.randrange(0, n - fill + 1)
    hay = haystack[start : start + fill].tolist()
    cut = round(depth * fill)
    ids = head + hay[:cut] + nd + hay[cut:] + qu
    return RetrievalCase(task, length, depth, trial, torch.tensor(ids, dtype=torch.long), answer, len(head) + cut, fill)


_NUMBER = re.compile(r"\d+")


def is_correct(generated: str, answer: str) -> bool:
    """Exact match: the first number in the model's answer is the needle's number."""
    m = _NUMBER.search(generated)
    return m is not None and m.group(0) == answer


def answer_tokens(tokenizer: Any, case: RetrievalCase) -> int:
    """Greedy tokens generated per case: the answer's length plus 4 (room for a leading space or quote)."""
    return len(_encode(tokenizer, " " + case.answer)) + 4


def answer_case(model: Any, tokenizer: Any, case: RetrievalCase, cache: Any, new_tokens: int | None = None) -> str:
    """Greedy answer to ``case`` with ``cache`` (a fresh cache object: kvquant, DynamicCache, a baseline)."""
    from .protocols import greedy_continuation

    n_new = new_tokens or answer_tokens(tokenizer, case)
    return tokenizer.decode(greedy_continuation(model, case.ids, n_new, cache), skip_special_tokens=True)


def grid(lengths: Sequence[int], depths: Sequence[float], trials: int) -> list[tuple[int, float, int]]:
    """Every (length, depth, trial) point, lengths outermost."""
    return [(n, d, t) for n in lengths for d in depths for t in range(trials)]


def run_retrieval(
    model: Any,
    tokenizer: Any,
    haystack: torch.Tensor,
    make_cache: dict[str, Callable[[], Any]],
    task: str = "passkey",
    lengths: Sequence[int] = (1024, 2048, 4096, 8192),
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    trials: int = 1,
    seed: int = 0,
    bos_id: int | None = None,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
    on_case: Callable[[dict[str, Any]], None] | None = None,
    measure: Callable[[str, Any, int], float | None] | None = None,
    errors: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Answer every case of the grid with every config; one dict per (config, case).

    ``make_cache`` maps a config name to a function returning a fresh cache for one request (``None`` for the
    model's default cache). Cases are built once and run by every config in turn, so all configs answer the
    same prompts. ``on_case`` receives each result as it is produced (e.g. to append it to a JSON file).
    ``measure(config, cache, tokens)``: KV bytes the cache holds after answering (default: a kvquant cache's
    ``memory_report()``, None for others). ``errors``: when given, a config that raises is recorded there
    (``config -> message``) and skipped for the remaining cases instead of stopping the run.
    """
    points = grid(lengths, depths, trials)
    cases = [build_case(task, tokenizer, haystack, n, d, t, seed, bos_id) for n, d, t in points]
    it: Iterable[RetrievalCase] = progress(cases) if progress else cases
    out: list[dict[str, Any]] = []
    for case in it:
        for name, factory in make_cache.items():
            if errors is not None and name in errors:
                continue
            try:
                cache = factory()
                new = answer_tokens(tokenizer, case)
                text = answer_case(model, tokenizer, case, cache, new)
                held = (measure or _measure_held)(name, cache, case.length + new)
            except Exception as e:  # noqa: BLE001 - with ``errors``, one broken config must not stop the others
                if errors is None:
                    raise
                errors[name] = f"{type(e).__name__}: {' '.join(str(e).split())}"[:500]
                continue
            row = {
                "config": name,
                "task": task,
                "length": case.length,
                "depth": case.depth,
                "trial": case.trial,
                "answer": case.answer,
                "generated": text.strip(),
                "correct": is_correct(text, case.answer),
                "kv_bytes": held,
                "tokens": case.length + new,
            }
            out.append(row)
            if on_case:
                on_case(row)
    return out


def _measure_held(name: str, cache: Any, tokens: int) -> int | None:
    return _held_bytes(cache)


def _held_bytes(cache: Any) -> int | None:
    """KV bytes a kvquant cache held at the end of the answer (None for caches that do not report them)."""
    report = getattr(cache, "memory_report", None)
    if report is None:
        return None
    return int(report()["bytes_total"])


def accuracy_table(rows: Sequence[dict[str, Any]]) -> dict[str, dict[tuple[int, float], float]]:
    """``{config: {(length, depth): accuracy over trials}}``."""
    acc: dict[str, dict[tuple[int, float], list[bool]]] = {}
    for r in rows:
        acc.setdefault(r["config"], {}).setdefault((r["length"], r["depth"]), []).append(bool(r["correct"]))
    return {c: {k: sum(v) / len(v) for k, v in cells.items()} for c, cells in acc.items()}


def summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per config: overall accuracy, its standard error over cases, and agreement with the reference."""
    by_cfg: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_cfg.setdefault(r["config"], []).append(r)
    ref = next(iter(by_cfg), None)
    ref_ok = {(r["length"], r["depth"], r["trial"]): r["correct"] for r in by_cfg.get(ref, [])}
    out = []
    for cfg, rs in by_cfg.items():
        n = len(rs)
        acc = sum(r["correct"] for r in rs) / n
        se = (acc * (1 - acc) / max(n - 1, 1)) ** 0.5
        same = sum(r["correct"] == ref_ok.get((r["length"], r["depth"], r["trial"])) for r in rs) / n
        held = [r["kv_bytes"] for r in rs if r["kv_bytes"]]
        out.append(
            {
                "config": cfg,
                "cases": n,
                "accuracy": acc,
                "accuracy_se": se,
                "agrees_with_reference": same,
                "mean_kv_bytes": sum(held) / len(held) if held else None,
            }
        )
    return out


def heatmap(rows: Sequence[dict[str, Any]], config: str, path: Any, title: str = "") -> None:
    """The field's standard picture: accuracy per (context length, needle depth) for one config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = accuracy_table(rows)[config]
    lengths = sorted({k[0] for k in cells})
    depths = sorted({k[1] for k in cells})
    grid_ = [[cells.get((n, d), float("nan")) for n in lengths] for d in depths]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.55 * len(depths)))
    im = ax.imshow(grid_, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i, row in enumerate(grid_):
        for j, v in enumerate(row):
            ax.text(j, i, "not run" if v != v else f"{v:.2f}", ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=ax, label="exact-match accuracy")
    ax.set_title(title or config, fontsize=9)
    fig.tight_layout()
    try:
        save_figure(fig, path, dpi=110)
    finally:
        plt.close(fig)
