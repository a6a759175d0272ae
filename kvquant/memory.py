"""KV-cache memory: what a cache holds, and what a config would hold (the sizing formula).

The seed formula::

    KV bytes = batch x tokens x 2 (K and V) x layers x kv_heads x head_dim x bytes per element

with ``bytes per element = avg_bits / 8`` (scale and zero-point overhead included) for a config.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import KVQuantConfig
from .errors import ArgumentError, InputError
from .inputs import read_text
from .outputs import save_figure
from .shape import ModelShape

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def kv_bytes(batch: int, tokens: int, shape: ModelShape, bytes_per_element: float) -> float:
    """The seed formula: ``batch x tokens x 2 x layers x kv_heads x head_dim x bytes``."""
    return batch * tokens * 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * bytes_per_element


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
        if store.ladder_n:  # the age ladder's refinement rows (in keys / values above)
            per_precision["refinement (ladder)"] = per_precision.get("refinement (ladder)", 0) + store.ladder_bytes()
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
        raise ValueError("lengths: the file holds no lengths")
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
    """Sizing figures for FP16 and ``config``: bytes at (context, batch), what fits a budget, P95/P99."""
    bits = config.avg_bits(shape)
    out: dict[str, Any] = {
        "shape": shape.as_dict(),
        "config": config.name,
        "avg_bits": bits,
        "context": context,
        "batch": batch,
        "fp16_bytes": kv_bytes(batch, context, shape, 2.0),
        "config_bytes": kv_bytes(batch, context, shape, bits / 8),
    }
    out["ratio_vs_fp16"] = out["config_bytes"] / out["fp16_bytes"]
    if budget is not None:
        out["budget"] = budget
        for name, bpe in (("fp16", 2.0), ("config", bits / 8)):
            out[f"{name}_max_context"] = int(budget // kv_bytes(batch, 1, shape, bpe))
            out[f"{name}_max_batch"] = int(budget // kv_bytes(1, context, shape, bpe))
    if lengths:
        p95, p99 = percentile(lengths, 95), percentile(lengths, 99)
        out["lengths"] = {"n": len(lengths), "p50": percentile(lengths, 50), "p95": p95, "p99": p99,
                          "max": float(max(lengths))}
        for q, v in (("p95", p95), ("p99", p99)):
            out[f"{q}_fp16_bytes"] = kv_bytes(batch, int(v), shape, 2.0)
            out[f"{q}_config_bytes"] = kv_bytes(batch, int(v), shape, bits / 8)
    return out


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
