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

import inspect
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time

BLOCK_SIZE = 128

KINDS = {  # name -> (kind, bits, group, part pointer type, scale pointer type)
    "fp16": (0, 8, 1, "*fp16", "*fp16"),
    "bf16": (0, 8, 1, "*bf16", "*bf16"),
    "int8": (1, 8, 1, "*i8", "*i8"),
    "int8-token": (2, 8, 1, "*i8", "*fp16"),
    "int4": (3, 4, 32, "*u8", "*fp16"),
    "int3": (3, 3, 32, "*u8", "*fp16"),
    "int2": (3, 2, 32, "*u8", "*fp16"),
    "int4-channel": (7, 4, 1, "*u8", "*fp16"),  # one scale per channel; tokens by block address (BS)
    "int3-channel": (7, 3, 1, "*u8", "*fp16"),
    "int2-channel": (7, 2, 1, "*u8", "*fp16"),
    "fp8-e4m3": (4, 8, 1, "*fp8e4nv", "*u8"),
    "fp8-e5m2": (4, 8, 1, "*fp8e5", "*u8"),
    "fp8-e4m3-bits": (5, 8, 1, "*u8", "*u8"),
    "fp8-e5m2-bits": (6, 8, 1, "*u8", "*u8"),
}
QTYPE = {0: "*fp32", 1: "*fp16", 2: "*bf16"}


def _signature(fn, ptrs: dict[str, str], consts: dict) -> dict[str, str]:
    sig = {}
    for n in inspect.signature(fn.fn).parameters:
        sig[n] = "constexpr" if n in consts else ptrs.get(n, "fp32" if n == "qk_scale" else "i32")
    return sig


def _kv_ptrs(prefix: str, name: str) -> dict[str, str]:
    _, _, _, part, scale = KINDS[name]
    return {prefix: part, prefix + "S": scale, prefix + "Z": scale, prefix + "H": "*fp32"}


def compile_one(kernel: str, k: str, v: str, dot: int, D: int, rep: int, has_range: bool, arch: int,
                num_warps: int | None = None, block_n: int | None = None, block_m: int | None = None):
    """Compile one specialisation; returns the compiled kernel (raises on a compile error)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import triton_chunk, triton_decode

    kk, kb, kg, _, _ = KINDS[k]
    vk, vb, vg, _, _ = KINDS[v]
    kv = dict(K_KIND=kk, K_BITS=kb, K_GROUP=kg, V_KIND=vk, V_BITS=vb, V_GROUP=vg)
    ptrs = {"Q": QTYPE[min(dot, 2)], "HEAD_IDX": "*i64", "LO": "*i32", "HI": "*i32", "OUT": QTYPE[min(dot, 2)],
            "FK": QTYPE[min(dot, 2)], "FV": QTYPE[min(dot, 2)], "O_PART": "*fp32", "LSE_PART": "*fp32",
            "LSE_OUT": "*fp32", "TBL": "*i32", **_kv_ptrs("K", k), **_kv_ptrs("V", v)}  # fmt: skip
    kv["BS"] = BLOCK_SIZE  # tokens per pool block (the default block_size; per-channel parts: their token group)
    block_h = max(16, triton.next_power_of_2(rep))
    if kernel == "decode":
        bn, nw = triton_decode.launch_config(kk, vk, dot, D)
        num_warps, block_n = num_warps or nw, block_n or bn
        fn = triton_decode._decode_partial
        consts = dict(REP=rep, BLOCK_H=block_h, D=D, BLOCK_N=block_n, HAS_RANGE=has_range, DOT=dot, **kv)
    elif kernel == "reduce":
        num_warps = num_warps or 4
        fn = triton_decode._decode_reduce
        consts = dict(REP=rep, BLOCK_H=block_h, D=D, HAS_RANGE=has_range, HAS_LSE=False)  # reads no block
    else:
        num_warps = num_warps or triton_chunk.NUM_WARPS
        block_m = block_m or triton_chunk.BLOCK_M
        fn = triton_chunk._chunk_attn
        block_n = block_n or triton_chunk.block_n_for(D)
        consts = dict(REP=rep, BLOCK_M=block_m, D=D, BLOCK_N=block_n, HAS_RANGE=has_range, DOT=dot, HAS_LSE=False,
                      **kv)
    src = ASTSource(fn, _signature(fn, ptrs, consts), consts)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


def ptxas_usage(compiled, arch: int) -> tuple[int, int]:
    """(registers per thread, spill stores in bytes) reported by ptxas for the compiled PTX."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        with open(p, "w") as f:
            f.write(compiled.asm["ptx"])
        out = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a" if arch == 90 else f"--gpu-name=sm_{arch}",
                              p, "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True)  # fmt: skip
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores", text)
    return int(regs.group(1)) if regs else -1, int(spill.group(1)) if spill else -1


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
        return
    for k, dot in itertools.product(KINDS, (0, 1, 2)):
        yield ("decode", k, k, dot, 128, 4, True, 90)
    for k in ("int8", "int4", "fp8-e4m3", "int4-channel"):
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
            regs, spill = ptxas_usage(c, spec[-1])
            dt = time.perf_counter() - t0
            print(f"ok   {spec}  regs {regs} spill {spill} B  smem {c.metadata.shared} B  {dt:.1f}s")
        except Exception as e:  # noqa: BLE001 - report every failing specialisation
            failed += 1
            print(f"FAIL {spec}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
