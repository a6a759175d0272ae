"""The decode launch table: which partial kernel a head group runs, with which tile, warps and options, as data.

:data:`DECODE_KERNELS` lists the partial decode kernels in the order they are tried; a head group runs the first
row whose ``when`` holds for its K / V operands, with the base constexprs (:func:`launch_config`'s ``BLOCK_N`` and
warps) updated by the row's ``options`` (each kernel's module defines them next to the kernel). The launcher
(:func:`~kvquant.kernels.triton_decode.decode_launches`) and the compile tools
(:mod:`~kvquant.kernels.triton_compile_check`, :mod:`~kvquant.kernels.launch_record`) read this one table. Why each
choice is what it is (tile sizes, register caps, the sm_90a SASS behind them): ``docs/kernels.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import triton

from .triton_codebook import KIND_CODEBOOK, KIND_TQC, KIND_TQT, KIND_TQV
from .triton_decode_kernels import _decode_partial, _decode_partial_t, partial_options, partial_t_options
from .triton_dequant import DOT_FP16, DOT_IEEE, KIND_CHANNEL, KIND_FP8, KIND_INTN, KIND_TOKEN, Operand
from .triton_rows import (
    _decode_partial_rows,
    _decode_partial_rows_t,
    code_rows_t_options,
    rows_options,
    rows_t_options,
)


def launch_config(kop: Operand, vop: Operand, dot: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of one group's partial kernel: packed codes unpacked in registers (any operand not
    folded into MMA operands) 8 x 32; fp32 MMAs 8 x 64; int8-token / fp8 / packed kinds at head_dim 64 2 x 64;
    else 4 x 64; half the tile above head_dim 128. The launcher caps ``BLOCK_N`` at the pool's block size (a tile
    lies in one block). The table's rows may override both."""
    kinds = {kop.kind, vop.kind}
    folded = [kop.folds4(head_dim) or kop.folds_channel4(), vop.folds4(head_dim)]
    unfolded = {op.kind for op, f in zip((kop, vop), folded, strict=True) if not f}
    if {KIND_INTN, KIND_CHANNEL, KIND_CODEBOOK, KIND_TQC, KIND_TQV, KIND_TQT} & unfolded:
        block_n, warps = 32, 8
    elif dot == DOT_IEEE:
        block_n, warps = 64, 8
    elif head_dim <= 64 and kinds <= {KIND_TOKEN, KIND_FP8, KIND_INTN, KIND_CHANNEL}:
        block_n, warps = 64, 2
    else:
        block_n, warps = 64, 4
    if head_dim > 128:
        block_n //= 2
    return block_n, warps


def rows_kernel(kop: Operand, vop: Operand, head_dim: int) -> bool:
    """True when a group's K and V run on the rows kernels (:mod:`triton_rows`): grouped int4 V and int4 K (grouped
    alike, or per channel), scale/zero rows contiguous per token."""
    if not vop.folds4(head_dim) or not (kop.folds_channel4() or (kop.folds4(head_dim) and kop.group == vop.group)):
        return False
    ops = (kop, vop) if kop.kind == KIND_INTN else (vop,)
    return all(op.scale.stride(-1) == 1 and op.scale.stride(-2) == head_dim // op.group for op in ops)


def code_rows_kernel(kop: Operand, vop: Operand, dot: int, head_dim: int) -> bool:
    """True when a group runs on :func:`~kvquant.kernels.triton_rows._decode_partial_rows_t` with grouped int4 /
    int3 / int2 values (:meth:`Operand.code_rows`) and keys grouped alike or per-channel int4, fp16 queries.
    (Grouped int4 K and V, or per-channel int4 keys with them, take it through :func:`rows_kernel`.)"""
    keys = kop.folds_channel4() or (kop.code_rows(head_dim) and kop.group == vop.group)
    return dot == DOT_FP16 and keys and vop.code_rows(head_dim)


#: Whether per-channel int4 keys with fp16 queries may take the transposed rows kernel: triton releases before
#: 3.7 fail to compile that specialisation for sm_90a (``TritonGPUOptimizeDotOperands``: "Illegal shared layout");
#: with them those groups take ``_decode_partial_rows`` (mma.sync), which every release compiles.
CHANNEL_KEYS_TRANSPOSED = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 7)


def transposed_kernel(kop: Operand, vop: Operand, dot: int) -> bool:
    """True when a group may run on :func:`~kvquant.kernels.triton_decode_kernels._decode_partial_t`: fp16 queries,
    int8 K and V (per head or per token; read by :func:`int8_words_fp16`)."""
    return kop.int8_words(dot) and vop.int8_words(dot)


def block_n_for(head_dim: int) -> int:
    """Partition granularity: a multiple of every group's BLOCK_N."""
    return 64 if head_dim <= 128 else 32


Condition = Callable[[Operand, Operand, int, int, int], bool]  # (K, V, dot kind, head_dim, base num_warps)
Options = Callable[[dict, Operand, Operand, int, int], dict]  # (base meta, K, V, rep, block_size) -> meta updates


@dataclass(frozen=True)
class DecodeKernel:
    """One row of :data:`DECODE_KERNELS`: a head group for which ``when`` holds runs ``kernel`` with the base
    constexprs updated by ``options``."""

    name: str
    kernel: Any
    when: Condition
    options: Options


def _code_rows(kop: Operand, vop: Operand, dot: int, head_dim: int, warps: int) -> bool:
    return not rows_kernel(kop, vop, head_dim) and code_rows_kernel(kop, vop, dot, head_dim)


def _rows_transposed(kop: Operand, vop: Operand, dot: int, head_dim: int, warps: int) -> bool:
    channel_ok = kop.folds4(head_dim) or CHANNEL_KEYS_TRANSPOSED
    return rows_kernel(kop, vop, head_dim) and dot == DOT_FP16 and channel_ok


def _rows(kop: Operand, vop: Operand, dot: int, head_dim: int, warps: int) -> bool:
    return rows_kernel(kop, vop, head_dim)


def _int8_words(kop: Operand, vop: Operand, dot: int, head_dim: int, warps: int) -> bool:
    return transposed_kernel(kop, vop, dot) and warps == 4


def _any(kop: Operand, vop: Operand, dot: int, head_dim: int, warps: int) -> bool:
    return True


#: The partial decode kernels, tried in this order (the first whose condition holds).
DECODE_KERNELS: tuple[DecodeKernel, ...] = (
    DecodeKernel("code-rows-transposed", _decode_partial_rows_t, _code_rows, code_rows_t_options),
    DecodeKernel("rows-transposed", _decode_partial_rows_t, _rows_transposed, rows_t_options),
    DecodeKernel("rows", _decode_partial_rows, _rows, rows_options),
    DecodeKernel("int8-words-transposed", _decode_partial_t, _int8_words, partial_t_options),
    DecodeKernel("per-head", _decode_partial, _any, partial_options),
)


def choose(kop: Operand, vop: Operand, dot: int, head_dim: int, warps: int) -> DecodeKernel:
    """The row of :data:`DECODE_KERNELS` a head group of operands ``kop`` / ``vop`` runs (``warps``: the base
    warps of :func:`launch_config`)."""
    return next(row for row in DECODE_KERNELS if row.when(kop, vop, dot, head_dim, warps))
