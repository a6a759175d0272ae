"""Tile steps of the grouped-rows decode kernels (:mod:`triton_rows`)."""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_decode_tiles import _block_pos
from .triton_dequant import (
    NIBBLE_HI,
    _mma,
    cap_scores,
    code_tiles,
    codes_operand,
    dot_split_a,
    key_tile2,
    mma_acc,
    nibble_tiles,
    nibbles_operand,
    online_rescale,
    perm4,
    pv_acc,
    reduce_max,
    reduce_sum,
)
from .triton_rows_cols import (
    _cat_cols,
    _from_rows,
    _group_cols,
    _group_rows,
    _group_sum,
    _head_cols,
    _kz_words,
    _rescale_acc,
    _rows_mask,
    _split_cols,
    _tiles_load,
    _to_rows,
    _zero_term,
)


@triton.jit
def _rows_tile(
    n0, start, end, MASKED: tl.constexpr,
    q_lo, q_hi, q_sum, scale, tbl,
    k_base, ks_base, kz_base, k_sb, k_st, ks_sb, ks_st,
    v_base, vs_base, vz_base, v_sb, v_st, vs_sb, vs_st,
    m_i, l_i, acc_lo, acc_hi, zacc,
    D: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr, DOT: tl.constexpr, SOFTCAP: tl.constexpr,
    G: tl.constexpr, REPP: tl.constexpr, K_FOLD: tl.constexpr,
):  # fmt: skip
    """One tile (see :func:`_tile`) of the rows kernel."""
    DH: tl.constexpr = D // 2
    inner = n0 % BS + tl.arange(0, BLOCK_N)
    if MASKED:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = (offs_n >= start) & (offs_n < end)
        blk = tl.load(tbl + n0 // BS, mask=n0 < end, other=0).to(tl.int64)
    else:
        mask_n = tl.full([BLOCK_N], 1, tl.int1)  # a constant-true mask: the compiler drops it
        blk = tl.load(tbl + n0 // BS).to(tl.int64)
    j = tl.arange(0, DH)
    # K codes [D/2, BLOCK_N]: low nibbles channels [0, D/2), high nibbles [D/2, D)
    kb = tl.load(k_base + blk * k_sb + inner[None, :] * k_st + j[:, None], mask=mask_n[None, :], other=0)
    if K_FOLD == 1:
        k_lo, k_hi = nibbles_operand(kb, DOT)
        s = mma_acc(q_hi, k_hi, _mma(q_lo, k_lo, DOT), DOT)
        ks = _group_rows(ks_base + blk * ks_sb, n0 % BS, G, REPP, BLOCK_N, mask_n)
        kz = _group_rows(kz_base + blk * ks_sb, n0 % BS, G, REPP, BLOCK_N, mask_n)
        s = s * ks + q_sum[:, None] * kz
    else:
        # per-channel keys: the block's scale row folded into the query, its zero into one term per row
        srow = ks_base + blk * ks_sb
        zrow = kz_base + blk * ks_sb
        a_lo = q_lo * tl.load(srow + j).to(tl.float32)[None, :]
        a_hi = q_hi * tl.load(srow + DH + j).to(tl.float32)[None, :]
        zq = reduce_sum(q_lo * tl.load(zrow + j).to(tl.float32)[None, :], 1)
        zq += reduce_sum(q_hi * tl.load(zrow + DH + j).to(tl.float32)[None, :], 1)
        s = dot_split_a(a_lo, codes_operand(kb & 15, DOT), DOT) + dot_split_a(a_hi, codes_operand(kb >> 4, DOT), DOT)
        s = s + zq[:, None]
    s = cap_scores(_from_rows(s, G, REPP) * scale, SOFTCAP)
    if MASKED:
        s = tl.where(mask_n[None, :], s, float("-inf"))
    m_new, m_safe, alpha = online_rescale(m_i, reduce_max(s, 1))
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + reduce_sum(p, 1)
    # V: codes [BLOCK_N, D/2]; probabilities on the group rows, scaled by each row's group scale
    vb = tl.load(v_base + blk * v_sb + inner[:, None] * v_st + j[None, :], mask=mask_n[:, None], other=0)
    pr = _to_rows(p, G)
    vs = _group_rows(vs_base + blk * vs_sb, n0 % BS, G, REPP, BLOCK_N, mask_n)
    vz = _group_rows(vz_base + blk * vs_sb, n0 % BS, G, REPP, BLOCK_N, mask_n)
    a = _to_rows(alpha, G)
    ps = pr * vs
    v_lo, v_hi = nibbles_operand(vb, DOT)
    acc_lo = pv_acc(ps, v_lo, acc_lo * a[:, None], DOT)
    acc_hi = pv_acc(ps, v_hi, acc_hi * a[:, None], DOT)
    zacc = zacc * a + reduce_sum(pr * vz, 1)
    return m_new, l_i, acc_lo, acc_hi, zacc


@triton.jit
def _rows_scores(
    n0, start, end, MASKED: tl.constexpr, qt_lo, q_sum, scale, wk, b_lo, b_hi, zq, k_base, ko, k_offs, ks_t, kz_t,
    D: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
    G: tl.constexpr, REPP: tl.constexpr, K_FOLD: tl.constexpr, K_BITS: tl.constexpr, COLS: tl.constexpr = 0,
):  # fmt: skip
    """Scores ``[BLOCK_N, REPP]`` of the tile at ``n0`` for :func:`_rows_tile_t` (-inf outside ``[start, end)``),
    from its loaded code words ``kw`` (int3: the byte planes ``kw``, ``kw_m``, ``kw_h``) and, for grouped keys, its
    scale / zero rows ``ks_t`` / ``kz_t [BLOCK_N, G]``. Grouped keys without softcapping: unscaled (``RAW`` there),
    else times the softmax scale."""
    mask_n = _rows_mask(n0, start, end, MASKED, BLOCK_N)
    kp = (k_base + ko).to(tl.pointer_type(tl.int32))
    if K_FOLD == 1:
        # one MMA over D: the code tile (code_tiles: position i = c 2**(e(i) - 24)) @ qt (row i: 2**(EMAX - e(i))
        # f q), so st = 2**(EMAX - 24) f q . c per column (h, g) = head h on group g (q_sum comes scaled alike,
        # `scale` holds 2**(24 - EMAX) / f)
        if K_BITS == 2 and D >= 64:  # noqa: SIM108 (a constexpr branch); int2: the MMA's register layout
            kx = key_tile2(kp, k_offs, mask_n, BLOCK_N, D)
        else:
            kx = code_tiles(kp, k_offs, mask_n, K_BITS, BLOCK_N, D)
        st = tl.dot(kx, qt_lo)
        ks = _group_cols(ks_t.to(tl.float32), BLOCK_N, G, REPP, COLS)
        if COLS == 2:  # q_sum: the zero-term MMA's operand (_zero_operand)
            s = _group_sum(st * ks, BLOCK_N, G, REPP, COLS) + _zero_term(kz_t, q_sum, BLOCK_N, G, REPP)  # words
        else:
            kz = _group_cols(kz_t.to(tl.float32), BLOCK_N, G, REPP, COLS)
            st = st * ks + q_sum[None, :] * kz
            s = _group_sum(st, BLOCK_N, G, REPP, COLS)  # [BLOCK_N, REPP]
        if SOFTCAP > 0:  # else the scale (> 0) is applied after the maximum (_rows_tile_t: RAW)
            s = s * scale
    else:  # per-channel keys: the block's operands b_lo / b_hi and zero term zq (_rows_tile_t)
        k_lo, k_hi = nibble_tiles(kp, k_offs, mask_n, BLOCK_N, D)
        if G >= 4:
            # b_lo / b_hi fill disjoint columns (_split_cols): one accumulator, the low nibbles' x16 and the softmax
            # scale in the per-column weights wk of the sum over g; zq comes scaled
            st = tl.dot(k_hi, b_hi, tl.dot(k_lo, b_lo))
            s = reduce_sum(tl.reshape(st * wk[None, :], [BLOCK_N, REPP, G]), 2) + zq[None, :]
        else:
            st = tl.dot(k_lo, b_lo) * 16.0  # 2**-20 units, as the high nibbles'
            st = tl.dot(k_hi, b_hi, st)
            s = (reduce_sum(tl.reshape(st, [BLOCK_N, REPP, G]), 2) + zq[None, :]) * scale
    s = cap_scores(s, SOFTCAP)
    if MASKED:
        s = tl.where(mask_n[:, None], s, float("-inf"))
    return s


@triton.jit
def _rows_pv(
    n0, start, end, MASKED: tl.constexpr, p, acc, zacc, v_base, vo, v_offs, vs_t, vz_t,
    D: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, REPP: tl.constexpr, V_BITS: tl.constexpr,
    COLS: tl.constexpr = 0,
):  # fmt: skip
    """``acc`` and ``zacc`` (already rescaled) plus the tile's probabilities ``p [BLOCK_N, REPP]`` times its values
    (loaded code words ``vw`` (int3: planes ``vw``, ``vw_m``, ``vw_h``), scale / zero rows ``vs_t`` / ``vz_t``
    ``[BLOCK_N, G]``), for :func:`_rows_tile_t`."""
    R: tl.constexpr = G * REPP
    pc = _head_cols(p, G, COLS)  # [BLOCK_N, R]
    vsz = tl.join(vs_t, vz_t).to(tl.float32)
    if COLS >= 1:
        vsz = tl.reshape(tl.broadcast_to(tl.reshape(vsz, [BLOCK_N, G // 2, 1, 2, 2]), [BLOCK_N, G // 2, REPP, 2, 2]),
                         [BLOCK_N, REPP * G, 2])  # fmt: skip
    else:
        vsz = tl.reshape(tl.broadcast_to(vsz[:, None, :, :], [BLOCK_N, REPP, G, 2]), [BLOCK_N, REPP * G, 2])
    vs_c, vz_c = tl.split(vsz)
    ps = pc * vs_c
    # hi / lo fp16 parts: ph32 = ps truncated to 11 significant bits (one and: exact in fp16 in the normal range),
    # pl the rest (exact in fp32); cheaper than rounding ps to fp16 (docs/kernels.md). A NaN still propagates
    # through pl.
    ph32 = (ps.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)  # -8192: 0xFFFFE000
    ph = ph32.to(tl.float16)
    pl = (ps - ph32).to(tl.float16)
    # one [D, BLOCK_N] operand (code_tiles: row i in units of 2**(e(i) - 24), applied in the epilogue); with at most
    # 16 columns one MMA chain against [ph | pl] (acc holds both halves' columns, summed after the loop: half the
    # MMAs), else one per half
    vp = (v_base + vo).to(tl.pointer_type(tl.int32))
    vt = tl.trans(code_tiles(vp, v_offs, _rows_mask(n0, start, end, MASKED, BLOCK_N), V_BITS, BLOCK_N, D))
    if R <= 16:  # noqa: SIM108 (a constexpr branch); acc [D, 2R]: both halves in one MMA chain (_rows_tile_t)
        acc = tl.dot(vt, _cat_cols(ph, pl, BLOCK_N, 2 * R), acc)
    else:
        acc = tl.dot(vt, pl, tl.dot(vt, ph, acc))
    # V's zero term per (token, row), summed over the tokens after the loop
    zacc = zacc + pc * vz_c
    return acc, zacc


@triton.jit
def _rows_tile_t(
    n0, start, end, MASKED: tl.constexpr, qt_lo, qt_hi, q_sum, scale, wk, tbl,
    k_base, ks_base, kz_base, k_sb, k_st, ks_sb,
    v_base, vs_base, vz_base, v_sb, v_st, vs_sb, k_offs, v_offs, g_offs,
    m_i, l_i, acc, zacc,
    D: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr, SOFTCAP: tl.constexpr,
    G: tl.constexpr, REPP: tl.constexpr, K_FOLD: tl.constexpr, OFF32: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, SUB: tl.constexpr, COLS: tl.constexpr = 0,
):  # fmt: skip
    """One step of :func:`_decode_partial_rows_t`: ``SUB`` (1, 2 or 4) tiles of ``BLOCK_N`` tokens from ``n0``; one or
    two tiles lie in one pool block (one block-table read; per-channel keys: the block's query operands built once),
    four in two (grouped keys only), all under one softmax update (every tile's scores first, then one
    running-maximum rescale of the accumulators). Addresses: a
    scalar base per part and tile (block, first token) plus the loop-invariant offsets ``k_offs`` / ``v_offs``
    (words of the rows, ``k_st`` / ``v_st`` in words) and ``g_offs`` (per-(token, group) scale / zero rows)."""
    n_blk, n_in = _block_pos(n0, BS)
    if MASKED:  # noqa: SIM108 (a constexpr branch)
        blk = tl.load(tbl + n_blk, mask=n0 < end, other=0)
    else:
        blk = tl.load(tbl + n_blk)
    if not OFF32:  # 64-bit element offsets (OFF32: every offset of the parts fits in 31 bits)
        blk = blk.to(tl.int64)
    b_lo = qt_lo  # unused unless K_FOLD == 2
    b_hi = qt_hi
    zq = scale
    if K_FOLD == 2:
        # per-channel keys (qt_lo / qt_hi: the heads' query [D/2, REPP] on the channels of the low / high nibbles,
        # fp32): the block's scale row folded into the query, a = q * s split into two fp16 MMA operands (columns
        # [hi | lo] of each head), its zero into one fp32 term per head q . z; once per step
        DH: tl.constexpr = D // 2
        jc = perm4(tl.arange(0, DH))
        srow = ks_base + blk * ks_sb + jc
        b_lo = _split_cols(qt_lo * tl.load(srow).to(tl.float32)[:, None], DH, REPP, G)
        b_hi = _split_cols(qt_hi * tl.load(srow + DH).to(tl.float32)[:, None], DH, REPP, G, True)
        # q . z over the natural channel order: q_sum holds the heads' query rows [REPP, D] (fp32)
        zq = reduce_sum(q_sum * tl.load(kz_base + blk * ks_sb + tl.arange(0, D)).to(tl.float32)[None, :], 1)
        if G >= 4:  # noqa: SIM108 (a constexpr branch)
            zq = zq * (scale / NIBBLE_HI)  # _rows_scores adds it to the scaled scores
        else:
            zq = zq * (1.0 / NIBBLE_HI)
    # scale / zero rows: one load per part for the step's SUB tiles (_tiles_load); code words: one load per tile
    # (_rows_scores, _rows_pv)
    HS: tl.constexpr = 1 if SUB == 1 else 2  # tiles per half-step (one pool block; SUB 4: two halves)
    ko = blk * k_sb + n_in * (k_st * 4)  # bytes: the step's first key row
    ks0, ks1, kz0, kz1 = scale, scale, scale, scale  # grouped keys only
    if K_FOLD == 1:
        gk = blk * ks_sb + n_in * G
        ks0, ks1 = _tiles_load(ks_base + gk, g_offs, BLOCK_N * G, n0, start, end, MASKED, BLOCK_N, HS)
        if COLS == 2:  # noqa: SIM108 (a constexpr branch)
            kz0, kz1 = _kz_words(kz_base + gk, n0, start, end, MASKED, BLOCK_N, G, HS)
        else:
            kz0, kz1 = _tiles_load(kz_base + gk, g_offs, BLOCK_N * G, n0, start, end, MASKED, BLOCK_N, HS)
    s0 = _rows_scores(n0, start, end, MASKED, qt_lo, q_sum, scale, wk, b_lo, b_hi, zq, k_base, ko, k_offs,
                      ks0, kz0,
                      D, BLOCK_N, SOFTCAP, G, REPP, K_FOLD, K_BITS, COLS)  # fmt: skip
    s1 = s0  # unused unless SUB >= 2
    if SUB >= 2:
        s1 = _rows_scores(n0 + BLOCK_N, start, end, MASKED, qt_lo, q_sum, scale, wk, b_lo, b_hi, zq, k_base,
                          ko + BLOCK_N * (k_st * 4), k_offs, ks1, kz1,
                          D, BLOCK_N, SOFTCAP, G, REPP, K_FOLD, K_BITS, COLS)  # fmt: skip
    blk2, n_in2, s2, s3 = blk, n_in, s0, s1  # unused unless SUB == 4
    if SUB == 4:
        n02 = n0 + 2 * BLOCK_N
        n_blk2, n_in2 = _block_pos(n02, BS)
        if MASKED:  # noqa: SIM108 (a constexpr branch)
            blk2 = tl.load(tbl + n_blk2, mask=n02 < end, other=0)
        else:
            blk2 = tl.load(tbl + n_blk2)
        if not OFF32:
            blk2 = blk2.to(tl.int64)
        ko2 = blk2 * k_sb + n_in2 * (k_st * 4)
        gk2 = blk2 * ks_sb + n_in2 * G
        ks2, ks3 = _tiles_load(ks_base + gk2, g_offs, BLOCK_N * G, n02, start, end, MASKED, BLOCK_N, 2)
        if COLS == 2:  # noqa: SIM108 (a constexpr branch)
            kz2, kz3 = _kz_words(kz_base + gk2, n02, start, end, MASKED, BLOCK_N, G, 2)
        else:
            kz2, kz3 = _tiles_load(kz_base + gk2, g_offs, BLOCK_N * G, n02, start, end, MASKED, BLOCK_N, 2)
        s2 = _rows_scores(n02, start, end, MASKED, qt_lo, q_sum, scale, wk, b_lo, b_hi, zq, k_base, ko2, k_offs,
                          ks2, kz2, D, BLOCK_N, SOFTCAP, G, REPP, K_FOLD, K_BITS, COLS)  # fmt: skip
        s3 = _rows_scores(n02 + BLOCK_N, start, end, MASKED, qt_lo, q_sum, scale, wk, b_lo, b_hi, zq, k_base,
                          ko2 + BLOCK_N * (k_st * 4), k_offs, ks3, kz3,
                          D, BLOCK_N, SOFTCAP, G, REPP, K_FOLD, K_BITS, COLS)  # fmt: skip
        m_blk = reduce_max(tl.maximum(tl.maximum(s0, s1), tl.maximum(s2, s3)), 0)
    elif SUB == 2:
        m_blk = reduce_max(tl.maximum(s0, s1), 0)  # one reduction over both tiles (elementwise maximum first)
    else:
        m_blk = reduce_max(s0, 0)
    # grouped keys without softcapping: the scores come unscaled; the scale (> 0) multiplies their maximum, and
    # folds into the exponent's multiply-add (one multiply per (token, head) less)
    RAW: tl.constexpr = K_FOLD == 1 and SOFTCAP == 0
    ssc = scale if RAW else 1.0
    if RAW:
        m_blk = m_blk * scale
    if MASKED:
        m_new, m_safe, alpha = online_rescale(m_i, m_blk)
    else:  # an interior step's scores are finite: so is the new maximum (no -inf guard)
        m_new = tl.maximum(m_i, m_blk)
        m_safe = m_new
        alpha = tl.exp2(m_i - m_new)
    acc, zacc = _rescale_acc(acc, zacc, alpha, G, REPP, COLS)
    vo = blk * v_sb + n_in * (v_st * 4)  # bytes: the step's first value row
    gv = blk * vs_sb + n_in * G
    vs0, vs1 = _tiles_load(vs_base + gv, g_offs, BLOCK_N * G, n0, start, end, MASKED, BLOCK_N, HS)
    vz0, vz1 = _tiles_load(vz_base + gv, g_offs, BLOCK_N * G, n0, start, end, MASKED, BLOCK_N, HS)
    p = tl.exp2(s0 * ssc - m_safe[None, :])
    l_i = l_i * alpha[None, :] + p  # per (token, head): summed over the tokens after the loop
    acc, zacc = _rows_pv(n0, start, end, MASKED, p, acc, zacc, v_base, vo, v_offs, vs0, vz0,
                         D, BLOCK_N, G, REPP, V_BITS, COLS)  # fmt: skip
    if SUB >= 2:
        p = tl.exp2(s1 * ssc - m_safe[None, :])
        l_i = l_i + p
        acc, zacc = _rows_pv(n0 + BLOCK_N, start, end, MASKED, p, acc, zacc, v_base, vo + BLOCK_N * (v_st * 4), v_offs,
                             vs1, vz1, D, BLOCK_N, G, REPP, V_BITS, COLS)  # fmt: skip
    if SUB == 4:
        n02 = n0 + 2 * BLOCK_N
        vo2 = blk2 * v_sb + n_in2 * (v_st * 4)
        gv2 = blk2 * vs_sb + n_in2 * G
        vs2, vs3 = _tiles_load(vs_base + gv2, g_offs, BLOCK_N * G, n02, start, end, MASKED, BLOCK_N, 2)
        vz2, vz3 = _tiles_load(vz_base + gv2, g_offs, BLOCK_N * G, n02, start, end, MASKED, BLOCK_N, 2)
        p = tl.exp2(s2 * ssc - m_safe[None, :])
        l_i = l_i + p
        acc, zacc = _rows_pv(n02, start, end, MASKED, p, acc, zacc, v_base, vo2, v_offs, vs2, vz2,
                             D, BLOCK_N, G, REPP, V_BITS, COLS)  # fmt: skip
        p = tl.exp2(s3 * ssc - m_safe[None, :])
        l_i = l_i + p
        acc, zacc = _rows_pv(n02 + BLOCK_N, start, end, MASKED, p, acc, zacc, v_base, vo2 + BLOCK_N * (v_st * 4),
                             v_offs, vs3, vz3, D, BLOCK_N, G, REPP, V_BITS, COLS)  # fmt: skip
    return m_new, l_i, acc, zacc


@triton.jit
def _pair_scores(
    n0, start, end, qt_lo, q_sum, scale, blk, k_base, ks_base, kz_base, k_sb, k_st, ks_sb, k_offs, g_offs,
    D: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr, SOFTCAP: tl.constexpr,
    G: tl.constexpr, REPP: tl.constexpr, OFF32: tl.constexpr, K_BITS: tl.constexpr, PAIR: tl.constexpr,
    K_ROW: tl.constexpr, COLS: tl.constexpr = 0,
):  # fmt: skip
    """The scores of the ``PAIR`` (2 or 1) interior tiles from ``n0`` (pool block ``blk``, loaded by the caller)
    for :func:`_rows_oct_t` (grouped keys; ``s1`` is ``s0`` when ``PAIR`` is 1), and the block's id and first row."""
    n_in = _block_pos(n0, BS)[1]
    if not OFF32:
        blk = blk.to(tl.int64)
    ko = blk * k_sb + n_in * (k_st * 4)
    gk = blk * ks_sb + n_in * G
    ks0, ks1 = _tiles_load(ks_base + gk, g_offs, BLOCK_N * G, n0, start, end, False, BLOCK_N, PAIR)
    if COLS == 2:  # noqa: SIM108 (a constexpr branch)
        kz0, kz1 = _kz_words(kz_base + gk, n0, start, end, False, BLOCK_N, G, PAIR)
    else:
        kz0, kz1 = _tiles_load(kz_base + gk, g_offs, BLOCK_N * G, n0, start, end, False, BLOCK_N, PAIR)
    s0 = _rows_scores(n0, start, end, False, qt_lo, q_sum, scale, scale, qt_lo, qt_lo, scale, k_base, ko, k_offs,
                      ks0, kz0, D, BLOCK_N, SOFTCAP, G, REPP, 1, K_BITS, COLS)  # fmt: skip
    s1 = s0
    if PAIR == 2:
        s1 = _rows_scores(n0 + BLOCK_N, start, end, False, qt_lo, q_sum, scale, scale, qt_lo, qt_lo, scale,
                          k_base + BLOCK_N * K_ROW, ko, k_offs, ks1, kz1, D, BLOCK_N, SOFTCAP, G, REPP, 1,
                          K_BITS, COLS)  # fmt: skip
    return s0, s1, blk, n_in


@triton.jit
def _pair_pv(
    n0, start, end, s0, s1, ssc, m_safe, l_i, acc, zacc, blk, n_in, v_base, vs_base, vz_base, v_sb, v_st, vs_sb,
    v_offs, g_offs, D: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, REPP: tl.constexpr,
    V_BITS: tl.constexpr, PAIR: tl.constexpr, V_ROW: tl.constexpr, COLS: tl.constexpr = 0,
):  # fmt: skip
    """``l_i``, ``acc`` and ``zacc`` (already rescaled) plus the two interior tiles from ``n0`` (scores ``s0`` /
    ``s1``, pool block ``blk`` from row ``n_in``) for :func:`_rows_oct_t`."""
    vo = blk * v_sb + n_in * (v_st * 4)
    gv = blk * vs_sb + n_in * G
    vs0, vs1 = _tiles_load(vs_base + gv, g_offs, BLOCK_N * G, n0, start, end, False, BLOCK_N, PAIR)
    vz0, vz1 = _tiles_load(vz_base + gv, g_offs, BLOCK_N * G, n0, start, end, False, BLOCK_N, PAIR)
    p = tl.exp2(s0 * ssc - m_safe[None, :])
    l_i = l_i + p
    acc, zacc = _rows_pv(n0, start, end, False, p, acc, zacc, v_base, vo, v_offs, vs0, vz0,
                         D, BLOCK_N, G, REPP, V_BITS, COLS)  # fmt: skip
    if PAIR == 2:
        p = tl.exp2(s1 * ssc - m_safe[None, :])
        l_i = l_i + p
        acc, zacc = _rows_pv(n0 + BLOCK_N, start, end, False, p, acc, zacc, v_base + BLOCK_N * V_ROW, vo,
                             v_offs, vs1, vz1, D, BLOCK_N, G, REPP, V_BITS, COLS)  # fmt: skip
    return l_i, acc, zacc


@triton.jit
def _rows_oct_t(
    n0, start, end, qt_lo, q_sum, scale, tbl, k_base, ks_base, kz_base, k_sb, k_st, ks_sb,
    v_base, vs_base, vz_base, v_sb, v_st, vs_sb, k_offs, v_offs, g_offs, m_i, l_i, acc, zacc,
    D: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr, SOFTCAP: tl.constexpr,
    G: tl.constexpr, REPP: tl.constexpr, OFF32: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    PAIR: tl.constexpr, K_ROW: tl.constexpr, V_ROW: tl.constexpr, COLS: tl.constexpr = 0,
):  # fmt: skip
    """An interior step of eight tiles (``SUB`` 8, grouped keys): four pairs, each in one pool block, under one
    softmax update -- :func:`_rows_tile_t`'s four-tile step twice as long (one maximum reduction, one rescale of
    ``acc`` / ``zacc`` / ``l`` per 8 tiles)."""
    T2: tl.constexpr = PAIR * BLOCK_N
    # the four parts' block ids in one load (one copy group and one wait instead of four)
    u = tl.cast(n0, tl.uint32)
    ids = tl.load(tbl + ((u + tl.arange(0, 4) * T2) // BS).to(tl.int32))
    ids02, ids13 = tl.split(tl.reshape(ids, [2, 2]))  # (ids[0], ids[2]), (ids[1], ids[3])
    bk0, bk2 = tl.split(ids02)
    bk1, bk3 = tl.split(ids13)
    s0, s1, b0, i0 = _pair_scores(n0, start, end, qt_lo, q_sum, scale, bk0, k_base, ks_base, kz_base, k_sb, k_st,
                                  ks_sb, k_offs, g_offs, D, BLOCK_N, BS, SOFTCAP, G, REPP, OFF32, K_BITS,
                                  PAIR, K_ROW, COLS)  # fmt: skip
    s2, s3, b1, i1 = _pair_scores(n0 + T2, start, end, qt_lo, q_sum, scale, bk1, k_base, ks_base, kz_base, k_sb,
                                  k_st, ks_sb, k_offs, g_offs, D, BLOCK_N, BS, SOFTCAP, G, REPP, OFF32, K_BITS,
                                  PAIR, K_ROW, COLS)  # fmt: skip
    s4, s5, b2, i2 = _pair_scores(n0 + 2 * T2, start, end, qt_lo, q_sum, scale, bk2, k_base, ks_base, kz_base, k_sb,
                                  k_st, ks_sb, k_offs, g_offs, D, BLOCK_N, BS, SOFTCAP, G, REPP, OFF32, K_BITS,
                                  PAIR, K_ROW, COLS)  # fmt: skip
    s6, s7, b3, i3 = _pair_scores(n0 + 3 * T2, start, end, qt_lo, q_sum, scale, bk3, k_base, ks_base, kz_base, k_sb,
                                  k_st, ks_sb, k_offs, g_offs, D, BLOCK_N, BS, SOFTCAP, G, REPP, OFF32, K_BITS,
                                  PAIR, K_ROW, COLS)  # fmt: skip
    m4 = tl.maximum(tl.maximum(s0, s1), tl.maximum(s2, s3))
    m4 = tl.maximum(m4, tl.maximum(tl.maximum(s4, s5), tl.maximum(s6, s7)))
    m_blk = reduce_max(m4, 0)
    RAW: tl.constexpr = SOFTCAP == 0  # as _rows_tile_t: unscaled scores, the scale on their maximum
    ssc = scale if RAW else 1.0
    if RAW:
        m_blk = m_blk * scale
    m_new = tl.maximum(m_i, m_blk)  # interior: finite scores
    alpha = tl.exp2(m_i - m_new)
    acc, zacc = _rescale_acc(acc, zacc, alpha, G, REPP, COLS)
    l_i = l_i * alpha[None, :]
    l_i, acc, zacc = _pair_pv(n0, start, end, s0, s1, ssc, m_new, l_i, acc, zacc, b0, i0, v_base, vs_base, vz_base,
                              v_sb, v_st, vs_sb, v_offs, g_offs, D, BLOCK_N, G, REPP, V_BITS, PAIR, V_ROW,
                              COLS)  # fmt: skip
    l_i, acc, zacc = _pair_pv(n0 + T2, start, end, s2, s3, ssc, m_new, l_i, acc, zacc, b1, i1, v_base, vs_base,
                              vz_base, v_sb, v_st, vs_sb, v_offs, g_offs, D, BLOCK_N, G, REPP, V_BITS,
                              PAIR, V_ROW, COLS)  # fmt: skip
    l_i, acc, zacc = _pair_pv(n0 + 2 * T2, start, end, s4, s5, ssc, m_new, l_i, acc, zacc, b2, i2, v_base, vs_base,
                              vz_base, v_sb, v_st, vs_sb, v_offs, g_offs, D, BLOCK_N, G, REPP, V_BITS,
                              PAIR, V_ROW, COLS)  # fmt: skip
    l_i, acc, zacc = _pair_pv(n0 + 3 * T2, start, end, s6, s7, ssc, m_new, l_i, acc, zacc, b3, i3, v_base, vs_base,
                              vz_base, v_sb, v_st, vs_sb, v_offs, g_offs, D, BLOCK_N, G, REPP, V_BITS,
                              PAIR, V_ROW, COLS)  # fmt: skip
    return m_new, l_i, acc, zacc
