"""Run a recipe end to end: load, score every method under each protocol against the reference, summarize.

Order of work: for each protocol, for each window, the reference is run once, then every method on the same
tokens, and its logits are compared at once (so memory holds one window's logits at a time). A method that
cannot run here (a backend not installed, bits it does not support) or on this model (transformers' quantized
cache refuses sliding-window layers) is ``skipped`` with the reason: not run, which is no error. One that
raises is ``error`` with the message (a bug: the CLI then exits 1), and the run goes on.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from kvquant.models import load_model
from kvquant.text import load_text, token_windows, tokenize, window_bos

from .baselines import REFERENCE, Method, ReferenceMethod, elements_per_token, make_method
from .metrics import DriftAccumulator, generation_agreement, token_drift
from .protocols import PROTOCOLS, decode_logits, greedy_continuation, simulated_logits
from .recipe import Recipe, RecipeError
from .retrieval_task import RETRIEVAL_TASKS, check_cases, check_lengths, run_retrieval_task


@dataclass
class RunResult:
    recipe: Recipe
    meta: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    #: long-context retrieval: one dict per (task, config, case), see :func:`kvquant.eval.longcontext.run_retrieval`
    retrieval: list[dict[str, Any]] = field(default_factory=list)

    def ok_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["status"] == "ok"]


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[kvquant eval] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' per-call generation/cache warnings inside the measured loops."""
    lg = logging.getLogger("transformers")
    old = lg.level
    lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        lg.setLevel(old)


class _AttnGuard:
    """kvquant caches install the ``kvquant`` attention on the model; put the original back afterwards."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.original = getattr(model.config, "_attn_implementation", None) or "sdpa"

    def restore(self) -> None:
        if getattr(self.model.config, "_attn_implementation", None) != self.original:
            self.model.set_attn_implementation(self.original)


def _versions() -> dict[str, str]:
    import transformers

    v = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import kvquant

        v["kvquant"] = getattr(kvquant, "__version__", "?")
    except ImportError:  # pragma: no cover
        pass
    return v


def build_methods(recipe: Recipe, model: Any = None) -> tuple[list[Method], list[dict[str, Any]]]:
    """The reference plus one method per config entry; those unavailable here, or (given ``model``) unsupported
    on the model, become skipped rows with the reason."""
    methods: list[Method] = [ReferenceMethod()]
    skipped: list[dict[str, Any]] = []
    for entry in recipe.configs:
        if entry == REFERENCE:
            continue
        m = make_method(recipe.resolved_configs.get(entry, entry))
        m.name = entry
        reason = m.unavailable() or (m.unsupported_on(model) if model is not None else None)
        if reason:
            skipped.append({"config": entry, "kind": m.kind, "description": m.description, "reason": reason})
        else:
            methods.append(m)
    return methods, skipped


def run_recipe(recipe: Recipe, command: str = "", quiet: bool = False, progress: bool = True) -> RunResult:
    """Run ``recipe``; returns the rows (one per method and protocol) and the run's metadata."""
    old_threads = torch.get_num_threads()
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    try:
        return _run(recipe, command, quiet, progress)
    finally:
        torch.set_num_threads(old_threads)


def _run(recipe: Recipe, command: str, quiet: bool, progress: bool) -> RunResult:
    t_start = time.perf_counter()
    torch.manual_seed(recipe.seed)
    text = load_text(recipe.data)  # before the model: a bad data file fails fast
    _log(f"loading model {recipe.model} ...", quiet)
    lm = load_model(recipe.model, dtype=recipe.dtype, device=recipe.device, progress=not quiet)
    model, tok = lm.model, lm.tokenizer
    _log(f"model ready in {lm.load_seconds:.1f} s{' (converted from GGUF)' if lm.converted else ''}", quiet)
    # the whole corpus is tokenized (not only the windows' prefix): generation prompts are drawn from all of it,
    # so a run's prompts do not depend on how many windows it scores
    ids = tokenize(text.text, tok)
    bos_id = window_bos(tok, recipe.bos)
    methods, skipped = build_methods(recipe, model)
    if any(t in RETRIEVAL_TASKS for t in recipe.tasks):
        check_lengths(model, recipe.retrieval.lengths)  # before any long work
        check_cases(recipe.tasks, tok, ids, recipe.retrieval.lengths, recipe.seed)
    guard = _AttnGuard(model)
    meta: dict[str, Any] = {
        "command": command,
        "recipe": recipe.to_dict(),
        "model": lm.source,
        "model_load_seconds": round(lm.load_seconds, 2),
        "model_converted": lm.converted,
        "dtype": str(model.dtype).replace("torch.", ""),
        "device": str(next(model.parameters()).device),
        "data": text.source,
        "corpus_tokens": int(ids.numel()),
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "versions": _versions(),
        "protocols": {p: PROTOCOLS[p] for p in recipe.protocol},
        "fp16_bytes_per_token": elements_per_token(model) * 2,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    result = RunResult(recipe, meta)
    fp16_bpt = meta["fp16_bytes_per_token"]

    for protocol in recipe.protocol:
        # both protocols score the targets after the prefill: no scored position's static scales saw its future
        min_score = recipe.prefill + 1
        skip = recipe.first_window
        last = None if recipe.max_windows is None else skip + recipe.max_windows
        every = token_windows(ids, recipe.window, recipe.stride, last, bos_id, min_score)
        windows = every[skip:]
        if not windows:
            raise RecipeError(
                f"first_window: {skip} skips every window (the text has {len(every)} of {recipe.window} tokens)"
            )
        meta.setdefault("windows", {})[protocol] = len(windows)
        accs = {m.name: DriftAccumulator() for m in methods}
        secs = {m.name: 0.0 for m in methods}
        storage: dict[str, Any] = {}
        errors: dict[str, str] = {}
        steps_per_window = sum((w.ids.numel() - 1 - recipe.prefill) if protocol == "decode" else 1 for w in windows)
        total = steps_per_window * len(methods)
        unit = "tok" if protocol == "decode" else "window"
        bar = tqdm(total=total, desc=f"{protocol}", unit=unit, disable=not progress, dynamic_ncols=True)
        with _quiet_transformers():
            for w in windows:
                ref_logits = None
                for m in methods:
                    if m.name in errors:
                        bar.update((w.ids.numel() - 1 - recipe.prefill) if protocol == "decode" else 1)
                        continue
                    bar.set_postfix_str(f"window {w.index + 1}/{skip + len(windows)} {m.name}")
                    try:
                        if protocol == "decode":
                            cache = m.decode_cache(model)
                            sc = decode_logits(model, w, cache, recipe.prefill, recipe.decode_chunk, progress=bar)
                        else:
                            cache = m.simulated_cache(model)
                            sc = simulated_logits(model, w, cache, calibrate=recipe.prefill)
                            bar.update(1)
                        held = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
                        storage[m.name] = m.storage(model, cache, int(held) or int(w.ids.numel()))
                    except Exception as e:  # noqa: BLE001 - one broken method must not stop the comparison
                        if m.kind == "reference":
                            raise
                        errors[m.name] = f"{type(e).__name__}: {' '.join(str(e).split())}"[:500]
                        _log(f"{m.name} failed on {protocol}: {errors[m.name]}", quiet)
                        continue
                    finally:
                        if m.uses_kvquant_attention:
                            guard.restore()
                    if ref_logits is None:
                        ref_logits = sc.logits
                    accs[m.name].add(token_drift(ref_logits, sc.logits, sc.targets), window=w.index)
                    secs[m.name] += sc.seconds
                    del sc, cache
        bar.close()
        for m in methods:
            row: dict[str, Any] = {"config": m.name, "kind": m.kind, "protocol": protocol, "description": m.description}
            if m.name in errors:
                row.update(status="error", reason=errors[m.name])
                result.rows.append(row)
                continue
            s = accs[m.name].summary()
            st = storage[m.name]
            row.update(
                status="ok",
                avg_bits=st.avg_bits,
                bytes_per_token=st.bytes_per_token,
                kv_vs_fp16=st.bytes_per_token / fp16_bpt,
                kv_bytes_held=st.bytes_held,
                held_tokens=st.tokens,
                asymptotic_bytes_per_token=st.asymptotic_bytes_per_token,
                asymptotic_vs_fp16=st.asymptotic_bytes_per_token / fp16_bpt,
                storage_note=st.note,
                **s,
                seconds=secs[m.name],
                tok_per_s=s["n_tokens"] / secs[m.name] if secs[m.name] > 0 else None,
            )
            result.rows.append(row)
        for sk in skipped:
            result.rows.append({**sk, "protocol": protocol, "status": "skipped"})

    if recipe.generation is not None:
        _run_generation(recipe, model, ids, methods, result, guard, quiet, progress)
    for task in recipe.tasks:
        if task in RETRIEVAL_TASKS:
            run_retrieval_task(task, recipe, lm, ids, methods, skipped, result, guard, quiet, progress)
    meta["seconds_total"] = round(time.perf_counter() - t_start, 1)
    return result


def _run_generation(
    recipe: Recipe,
    model: Any,
    ids: torch.Tensor,
    methods: list[Method],
    result: RunResult,
    guard: _AttnGuard,
    quiet: bool,
    progress: bool,
) -> None:
    """Greedy continuations of N prompts taken at seeded offsets of the corpus; reported, not asserted."""
    g = recipe.generation
    assert g is not None
    n = int(ids.numel())
    if n <= g.prompt_tokens:
        _log("generation: corpus shorter than one prompt, skipped", quiet)
        return
    gen = torch.Generator().manual_seed(recipe.seed)
    starts = torch.randint(0, n - g.prompt_tokens, (g.prompts,), generator=gen).tolist()
    prompts = [ids[s : s + g.prompt_tokens] for s in starts]
    result.meta["generation"] = {
        "prompts": g.prompts,
        "prompt_tokens": g.prompt_tokens,
        "new_tokens": g.new_tokens,
        "prompt_offsets": starts,
        "what": "greedy continuations through each method's real cache, compared with the reference's",
    }
    outs: dict[str, list[list[int]] | str] = {}
    bar = tqdm(
        total=len(methods) * len(prompts), desc="generation", unit="prompt", disable=not progress, dynamic_ncols=True
    )
    with _quiet_transformers():
        for m in methods:
            seqs: list[list[int]] = []
            t0 = time.perf_counter()
            try:
                for p in prompts:
                    bar.set_postfix_str(m.name)
                    seqs.append(greedy_continuation(model, p, g.new_tokens, m.decode_cache(model)))
                    bar.update(1)
                outs[m.name] = seqs
            except Exception as e:  # noqa: BLE001
                if m.kind == "reference":
                    raise
                outs[m.name] = f"{type(e).__name__}: {' '.join(str(e).split())}"[:300]
                bar.update(len(prompts) - len(seqs))
            finally:
                if m.uses_kvquant_attention:
                    guard.restore()
            result.meta.setdefault("generation_seconds", {})[m.name] = round(time.perf_counter() - t0, 2)
    bar.close()
    ref = outs[REFERENCE]
    assert isinstance(ref, list)
    for row in result.rows:
        if row["status"] != "ok":
            continue
        o = outs.get(row["config"])
        if isinstance(o, list):
            row["gen"] = generation_agreement(ref, o)
        elif isinstance(o, str):
            row["gen"] = {"error": o}
