"""KV-cache memory: what a cache holds, and what a config would hold (the sizing formula).

The seed formula::

    KV bytes = batch x tokens x 2 (K and V) x layers x kv_heads x head_dim x bytes per element

with ``bytes per element = avg_bits / 8`` (scale and zero-point overhead included) for a config.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import KVQuantConfig
from .errors import ArgumentError, InputError
from .heavy import position_dtype
from .inputs import read_text
from .outputs import save_figure
from .shape import ModelShape

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def kv_bytes(batch: int, tokens: int, shape: ModelShape, bytes_per_element: float) -> float:
    """The seed formula: ``batch x tokens x 2 x layers x kv_heads x head_dim x bytes``."""
    return batch * tokens * 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * bytes_per_element


@dataclass(frozen=True)
class LayerLayout:
    """What one layer's store holds per sequence, from its K/V precisions (see :func:`sequence_bytes`)."""

    heads: int
    token_bytes: float  # one pooled token: every head, K and V, scales included
    static: bool  # a static-scale precision: a short prompt is held in full precision until it can be fitted
    per_block: bool  # a per-block precision: residual mode even without residual_tokens
    state_bytes: tuple[int, int]  # fitted scales / codebook state of every head, K and V: per sequence, shared
    rung_bytes: tuple[int, int]  # one age-ladder row of every head, first and second rung
    refined_heads: int = 0  # heads with a first rung on K or V (a heavy row's position is held per such head)


def layouts(shape: ModelShape, config: KVQuantConfig) -> list[LayerLayout]:
    """Each layer's :class:`LayerLayout` under ``config`` (builds each precision's quantizer once)."""
    from .dense import CALIB_MIN_TOKENS
    from .quantizers import make_quantizer  # (config -> quantizer: the quantizers know their own layouts)
    from .quantizers.base import spec_bits

    D, bs = shape.head_dim, config.block_size
    made: dict[str, tuple[Any, tuple[int, int]]] = {}
    plan = config.resolve(shape)
    for name in {n for row in plan for p in row for n in (p.key, p.value)}:
        q = make_quantizer(name, D, group_size=config.effective_group_size(D), block_size=bs)
        x = torch.randn(1, 1, max(bs, CALIB_MIN_TOKENS), D, generator=torch.Generator().manual_seed(0))
        state = (q.fit(x) if q.space else None) or q.calibrate(x.abs().amax(dim=(2, 3)))
        nbytes = [0, 0]  # per sequence (one row of [B, H, ...]), shared by every sequence (e.g. rotation signs)
        for n, t in state.items():
            nbytes[not q.per_sequence(n, t)] += t.numel() * t.element_size()
        made[name] = q, (nbytes[0], nbytes[1])
    out = []
    for row in plan:
        names = [n for p in row for n in (p.key, p.value)]
        qs = [made[n][0] for n in names]
        refined = sum(any(made[n][0].rung_parts(1) for n in (p.key, p.value)) for p in row)
        rungs = (0, 0)
        if (config.ladder_tokens or config.heavy_tokens) and any(q.rung_parts(1) for q in qs):
            rungs = tuple(sum(spec_bits(q.rung_parts(r)) for q in qs) // 8 for r in (1, 2))  # type: ignore[assignment]
        out.append(LayerLayout(
            heads=len(row), token_bytes=sum(config.bits(n, D) for n in names) * D / 8,
            static=any(q.static for q in qs), per_block=any(q.per_block for q in qs),
            state_bytes=(sum(made[n][1][0] for n in names) + (len(row) * D * 4 if config.centers_keys else 0),
                         sum(made[n][1][1] for n in names)),
            rung_bytes=rungs, refined_heads=refined))  # fmt: skip
    return out


def sequence_bytes(
    shape: ModelShape, config: KVQuantConfig, tokens: int, batch: int = 1, layout: list[LayerLayout] | None = None
) -> dict[str, int]:
    """Bytes a cache of ``batch`` sequences of ``tokens`` each holds under ``config``, laid out as
    :mod:`kvquant.store` lays it out (``layout``: :func:`layouts` of ``shape`` and ``config``, when at hand).

    * ``pool``: the quantized rows, in whole blocks of ``block_size`` tokens (per layer); in residual mode
      (``residual_tokens`` > 0, or a per-block precision) the pool ends where the residual window starts.
    * ``dense``: the full-precision (2-byte) rows: the ``sink_tokens`` buffer (the sinks are in the pool too), the
      residual window (``residual_tokens`` plus up to ``residual_step - 1`` tokens waiting to be quantized), and a
      prompt shorter than ``CALIB_MIN_TOKENS`` that static scales are not fitted on yet.
    * ``ladder``: the age ladder's refinement rows (``ladder_tokens`` / ``ladder2_tokens`` newest pool tokens of the
      heads whose precision has those rungs, :meth:`~kvquant.quantizers.Quantizer.rung_parts`).
    * ``heavy``: the heavy rows (``heavy_tokens``, picked when the prompt is written: here the whole context is
      taken as the prompt): their first-rung parts and 2-byte positions (4 past 32,767 tokens), of the pool rows
      below the ladder's.
    * ``state``: each head's fitted scales or codebook state and the key mean (``center_keys``): per sequence, and
      once for all of them (a codebook's rotation signs).
    * ``total``: their sum. Not modelled: eviction (``evict`` keeps fewer tokens), sliding-window layers and per-head
      lanes (no ladder there), and blocks shared between sequences (prefix reuse, beams).
    """
    from .dense import CALIB_MIN_TOKENS

    out = {"pool": 0, "dense": 0, "ladder": 0, "heavy": 0, "state": 0}
    if tokens <= 0:
        return {**out, "total": 0}
    bs, r = config.block_size, config.residual_tokens
    for lay in layout if layout is not None else layouts(shape, config):
        if lay.static and tokens < CALIB_MIN_TOKENS:
            dense = tokens  # (held until the static scales can be fitted)
        elif r > 0 or lay.per_block:
            dense = tokens if tokens <= r else r + (tokens - r) % (config.residual_step or bs)
        else:
            dense = 0
        pooled = tokens - dense
        out["pool"] += batch * round(-(-pooled // bs) * bs * lay.token_bytes)
        out["dense"] += batch * (config.sink_tokens + dense) * 2 * lay.heads * shape.head_dim * 2
        out["state"] += batch * lay.state_bytes[0] + lay.state_bytes[1] if pooled else 0
        out["ladder"] += batch * sum(min(n, pooled) * b for n, b in zip((config.ladder_tokens, config.ladder2_tokens),
                                                                         lay.rung_bytes, strict=True))  # fmt: skip
        below = pooled - config.ladder_tokens  # the prompt's pool rows heavy rows are picked among
        if config.heavy_tokens and lay.refined_heads and below > 0:
            n = min(config.heavy_tokens, below)
            at = position_dtype(below).itemsize
            out["heavy"] += batch * n * (lay.rung_bytes[0] + lay.refined_heads * at)
    out["total"] = sum(out.values())
    return out


def parse_bytes(text: str, what: str = "--budget") -> int:
    """``"8GiB"``, ``"500MB"``, ``"1e9"`` -> bytes (``what`` names the option in the error); a rate such as
    ``"4.8TB/s"`` gives its bytes per second."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*?)\s*(?:/s)?\s*", str(text))
    try:
        value = float(m.group(1)) * _UNITS[m.group(2).lower()] if m else math.nan
    except (ValueError, KeyError):
        value = math.nan
    if not (math.isfinite(value) and 0 < value < 2**80):
        raise ArgumentError(f"{what}: {text!r} is not a size like 8GiB, 500MB or 1e9")
    return int(value)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def memory_report(cache: Any) -> dict[str, Any]:
    """Bytes held by a :class:`~kvquant.cache.QuantizedKVCache` (see its ``memory_report``).

    Blocks shared by several rows (beams) or caches (prefix reuse) count once: per layer, the distinct
    blocks of all rows. ``bytes_shared``: those referenced more than once; ``bytes_moved``: quantized
    bytes copied by copy-on-write (a shared partial block written after a reorder). With ``offload``,
    ``bytes_device`` + ``bytes_host`` = ``bytes_total``: what the compute device holds (recent blocks, sinks, dense
    buffers, scales) and what the host tier holds (cold blocks); ``bytes_moved_to_host``: bytes moved there."""
    shape: ModelShape = cache.shape
    per_layer: list[dict[str, Any]] = []
    per_precision: dict[str, int] = {}
    totals = {"keys": 0, "values": 0, "scales": 0, "dense": 0, "index": 0, "reserved": 0, "shared": 0, "blocks": 0,
              "host": 0, "blocks_host": 0, "moved_to_host": 0}  # fmt: skip
    batch = moved = 0
    for i, layer in enumerate(cache.layers):
        store = layer.store
        if store is None:
            per_layer.append({"layer": i, "bytes": 0})
            continue
        batch = store.batch
        moved += store.bytes_moved
        mem = store.memory()
        for k in totals:
            totals[k] += mem[k]
        layer_bytes = mem["keys"] + mem["values"] + mem["scales"] + mem["dense"] + mem["index"]
        per_layer.append({"layer": i, "bytes": layer_bytes, **mem})
        for g in store.groups:
            for kind, s in (("key", g.key), ("value", g.value)):
                name = f"{s.quantizer.name} ({kind}s)"
                held = store.held_bytes(s)
                per_precision[name] = per_precision.get(name, 0) + held
        for what, (k, _v) in store.dense_buffers().items():
            name = f"{str(k.dtype).removeprefix('torch.')} ({what})"
            per_precision[name] = per_precision.get(name, 0) + k.numel() * k.element_size() * 2
        if store.refine.ladder_n:  # the age ladder's refinement rows (in keys / values above)
            per_precision["refinement (ladder)"] = (per_precision.get("refinement (ladder)", 0)
                                                    + store.refine.ladder_bytes())
        if store.refine.heavy:  # heavy rows' refinement parts and positions (in keys / values / index above)
            per_precision["refinement (heavy rows)"] = per_precision.get("refinement (heavy rows)", 0) + \
                store.refine.heavy_bytes()
    tokens = cache.get_seq_length()
    total = totals["keys"] + totals["values"] + totals["scales"] + totals["dense"] + totals["index"]
    fp16_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2
    per_token = total / (tokens * batch) if tokens and batch else 0.0
    return {
        "config": cache.kv_config.name,
        "session_id": getattr(cache, "session_id", None),
        "tokens": tokens,
        "batch": batch,
        "bytes_total": total,
        "bytes_keys": totals["keys"],
        "bytes_values": totals["values"],
        "bytes_scales": totals["scales"],
        "bytes_dense": totals["dense"],
        # eviction: each kept token's original position (int32 per slot and KV head) and H2O/TOVA scores
        "bytes_index": totals["index"],
        "bytes_shared": totals["shared"],
        "bytes_reserved": totals["reserved"],
        "bytes_moved": moved,
        # offload: bytes held on the compute device and in the host tier (they add up to bytes_total)
        "bytes_device": total - totals["host"],
        "bytes_host": totals["host"],
        "bytes_moved_to_host": totals["moved_to_host"],
        "blocks": totals["blocks"],
        "blocks_host": totals["blocks_host"],
        "bytes_per_block_all_layers": sum(la.store.blocks.bytes_per_block for la in cache.layers
                                          if la.store is not None),
        "bytes_per_token": per_token,
        "fp16_bytes_per_token": fp16_per_token,
        "ratio_vs_fp16": per_token / fp16_per_token if per_token else 0.0,
        "formula_bytes": kv_bytes(batch, tokens, shape, cache.kv_config.avg_bits(shape) / 8),
        "clipped_values": cache.clipped_values(),
        # fraction of the values written through static (per-head) scales that were clipped
        "clipped": cache.clipped_rate(),
        "per_layer": per_layer,
        "per_precision": per_precision,
    }


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (the length that ``q`` percent of requests fit in)."""
    s = sorted(values)
    if not s:
        raise InputError("--lengths: the file holds no lengths")
    return float(s[max(0, math.ceil(q / 100 * len(s)) - 1)])


def read_lengths(path: str | Path) -> list[int]:
    """One request length (tokens) per line, or whitespace/comma separated; ``#`` comments allowed."""
    out = []
    for n, line in enumerate(read_text(path, "--lengths").splitlines(), 1):
        line = line.split("#", 1)[0]
        for tok in re.split(r"[,\s]+", line.strip()):
            if not tok:
                continue
            try:
                v = int(float(tok))
            except (ValueError, OverflowError):
                raise InputError(f"--lengths: {path}:{n}: {tok!r} is not a length") from None
            if v < 0:
                raise InputError(f"--lengths: {path}:{n}: negative length {v}")
            out.append(v)
    if not out:
        raise InputError(f"--lengths: {path} holds no lengths")
    return out


def estimate(
    shape: ModelShape,
    config: KVQuantConfig,
    context: int,
    batch: int = 1,
    budget: int | None = None,
    lengths: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Sizing figures for FP16 and ``config``: bytes at (context, batch), what fits a budget, P95/P99.

    ``config_bytes`` is :func:`sequence_bytes` (the store's layout: whole blocks, fp16 sinks and residual
    window, ladder rows, scale state), which is what a cache holds; ``formula_bytes`` is the seed formula at
    ``avg_bits``, which leaves the fixed per-sequence bytes out (they weigh most at short contexts)."""
    bits = config.avg_bits(shape)
    layout = layouts(shape, config)
    held = functools.cache(lambda t, b=batch: sequence_bytes(shape, config, t, b, layout)["total"])
    parts = sequence_bytes(shape, config, context, batch, layout)
    out: dict[str, Any] = {
        "shape": shape.as_dict(),
        "config": config.name,
        "avg_bits": bits,
        "context": context,
        "batch": batch,
        "fp16_bytes": kv_bytes(batch, context, shape, 2.0),
        "config_bytes": parts["total"],
        "config_parts": {k: v for k, v in parts.items() if k != "total"},
        "formula_bytes": kv_bytes(batch, context, shape, bits / 8),
    }
    out["ratio_vs_fp16"] = out["config_bytes"] / out["fp16_bytes"]
    if budget is not None:
        out["budget"] = budget
        out["fp16_max_context"] = int(budget // kv_bytes(batch, 1, shape, 2.0))
        out["fp16_max_batch"] = int(budget // kv_bytes(1, context, shape, 2.0))
        out["config_max_context"] = largest_fitting(lambda t: held(t) <= budget)
        out["config_max_batch"] = largest_fitting(lambda b: held(context, b) <= budget)
    if lengths:
        p95, p99 = percentile(lengths, 95), percentile(lengths, 99)
        out["lengths"] = {"n": len(lengths), "p50": percentile(lengths, 50), "p95": p95, "p99": p99,
                          "max": float(max(lengths))}
        for q, v in (("p95", p95), ("p99", p99)):
            out[f"{q}_fp16_bytes"] = kv_bytes(batch, int(v), shape, 2.0)
            out[f"{q}_config_bytes"] = held(int(v))
    return out


def largest_fitting(fits: Callable[[int], bool], hi: int = 1 << 40) -> int:
    """The largest ``t`` in ``[0, hi]`` with ``fits(t)`` (``fits`` true up to some length, then false)."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def plot_lengths_cdf(lengths: Sequence[int], path: str | Path, marks: dict[str, float], force: bool = True) -> None:
    """Save the empirical CDF of request lengths, with P95/P99 marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = sorted(lengths)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.step(s, [(i + 1) / len(s) for i in range(len(s))], where="post")
    for name, v in marks.items():
        ax.axvline(v, linestyle="--", color="gray")
        ax.text(v, 0.05, f" {name}={int(v)}", rotation=90, va="bottom")
    ax.set_xlabel("request length (tokens)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Request lengths: size the cache by P95/P99, not the model's max context")
    fig.tight_layout()
    try:
        save_figure(fig, path, dpi=120, force=force, what="--plot")
    finally:
        plt.close(fig)
