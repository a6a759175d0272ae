"""Tile steps of the per-head decode kernels (:mod:`triton_decode_kernels`): one tile of ``BLOCK_N`` tokens
read through the block table, dequantized in registers and folded into the online softmax."""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_codebook import codebook_norms
from .triton_dequant import (
    cap_scores,
    dot_pv,
    dot_qk,
    int8_words_fp16,
    load_tile,
    load_token_scale,
    online_rescale,
    pv_fold4,
    qk_channel4,
    qk_fold4,
    reduce_max,
    reduce_sum,
)


@triton.jit
def _tile(
    n0, start, end, MASKED: tl.constexpr,
    q, q_lo, q_hi, qs_lo, qs_hi, scale, tbl,
    k_base, ks_base, kz_base, k_sb, k_st, ks_sb, ks_st,
    v_base, vs_base, vz_base, v_sb, v_st, vs_sb, vs_st,
    m_i, l_i, acc, acc_lo, acc_hi, zacc_lo, zacc_hi,
    D: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr, DOT: tl.constexpr, SOFTCAP: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr,
    K_FOLD: tl.constexpr, V_FOLD: tl.constexpr,
):  # fmt: skip
    """One tile of ``BLOCK_N`` tokens ``[n0, n0 + BLOCK_N)``, all in one pool block (``BLOCK_N`` divides
    ``BS``): one block-table read per tile, contiguous rows. ``MASKED`` (edge tiles): tokens outside
    ``[start, end)`` take no part; interior tiles load and score without masks."""
    inner = n0 % BS + tl.arange(0, BLOCK_N)
    if MASKED:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = (offs_n >= start) & (offs_n < end)
        blk = tl.load(tbl + n0 // BS, mask=n0 < end, other=0).to(tl.int64)
    else:
        mask_n = tl.full([BLOCK_N], 1, tl.int1)  # a constant-true mask: the compiler drops it
        blk = tl.load(tbl + n0 // BS).to(tl.int64)
    kb = k_base + blk * k_sb
    vb = v_base + blk * v_sb
    ksb, kzb = ks_base + blk * ks_sb, kz_base + blk * ks_sb
    vsb, vzb = vs_base + blk * vs_sb, vz_base + blk * vs_sb
    if K_KIND >= 8:  # codebook / tqc / tqv: kz_base is the (sequence, head)'s row, not a per-block part
        kzb = kz_base
    if V_KIND >= 8:
        vzb = vz_base
    k_rows = inner * k_st
    v_rows = inner * v_st
    # CHANNEL scales: the block's one row; others: one row per token
    if K_KIND == 7:  # noqa: SIM108 (a constexpr branch)
        ks_rows = inner * 0
    else:
        ks_rows = inner * ks_st
    if V_KIND == 7:  # noqa: SIM108 (a constexpr branch)
        vs_rows = inner * 0
    else:
        vs_rows = inner * vs_st
    if K_FOLD == 2:
        s = qk_channel4(q_lo, q_hi, kb, ksb, kzb, k_rows, 0, mask_n, D, DOT) * scale
    elif K_FOLD == 1:
        s = qk_fold4(q_lo, q_hi, qs_lo, qs_hi, kb, ksb, kzb, k_rows, ks_rows, mask_n, D, K_GROUP, DOT) * scale
    else:
        offs_d = tl.arange(0, D)
        k = load_tile(kb, ksb, kzb, k_rows, ks_rows, mask_n, offs_d, K_KIND, K_BITS, K_GROUP, D, DOT)
        s = dot_qk(q, tl.trans(k), DOT, K_KIND == 3 or K_KIND >= 7) * scale
    if K_KIND == 2:
        s = s * load_token_scale(ksb, ks_rows, mask_n)[None, :]
    elif K_KIND >= 8:
        s = s * codebook_norms(ksb, ks_rows, mask_n, kzb)[None, :]
    s = cap_scores(s, SOFTCAP)
    if MASKED:
        s = tl.where(mask_n[None, :], s, float("-inf"))
    m_new, m_safe, alpha = online_rescale(m_i, reduce_max(s, 1))
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + reduce_sum(p, 1)
    if V_FOLD:
        a3 = alpha[None, :, None]
        acc_lo, acc_hi, zacc_lo, zacc_hi = pv_fold4(
            p, acc_lo * a3, acc_hi * a3, zacc_lo * a3, zacc_hi * a3, vb, vsb, vzb, v_rows, vs_rows,
            mask_n, D, V_GROUP, DOT)  # fmt: skip
    else:
        offs_d = tl.arange(0, D)
        v = load_tile(vb, vsb, vzb, v_rows, vs_rows, mask_n, offs_d, V_KIND, V_BITS, V_GROUP, D, DOT)
        if V_KIND == 2:
            p = p * load_token_scale(vsb, vs_rows, mask_n)[None, :]
        elif V_KIND >= 8:
            p = p * codebook_norms(vsb, vs_rows, mask_n, vzb)[None, :]
        acc = acc * alpha[:, None] + dot_pv(p, v, DOT, V_KIND == 3 or V_KIND >= 7)
    return m_new, l_i, acc, acc_lo, acc_hi, zacc_lo, zacc_hi


@triton.jit
def _program_span(HEAD_IDX, LO, HI, lo_sb, past_len, part_len, Hg, HAS_RANGE: tl.constexpr):
    """This program's (row, KV head of the group) and the history span ``[start, end)`` of its split:
    ``(pid, split, b, hg, b64, h, start, end)`` (``h``: the layer's KV head; ``b64``: ``b`` for 64-bit offsets)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // Hg
    hg = pid % Hg
    h = tl.load(HEAD_IDX + hg)
    lo = 0
    hi = past_len
    if HAS_RANGE:
        lo = tl.load(LO + b * lo_sb)
        hi = tl.minimum(tl.load(HI + b * lo_sb), past_len)
    start = tl.maximum(lo, split * part_len)
    end = tl.minimum(hi, (split + 1) * part_len)
    return pid, split, b, hg, b.to(tl.int64), h, start, end


# ------------------------------------------------------- exact fp16 operands, transposed (tokens as MMA rows)
# With fp16 queries and K / V tiles that are exact fp16 MMA operands (int8 codes, fp16 values, fp8), the
# decode runs transposed: scores^T [BLOCK_N, heads] = K [BLOCK_N, D] @ q^T [D, heads] and out^T [D, heads] +=
# V^T [D, BLOCK_N] @ p^T [BLOCK_N, heads]. The MMA rows are then tokens / channels (64 or more: Hopper's
# warpgroup MMAs, wgmma, with the loop-invariant query in shared memory) instead of the few query heads
# padded to 16 rows (mma.sync, whose operand fragments the compiler copies around every instruction).
@triton.jit
def _block_pos(n0, BS: tl.constexpr):
    """Pool block index and offset in it of the token ``n0 >= 0`` (unsigned: a shift and a mask for a
    power-of-two ``BS``)."""
    u = tl.cast(n0, tl.uint32)  # (n0 may be a Python int under the interpreter)
    return (u // BS).to(tl.int32), (u % BS).to(tl.int32)


@triton.jit
def _exact_tile(ptr, sc_ptr, zp_ptr, inner, st, sc_rows, mask_n, KIND: tl.constexpr, BITS: tl.constexpr,
                GROUP: tl.constexpr, W8: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):  # fmt: skip
    """fp16 ``[BLOCK_N, D]`` tile of an exact kind, rows ``inner`` (row stride ``st``; ``W8``: int8 codes by
    words, channels in perm4 order)."""
    if W8:
        x = int8_words_fp16(ptr, inner * (st // 4), mask_n, BLOCK_N, D)
    else:
        x = load_tile(ptr, sc_ptr, zp_ptr, inner * st, sc_rows, mask_n, tl.arange(0, D), KIND, BITS, GROUP, D, 1)
    return x


@triton.jit
def _tile_t(
    n0, start, end, MASKED: tl.constexpr, qt, scale, tbl,
    k_base, ks_base, kz_base, k_sb, k_st, ks_sb, ks_st,
    v_base, vs_base, vz_base, v_sb, v_st, vs_sb, vs_st,
    m_i, l_i, acc_t,
    D: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr, SOFTCAP: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr, K_W8: tl.constexpr, V_W8: tl.constexpr,
):  # fmt: skip
    """One tile (see :func:`_tile`) of the transposed kernel: ``acc_t [D, BLOCK_H]``, ``qt [D, BLOCK_H]`` fp16."""
    n_blk, n_in = _block_pos(n0, BS)
    inner = n_in + tl.arange(0, BLOCK_N)
    if MASKED:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = (offs_n >= start) & (offs_n < end)
        blk = tl.load(tbl + n_blk, mask=n0 < end, other=0).to(tl.int64)
    else:
        mask_n = tl.full([BLOCK_N], 1, tl.int1)
        blk = tl.load(tbl + n_blk).to(tl.int64)
    ksb = ks_base + blk * ks_sb
    vsb = vs_base + blk * vs_sb
    k = _exact_tile(k_base + blk * k_sb, ksb, kz_base + blk * ks_sb, inner, k_st, inner * ks_st, mask_n,
                    K_KIND, K_BITS, K_GROUP, K_W8, BLOCK_N, D)  # fmt: skip
    s = tl.dot(k, qt) * scale  # [BLOCK_N, BLOCK_H]
    if K_KIND == 2:
        s = s * load_token_scale(ksb, inner * ks_st, mask_n)[:, None]
    s = cap_scores(s, SOFTCAP)
    if MASKED:
        s = tl.where(mask_n[:, None], s, float("-inf"))
    m_new, m_safe, alpha = online_rescale(m_i, reduce_max(s, 0))
    p = tl.exp2(s - m_safe[None, :])
    l_i = l_i * alpha + reduce_sum(p, 0)
    v = _exact_tile(v_base + blk * v_sb, vsb, vz_base + blk * vs_sb, inner, v_st, inner * vs_st, mask_n,
                    V_KIND, V_BITS, V_GROUP, V_W8, BLOCK_N, D)  # fmt: skip
    if V_KIND == 2:
        p = p * load_token_scale(vsb, inner * vs_st, mask_n)[:, None]
    # p in two fp16 halves (high + low): its rounding costs ~2^-22 relative, as in dot_pv
    ph = p.to(tl.float16)
    pl = (p - ph.to(tl.float32)).to(tl.float16)
    vt = tl.trans(v)
    acc_t = tl.dot(vt, pl, tl.dot(vt, ph, acc_t * alpha[None, :]))
    return m_new, l_i, acc_t
