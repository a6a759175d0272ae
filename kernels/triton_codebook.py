"""Codebook (``tq*``) reads for the Triton decode and chunk kernels.

A codebook-stored head (:mod:`kvquant.quantizers.codebook`) keeps its rows in its own *head space*
``y = H (s * (x - mu))``: the dispatcher rotates the queries once per step and maps the output of a
V head back once, so the kernels never un-rotate a key. Each stored row is ``b``-bit codes packed
exactly like int4/3/2 (:func:`~kernels.triton_dequant.load_tile` unpacks them) plus one 8-bit log
norm code; the row is ``norm * level[code]``.

What the kernels read per (sequence, head), from the quantizer's ``params`` row
``[lo, step, level_0 .. level_{2^b - 1}]`` (fp32, ``2 + 2^b`` values, a few hundred bytes in L1):

* :func:`codebook_row` -- the row's address (``pid = b * Hg + head``);
* :func:`codebook_levels` -- ``level[code]`` for a tile of codes (a gather from that tiny table);
* :func:`codebook_norms` -- the per-token norms ``2^(lo + step * (c - 1))`` (code 0: a zero row),
  folded like int8-token's per-token scale: on the score column (K) or the probability column (V).

:func:`codebook_operand` describes one codebook store as kernel arguments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .unsupported import Unsupported

KIND_CODEBOOK = 8  # tq4/3/2: codes packed as INTN, value = level[code] * norm[token], in the head's space


@triton.jit
def codebook_row(params, pid, BITS: tl.constexpr):
    """Address of the ``params`` row of (sequence, head) ``pid = b * Hg + hg`` (rows of ``2 + 2^BITS``)."""
    return params + pid.to(tl.int64) * (2 + (1 << BITS))


@triton.jit
def codebook_levels(row, code):
    """``level[code]`` (float32) for an integer tile of codes, from the params row ``row``."""
    return tl.load(row + 2 + code).to(tl.float32)


@triton.jit
def codebook_norms(n_ptr, n_rows, mask_n, row):
    """Row norms ``[BLOCK_N]`` from their 8-bit log codes at offsets ``n_rows`` (0 outside ``mask_n``)."""
    c = tl.load(n_ptr + n_rows, mask=mask_n, other=0).to(tl.float32)
    lo = tl.load(row).to(tl.float32)
    step = tl.load(row + 1).to(tl.float32)
    return tl.where(c > 0, tl.exp2(lo + step * (c - 1.0)), 0.0)


def codebook_operand(store, main: torch.Tensor, operand_cls: type):
    """``operand_cls`` (:class:`~kernels.triton_dequant.Operand`) for a codebook store: the codes, the
    norm codes as the per-token part, and the fp32 ``params`` rows ``[B, Hg, 2 + 2^b]`` as the head part."""
    qz = store.quantizer
    norm = store.parts["norm"]
    if norm.dim() != 4 or norm.shape[:3] != main.shape[:3]:
        raise Unsupported(f"{qz.describe()}: norm part not [blocks, H, block_size, 1]")
    if qz.head_dim % 8:
        raise Unsupported(f"{qz.describe()}: head_dim {qz.head_dim} not a multiple of the packing")
    params = store.state.get("params")
    width = 2 + 2**qz.bits
    if params is None:  # not fitted yet: nothing is in the pool, nothing is read
        params = torch.zeros(store.batch, store.heads, width, device=main.device)
    params = params.float().contiguous()
    if params.shape != (store.batch, store.heads, width):
        raise Unsupported(f"{qz.describe()}: codebook state {tuple(params.shape)} not per (sequence, head)")
    return operand_cls(main, norm, main, params, KIND_CODEBOOK, bits=qz.bits)


@triton.jit
def part_bases(P, S, Z, PH, sh, ssh, hg, pid, KIND: tl.constexpr, BITS: tl.constexpr):
    """Head ``hg``'s pointers to a part, its scale and its zero (block 0); for a codebook part (``KIND`` 8)
    the third is the (sequence, head)'s params row instead (norm code range, levels)."""
    h = hg.to(tl.int64)  # head strides of a head-major pool can exceed 2^31 elements
    # one return: compiled, a return under a constexpr branch still meets the later one ("return type mismatch")
    if KIND == 8:  # noqa: SIM108  (a statement, not a ternary: constexpr branches are compiled apart)
        third = codebook_row(PH, pid, BITS)
    else:
        third = Z + h * ssh
    return P + h * sh, S + h * ssh, third
