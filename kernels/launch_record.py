"""The decode and chunk launches of every variant the compile tools enumerate, recorded as plain data.

A launch decision is pure Python (:func:`~kvquant.kernels.triton_compile_check.meta_launches` builds it on
``meta`` tensors; nothing runs), so it can be written down and compared: :func:`record` returns, for each
variant, every :class:`~kvquant.kernels.triton_launch.Launch` the runtime launcher makes for it -- the kernel's
name, the grid, the constexprs and launch options (``num_warps``, ``num_stages``, ``maxnreg``) and the
positional arguments (tensors by dtype, shape and strides; scalars by value). ``tests/data/decode_launches.json.gz``
holds the record of the launcher as it is; ``tests/test_launch_table.py`` regenerates it and fails on any
difference. The launches depend on the installed triton release only through
:data:`~kvquant.kernels.triton_decode_table.CHANNEL_KEYS_TRANSPOSED`, which the record states.

    python -m kvquant.kernels.launch_record tests/data/decode_launches.json.gz     # rewrite the record
"""

from __future__ import annotations

import gzip
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch

from .triton_compile_check import matrix, meta_launches
from .triton_launch import Launch
from .unsupported import Unsupported

#: kinds whose pairs select among the decode launcher's kernels and options (the rows kernels, the transposed
#: int8 kernel, the packed and per-channel fallbacks, the codebooks, fp8, fp16)
PAIR_KINDS = ("fp16", "int8", "int8-token", "int4", "int3", "int2", "int4-channel", "fp8-e4m3", "tq3")
#: (head_dim, rep) of the pairs: the shapes the launcher's choice depends on (tile length, head rows, GQA 1)
PAIR_SHAPES = ((64, 4), (128, 1), (128, 4), (128, 8), (256, 4))
#: programs per SM the compile matrices' decode variants are also recorded at (the split count, hence the grid,
#: follows it); ``None``: the default rule, the only one recorded for the other variants
OCCUPANCIES = (None, 1, 2)


def variants() -> list[tuple]:
    """``(variant, occupancies)`` in a fixed order without repeats, a variant being ``(kernel, K, V, dot, head_dim,
    rep, has_range)``: the compile check's quick and full matrices (decode at :data:`OCCUPANCIES`), then every pair
    of :data:`PAIR_KINDS` (decode at fp16 queries with a range; :data:`PAIR_SHAPES`). ``reduce``
    specs are folded into ``decode`` (a decode variant records its reduction too)."""
    seen: dict[tuple, tuple] = {}
    for full in (False, True):
        for kernel, k, v, dot, d, rep, has_range, _arch in matrix(full):
            kernel = "decode" if kernel == "reduce" else kernel
            seen[(kernel, k, v, dot, d, rep, has_range)] = OCCUPANCIES if kernel == "decode" else (None,)
    for (k, v), (d, rep) in itertools.product(itertools.product(PAIR_KINDS, repeat=2), PAIR_SHAPES):
        seen.setdefault(("decode", k, v, 1, d, rep, True), (None,))
    return list(seen.items())


def _value(x: Any) -> Any:
    if isinstance(x, torch.Tensor):  # dtype[shape]/[strides]
        shape, stride = ",".join(map(str, x.shape)), ",".join(map(str, x.stride()))
        return f"{str(x.dtype).removeprefix('torch.')}[{shape}]/[{stride}]"
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    raise TypeError(f"launch argument of type {type(x).__name__}: not recordable")


def launch_record(launch: Launch) -> dict:
    """One launch as JSON-able data: ``kernel`` (the jit function's name), ``grid``, ``meta`` (constexprs and
    launch options, sorted by name) and ``args`` (positional, :func:`_value`)."""
    fn = getattr(launch.kernel, "fn", launch.kernel)
    return {
        "kernel": fn.__name__,
        "grid": list(launch.grid),
        "meta": {k: _value(launch.meta[k]) for k in sorted(launch.meta)},
        "args": [_value(a) for a in launch.args],
    }


def _launches(kernel: str, spec: tuple, per_sm: int | None) -> list[Launch]:
    pairs, dot, d, rep, has_range = [(spec[0], spec[1], 2)], *spec[2:]
    if kernel == "chunk":
        return meta_launches("chunk", pairs, dot, d, rep, has_range)
    decode = meta_launches("decode", pairs, dot, d, rep, has_range, occupancy=lambda _: per_sm)
    return decode + meta_launches("reduce", pairs, dot, d, rep, has_range, occupancy=lambda _: per_sm)


def record() -> dict:
    """The record: ``{"channel_keys_transposed": bool, "variants": [{"variant": [...], "occupancy": n, "launches":
    [...]}]}``. A variant the launcher refuses (``Unsupported``, ``ValueError``) is recorded with its error."""
    from . import triton_decode_table

    rows = []
    for (kernel, *spec), occupancies in variants():
        for per_sm in occupancies:
            row: dict[str, Any] = {"variant": [kernel, *spec], "occupancy": per_sm}
            try:
                row["launches"] = [launch_record(x) for x in _launches(kernel, tuple(spec), per_sm)]
            except (ValueError, Unsupported) as e:
                row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
    return {"channel_keys_transposed": triton_decode_table.CHANNEL_KEYS_TRANSPOSED, "variants": rows}


def table_use() -> dict[str, int]:
    """How many of the decode variants (:func:`variants`) each row of
    :data:`~kvquant.kernels.triton_decode_table.DECODE_KERNELS` serves: the table as the compile tools enumerate
    it (a row no variant takes is neither compiled nor recorded)."""
    from .triton_compile_check import meta_groups
    from .triton_decode_table import DECODE_KERNELS, choose, launch_config

    use = {row.name: 0 for row in DECODE_KERNELS}
    for (kernel, k, v, dot, d, _rep, _has_range), _ in variants():
        if kernel == "decode":
            ((_, kop, vop),) = meta_groups([(k, v, 2)], 2, d, 4096)
            use[choose(kop, vop, dot, d, launch_config(kop, vop, dot, d)[1]).name] += 1
    return use


def dumps(rec: dict) -> str:
    """The record as the file holds it: one variant per line."""
    lines = [json.dumps(row, sort_keys=True, separators=(",", ":")) for row in rec["variants"]]
    head = json.dumps({k: v for k, v in rec.items() if k != "variants"}, sort_keys=True)[:-1]
    return head + ', "variants": [\n' + ",\n".join(lines) + "\n]}\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m kvquant.kernels.launch_record OUT.json.gz")
        return 2
    Path(argv[0]).write_bytes(gzip.compress(dumps(record()).encode(), mtime=0))  # mtime 0: the same bytes each run
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
