"""Compile the Triton kernels for a CUDA target without a GPU (ahead of time, to PTX and cubin).

The CPU tests run the kernels under Triton's interpreter, which executes them with numpy semantics
and does not type-check them as the compiler does. This module compiles a matrix of kernel
specialisations with ``triton.compile`` for ``sm_90`` (Hopper) / ``sm_80`` (Ampere) -- no driver or
GPU is needed, ptxas ships with triton -- so that a compile error is caught on CPU. It does not
run the code: correctness of the compiled kernels still needs a GPU (``benchmarks/gpu_check.sh``).

    python -m kvquant.kernels.triton_compile_check            # the full matrix, with ptxas register / spill counts

Must run with ``TRITON_INTERPRET`` unset (the kernels must be compiled functions).
"""

from __future__ import annotations

import itertools
import os
import sys
import time

import torch

from kvquant.blocks import LayerBlocks
from kvquant.quantizers import channel_precision, make_quantizer
from kvquant.snapshot import PartSnapshot, RowsMemo

from .triton_dequant import operand
from .triton_launch import compile_launch, resource_usage

# name -> (store precision, native fp8 loads); "-bits": the integer fp8 decode used below sm_89
KINDS = {
    **{p: (p, True) for p in ("fp16", "bf16", "int8", "int8-token", "int4", "int3", "int2", "int4-channel",
                              "int3-channel", "int2-channel", "fp8-e4m3", "fp8-e5m2", "tq4", "tq3", "tq2")},
    "fp8-e4m3-bits": ("fp8-e4m3", False),
    "fp8-e5m2-bits": ("fp8-e5m2", False),
    "tqc4": ("tqc4", True),  # per-channel widths (tqc-<widths>), a real SmolLM2 key head's: see TQC_EXAMPLES
    "tqc3": ("tqc3", True),
    **{p: (p, True) for p in ("tqv4", "tqv3", "tqv2")},  # 2-D vector codebooks: a code per channel pair
    **{p: (p, True) for p in ("tqt4", "tqt3", "tqt2")},  # trellis codes: a window of a circular code stream
}  # fmt: skip
#: per-channel key widths of two real SmolLM2-135M key heads (head_dim 64, RoPE halves [0, 32) / [32, 64)):
#: research/configs/tqc4-v72-r15s1.yaml (widths 1..8, 4 bits average) and tqc3-r7s1.yaml (1..6, 3 bits)
TQC_EXAMPLES = {
    "tqc4": "1111223334344444444455465555678611212233333445445555545555556667",
    "tqc3": "6555535325252522252111115323111265555353252525222422111254232122",
}
QDTYPE = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16}
META = torch.device("meta")
BLOCK_SIZE = 128  # the store's block size (tokens per scale row of the per-channel kinds)


def kind_precision(name: str, head_dim: int) -> str:
    """The config precision of a :data:`KINDS` precision at ``head_dim``: ``tqc4`` / ``tqc3`` become ``tqc-<widths>``
    of :data:`TQC_EXAMPLES`, each RoPE half's channels stretched to ``head_dim / 2`` (64: as calibrated)."""
    if name not in TQC_EXAMPLES:
        return name
    w64 = [int(c) for c in TQC_EXAMPLES[name]]
    if head_dim < 64 or head_dim % 64:
        raise ValueError(f"head_dim: {head_dim} is not a multiple of 64 (the {name} example's)")
    half, f = head_dim // 2, head_dim // 64
    return channel_precision([w64[(j // half) * 32 + (j % half) // f] for j in range(head_dim)])


def meta_store(precision: str, batch: int, heads: int, head_dim: int, capacity: int) -> PartSnapshot:
    """A K or V of ``precision`` on the ``meta`` device, as the attention's snapshot holds it: the runtime's part
    shapes, dtypes and strides (the layer's block arena), no data."""
    quantizer = make_quantizer(kind_precision(precision, head_dim), head_dim, block_size=BLOCK_SIZE)
    blocks = LayerBlocks([(heads, quantizer.parts(), quantizer.parts())], BLOCK_SIZE, META,
                         num_blocks=batch * -(-capacity // BLOCK_SIZE))  # fmt: skip
    state = {"scale": torch.empty(heads, device=META)} if quantizer.static else {}
    return PartSnapshot(quantizer, blocks.parts[0]["key"], state, batch, heads, BLOCK_SIZE, META, RowsMemo())


def meta_groups(pairs: list[tuple[str, str, int]], batch: int, head_dim: int, capacity: int):
    """Head groups ``(head_index, K operand, V operand)`` of a layer whose groups are ``pairs`` =
    (K kind, V kind, KV heads) (kinds: :data:`KINDS`), on the ``meta`` device."""
    groups, first = [], 0
    for k, v, heads in pairs:
        ops = []
        for name in (k, v):
            precision, native = KINDS[name]
            ops.append(operand(meta_store(precision, batch, heads, head_dim, capacity), head_dim, native))
        idx = torch.arange(first, first + heads, dtype=torch.int32, device=META)
        groups.append((idx, *ops))
        first += heads
    return groups


def meta_launches(kernel: str, pairs: list[tuple[str, str, int]], dot: int, D: int, rep: int, has_range: bool,
                  batch: int = 2, past_len: int = 4095, capacity: int = 4096, q_len: int = 16, sms: int = 132,
                  occupancy=None, **overrides) -> list:
    """The launches the runtime launcher (``decode_launches`` / ``chunk_launches``) makes for these
    shapes, on ``meta`` tensors. ``occupancy`` (decode: launch -> programs per SM of its binary, or ``None``)
    sets the split count as the runtime's compile would (``decode_launches``); without it, the default rule.
    ``overrides`` (num_warps, BLOCK_N, BLOCK_M) replace launch options."""
    from . import triton_chunk, triton_decode

    kv_heads = sum(h for _, _, h in pairs)
    tq = 1 if kernel in ("decode", "reduce") else q_len
    query = torch.empty((batch, kv_heads * rep, tq, D), dtype=QDTYPE[dot], device=META)
    fresh = torch.empty((batch, kv_heads, tq, D), dtype=QDTYPE[dot], device=META)
    out = torch.empty_like(query)
    ranges = None
    if has_range:
        ranges = tuple(torch.empty((batch, tq), dtype=torch.int32, device=META) for _ in range(2))
    groups = meta_groups(pairs, batch, D, capacity)
    table = torch.empty((batch, -(-capacity // BLOCK_SIZE)), dtype=torch.int32, device=META)
    paged = dict(table=table, block_size=BLOCK_SIZE)
    if kernel == "chunk":
        launches = triton_chunk.chunk_launches(query, fresh, fresh, groups, kv_heads, past_len, ranges, D**-0.5,
                                               out, dot, **paged)  # fmt: skip
    else:
        launches = triton_decode.decode_launches(query, fresh, fresh, groups, kv_heads, past_len, ranges, D**-0.5,
                                                 out, dot, sms=sms, occupancy=occupancy or (lambda _: None),
                                                 **paged)  # fmt: skip
        launches = launches[-1:] if kernel == "reduce" else launches[:-1]
    for launch in launches:
        launch.meta.update({k: v for k, v in overrides.items() if v is not None})
    return launches


def compile_one(kernel: str, k: str, v: str, dot: int, D: int, rep: int, has_range: bool, arch: int,
                num_warps: int | None = None, block_n: int | None = None, block_m: int | None = None):
    """Compile one specialisation (2 KV heads of K/V kinds ``k``/``v``) exactly as the runtime launcher
    would launch it; returns the compiled kernel (raises on a compile error)."""
    overrides = dict(num_warps=num_warps, BLOCK_N=block_n, BLOCK_M=block_m if kernel == "chunk" else None)
    (launch,) = meta_launches(kernel, [(k, v, 2)], dot, D, rep, has_range, **overrides)
    return compile_launch(launch, arch)


def matrix(full: bool):
    """(kernel, K, V, dot, D, rep, has_range, arch) specialisations to compile."""
    if not full:
        yield ("decode", "int8", "int8", 1, 128, 4, False, 90)
        yield ("decode", "fp8-e4m3", "int8-token", 1, 128, 4, True, 90)
        yield ("decode", "int4", "int2", 2, 64, 8, True, 90)
        yield ("decode", "int3", "int3", 1, 128, 4, True, 90)
        yield ("decode", "fp8-e4m3-bits", "fp8-e5m2-bits", 0, 64, 1, True, 80)
        yield ("reduce", "fp16", "fp16", 1, 128, 4, True, 90)
        yield ("chunk", "int8-token", "int4", 1, 128, 4, True, 90)
        yield ("chunk", "bf16", "fp8-e5m2", 2, 64, 3, False, 90)
        yield ("decode", "int4-channel", "int4", 1, 128, 4, True, 90)
        yield ("chunk", "int3-channel", "int2-channel", 2, 64, 2, True, 90)
        yield ("decode", "tq4", "tq3", 1, 128, 4, True, 90)  # codebooks: levels and norms read in-kernel
        yield ("chunk", "tq2", "tq4", 2, 64, 2, False, 90)
        yield ("decode", "tqc4", "tq3", 1, 128, 4, True, 90)  # tqc: per-channel widths read in-kernel
        yield ("chunk", "tqc3", "tqc4", 2, 64, 2, False, 90)
        yield ("decode", "tqv3", "tq3", 1, 128, 4, True, 90)  # tqv: pair codes, codeword table read in-kernel
        yield ("chunk", "tqv4", "tqv2", 2, 64, 2, False, 90)
        yield ("decode", "tqt3", "tq3", 1, 128, 4, True, 90)  # tqt: windows of the circular stream, table lookup
        yield ("chunk", "tqt4", "tqt2", 2, 64, 2, False, 90)
        return
    for k, dot in itertools.product(KINDS, (0, 1, 2)):
        yield ("decode", k, k, dot, 128, 4, True, 90)
    for k in ("int8", "int4", "fp8-e4m3", "int4-channel", "tqc4", "tqv3"):
        yield ("chunk", k, k, 1, 128, 4, True, 90)
    yield ("reduce", "fp16", "fp16", 1, 128, 4, True, 90)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the kernels must be compiled functions")
        return 2
    full = "--quick" not in sys.argv
    failed = 0
    for spec in matrix(full):
        t0 = time.perf_counter()
        try:
            c = compile_one(*spec)
            use = resource_usage(c.asm["cubin"])
            dt = time.perf_counter() - t0
            print(f"ok   {spec}  regs {use['reg']} spill {use['local'] + use['stack']} B  smem {c.metadata.shared} B  "
                  f"{dt:.1f}s")
        except Exception as e:  # noqa: BLE001 - report every failing specialisation
            failed += 1
            print(f"FAIL {spec}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
