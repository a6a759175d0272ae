"""The grouped-rows decode kernels: ``_decode_partial_rows`` (mma.sync) and ``_decode_partial_rows_t`` (warpgroup
MMAs), each followed by its launch options (the rows of :data:`~kvquant.kernels.triton_decode_table.DECODE_KERNELS`
that take it).

**Rows (group, head)** -- int4 K and V. The MMA needs >= 16 rows, GQA gives a few query heads: padding them to 16
would multiply every per-element step (scales, softmax, probability splits) by the padding.
Instead the rows are (group g, head h), r = g * REPP + h, G = D / V_GROUP groups: row r of the
score MMA holds the query head h restricted to key group g (int4 g keys: its own group's channels, whose
per-(token, group) scale and zero then apply row-wise; per-channel int4 keys: the whole query in the
g = 0 rows), the G partial scores are summed into the heads' scores [REPP, BLOCK_N], the softmax runs on
the real heads only, and the probabilities are broadcast back to the G row copies, scaled row-wise by
the V group's scale: the value MMA of row (g, h) is exact for the channels of group g, which are the
only ones it keeps (the others are discarded at the end). V's zero term is a per-row sum.

**Columns (head, group), transposed** -- int4 / int3 / int2 K and V with fp16 queries.
fp16 queries: the rows kernel's products transposed, so that tokens (keys) and channels (values) are the MMA
rows, on R = heads x G columns (h, g) (column r: head r // G, group r % G, or with grouped keys and 4-8 groups
the order (g // 2, h, g % 2) of _col_head, COLS 1 / 2): scores^T [BLOCK_N, R] = K codes
[BLOCK_N, D] @ q_cols [D, R] (warpgroup MMAs, the loop-invariant query in shared memory; grouped keys: column
(h, g) holds head h on the channels of group g) and out^T [D, R] += V codes^T [D, BLOCK_N] @ (p x V scale)
[BLOCK_N, R] (hi + lo fp16 halves). Codes come as fp16 subnormals (:func:`code_tiles`: one and per two codes,
channels in perm4 order; position i in units of 2**(code_exp(i) - 24): the key operand's rows carry the
complementary powers of two, the rest goes into the softmax scale and the epilogue). Per-(token, group) scales and
zeros are per-column factors of the [BLOCK_N, R] tiles (grouped keys, COLS 2: their zero term by one more MMA,
_zero_term); V's zero term is accumulated per (token, column) and summed
over the tokens after the loop. Per-channel int4 keys (int4-channel) fold their block's scale into the query (fp32
[D/2, heads] per nibble half, split into hi + lo fp16 columns (h, 0) and (h, 1)) and add their zero term q . z (an
fp32 reduction per head) to the scores. A loop step is SUB (1, 2 or 4) tiles under one softmax update, two tiles
at most in one pool block; the partial steps at both ends of a program's range run as masked single tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_decode_tiles import _program_span
from .triton_dequant import (
    Operand,
    code_exp,
    head_ptrs,
    key_chan2,
    key_exp2,
    perm4,
    pow2,
    reduce_max,
    reduce_sum,
)
from .triton_rows_cols import _col_head, _head_cols, _hi_cols, _to_rows, _zero_operand
from .triton_rows_tiles import _rows_oct_t, _rows_tile, _rows_tile_t


@triton.jit
def _decode_partial_rows(
    Q, q_sb, q_sh,
    K, KS, KZ, KH, k_sb, k_sh, k_st, ks_sb, ks_sh, ks_st,
    V, VS, VZ, VH, v_sb, v_sh, v_st, vs_sb, vs_sh, vs_st, TBL, tbl_sb,
    HEAD_IDX, LO, HI, lo_sb, O_PART, LSE_PART,
    qk_scale, past_len, part_len, Hg, S, n_qheads,
    REP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_RANGE: tl.constexpr, DOT: tl.constexpr, SOFTCAP: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr, BS: tl.constexpr,
    K_FOLD: tl.constexpr = 0, V_FOLD: tl.constexpr = False, K_W8: tl.constexpr = False,
    V_W8: tl.constexpr = False,
):  # fmt: skip
    """``_decode_partial`` for int4 K (grouped, ``K_FOLD`` 1, groups of ``V_GROUP`` channels; or per channel,
    ``K_FOLD`` 2) and grouped int4 V, on (group, head) rows (``BLOCK_H`` = REPP, heads per row group)."""
    G: tl.constexpr = D // V_GROUP
    REPP: tl.constexpr = BLOCK_H
    R: tl.constexpr = G * REPP
    DH: tl.constexpr = D // 2
    pid, split, b, hg, b64, h, start, end = _program_span(HEAD_IDX, LO, HI, lo_sb, past_len, part_len, Hg, HAS_RANGE)

    r = tl.arange(0, R)
    rh = r % REPP  # the row's query head (of this KV head)
    rg = r // REPP  # the row's group
    valid = rh < REP
    j = tl.arange(0, DH)
    q_ptr = Q + b64 * q_sb + (h * REP + rh)[:, None] * q_sh + j[None, :]
    if K_FOLD == 1:  # row (g, h): head h on the channels of group g
        m_lo = valid[:, None] & ((j[None, :] // V_GROUP) == rg[:, None])
        m_hi = valid[:, None] & ((j[None, :] + DH) // V_GROUP == rg[:, None])
    else:  # per-channel keys: the whole query in the g = 0 rows
        m_lo = valid[:, None] & (rg[:, None] == 0) & (j[None, :] >= 0)
        m_hi = m_lo
    q_lo = tl.load(q_ptr, mask=m_lo, other=0.0)
    q_hi = tl.load(q_ptr + DH, mask=m_hi, other=0.0)
    q_sum = reduce_sum(q_lo.to(tl.float32), 1) + reduce_sum(q_hi.to(tl.float32), 1)
    if K_FOLD == 2 or DOT == 0 or DOT == 3:
        q_lo = q_lo.to(tl.float32)
        q_hi = q_hi.to(tl.float32)

    k_base, ks_base, kz_base = head_ptrs(K, KS, KZ, k_sh, ks_sh, hg)
    v_base, vs_base, vz_base = head_ptrs(V, VS, VZ, v_sh, vs_sh, hg)
    tbl = TBL + b64 * tbl_sb
    scale = qk_scale
    m_i = tl.full([REPP], float("-inf"), tl.float32)
    l_i = tl.full([REPP], 0, tl.float32)
    acc_lo = tl.full([R, DH], 0, tl.float32)
    acc_hi = tl.full([R, DH], 0, tl.float32)
    zacc = tl.full([R], 0, tl.float32)
    full_lo = tl.cdiv(start, BLOCK_N) * BLOCK_N
    full_hi = (end // BLOCK_N) * BLOCK_N
    for n0 in range(full_lo, full_hi, BLOCK_N):
        m_i, l_i, acc_lo, acc_hi, zacc = _rows_tile(
            n0, start, end, False, q_lo, q_hi, q_sum, scale, tbl,
            k_base, ks_base, kz_base, k_sb, k_st, ks_sb, ks_st, v_base, vs_base, vz_base, v_sb, v_st, vs_sb, vs_st,
            m_i, l_i, acc_lo, acc_hi, zacc, D, BLOCK_N, BS, DOT, SOFTCAP, G, REPP, K_FOLD)  # fmt: skip
    if (start % BLOCK_N != 0) & (start < end):
        n0 = start - start % BLOCK_N
        m_i, l_i, acc_lo, acc_hi, zacc = _rows_tile(
            n0, start, end, True, q_lo, q_hi, q_sum, scale, tbl,
            k_base, ks_base, kz_base, k_sb, k_st, ks_sb, ks_st, v_base, vs_base, vz_base, v_sb, v_st, vs_sb, vs_st,
            m_i, l_i, acc_lo, acc_hi, zacc, D, BLOCK_N, BS, DOT, SOFTCAP, G, REPP, K_FOLD)  # fmt: skip
    if tl.maximum(full_hi, full_lo) < end:
        n0 = tl.maximum(full_hi, full_lo)
        m_i, l_i, acc_lo, acc_hi, zacc = _rows_tile(
            n0, start, end, True, q_lo, q_hi, q_sum, scale, tbl,
            k_base, ks_base, kz_base, k_sb, k_st, ks_sb, ks_st, v_base, vs_base, vz_base, v_sb, v_st, vs_sb, vs_st,
            m_i, l_i, acc_lo, acc_hi, zacc, D, BLOCK_N, BS, DOT, SOFTCAP, G, REPP, K_FOLD)  # fmt: skip

    has = l_i != 0
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    offs_h = tl.arange(0, REPP)
    prow_h = (b64 * n_qheads + h * REP + offs_h) * S + split
    tl.store(LSE_PART + prow_h, lse, mask=offs_h < REP)
    # row (g, h) keeps the channels of group g: out[h, d] = (acc[(g(d), h), d] + zacc[(g(d), h)]) / l[h]
    den = _to_rows(tl.where(has, l_i, 1.0), G)
    prow = (b64 * n_qheads + h * REP + rh) * S + split
    o_ptr = O_PART + prow[:, None] * D + j[None, :]
    keep_lo = valid[:, None] & ((j[None, :] // V_GROUP) == rg[:, None])
    keep_hi = valid[:, None] & ((j[None, :] + DH) // V_GROUP == rg[:, None])
    tl.store(o_ptr, (acc_lo + zacc[:, None]) / den[:, None], mask=keep_lo)
    tl.store(o_ptr + DH, (acc_hi + zacc[:, None]) / den[:, None], mask=keep_hi)




def row_heads(rep: int, head_dim: int, v_group: int) -> int:
    """Query heads per row group of the rows kernels (``BLOCK_H``): ``rep`` padded to a power of two, and to at
    least 16 rows with the ``head_dim / v_group`` groups."""
    return max(triton.next_power_of_2(rep), 16 // max(1, head_dim // v_group))


def rows_options(meta: dict, kop: Operand, vop: Operand, rep: int, block_size: int) -> dict:
    """Launch options of :func:`_decode_partial_rows` over the base ``meta``: ``BLOCK_H`` (:func:`row_heads`); 8
    warps at 32 or more (group, head) rows."""
    rows_h = row_heads(rep, meta["D"], vop.group)
    opts: dict = {"BLOCK_H": rows_h}
    if rows_h * (meta["D"] // vop.group) >= 32:
        opts["num_warps"] = 8
    return opts


@triton.jit
def _decode_partial_rows_t(
    Q, q_sb, q_sh,
    K, KS, KZ, KH, k_sb, k_sh, k_st, ks_sb, ks_sh, ks_st,
    V, VS, VZ, VH, v_sb, v_sh, v_st, vs_sb, vs_sh, vs_st, TBL, tbl_sb,
    HEAD_IDX, LO, HI, lo_sb, O_PART, LSE_PART,
    qk_scale, past_len, part_len, Hg, S, n_qheads,
    REP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_RANGE: tl.constexpr, DOT: tl.constexpr, SOFTCAP: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr, BS: tl.constexpr,
    K_FOLD: tl.constexpr = 0, V_FOLD: tl.constexpr = False, K_W8: tl.constexpr = False,
    V_W8: tl.constexpr = False, OFF32: tl.constexpr = False, SUB: tl.constexpr = 1, OCT: tl.constexpr = False,
    K_ROW: tl.constexpr = 0, V_ROW: tl.constexpr = 0, KZW: tl.constexpr = True,
):  # fmt: skip
    """:func:`_decode_partial_rows` transposed (fp16 queries; grouped int4 / int3 / int2 V, K grouped alike with
    any of these widths (``K_FOLD`` 1) or per-channel int4 (``K_FOLD`` 2)); ``OFF32``: the parts' element offsets
    in 32-bit integers (:meth:`Operand.offsets32`); ``SUB``: tiles per loop step (:func:`_rows_tile_t`); ``KZW``: the
    keys' zero term by the zero-term MMA, the zeros read as 32-bit words (COLS 2; the launcher's choice: every row
    4-byte aligned)."""
    G: tl.constexpr = D // V_GROUP
    REPP: tl.constexpr = BLOCK_H
    R: tl.constexpr = G * REPP
    DH: tl.constexpr = D // 2
    pid, split, b, hg, b64, h, start, end = _program_span(HEAD_IDX, LO, HI, lo_sb, past_len, part_len, Hg, HAS_RANGE)

    # the (head, group) columns' order (_col_head): order 1 (2 with the zero-term MMA) for grouped keys in 4 groups,
    # head-major otherwise (docs/kernels.md)
    COLS: tl.constexpr = (2 if REPP <= 8 and KZW else 1) if (K_FOLD == 1 and G == 4) else 0
    r = tl.arange(0, R)
    rh, rg = _col_head(r, G, REPP, COLS)  # column r: head rh, group rg
    valid = rh < REP
    j = tl.arange(0, DH)
    jc = perm4(j)  # position j holds channel jc (nibble_tiles); perm4 keeps every channel in its group
    qf = 1.0  # the power of two the query operand is scaled by (K_FOLD 1)
    # the largest power of two of the key code tiles (code_tiles, code_exp)
    K_EMAX: tl.constexpr = 4 if K_BITS == 4 else (7 if K_BITS == 3 else 6)
    if K_FOLD == 1:  # column (h, g): head h on the channels of group g; row i: channel perm4(i)
        i = tl.arange(0, D)
        if K_BITS == 2 and D >= 64:  # key_tile2's positions
            kc = key_chan2(i, D)
            ke = key_exp2(i, D)
        else:  # code_tiles' positions (perm4 keeps every channel in its group)
            kc = perm4(i)
            ke = code_exp(i, K_BITS, D)
        q_mask = valid[None, :] & ((kc[:, None] // V_GROUP) == rg[None, :])
        qt = tl.load(Q + b64 * q_sb + (h * REP + rh)[None, :] * q_sh + kc[:, None], mask=q_mask, other=0.0)
        qt = qt.to(tl.float32)
        # row i x 2**(EMAX - e(i)) (the units of its codes: code_tiles), all rows x qf <= 1, a power of two that keeps
        # 2**EMAX qf |q| < 2**15 (qf = 1 unless max |q| >= 2**(15 - EMAX)): exact fp16 operands
        e = (reduce_max(reduce_max(tl.abs(qt), 0), 0).to(tl.int32, bitcast=True) >> 23) & 0xFF
        qf = ((127 - tl.maximum(e - (141 - K_EMAX), 0)) << 23).to(tl.float32, bitcast=True)
        q_sum = reduce_sum(qt, 0) * (qf * pow2(K_EMAX - 24))
        if COLS == 2:
            q_sum = _zero_operand(q_sum, G, REPP)
        qt_lo = (qt * (pow2(K_EMAX - ke).to(tl.float32) * qf)[:, None]).to(tl.float16)
        qt_hi = qt_lo  # unused
    else:  # per-channel keys: the heads' query [D/2, REPP] per half, fp32 (the block scale multiplies it)
        hh = tl.arange(0, REPP)
        q_ptr = Q + b64 * q_sb + (h * REP + hh)[None, :] * q_sh + jc[:, None]
        qt_lo = tl.load(q_ptr, mask=(hh < REP)[None, :], other=0.0).to(tl.float32)
        qt_hi = tl.load(q_ptr + DH, mask=(hh < REP)[None, :], other=0.0).to(tl.float32)
        q_rows = Q + b64 * q_sb + (h * REP + hh)[:, None] * q_sh + tl.arange(0, D)[None, :]
        q_sum = tl.load(q_rows, mask=(hh < REP)[:, None], other=0.0).to(tl.float32)  # [REPP, D]: for q . z

    k_base, ks_base, kz_base = head_ptrs(K, KS, KZ, k_sh, ks_sh, hg)
    v_base, vs_base, vz_base = head_ptrs(V, VS, VZ, v_sh, vs_sh, hg)
    tbl = TBL + b64 * tbl_sb
    scale = qk_scale * (pow2(24 - K_EMAX) / qf)  # the key tiles' subnormal codes (code_tiles), the query's scale
    wk = scale  # unused unless K_FOLD == 2 and G >= 4
    if K_FOLD == 2 and G >= 4:
        # per-channel keys: per-column weights of the sum over g (_rows_scores): the softmax scale, times 16 on the
        # low nibbles' columns (their codes are in 2**-24 units, the high nibbles' in 2**-20)
        wk = tl.where(_hi_cols(rg, G), scale, scale * 16.0)
    m_i = tl.full([REPP], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_N, REPP], 0, tl.float32)  # per (token, head); summed after the loop
    # row i: channel perm4(i); with R <= 16 columns [hi | lo]: column j R + r holds part j of the probabilities
    # (_rows_pv: one MMA chain per tile), summed after the loop
    PCAT: tl.constexpr = R <= 16
    acc = tl.full([D, 2 * R if PCAT else R], 0, tl.float32)
    zacc = tl.full([BLOCK_N, R], 0, tl.float32)
    # loop-invariant offsets of a tile's rows (codes: 32-bit words, row strides in words)
    k_stw = k_st // 4
    v_stw = v_st // 4
    tok = tl.arange(0, BLOCK_N)[:, None]
    KW: tl.constexpr = D // 32 if K_BITS == 3 else D * K_BITS // 32  # words per row (int3: per byte plane)
    VW: tl.constexpr = D // 32 if V_BITS == 3 else D * V_BITS // 32
    k_offs = tok * k_stw + tl.arange(0, KW)[None, :]
    v_offs = tok * v_stw + tl.arange(0, VW)[None, :]
    g_offs = tok * G + tl.arange(0, G)[None, :]
    # tokens per loop step: SUB tiles, up to two in one pool block (OCT: four pool-block parts of SUB / 4 tiles each)
    STEP: tl.constexpr = SUB * BLOCK_N
    tl.static_assert(SUB < 4 or K_FOLD == 1, "four or eight tiles per step: grouped keys only")
    full_lo = tl.cdiv(start, STEP) * STEP
    full_hi = (end // STEP) * STEP
    # the partial steps at both ends ([start, full_lo) and [full_hi, end), each shorter than a step): one loop of
    # masked single tiles (one copy of the masked tile code, not two of the masked step)
    head_end = tl.minimum(full_lo, end)
    h0 = start - start % BLOCK_N
    nh = tl.where(start < head_end, tl.cdiv(head_end - h0, BLOCK_N), 0)
    t0 = tl.maximum(full_hi, full_lo)
    nt = tl.where(t0 < end, tl.cdiv(end - t0, BLOCK_N), 0)
    # the masked loop first when the main loop takes two or four tiles per step, after it with one (docs/kernels.md)
    if SUB >= 2:  # the masked tiles first
        for i in tl.range(0, nh + nt, num_stages=1):  # not pipelined: at most a few tiles per program
            n0 = tl.where(i < nh, h0 + i * BLOCK_N, t0 + (i - nh) * BLOCK_N)
            m_i, l_i, acc, zacc = _rows_tile_t(
                n0, start, end, True, qt_lo, qt_hi, q_sum, scale, wk, tbl,
                k_base, ks_base, kz_base, k_sb, k_stw, ks_sb, v_base, vs_base, vz_base, v_sb, v_stw, vs_sb,
                k_offs, v_offs, g_offs, m_i, l_i, acc, zacc, D, BLOCK_N, BS, SOFTCAP, G, REPP, K_FOLD, OFF32,
                K_BITS, V_BITS, 1, COLS)  # fmt: skip
    if OCT:
        for n0 in range(full_lo, full_hi, STEP):
            m_i, l_i, acc, zacc = _rows_oct_t(
                n0, start, end, qt_lo, q_sum, scale, tbl, k_base, ks_base, kz_base, k_sb, k_stw, ks_sb,
                v_base, vs_base, vz_base, v_sb, v_stw, vs_sb, k_offs, v_offs, g_offs, m_i, l_i, acc, zacc,
                D, BLOCK_N, BS, SOFTCAP, G, REPP, OFF32, K_BITS, V_BITS, SUB // 4, K_ROW, V_ROW, COLS)  # fmt: skip
    else:
        for n0 in range(full_lo, full_hi, STEP):
            m_i, l_i, acc, zacc = _rows_tile_t(
                n0, start, end, False, qt_lo, qt_hi, q_sum, scale, wk, tbl,
                k_base, ks_base, kz_base, k_sb, k_stw, ks_sb, v_base, vs_base, vz_base, v_sb, v_stw, vs_sb,
                k_offs, v_offs, g_offs, m_i, l_i, acc, zacc, D, BLOCK_N, BS, SOFTCAP, G, REPP, K_FOLD, OFF32,
                K_BITS, V_BITS, SUB, COLS)  # fmt: skip
    if SUB < 2:  # the masked tiles last
        for i in tl.range(0, nh + nt, num_stages=1):  # not pipelined: at most a few tiles per program
            n0 = tl.where(i < nh, h0 + i * BLOCK_N, t0 + (i - nh) * BLOCK_N)
            m_i, l_i, acc, zacc = _rows_tile_t(
                n0, start, end, True, qt_lo, qt_hi, q_sum, scale, wk, tbl,
                k_base, ks_base, kz_base, k_sb, k_stw, ks_sb, v_base, vs_base, vz_base, v_sb, v_stw, vs_sb,
                k_offs, v_offs, g_offs, m_i, l_i, acc, zacc, D, BLOCK_N, BS, SOFTCAP, G, REPP, K_FOLD, OFF32,
                K_BITS, V_BITS, 1, COLS)  # fmt: skip

    l_i = reduce_sum(l_i, 0)
    has = l_i != 0
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    offs_h = tl.arange(0, REPP)
    prow_h = (b64 * n_qheads + h * REP + offs_h) * S + split
    tl.store(LSE_PART + prow_h, lse, mask=offs_h < REP)
    # column (h, g) keeps the channels of group g: out[h, c] = (acc[pos(c), (h, g(c))] + zero[(h, g(c))]) / l[h]
    den = _head_cols(tl.where(has, l_i, 1.0), G, COLS)
    zsum = reduce_sum(zacc, 0)
    if PCAT:
        acc = reduce_sum(tl.reshape(acc, [D, 2, R]), 1)
    prow = (b64 * n_qheads + h * REP + rh) * S + split
    i = tl.arange(0, D)
    fac = pow2(24 - code_exp(i, V_BITS, D))  # the value codes' subnormal units (code_tiles)
    keep = valid[None, :] & ((i[:, None] // V_GROUP) == rg[None, :])  # perm4 keeps channels in their group
    tl.store(O_PART + prow[None, :] * D + perm4(i)[:, None], (acc * fac[:, None] + zsum[None, :]) / den[None, :],
             mask=keep)  # fmt: skip


def _word_rows(t: torch.Tensor) -> bool:
    """True when every (block, head, token) row of the 16-bit part ``t`` starts 4-byte aligned (its block and head
    strides even, its storage aligned; ``meta`` tensors: the strides only), so a kernel may read it by 32-bit words."""
    aligned = t.device.type == "meta" or t.data_ptr() % 4 == 0
    return aligned and t.element_size() == 2 and all(st % 2 == 0 for st in t.stride()[:3])


def _rows_sub(block_n: int, block_size: int, columns: int, wide: bool = False) -> int:
    """Tiles per loop step of :func:`_decode_partial_rows_t` with grouped keys: 2 when a pool block holds two tiles
    and the MMAs have at most 16 (head, group) columns, else 1; ``wide`` (int3 / int2): 4 there instead (two halves
    of two tiles, each in one pool block)."""
    if block_size % (2 * block_n) != 0 or columns > 16:
        return 1
    return 4 if wide else 2


def _channel_sub(block_n: int, block_size: int) -> int:
    """Tiles per loop step with per-channel int4 keys: 2 when a pool block holds them (the block's query operands
    built once per two tiles), else 1."""
    return 2 if block_size % (2 * block_n) == 0 else 1


def rows_t_options(meta: dict, kop: Operand, vop: Operand, rep: int, block_size: int) -> dict:
    """Launch options of :func:`_decode_partial_rows_t` for int4 K and V (grouped alike, or per-channel keys): 4
    warps, the base tile, ``SUB`` tiles per step and a register cap (``maxnreg``) that keeps two programs per SM
    without spills (per-channel keys with 32 (head, group) columns: none)."""
    D = meta["D"]
    rows_h = row_heads(rep, D, vop.group)
    opts: dict = {"BLOCK_H": rows_h, "num_warps": 4, "OFF32": kop.offsets32() and vop.offsets32(),
                  "KZW": _word_rows(kop.zero)}  # fmt: skip
    if kop.folds4(D):
        opts["SUB"] = _rows_sub(meta["BLOCK_N"], block_size, rows_h * (D // vop.group))
        opts["maxnreg"] = 168 if opts["SUB"] == 1 else 176
    else:
        opts["SUB"] = _channel_sub(meta["BLOCK_N"], block_size)
        if rows_h * (D // vop.group) <= 16:
            opts["maxnreg"] = 168
    return opts


def code_rows_t_options(meta: dict, kop: Operand, vop: Operand, rep: int, block_size: int) -> dict:
    """Launch options of :func:`_decode_partial_rows_t` for grouped int3 / int2 (or int4 with one of them) K and V
    or per-channel int4 keys over such values: 64-token tiles (32 above head_dim 128), 4 warps, ``SUB`` tiles per
    step with its register cap; int2 keys at head_dim 128 with four tiles per step take eight (``OCT``: four
    pool-block parts under one softmax update, the parts' row strides as constants ``K_ROW`` / ``V_ROW``); two
    pipeline stages with four or eight tiles per step except eight over int2 values at GQA > 1; no zero-term MMA
    (``KZW``) over int4 values there."""
    D = meta["D"]
    rows_h = row_heads(rep, D, vop.group)
    chan = kop.folds_channel4()
    opts: dict = {"BLOCK_N": min(64 if D <= 128 else 32, block_size), "BLOCK_H": rows_h, "num_warps": 4,
                  "K_FOLD": 2 if chan else 1, "V_FOLD": True, "OFF32": kop.offsets32() and vop.offsets32(),
                  "KZW": _word_rows(kop.zero)}  # fmt: skip
    columns = rows_h * (D // vop.group)
    if chan:
        opts["SUB"] = _channel_sub(opts["BLOCK_N"], block_size)
        if columns <= 16:
            opts["maxnreg"] = 128 if opts["SUB"] == 1 else 168
        return opts
    opts["SUB"] = _rows_sub(opts["BLOCK_N"], block_size, columns, wide=True)
    opts["maxnreg"] = {1: 168, 2: 176}.get(opts["SUB"], 192)
    if opts["SUB"] == 4 and kop.bits == 2 and D == 128:
        opts.update(SUB=8, OCT=True, maxnreg=255, K_ROW=kop.data.stride(2), V_ROW=vop.data.stride(2))
        if rep == 1 or vop.bits != 2:
            opts["num_stages"] = 2
        if vop.bits == 4:
            opts["KZW"] = False
    if opts["SUB"] == 4:
        opts["num_stages"] = 2
    return opts
