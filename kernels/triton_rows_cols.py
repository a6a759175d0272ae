"""Register layouts of the grouped-rows decode kernels (:mod:`triton_rows`): (group, head) rows and (head, group)
columns, their broadcasts and sums, the zero-term MMA's operands and the tile loads of one loop step."""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_dequant import (
    _halves,
    reduce_sum,
)


@triton.jit
def _group_rows(ptr, n_in, G: tl.constexpr, REPP: tl.constexpr, BLOCK_N: tl.constexpr, mask_n):
    """Per-(token, group) values of the tokens ``n_in ..`` of a block whose rows of ``G`` values are
    contiguous (``ptr + t * G + g``), as rows ``[G * REPP, BLOCK_N]`` (row r: group ``r // REPP``), fp32;
    0 outside ``mask_n``. One contiguous load."""
    i = tl.arange(0, BLOCK_N * G)
    x = tl.load(ptr + n_in * G + i, mask=tl.reshape(tl.broadcast_to(mask_n[:, None], [BLOCK_N, G]), [BLOCK_N * G]),
                other=0.0)  # fmt: skip
    x = tl.trans(tl.reshape(x.to(tl.float32), [BLOCK_N, G]))
    x = tl.broadcast_to(x[:, None, :], [G, REPP, BLOCK_N])
    return tl.reshape(x, [G * REPP, BLOCK_N])


@triton.jit
def _to_rows(x, G: tl.constexpr):
    """``x [REPP, ...]`` repeated for the ``G`` groups: ``[G * REPP, ...]`` (row r: ``x[r % REPP]``)."""
    if len(x.shape) == 1:
        r = tl.reshape(tl.broadcast_to(x[None, :], [G, x.shape[0]]), [G * x.shape[0]])
    else:
        r = tl.reshape(tl.broadcast_to(x[None, :, :], [G, x.shape[0], x.shape[1]]), [G * x.shape[0], x.shape[1]])
    return r


@triton.jit
def _from_rows(x, G: tl.constexpr, REPP: tl.constexpr):
    """Sum of the ``G`` row groups of ``x [G * REPP, N]``: ``[REPP, N]``."""
    return reduce_sum(tl.reshape(x, [G, REPP, x.shape[1]]), 0)


@triton.jit
def _split_cols(a, DH: tl.constexpr, REPP: tl.constexpr, G: tl.constexpr, HI: tl.constexpr = False):
    """fp32 ``a [DH, REPP]`` as an fp16 MMA operand ``[DH, REPP * G]`` (``G`` in 2, 4, 8, 16), the columns (h, g) of the
    grouped keys: ``a[:, h]`` rounded to fp16 and the rest (together ``a`` to ~2**-22) in two of head h's G columns,
    zeros in the others (summed over g like the grouped keys' partial scores). With ``G >= 4`` the two columns are
    those with ``(g // (G // 4)) % 2`` equal to ``HI`` (:func:`_hi_cols`), so that two operands (``HI`` False and
    True) add their products into disjoint columns of one accumulator."""
    ah = a.to(tl.float16)
    x = tl.join(ah, (a - ah.to(tl.float32)).to(tl.float16))  # [DH, REPP, 2]
    if G >= 4:
        if HI:  # noqa: SIM108 (a constexpr branch)
            x = tl.reshape(tl.join(tl.zeros_like(x), x), [DH, REPP, 4])  # positions 1, 3
        else:
            x = tl.reshape(tl.join(x, tl.zeros_like(x)), [DH, REPP, 4])  # positions 0, 2
    if G >= 8:
        x = tl.reshape(tl.join(x, tl.zeros_like(x)), [DH, REPP, 8])
    if G >= 16:
        x = tl.reshape(tl.join(x, tl.zeros_like(x)), [DH, REPP, 16])
    return tl.reshape(x, [DH, REPP * G])


@triton.jit
def _cat_cols(a, b, N: tl.constexpr, C: tl.constexpr):
    """``[N, C]``: the columns of ``a [N, C/2]`` then those of ``b`` (register views)."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), [N, C])


@triton.jit
def _hi_cols(rg, G: tl.constexpr):
    """True for the columns (h, g) (``rg`` = g) where :func:`_split_cols` with ``HI`` puts its values (``G >= 4``):
    each widening step of it doubles the positions, so the ``HI`` operand's first step (positions 1, 3) ends at
    positions ``G // 4 * (1, 3)``."""
    return ((rg // (G // 4)) % 2) == 1


@triton.jit
def _head_cols(x, G: tl.constexpr, COLS: tl.constexpr = 0):
    """``x [..., REPP]`` (per head) repeated for the ``G`` groups of each head: ``[..., REPP * G]``, in the column
    order ``COLS`` (:func:`_col_head`)."""
    if COLS >= 1:
        if len(x.shape) == 1:
            r = tl.reshape(tl.broadcast_to(x[None, :, None], [G // 2, x.shape[0], 2]), [x.shape[0] * G])
        else:
            r = tl.reshape(tl.broadcast_to(x[:, None, :, None], [x.shape[0], G // 2, x.shape[1], 2]),
                           [x.shape[0], x.shape[1] * G])  # fmt: skip
    elif len(x.shape) == 1:
        r = tl.reshape(tl.broadcast_to(x[:, None], [x.shape[0], G]), [x.shape[0] * G])
    else:
        r = tl.reshape(tl.broadcast_to(x[:, :, None], [x.shape[0], x.shape[1], G]), [x.shape[0], x.shape[1] * G])
    return r


# The rows kernels' column order of the (head, group) columns r of the grouped keys' scores and of the values'
# probabilities (constexpr COLS): 0 = head-major (r = h G + g); 1 = (g // 2, h, g % 2), i.e. r = g % 2 + 2 h +
# 2 REPP (g // 2) (G even). In a warpgroup MMA's accumulator a thread holds the columns 2 c + {0, 1} + 8 j, so with
# REPP = 4 order 1 gives each thread all G groups of one head (c): the sum over the groups needs no shuffle and the
# softmax of a (token, head) is computed by one lane, not by a pair of lanes.
@triton.jit
def _col_head(r, G: tl.constexpr, REPP: tl.constexpr, COLS: tl.constexpr):
    """The (head, group) of columns ``r`` in the order ``COLS``."""
    if COLS >= 1:
        rh = (r // 2) % REPP
        rg = (r // (2 * REPP)) * 2 + r % 2
    else:
        rh = r // G
        rg = r % G
    return rh, rg


@triton.jit
def _group_cols(y, N: tl.constexpr, G: tl.constexpr, REPP: tl.constexpr, COLS: tl.constexpr):
    """Per-(token, group) ``y [N, G]`` on the (head, group) columns ``[N, REPP * G]`` (order ``COLS``)."""
    if COLS >= 1:
        r = tl.reshape(tl.broadcast_to(tl.reshape(y, [N, G // 2, 1, 2]), [N, G // 2, REPP, 2]), [N, REPP * G])
    else:
        r = tl.reshape(tl.broadcast_to(y[:, None, :], [N, REPP, G]), [N, REPP * G])
    return r


@triton.jit
def _group_sum(x, N: tl.constexpr, G: tl.constexpr, REPP: tl.constexpr, COLS: tl.constexpr):
    """``x [N, REPP * G]`` (order ``COLS``) summed over the groups of each head: ``[N, REPP]``."""
    if COLS >= 1:
        r = reduce_sum(reduce_sum(tl.reshape(x, [N, G // 2, REPP, 2]), 3), 1)
    else:
        r = reduce_sum(tl.reshape(x, [N, REPP, G]), 2)
    return r


# COLS 2: order 1, and the grouped keys' zero term sum_g q_sum[h, g] kz[t, g] by one more MMA per tile (K = 16: the
# rows g and G + g of the fp16 zeros against the hi / lo fp16 parts of the query's group sums, accumulated in fp32):
# the zeros need no conversion and each (token, head) one multiply-add of the result instead of G products and G - 1
# sums. The query's sums are scaled by 2**17 (in the scores' units of q_sum, q_sum 2**17 < 2**15 for groups of up to
# 128 channels: 2**EMAX qf |q| < 2**15); ZT_UNIT takes the MMA's result back.
ZT_UNIT = tl.constexpr(2.0**-17)


@triton.jit
def _pad_cols(x, N: tl.constexpr, C: tl.constexpr, W: tl.constexpr):
    """``x [N, C]`` followed by zero columns: ``[N, W]`` (``W`` a power-of-two multiple of ``C``)."""
    if C < W:
        x = tl.reshape(tl.permute(tl.join(x, tl.zeros_like(x)), (0, 2, 1)), [N, 2 * C])
        x = _pad_cols(x, N, 2 * C, W)
    return x


@triton.jit
def _zero_operand(q_sum, G: tl.constexpr, REPP: tl.constexpr):
    """The zero-term MMA's B operand ``[16, 16]`` fp16 from ``q_sum [REPP * G]`` (order 1, the scores' units): row
    ``g`` / ``G + g`` column ``2 h``: the hi / lo fp16 parts of ``q_sum[h, g] 2**17``; zeros elsewhere."""
    qg = tl.reshape(tl.permute(tl.reshape(q_sum * 131072.0, [G // 2, REPP, 2]), (0, 2, 1)), [G, REPP])
    hi = qg.to(tl.float16)
    lo = (qg - hi.to(tl.float32)).to(tl.float16)
    b = tl.reshape(tl.permute(tl.join(hi, lo), (2, 0, 1)), [2 * G, REPP])  # rows: hi g, then lo g
    b = tl.trans(_pad_cols(tl.trans(b), REPP, 2 * G, 16))  # [16, REPP]
    b = tl.reshape(tl.join(b, tl.zeros_like(b)), [16, 2 * REPP])  # column 2 h
    return _pad_cols(b, 16, 2 * REPP, 16)


@triton.jit
def _kz_words(ptr, n0, start, end, MASKED: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, SUB: tl.constexpr):
    """The fp16 zeros of ``SUB`` (1 or 2) tiles from row ``ptr`` (``G`` per token) for :func:`_zero_term` (COLS 2): as
    32-bit words ``[BLOCK_N, G]``, word ``j`` holding the pair of groups ``j % (G / 2)`` (each pair twice: the MMA's
    A operand wants the rows ``g`` and ``G + g`` alike, and one word per lane and row is what its register layout
    reads, so the words come straight from the copy buffer)."""
    W: tl.constexpr = G // 2
    offs = tl.arange(0, BLOCK_N)[:, None] * W + (tl.arange(0, G) % W)[None, :]
    return _tiles_load(ptr.to(tl.pointer_type(tl.int32)), offs, BLOCK_N * W, n0, start, end, MASKED, BLOCK_N, SUB)


@triton.jit
def _zero_term(kzw, qz, N: tl.constexpr, G: tl.constexpr, REPP: tl.constexpr):
    """``sum_g q_sum[h, g] kz[t, g]`` ``[N, REPP]`` in the scores' units (COLS 2) from the zeros' words ``kzw [N, G]``
    (:func:`_kz_words`) and :func:`_zero_operand`'s ``qz``."""
    w = _pad_cols(kzw, N, G, 8)  # [N, 8] words: halves 0 .. 2 G - 1 = kz[t, k % G], the rest 0
    zt = tl.dot(tl.reshape(_halves(w), [N, 16]), qz)  # [N, 16]: column 2 h
    J: tl.constexpr = 16 // (2 * REPP)
    z = tl.split(tl.permute(tl.reshape(zt, [N, J, REPP, 2]), (0, 2, 1, 3)))[0]  # [N, REPP, J]
    if J == 2:  # noqa: SIM108 (a constexpr branch)
        z = tl.split(z)[0]
    else:
        z = tl.reshape(z, [N, REPP])
    return z * ZT_UNIT


@triton.jit
def _rescale_acc(acc, zacc, alpha, G: tl.constexpr, REPP: tl.constexpr, COLS: tl.constexpr = 0):
    """The rows kernels' accumulators times the step's rescale ``alpha`` (one per (head, query) column): ``acc`` is
    ``[D, 2 R]`` (hi / lo fp16 halves, :func:`_rows_pv`) up to 16 columns, ``[D, R]`` above."""
    a = _head_cols(alpha, G, COLS)[None, :]
    if G * REPP <= 16:  # noqa: SIM108 (a constexpr branch)
        acc = acc * _cat_cols(a, a, 1, 2 * G * REPP)
    else:
        acc = acc * a
    return acc, zacc * a


@triton.jit
def _rows_mask(n0, start, end, MASKED: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tokens ``[n0, n0 + BLOCK_N)`` inside ``[start, end)`` (all of them for an interior tile)."""
    if MASKED:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = (offs_n >= start) & (offs_n < end)
    else:
        mask_n = tl.full([BLOCK_N], 1, tl.int1)
    return mask_n


@triton.jit
def _tiles_load(ptr, offs, step, n0, start, end, MASKED: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr):
    """``ptr + offs`` (``offs [BLOCK_N, W]``: per-token rows of tile 0) for the ``SUB`` (1 or 2) tiles of a step or
    half-step (tile 1: ``step`` elements further), as ``(tile 0, tile 1)`` (tile 1 = tile 0 when ``SUB`` is 1). Two
    tiles in one load: one copy and commit group per part and two tiles, not per tile. Tokens outside
    ``[start, end)`` read as 0 (masked steps)."""
    if SUB == 2:
        o2 = offs[:, :, None] + (tl.arange(0, 2) * step)[None, None, :]
        if MASKED:
            t2 = n0 + tl.arange(0, BLOCK_N)[:, None, None] + (tl.arange(0, 2) * BLOCK_N)[None, None, :]
            x = tl.load(ptr + o2, mask=(t2 >= start) & (t2 < end), other=0)
        else:
            x = tl.load(ptr + o2)
        a, b = tl.split(x)
    else:
        if MASKED:
            t = n0 + tl.arange(0, BLOCK_N)[:, None]
            a = tl.load(ptr + offs, mask=(t >= start) & (t < end), other=0)
        else:
            a = tl.load(ptr + offs)
        b = a
    return a, b
