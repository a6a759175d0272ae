"""``kvquant calibrate`` and ``kvquant show-config``: per-head precisions from measured sensitivity.

``calibrate`` measures, on calibration text that evaluation windows do not use (the END of the corpus;
evaluation windows are cut from its start), how much each (layer, KV head)'s K and V move the final
logits when stored in each candidate precision (:mod:`kvquant.sensitivity`), caches those numbers
beside the output, allocates precisions under an average-bits budget (:mod:`kvquant.allocate`), and
writes a commented YAML config that ``KVQuantConfig.from_file`` reads as is, plus a heatmap PNG.

Library use::

    from kvquant.calibrate import calibrate
    result = calibrate(model, tokenizer, text, budget_bits=6.0, output="cfg.yaml")
    result.config.avg_bits(model)
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .allocate import (
    Allocation,
    allocate,
    candidate_bits,
    check_budget,
    check_sensitivity,
    parse_candidates,
    plan_to_config,
)
from .calibrate_target import (
    BLOCK_KEY_CANDIDATES,
    EXPECT_TOKENS,
    KEY_CANDIDATES,
    LADDER,
    RESIDUAL,
    RESIDUAL_STEP,
    TARGET_EPILOG,
    TIERS,
    VALUE_CANDIDATES,
)
from .config import CONFIG_SUFFIXES, KVPrecision, KVQuantConfig, check_int
from .errors import ArgumentError, ConfigError
from .inputs import looks_like_path
from .outputs import check_disjoint, check_output, input_paths, save_figure, staged_files
from .sensitivity import (
    METHODS,
    CalibrationTokens,
    Sensitivity,
    cache_key,
    calibration_windows,
    check_cache_file,
    estimate_fisher,
    load_cached,
    measure_kl,
    save_cached,
)
from .shape import ModelShape

#: per-token and per-channel candidates at 4 and 8 bits, K and V separately with --kv-separate: per-channel
#: keys hold outlier / offset channels (docs/results/stress-outliers.md), the static int8 scale does not
DEFAULT_CANDIDATES = "int4,int4-channel,int8-token,int8-channel,fp16"
CACHE_NAME = "kvquant-sensitivity.json"

CALIBRATE_EPILOG = """\
examples:
  kvquant calibrate --model smollm2-135m --data wikitext-2 --budget-bits 6.0 -o smollm2-6bit.yaml
  kvquant calibrate --model smollm2-135m --data wikitext-2 --budget-bits 5.5 --kv-separate -o smollm2-5.5.yaml
  kvquant calibrate --model ./my-model --data corpus.txt --budget-bits 7 --candidates int4,int8-token,fp16 \\
      --method kl --calib-windows 4 --calib-window 512 -o my.yaml
  kvquant calibrate --model smollm2-135m+kbias --budget-bits 5 --kv-separate \\
      --candidates int4,int4-channel,int8-token,int8-channel,fp16 -o kbias-5bit.yaml

What it does:
  1. takes the LAST calib-windows x calib-window tokens of --data (evaluation windows are cut from the
     start of a corpus, so the two do not overlap; the header records the token range);
  2. measures each (layer, KV head)'s sensitivity, K and V apart: the mean KL(base || quantized) of
     the next-token distribution when that unit alone is stored in a candidate precision
     (--method kl: measured, one forward per unit and candidate; --method fisher: estimated from a
     few backward passes, much faster, rank correlation with kl reported in docs/results/calibration.md);
  3. caches the sensitivities in kvquant-sensitivity.json beside -o: another budget is then seconds;
  4. allocates greedily by predicted KL decrease per added bit until the average bits per element
     (scale/zero overhead included) would exceed --budget-bits; K and V of a head share a precision
     unless --kv-separate;
  5. writes -o (commented YAML, editable by hand) and a heatmap PNG beside it.
Bits per element with head_dim 64: int4 5.0 (4 + fp16 scale and zero per 32), int4-channel 4.25 (fp16 scale
and zero per channel and 128-token block), int8 8.0, int8-token 8.25, int8-channel 8.25, fp16 16.0.
"""

SHOW_EPILOG = """\
examples:
  kvquant show-config smollm2-6bit.yaml
  kvquant show-config recipes/configs/mixed-int4-int8.yaml --model smollm2-135m
  kvquant show-config int4 --model ./my-model

The shape comes from --model, else from the config's model_shape field (written by calibrate).
"""


# ------------------------------------------------------------------------------ loading (kvquant.models, kvquant.text)
def _tokenize(text: str, tokenizer: Any) -> torch.Tensor:
    """The whole text as 1-D token ids, no special tokens (``kvquant.text.tokenize``)."""
    from kvquant.text import tokenize

    return tokenize(text, tokenizer)


def _model_shape(spec: str) -> ModelShape:
    """The shape of a model from its config alone (``kvquant.models.read_model_config``); errors name --model."""
    from kvquant.models import read_model_config

    return ModelShape.from_config(read_model_config(spec, what="--model"))


def _load_model_and_text(model: str, data: str, dtype: str) -> tuple[Any, Any, str, str, str]:
    """``(model, tokenizer, text, model label, data label)`` through :mod:`kvquant.models` and :mod:`kvquant.text`."""
    from kvquant.models import load_model
    from kvquant.text import load_text

    text = load_text(data)  # before the model: a bad --data fails fast
    loaded = load_model(model, dtype=dtype, attn_implementation="sdpa", progress=True)
    return loaded.model, loaded.tokenizer, text.text, model, f"{data} ({text.source})"


# ------------------------------------------------------------------------------------------ result
@dataclass
class CalibrationResult:
    config: KVQuantConfig
    allocation: Allocation
    sensitivity: Sensitivity
    tokens: CalibrationTokens
    bits: dict[str, float]
    header: str
    cache_hit: bool
    cache_path: Path | None = None
    heatmap: Path | None = None
    output: Path | None = None
    seconds: dict[str, float] = field(default_factory=dict)


def _text_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _model_identity(model: Any, model_name: str | None) -> dict[str, Any]:
    shape = ModelShape.of(model)
    # a cheap fingerprint of the weights: a few values of the embedding and the last layer norm
    params = list(model.parameters())
    probe = torch.cat([p.detach().flatten()[:64].float().cpu() for p in (params[0], params[-1])])
    return {
        "name": model_name or getattr(model.config, "_name_or_path", "") or type(model).__name__,
        "shape": shape.as_dict(),
        "dtype": str(next(model.parameters()).dtype),
        "probe": hashlib.sha256(probe.numpy().tobytes()).hexdigest()[:16],
    }


def calibrate(
    model: Any,
    tokenizer: Any,
    text: str,
    budget_bits: float,
    candidates: str | list[str] = DEFAULT_CANDIDATES,
    kv_separate: bool = False,
    method: str = "fisher",
    calib_window: int = 512,
    calib_windows: int = 2,
    samples: int = 8,
    seed: int = 0,
    template: KVQuantConfig | None = None,
    output: str | Path | None = None,
    cache_path: str | Path | None = None,
    use_cache: bool = True,
    heatmap: bool = True,
    model_name: str | None = None,
    data_name: str | None = None,
    command: str | None = None,
    progress: bool = False,
    force: bool = False,
) -> CalibrationResult:
    """Measure (or reuse) sensitivities, allocate under ``budget_bits``, optionally write the config and heatmap.

    Every check runs before the measurement: the options, the candidates against the model's head_dim, and
    the outputs (``output`` must be a ``.yaml``/``.yml``/``.json`` path; it, its heatmap PNG and a cache
    file that is not a kvquant cache are not overwritten unless ``force``).
    """
    t_start = time.perf_counter()
    shape = ModelShape.of(model)  # raises for a model without KV heads
    template = template or KVQuantConfig()
    cands = parse_candidates(candidates)
    check_options(method=method, calib_window=calib_window, calib_windows=calib_windows, samples=samples, seed=seed)
    check_candidates(cands, template, shape)
    bits = candidate_bits(cands, template, shape.head_dim)
    check_budget(budget_bits, bits)
    out_path, heat_path, cache_path = check_outputs(output, heatmap, cache_path, force)
    base = max(cands, key=lambda c: (bits[c], c))
    # tokens
    ids = _tokenize(text, tokenizer)
    tokens = calibration_windows(ids, calib_window, calib_windows)
    t_tok = time.perf_counter()
    key_parts = {
        "model": _model_identity(model, model_name),
        "data": {"name": data_name, "sha256_16": _text_digest(text), "start": tokens.start, "end": tokens.end,
                 "window": calib_window, "windows": calib_windows},
        "candidates": sorted(cands),
        "base": base,
        "method": method,
        "samples": samples if method == "fisher" else None,
        "seed": seed if method == "fisher" else None,
        "storage": {"group_size": template.effective_group_size(shape.head_dim), "headroom": template.headroom,
                    "share_kv_scale": template.share_kv_scale},
    }
    # labels (how the model and the text were named) are recorded, not hashed: the same weights and text
    # reached by another path or name reuse the measurement
    key = cache_key({**key_parts, "model": {k: v for k, v in key_parts["model"].items() if k != "name"},
                     "data": {k: v for k, v in key_parts["data"].items() if k != "name"}})
    sens = load_cached(cache_path, key) if (use_cache and cache_path) else None
    units = (shape.num_layers, shape.num_kv_heads)
    cache_hit = sens is not None
    if sens is None:
        report = _progress_printer(method) if progress else None
        if method == "kl":
            sens = measure_kl(model, tokens.ids, cands, base, template, progress=report)
        else:
            sens = estimate_fisher(model, tokens.ids, cands, base, template, samples=samples, seed=seed,
                                   progress=report)
        # a NaN or negative measurement (a model that overflows) is refused before it is cached
        check_sensitivity(sens.values, cands, f"sensitivity ({method}, measured)", units)
        if cache_path is not None:
            save_cached(cache_path, key, sens, key_parts)
    else:
        check_sensitivity(sens.values, cands, f"--sens-cache: {cache_path}: entry {key}", units)
    t_sens = time.perf_counter()
    alloc = allocate(sens.values, bits, budget_bits, kv_separate=kv_separate)
    cfg = plan_to_config(alloc.plan, template, shape, name=out_path.stem if out_path else None)
    achieved = cfg.avg_bits(shape)
    if achieved > budget_bits + 1e-9:  # the allocator and the config count bits the same way; guard anyway
        raise AssertionError(f"allocation: {achieved:.4f} avg bits exceeds the budget {budget_bits}")
    header = _header(
        shape=shape, cfg=cfg, alloc=alloc, sens=sens, tokens=tokens, bits=bits, budget=budget_bits,
        kv_separate=kv_separate, model_name=key_parts["model"]["name"], data_name=data_name,
        text_digest=key_parts["data"]["sha256_16"], command=command, cache_path=cache_path, key=key,
        cache_hit=cache_hit, heatmap=heat_path,
    )
    cfg.description = (
        f"calibrated: {sens.method} sensitivity, budget {budget_bits} avg bits, achieved {achieved:.3f}"
    )
    if out_path is not None:  # the config and its heatmap replace an earlier run's together (staged_files)
        check_outputs(output, heatmap, None, force)  # again, right before writing: one may have appeared
        own = [out_path.name] + ([heat_path.name] if heat_path is not None else [])
        with staged_files(out_path.parent, own, "-o") as stage:
            cfg.save(stage / out_path.name, header=header)
            if heat_path is not None:
                save_heatmap(sens, alloc, stage / heat_path.name,
                             title=f"{key_parts['model']['name']}: {out_path.name}")
    seconds = {"tokenize": round(t_tok - t_start, 2), "sensitivity": round(t_sens - t_tok, 2),
               "allocate_and_write": round(time.perf_counter() - t_sens, 2)}
    return CalibrationResult(cfg, alloc, sens, tokens, bits, header, cache_hit, cache_path, heat_path, out_path,
                             seconds)


def check_options(*, method: str, calib_window: int, calib_windows: int, samples: int, seed: int) -> None:
    """The calibration options, checked before anything is loaded (errors name the option)."""
    if method not in METHODS:
        raise ArgumentError(f"--method: unknown {method!r} (known: {', '.join(METHODS)})")
    check_int(calib_window, "--calib-window", 2, 1 << 20, ArgumentError)
    check_int(calib_windows, "--calib-windows", 1, 4096, ArgumentError)
    check_int(samples, "--samples", 1, 4096, ArgumentError)
    check_int(seed, "--seed", 0, 2**32 - 1, ArgumentError)


def check_candidates(cands: list[str], template: KVQuantConfig, shape: ModelShape) -> None:
    """Every candidate must be storable for this model (group size, code packing, rotation)."""
    for c in cands:
        try:
            template.with_updates(default=KVPrecision(c, c), layers={}, heads={}, model_shape=None).validate(shape)
        except ConfigError as e:
            field = str(e).split(":", 1)[0]
            option = {"group_size": "--group-size"}.get(field, "--candidates")
            raise ArgumentError(f"{option}: {c}: {str(e).split(': ', 1)[-1]}") from None


def check_outputs(
    output: str | Path | None, heatmap: bool, cache_path: str | Path | None, force: bool
) -> tuple[Path | None, Path | None, Path | None]:
    """``(config, heatmap, sensitivity cache)`` paths, each checked before work (see :func:`calibrate`)."""
    # (--force replaces only the config / heatmap kvquant wrote: kvquant.outputs.is_own_file)
    out_path = check_output(output, CONFIG_SUFFIXES, "-o", force, own=True) if output else None
    heat_path = None
    if out_path is not None and heatmap:
        heat_path = check_output(out_path.with_suffix(".png"), (".png",), "-o (its heatmap)", force, own=True)
    if cache_path is None and out_path is not None:
        cache_path = out_path.parent / CACHE_NAME
    if cache_path is not None:
        cache_path = check_cache_file(cache_path, force=force)
    return out_path, heat_path, cache_path


def _progress_printer(method: str):
    t0 = time.perf_counter()
    last = [0.0]

    def report(done: int, total: int) -> None:
        now = time.perf_counter()
        if now - last[0] > 5 or done == total:
            last[0] = now
            el = now - t0
            eta = el / done * (total - done) if done else 0
            print(f"[kvquant calibrate] {method}: {done}/{total}  {el:.0f}s elapsed, ~{eta:.0f}s left",
                  file=sys.stderr, flush=True)

    return report


def _count_line(cfg: KVQuantConfig, shape: ModelShape) -> str:
    plan = cfg.resolve(shape)
    out = []
    for kind in ("key", "value"):
        counts: dict[str, int] = {}
        for row in plan:
            for p in row:
                c = getattr(p, kind)
                counts[c] = counts.get(c, 0) + 1
        out.append(f"{kind[0].upper()}: " + ", ".join(f"{n} {c}" for c, n in sorted(counts.items())))
    return "; ".join(out)


def _header(*, shape, cfg, alloc, sens, tokens, bits, budget, kv_separate, model_name, data_name, text_digest,
            command, cache_path, key, cache_hit, heatmap) -> str:
    achieved = cfg.avg_bits(shape)
    n_units = shape.num_layers * shape.num_kv_heads
    lines = [
        "kvquant calibrated KV-cache config: a precision per (layer, KV head), K and V "
        + ("chosen separately" if kv_separate else "chosen together per head"),
        f"made {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by: {command or '(library call)'}",
        "",
        f"model: {model_name} ({shape.num_layers} layers x {shape.num_kv_heads} KV heads x head_dim "
        f"{shape.head_dim} = {n_units} heads)",
        f"calibration text: {data_name or '(given text)'} (sha256 {text_digest}...)",
        f"  tokens used: {tokens.describe()};",
        "  evaluation windows are cut from the start of a corpus, so they do not overlap these",
        f"sensitivity: {sens.method} -- {METHODS[sens.method]}",
        f"  per unit (layer, head, K or V) and candidate: mean per-token KL({sens.base} everywhere || that unit "
        "lowered), in nats",
        "  candidates (stored bits per element, scale/zero overhead included): "
        + ", ".join(f"{c} {bits[c]:.3f}" for c in sorted(bits, key=bits.get)),
        f"  cached in {cache_path.name if cache_path else '(not cached)'} under key {key}"
        + (" (reused)" if cache_hit else ""),
        "allocation: greedy, largest predicted KL decrease per added bit first, while the average fits",
        f"budget: {budget} avg bits per element; achieved: {achieved:.4f} (overhead included)",
        f"predicted KL (sum of chosen units' sensitivities): {alloc.predicted_kl:.5f} nats/token",
        f"counts over {n_units} heads: {_count_line(cfg, shape)}",
    ]
    if heatmap is not None:
        lines.append(f"heatmap: {heatmap.name}")
    lines += [
        "",
        "Edit freely: default, layers.N and heads.\"L.H\" (K/V: {key: ..., value: ...}) are read by",
        "KVQuantConfig.from_file; `kvquant show-config FILE` prints the table and the average bits.",
        "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ heatmap
def save_heatmap(
    sens: Sensitivity, alloc: Allocation | None, path: str | Path, title: str = "", force: bool = True
) -> Path:
    """Layers x heads heatmaps of the K and V sensitivity at the cheapest candidate, chosen precision in each cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    # the candidate with the largest sensitivities: the cheapest one
    lowest = max(sens.candidates, key=lambda c: float(sens.values[c].sum()))
    vals = sens.values[lowest].double()
    L, H = vals.shape[0], vals.shape[1]
    pos = vals[vals > 0]
    vmin = float(pos.min()) if pos.numel() else 1e-9
    vmax = max(float(vals.max()), vmin * 10)
    fig, axes = plt.subplots(1, 2, figsize=(2.2 + 1.1 * H * 2, 1.2 + 0.28 * L), squeeze=False)
    for kind, ax in enumerate(axes[0]):
        data = vals[:, :, kind].clamp_min(vmin).numpy()
        im = ax.imshow(data, aspect="auto", cmap="magma", norm=LogNorm(vmin=vmin, vmax=vmax))
        ax.set_title(f"{'K' if kind == 0 else 'V'}: KL at {lowest}", fontsize=9)
        ax.set_xlabel("KV head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(H))
        ax.set_yticks(range(L))
        ax.tick_params(labelsize=6)
        if alloc is not None:
            for li in range(L):
                for h in range(H):
                    p = alloc.plan[li][h]
                    ax.text(h, li, p.key if kind == 0 else p.value, ha="center", va="center", fontsize=5,
                            color="cyan")
        fig.colorbar(im, ax=ax, fraction=0.08)
    fig.suptitle(title or "KV sensitivity", fontsize=9)
    fig.tight_layout()
    try:
        return save_figure(fig, path, dpi=120, force=force, what="-o (its heatmap)")
    finally:
        plt.close(fig)


# ------------------------------------------------------------------------------------------ show-config
def config_table(cfg: KVQuantConfig, shape: ModelShape) -> str:
    """The per-layer table of a config: K and V precision of every KV head, bits per layer, and the average."""
    plan = cfg.resolve(shape)
    H = shape.num_kv_heads
    rows = []
    width = max(8, max(len(p.key) + len(p.value) + 1 for row in plan for p in row))
    head_cols = "  ".join(f"{'h' + str(h) + ' K/V':<{width}}" for h in range(H))
    rows.append(f"{'layer':>5}  {head_cols}  {'avg bits':>8}")
    for li, row in enumerate(plan):
        cells = "  ".join(f"{p.key + '/' + p.value:<{width}}" for p in row)
        layer_bits = sum(cfg.bits(p.key, shape.head_dim) + cfg.bits(p.value, shape.head_dim) for p in row) / (2 * H)
        rows.append(f"{li:>5}  {cells}  {layer_bits:>8.3f}")
    fp16 = 16.0
    avg = cfg.avg_bits(shape)
    rows.append(f"avg bits per K/V element (scale/zero overhead included): {avg:.4f}  "
                f"({avg / fp16:.3f}x FP16)")
    return "\n".join(rows)


def _shape_for(model: str | None, cfg: KVQuantConfig) -> ModelShape:
    if model:
        return _model_shape(model)
    if cfg.model_shape and {"layers", "kv_heads", "head_dim"} <= set(cfg.model_shape):
        ms = cfg.model_shape
        return ModelShape(int(ms["layers"]), int(ms["kv_heads"]), int(ms["head_dim"]))
    raise ArgumentError("--model: needed, the config has no model_shape to size the table by")


def cmd_show_config(args: argparse.Namespace) -> int:
    check_int(args.context, "--context", 1, 1 << 24, ArgumentError)
    cfg = KVQuantConfig.load(args.config)
    shape = _shape_for(args.model, cfg)
    cfg.check_model(shape)  # indices, storage and the scales file, as a cache would check them
    print(f"config: {args.config}" + (f"  ({cfg.description})" if cfg.description else ""))
    print(f"model shape: {shape.num_layers} layers x {shape.num_kv_heads} KV heads x head_dim {shape.head_dim}")
    for line in provenance_lines(args.config):
        print(line)
    print(config_table(cfg, shape))
    from .calibrate_target import fp16_bytes
    from .memory import human, sequence_bytes

    held = sequence_bytes(shape, cfg, args.context)
    print(f"bytes at {args.context} tokens (kvquant.memory.sequence_bytes): {human(held['total'])}, "
          f"{held['total'] / fp16_bytes(shape, args.context):.4f}x FP16 (" + ", ".join(
              f"{k} {human(v)}" for k, v in held.items() if k != "total" and v) + ")")
    return 0


PROVENANCE = ("made ", "kvquant version:", "model:", "calibration text:", "target:", "bytes held", "objective:",
              "expected", "counts:")


def provenance_lines(spec: str) -> list[str]:
    """The provenance lines of a calibrated config file's header comment (none for a preset or another file)."""
    path = Path(spec)
    if not (path.suffix.lower() in (".yaml", ".yml") and path.is_file()):
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        body = line[1:].strip()
        if body.startswith(PROVENANCE):
            out.append(body)
    return out


# ------------------------------------------------------------------------------------------ calibrate CLI
def cmd_calibrate(args: argparse.Namespace) -> int:
    # every check first: a bad option or output path must not wait for the model to load
    from kvquant.models import parse_dtype

    if args.target_bytes is not None or args.tier is not None:
        from .calibrate_target import cmd_calibrate_target

        return cmd_calibrate_target(args)
    cands = parse_candidates(args.candidates)
    if args.budget_bits is None:
        raise ArgumentError("--budget-bits: required (or --target-bytes / --tier), e.g. --budget-bits 6.0")
    check_options(method=args.method, calib_window=args.calib_window, calib_windows=args.calib_windows,
                  samples=args.samples, seed=args.seed)
    parse_dtype(args.dtype)
    template = KVQuantConfig(group_size=args.group_size) if args.group_size is not None else KVQuantConfig()
    try:
        template._check_options()
    except ConfigError as e:
        raise ArgumentError(f"--group-size: {str(e).split(': ', 1)[-1]}") from None
    force = getattr(args, "force", False)
    out_path, heat_path, cache_path = check_outputs(args.output, not args.no_heatmap, args.sens_cache, force)
    from kvquant.models import model_input_paths

    inputs = model_input_paths(args.model) + (input_paths("--data", args.data) if looks_like_path(args.data) else [])
    check_disjoint([(w, p) for w, p in (("-o", out_path), ("-o (its heatmap)", heat_path),
                                        ("--sens-cache", cache_path)) if p is not None], inputs)
    shape = _model_shape(args.model)  # the shape errors without waiting for the weights
    check_candidates(cands, template, shape)
    check_budget(args.budget_bits, candidate_bits(cands, template, shape.head_dim))
    model, tokenizer, text, model_label, data_label = _load_model_and_text(args.model, args.data, args.dtype)
    command = _command_line(args)
    res = calibrate(
        model, tokenizer, text, args.budget_bits, candidates=cands, kv_separate=args.kv_separate, method=args.method,
        calib_window=args.calib_window, calib_windows=args.calib_windows, samples=args.samples, seed=args.seed,
        template=template, output=args.output, cache_path=args.sens_cache, use_cache=not args.no_cache,
        heatmap=not args.no_heatmap, model_name=model_label, data_name=data_label, command=command, progress=True,
        force=force,
    )
    shape = ModelShape.of(model)
    print(f"wrote {res.output}  (avg bits {res.config.avg_bits(shape):.4f} <= budget {args.budget_bits}; "
          f"predicted KL {res.allocation.predicted_kl:.5f})")
    if res.heatmap:
        print(f"heatmap {res.heatmap}")
    print(f"sensitivities {'reused from' if res.cache_hit else 'cached in'} {res.cache_path}  "
          f"(sensitivity {res.seconds['sensitivity']}s)")
    return 0


def _command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run, every setting spelled out (defaults included)."""
    parts = ["kvquant", "calibrate", "--model", args.model, "--data", args.data, "--budget-bits", str(args.budget_bits),
             "--candidates", args.candidates]
    if args.kv_separate:
        parts.append("--kv-separate")
    parts += ["--method", args.method, "--calib-window", str(args.calib_window), "--calib-windows",
              str(args.calib_windows)]
    if args.method == "fisher":
        parts += ["--samples", str(args.samples), "--seed", str(args.seed)]
    if args.group_size:
        parts += ["--group-size", str(args.group_size)]
    if args.dtype != "float32":
        parts += ["--dtype", args.dtype]
    parts += ["-o", args.output]
    return " ".join(shlex.quote(str(a)) for a in parts)


def register(subparsers: Any) -> None:
    """Add the ``calibrate`` and ``show-config`` subcommands to the ``kvquant`` CLI."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = subparsers.add_parser(
        "calibrate",
        help="measure per-head sensitivity and write a mixed-precision config for a bit budget",
        description="Measure each (layer, KV head)'s K/V sensitivity on calibration text, allocate precisions "
        "under an average-bits budget, write a commented YAML config and a heatmap.",
        epilog=CALIBRATE_EPILOG + TARGET_EPILOG,
        formatter_class=fmt,
    )
    p.add_argument("--model", required=True, help="smollm2-135m, a checkpoint directory, a .gguf file or a hub id")
    p.add_argument("--data", default="wikitext-2",
                   help="calibration corpus: wikitext-2, tinystories, kjv, hub:NAME[/CONFIG][:SPLIT] or a text file "
                   "(default: wikitext-2); its LAST tokens are used")
    p.add_argument("--budget-bits", dest="budget_bits", type=float,
                   help="average stored bits per K/V element, scale/zero overhead included (e.g. 6.0)")
    p.add_argument("--target-bytes", dest="target_bytes", type=float,
                   help="the bytes the cache holds at --context, as a fraction of FP16's (0.5, 0.3, 0.27, 0.21): "
                   "a complete config over every candidate family (see below)")
    p.add_argument("--tier", choices=list(TIERS),
                   help="a named target: " + ", ".join(f"{k} = --target-bytes {v}" for k, v in TIERS.items()))
    p.add_argument("--context", type=int, default=1024,
                   help="--target-bytes: the tokens at which the bytes are counted (1024)")
    p.add_argument("--key-candidates", dest="key_candidates",
                   help=f"--target-bytes: key labels (default: {KEY_CANDIDATES}; with --residual 0 or --residual-step "
                   f"128: {BLOCK_KEY_CANDIDATES}; below 0.25x also tqc2; tqc<bits>: per-channel widths)")
    p.add_argument("--value-candidates", dest="value_candidates",
                   help=f"--target-bytes: value labels (default: {VALUE_CANDIDATES}; below 0.25x also tqv2,tq2)")
    p.add_argument("--fast", action="store_true",
                   help="--target-bytes: no tqv*/tqc* codebook candidates: faster CPU decode, at a higher error")
    p.add_argument("--residual", type=int, default=RESIDUAL,
                   help=f"--target-bytes: the newest tokens every layer keeps exactly in fp16 ({RESIDUAL}; their "
                   "bytes count in the target); 0: none, and per-channel block keys (int*-channel) become candidates")
    p.add_argument("--residual-step", dest="residual_step", type=int, default=RESIDUAL_STEP,
                   help=f"--target-bytes: tokens of the full window quantized at a time ({RESIDUAL_STEP}: it holds "
                   f"--residual to --residual + {RESIDUAL_STEP - 1}); 1: exactly --residual, slower CPU decode; 128: "
                   "whole blocks, and int*-channel keys become candidates")
    p.add_argument("--ladder", type=int, default=LADDER,
                   help=f"--target-bytes: an age ladder: the newest quantized tokens of codebook heads keep one "
                   f"refinement bit ({LADDER}; bytes counted); 0: none (needed to add evict or offload later)")
    p.add_argument("--expect-tokens", dest="expect_tokens", type=int, default=EXPECT_TOKENS,
                   help="--target-bytes: targets of each held-out window scored by exact one-token decode for the "
                   f"stated expectation ({EXPECT_TOKENS})")
    p.add_argument("--target-weight", dest="target_weight", type=float, default=1.0,
                   help="--target-bytes: weight of the target-token NLL term beside KL in the objective (1.0)")
    p.add_argument("--heldout-windows", dest="heldout_windows", type=int, default=4,
                   help="--target-bytes: calibration windows kept out of the fit to measure the expectation (4)")
    p.add_argument("--sinks", type=int, default=4, help="--target-bytes: fp16 attention-sink tokens (4)")
    p.add_argument("--candidates", default=DEFAULT_CANDIDATES,
                   help=f"precisions to choose from, comma-separated (default: {DEFAULT_CANDIDATES})")
    p.add_argument("--kv-separate", dest="kv_separate", action="store_true",
                   help="choose K and V of a head separately (default: one precision per head); usually "
                   "better, keys are more sensitive than values")
    p.add_argument("--method", default="fisher", choices=list(METHODS),
                   help="fisher: estimated from gradients, fast (default); kl: measured, one forward per unit")
    p.add_argument("--calib-window", dest="calib_window", type=int, default=512, help="tokens per window (512)")
    p.add_argument("--calib-windows", dest="calib_windows", type=int, default=2, help="windows, from the end (2)")
    p.add_argument("--samples", type=int, default=8, help="fisher: sampled backward passes per window (8)")
    p.add_argument("--seed", type=int, default=0, help="fisher: sampling seed (0)")
    p.add_argument("--group-size", dest="group_size", type=int, help="int4/int2 group size (default: 32)")
    p.add_argument("--dtype", default="float32", help="model dtype (float32)")
    p.add_argument("--sens-cache", dest="sens_cache",
                   help=f"sensitivity cache file (default: {CACHE_NAME} beside the output)")
    p.add_argument("--no-cache", dest="no_cache", action="store_true", help="measure again, ignore the cache")
    p.add_argument("--no-heatmap", dest="no_heatmap", action="store_true", help="skip the heatmap PNG")
    p.add_argument("-o", "--output", required=True,
                   help="the config to write (.yaml, .yml or .json); the heatmap PNG goes beside it")
    p.add_argument("--force", action="store_true",
                   help="overwrite -o, its heatmap and a --sens-cache file that is not a kvquant cache")
    p.set_defaults(func=cmd_calibrate)

    p = subparsers.add_parser(
        "show-config",
        help="print a config's per-layer precisions and average bits",
        description="Print the per-layer, per-head K/V precisions of a config and its average bits.",
        epilog=SHOW_EPILOG,
        formatter_class=fmt,
    )
    p.add_argument("config", help="a YAML/JSON config file or a preset name")
    p.add_argument("--model", help="the model the table is sized for (default: the config's model_shape)")
    p.add_argument("--context", type=int, default=1024, help="tokens at which the bytes held are shown (1024)")
    p.set_defaults(func=cmd_show_config)
