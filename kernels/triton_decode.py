"""Split-K (flash-decoding) attention of one new token over the quantized history.

Two kernels:

* ``_decode_partial`` -- grid ``(B * Hg, S)``: one program per (batch row, KV head of the group,
  partition of the history). It holds *all* ``rep = Hq / Hkv`` query heads of its KV head (GQA: each
  K/V byte is read once for ``rep`` queries; the query rows are padded to ``BLOCK_H >= 16`` for
  ``tl.dot``), walks its partition ``BLOCK_N`` tokens at a time, dequantizes K and V in registers
  (:mod:`triton_dequant`), and keeps an online softmax in base 2 (``exp2``, ``log2(e)`` folded into
  the softmax scale). It writes the partition's normalised output and log-sum-exp.
* ``_decode_reduce`` -- grid ``(B * Hkv,)``: merges the ``S`` partitions of every query head by
  log-sum-exp, then merges the fresh token (this step's own K/V, full precision) as one more key,
  and writes the output in the query dtype.

The fresh token is computed in the reduction kernel rather than as a torch LSE partial: it is a
single key per head (a ``D``-long dot per query head), so it costs nothing there, whereas a torch
partial would add several small launches per layer and step, comparable to the whole attention
at short contexts.

Mixed precisions: the launcher runs ``_decode_partial`` once per head group (see
:mod:`triton_attention` for why) into one shared partial buffer, and ``_decode_reduce`` once for
all heads.

Variable lengths / left padding: ``lo[b], hi[b]`` (from the mask) bound the visible history of row
``b``; partitions outside it exit without loading anything.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .triton_codebook import KIND_CODEBOOK, KIND_TQC, KIND_TQT, KIND_TQV, codebook_norms, part_bases
from .triton_dequant import (
    DOT_FP16,
    DOT_IEEE,
    KIND_CHANNEL,
    KIND_FP8,
    KIND_INTN,
    KIND_TOKEN,
    NIBBLE_HI,
    Operand,
    _halves,
    _mma,
    cap_scores,
    code_exp,
    code_tiles,
    codes_operand,
    dot_pv,
    dot_qk,
    dot_split_a,
    head_ptrs,
    int8_words_fp16,
    key_chan2,
    key_exp2,
    key_tile2,
    load_head_scale,
    load_q_halves,
    load_tile,
    load_token_scale,
    mma_acc,
    nibble_tiles,
    nibbles_operand,
    online_rescale,
    perm4,
    pow2,
    pv_acc,
    pv_fold4,
    qk_channel4,
    qk_fold4,
    reduce_max,
    reduce_sum,
)
from .triton_launch import Launch
from .unsupported import Unsupported

LOG2E = 1.4426950408889634


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


@triton.jit
def _decode_partial(
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
    pid, split, b, hg, b64, h, start, end = _program_span(HEAD_IDX, LO, HI, lo_sb, past_len, part_len, Hg, HAS_RANGE)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    mask_h = offs_h < REP
    qh = h * REP + offs_h  # query heads of this KV head
    q = tl.load(Q + b64 * q_sb + qh[:, None] * q_sh + offs_d[None, :], mask=mask_h[:, None], other=0.0)

    # block tensors [num_blocks, Hg, block_size, ...]: one head's base; rows come from the block table
    k_base, ks_base, kz_base = part_bases(K, KS, KZ, KH, k_sh, ks_sh, hg, pid, K_KIND, K_BITS, D)
    v_base, vs_base, vz_base = part_bases(V, VS, VZ, VH, v_sh, vs_sh, hg, pid, V_KIND, V_BITS, D)
    tbl = TBL + b64 * tbl_sb
    # per-head K scale folded into the softmax scale
    scale = qk_scale * load_head_scale(KH, pid, K_KIND)

    # grouped int4 K / V (K_FOLD / V_FOLD: Operand.folds4): folded scales, codes as MMA operands
    q_lo, q_hi, qs_lo, qs_hi = q, q, q, q  # unused unless K_FOLD
    if K_FOLD == 1:
        q_lo, q_hi, qs_lo, qs_hi = load_q_halves(Q + b64 * q_sb, qh, q_sh, mask_h, D, K_GROUP, DOT)
    elif K_FOLD == 2:  # per-channel int4 keys: the query's halves in fp32 (the block scale multiplies them)
        q_half = Q + b64 * q_sb + qh[:, None] * q_sh + tl.arange(0, D // 2)[None, :]
        q_lo = tl.load(q_half, mask=mask_h[:, None], other=0.0).to(tl.float32)
        q_hi = tl.load(q_half + D // 2, mask=mask_h[:, None], other=0.0).to(tl.float32)
    if V_FOLD:
        VG2: tl.constexpr = D // 2 // V_GROUP
        acc_lo = tl.full([VG2, BLOCK_H, V_GROUP], 0, tl.float32)
        acc_hi = tl.full([VG2, BLOCK_H, V_GROUP], 0, tl.float32)
        zacc_lo = tl.full([VG2, BLOCK_H, 1], 0, tl.float32)
        zacc_hi = tl.full([VG2, BLOCK_H, 1], 0, tl.float32)
        acc = tl.full([1, 1], 0, tl.float32)  # unused
    else:
        acc = tl.full([BLOCK_H, D], 0, tl.float32)
        acc_lo = tl.full([1, 1, 1], 0, tl.float32)  # unused
        acc_hi, zacc_lo, zacc_hi = acc_lo, acc_lo, acc_lo

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_H], 0, tl.float32)
    # tiles of BLOCK_N tokens (BLOCK_N divides the pool block): the interior ones without masks, then
    # at most two edge tiles (around `start` and `end`) with masks
    full_lo = tl.cdiv(start, BLOCK_N) * BLOCK_N
    full_hi = (end // BLOCK_N) * BLOCK_N
    for n0 in range(full_lo, full_hi, BLOCK_N):
        m_i, l_i, acc, acc_lo, acc_hi, zacc_lo, zacc_hi = _tile(
            n0, start, end, False, q, q_lo, q_hi, qs_lo, qs_hi, scale, tbl,
            k_base, ks_base, kz_base, k_sb, k_st, ks_sb, ks_st, v_base, vs_base, vz_base, v_sb, v_st, vs_sb, vs_st,
            m_i, l_i, acc, acc_lo, acc_hi, zacc_lo, zacc_hi, D, BLOCK_N, BS, DOT, SOFTCAP,
            K_KIND, K_BITS, K_GROUP, V_KIND, V_BITS, V_GROUP, K_FOLD, V_FOLD)  # fmt: skip
    # the edge tiles, masked (branches, not loops: the interior loop is the kernel's one loop): the head
    # tile holding an unaligned `start`, and the tail tile holding an unaligned `end` (not the head's)
    if (start % BLOCK_N != 0) & (start < end):
        n0 = start - start % BLOCK_N
        m_i, l_i, acc, acc_lo, acc_hi, zacc_lo, zacc_hi = _tile(
            n0, start, end, True, q, q_lo, q_hi, qs_lo, qs_hi, scale, tbl,
            k_base, ks_base, kz_base, k_sb, k_st, ks_sb, ks_st, v_base, vs_base, vz_base, v_sb, v_st, vs_sb, vs_st,
            m_i, l_i, acc, acc_lo, acc_hi, zacc_lo, zacc_hi, D, BLOCK_N, BS, DOT, SOFTCAP,
            K_KIND, K_BITS, K_GROUP, V_KIND, V_BITS, V_GROUP, K_FOLD, V_FOLD)  # fmt: skip
    if tl.maximum(full_hi, full_lo) < end:
        n0 = tl.maximum(full_hi, full_lo)
        m_i, l_i, acc, acc_lo, acc_hi, zacc_lo, zacc_hi = _tile(
            n0, start, end, True, q, q_lo, q_hi, qs_lo, qs_hi, scale, tbl,
            k_base, ks_base, kz_base, k_sb, k_st, ks_sb, ks_st, v_base, vs_base, vz_base, v_sb, v_st, vs_sb, vs_st,
            m_i, l_i, acc, acc_lo, acc_hi, zacc_lo, zacc_hi, D, BLOCK_N, BS, DOT, SOFTCAP,
            K_KIND, K_BITS, K_GROUP, V_KIND, V_BITS, V_GROUP, K_FOLD, V_FOLD)  # fmt: skip

    has = l_i != 0  # rows with no visible key; a NaN sum (corrupt history) stays NaN
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    # partial buffers [B, Hq, S, D] and [B, Hq, S] (contiguous), indexed by the layer's query head
    prow = (b64 * n_qheads + qh) * S + split
    if V_FOLD:
        den = tl.where(has, l_i, 1.0)[None, :, None]
        g3 = tl.arange(0, VG2)[:, None, None] * V_GROUP + tl.arange(0, V_GROUP)[None, None, :]
        o_ptr = O_PART + prow[None, :, None] * D + g3
        tl.store(o_ptr, (acc_lo + zacc_lo) / den, mask=mask_h[None, :, None])
        tl.store(o_ptr + D // 2, (acc_hi + zacc_hi) / den, mask=mask_h[None, :, None])
    else:
        # per-head V scale, once after the loop
        acc = acc * load_head_scale(VH, pid, V_KIND)
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        tl.store(O_PART + prow[:, None] * D + offs_d[None, :], o, mask=mask_h[:, None])
    tl.store(LSE_PART + prow, lse, mask=mask_h)


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


@triton.jit
def _decode_partial_t(
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
    """``_decode_partial`` transposed (fp16 queries, exact fp16 K / V tiles; :func:`transposed_kernel`)."""
    pid, split, b, hg, b64, h, start, end = _program_span(HEAD_IDX, LO, HI, lo_sb, past_len, part_len, Hg, HAS_RANGE)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    mask_h = offs_h < REP
    qh = h * REP + offs_h
    q_cols = perm4(offs_d) if K_W8 else offs_d  # K_W8: the keys' channels come in perm4 order
    qt = tl.load(Q + b64 * q_sb + qh[None, :] * q_sh + q_cols[:, None], mask=mask_h[None, :], other=0.0)
    qt = qt.to(tl.float16)

    k_base, ks_base, kz_base = part_bases(K, KS, KZ, KH, k_sh, ks_sh, hg, pid, K_KIND, K_BITS)
    v_base, vs_base, vz_base = part_bases(V, VS, VZ, VH, v_sh, vs_sh, hg, pid, V_KIND, V_BITS)
    tbl = TBL + b64 * tbl_sb
    scale = qk_scale * load_head_scale(KH, pid, K_KIND)
    acc_t = tl.full([D, BLOCK_H], 0, tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_H], 0, tl.float32)
    full_lo = tl.cdiv(start, BLOCK_N) * BLOCK_N
    full_hi = (end // BLOCK_N) * BLOCK_N
    for n0 in range(full_lo, full_hi, BLOCK_N):
        m_i, l_i, acc_t = _tile_t(
            n0, start, end, False, qt, scale, tbl,
            k_base, ks_base, kz_base, k_sb, k_st, ks_sb, ks_st, v_base, vs_base, vz_base, v_sb, v_st, vs_sb, vs_st,
            m_i, l_i, acc_t, D, BLOCK_N, BS, SOFTCAP,
            K_KIND, K_BITS, K_GROUP, V_KIND, V_BITS, V_GROUP, K_W8, V_W8)  # fmt: skip
    if (start % BLOCK_N != 0) & (start < end):
        n0 = start - start % BLOCK_N
        m_i, l_i, acc_t = _tile_t(
            n0, start, end, True, qt, scale, tbl,
            k_base, ks_base, kz_base, k_sb, k_st, ks_sb, ks_st, v_base, vs_base, vz_base, v_sb, v_st, vs_sb, vs_st,
            m_i, l_i, acc_t, D, BLOCK_N, BS, SOFTCAP,
            K_KIND, K_BITS, K_GROUP, V_KIND, V_BITS, V_GROUP, K_W8, V_W8)  # fmt: skip
    if tl.maximum(full_hi, full_lo) < end:
        n0 = tl.maximum(full_hi, full_lo)
        m_i, l_i, acc_t = _tile_t(
            n0, start, end, True, qt, scale, tbl,
            k_base, ks_base, kz_base, k_sb, k_st, ks_sb, ks_st, v_base, vs_base, vz_base, v_sb, v_st, vs_sb, vs_st,
            m_i, l_i, acc_t, D, BLOCK_N, BS, SOFTCAP,
            K_KIND, K_BITS, K_GROUP, V_KIND, V_BITS, V_GROUP, K_W8, V_W8)  # fmt: skip

    has = l_i != 0
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    prow = (b64 * n_qheads + qh) * S + split
    o_t = acc_t * (load_head_scale(VH, pid, V_KIND) / tl.where(has, l_i, 1.0))[None, :]
    o_cols = perm4(offs_d) if V_W8 else offs_d  # V_W8: the accumulator's rows in perm4 order
    tl.store(O_PART + prow[None, :] * D + o_cols[:, None], o_t, mask=mask_h[None, :])
    tl.store(LSE_PART + prow, lse, mask=mask_h)


# ------------------------------------------------------------- int4 K and V, rows = (V group, query head)
# The folded int4 decode with every MMA row doing work. The MMA needs >= 16 rows, GQA gives 4 query heads:
# padding them to 16 would multiply every per-element step (scales, softmax, probability splits) by 4.
# Instead the rows are (group g, head h), r = g * REPP + h, G = D / V_GROUP groups: row r of the
# score MMA holds the query head h restricted to key group g (int4 g keys: its own group's channels, whose
# per-(token, group) scale and zero then apply row-wise; per-channel int4 keys: the whole query in the
# g = 0 rows), the G partial scores are summed into the heads' scores [REPP, BLOCK_N], the softmax runs on
# the real heads only, and the probabilities are broadcast back to the G row copies, scaled row-wise by
# the V group's scale: the value MMA of row (g, h) is exact for the channels of group g, which are the
# only ones it keeps (the others are discarded at the end). V's zero term is a per-row sum.
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


# ------------------------------------- int4 / int3 / int2 K and V on (head, group) columns, transposed (wgmma)
# fp16 queries: the rows kernel's products transposed, so that tokens (keys) and channels (values) are the MMA
# rows, on R = heads x G columns (h, g) (column r: head r // G, group r % G, or with grouped keys and 4-8 groups
# the order (g // 2, h, g % 2) of _col_head, COLS 1 / 2): scores^T [BLOCK_N, R] = K codes
# [BLOCK_N, D] @ q_cols [D, R] (warpgroup MMAs, the loop-invariant query in shared memory; grouped keys: column
# (h, g) holds head h on the channels of group g) and out^T [D, R] += V codes^T [D, BLOCK_N] @ (p x V scale)
# [BLOCK_N, R] (hi + lo fp16 halves). Codes come as fp16 subnormals (:func:`code_tiles`: one and per two codes,
# channels in perm4 order; position i in units of 2**(code_exp(i) - 24): the key operand's rows carry the
# complementary powers of two, the rest goes into the softmax scale and the epilogue). Per-(token, group) scales and
# zeros are per-column factors of the [BLOCK_N, R] tiles (grouped keys, COLS 2: their zero term by one more MMA,
# _zero_term); V's zero term is accumulated per (token, column) and summed
# over the tokens after the loop. Per-channel int4 keys (int4-channel) fold their block's scale into the query (fp32
# [D/2, heads] per nibble half, split into hi + lo fp16 columns (h, 0) and (h, 1)) and add their zero term q . z (an
# fp32 reduction per head) to the scores. A loop step is SUB (1, 2 or 4) tiles under one softmax update, two tiles
# at most in one pool block; the partial steps at both ends of a program's range run as masked single tiles.
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
    # pl the rest (exact in fp32). Rounding ps to fp16 instead needed its fp32 value back (a conversion per element)
    # and a half swap per pair (PRMT): 16 more per four tiles (hd128 GQA 4). A NaN still propagates through pl.
    ph32 = (ps.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)  # -8192: 0xFFFFE000
    ph = ph32.to(tl.float16)
    pl = (ps - ph32).to(tl.float16)
    # one [D, BLOCK_N] operand (code_tiles: row i in units of 2**(e(i) - 24), applied in the epilogue); with at most
    # 16 columns one MMA chain against [ph | pl] (acc holds both halves' columns, summed after the loop: half the
    # HGMMAs, and half the B-operand descriptors, which freed ptxas' uniform registers), else one per half
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
    4-byte aligned, and not for int2 keys over int4 values, where it spilled)."""
    G: tl.constexpr = D // V_GROUP
    REPP: tl.constexpr = BLOCK_H
    R: tl.constexpr = G * REPP
    DH: tl.constexpr = D // 2
    pid, split, b, hg, b64, h, start, end = _program_span(HEAD_IDX, LO, HI, lo_sb, past_len, part_len, Hg, HAS_RANGE)

    # the (head, group) columns' order (_col_head): grouped keys with an even number of groups: order 1
    # (4 groups: head_dim 128 in groups of 32; at 2 groups the zero MMA did not pay, at 8 (head_dim 256) it spilled)
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
    # the masked loop first when the main loop takes two or four tiles per step, after it with one (sm_90a SASS: the
    # other order issues 12 more per four-tile step (int3) and 15 per two-tile step (int4), and with one tile it
    # spills 32 B (int4, hd128 GQA 8))
    if SUB >= 2:  # the masked tiles first (see above)
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


@triton.jit
def _decode_reduce(
    O_PART, LSE_PART, Q, q_sb, q_sh, FK, fk_sb, fk_sh, FV, fv_sb, fv_sh, OUT, o_sb, o_sh, LSE_OUT,
    LO, HI, lo_sb, qk_scale, past_len, Hkv, S,
    REP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, HAS_RANGE: tl.constexpr, HAS_LSE: tl.constexpr,
    SOFTCAP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = pid // Hkv
    h = pid % Hkv
    b64 = b.to(tl.int64)
    n_qheads = Hkv * REP
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    mask_h = offs_h < REP
    qh = h * REP + offs_h

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_H], 0, tl.float32)
    acc = tl.full([BLOCK_H, D], 0, tl.float32)
    prow = (b64 * n_qheads + qh) * S
    for split in range(0, S):
        lse = tl.load(LSE_PART + prow + split, mask=mask_h, other=float("-inf"))
        o = tl.load(O_PART + (prow + split)[:, None] * D + offs_d[None, :], mask=mask_h[:, None], other=0.0)
        m_new, m_safe, alpha = online_rescale(m_i, lse)
        w = tl.exp2(lse - m_safe)
        l_i = l_i * alpha + w
        acc = acc * alpha[:, None] + o * w[:, None]
        m_i = m_new

    # the fresh token: one full-precision key/value per KV head, visible when lo <= past_len < hi
    q = tl.load(Q + b64 * q_sb + qh[:, None] * q_sh + offs_d[None, :], mask=mask_h[:, None], other=0.0)
    fk = tl.load(FK + b64 * fk_sb + h * fk_sh + offs_d).to(tl.float32)
    fv = tl.load(FV + b64 * fv_sb + h * fv_sh + offs_d).to(tl.float32)
    s = cap_scores(reduce_sum(q.to(tl.float32) * fk[None, :], 1) * qk_scale, SOFTCAP)
    if HAS_RANGE:
        lo = tl.load(LO + b * lo_sb)
        hi = tl.load(HI + b * lo_sb)
        s = tl.where((lo <= past_len) & (past_len < hi), s, float("-inf"))
    m_new, m_safe, alpha = online_rescale(m_i, s)
    w = tl.exp2(s - m_safe)
    l_i = l_i * alpha + w
    acc = acc * alpha[:, None] + w[:, None] * fv[None, :]
    m_i = m_new

    # rows with no visible key give 0 (as the torch path)
    out = acc / tl.where(l_i != 0, l_i, 1.0)[:, None]
    out = tl.where((l_i != 0)[:, None], out, 0.0)
    o_ptr = OUT + b64 * o_sb + qh[:, None] * o_sh + offs_d[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=mask_h[:, None])
    if HAS_LSE:
        # base-2 log-sum-exp of the scaled scores, [B, Hq] contiguous (-inf: no visible key)
        lse_o = tl.where(l_i != 0, m_i + tl.log2(tl.where(l_i != 0, l_i, 1.0)), float("-inf"))
        tl.store(LSE_OUT + b64 * n_qheads + qh, lse_o, mask=mask_h)


# ------------------------------------------------------------------------------------------- launcher
def launch_config(kop: Operand, vop: Operand, dot: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of one group's partial kernel.

    Chosen with ``benchmarks/kernel_static.py`` (sm_90a SASS of the loop, head_dim 128, GQA 4:
    warp-instructions per token, registers, spills; docs/results/kernel_static.md), not from timings:
    no GPU was available. int8 / fp8 with half-precision MMAs: 4 warps x 64 tokens (2 x 64 issues ~10%
    fewer instructions per token but spills since the tile loop has no masks); folded int4 K and V (the
    rows kernel, :func:`rows_kernel`, per-channel keys included) and folded int4 K or V: 4 x 64 (2 x 64:
    ~10% fewer, at 245 registers); other packed int4/3/2 and per-channel kinds: 8 x 32 (4 x 64 hit 255
    registers and spilled); fp32 MMAs 8 x 64; fp16/bf16 4 x 64. At head_dim 64, int8-token, fp8 and folded
    int4 take 2 x 64 (10-20% fewer instructions per token, no spills). ``BLOCK_N`` is capped at the pool's
    block size by the launcher (a tile lies in one block).
    """
    kinds = {kop.kind, vop.kind}
    folded = [kop.folds4(head_dim) or kop.folds_channel4(), vop.folds4(head_dim)]
    unfolded = {op.kind for op, f in zip((kop, vop), folded, strict=True) if not f}
    if {KIND_INTN, KIND_CHANNEL, KIND_CODEBOOK, KIND_TQC, KIND_TQV, KIND_TQT} & unfolded:  # codes unpacked in registers
        block_n, warps = 32, 8
    elif dot == DOT_IEEE:
        block_n, warps = 64, 8
    elif head_dim <= 64 and kinds <= {KIND_TOKEN, KIND_FP8, KIND_INTN, KIND_CHANNEL}:
        block_n, warps = 64, 2  # head_dim 64: half the registers, no spills (int8 per head spills: 4 warps)
    else:
        block_n, warps = 64, 4
    if head_dim > 128:
        block_n //= 2
    return block_n, warps


def _word_rows(t: torch.Tensor) -> bool:
    """True when every (block, head, token) row of the 16-bit part ``t`` starts 4-byte aligned (its block and head
    strides even, its storage aligned; ``meta`` tensors: the strides only), so a kernel may read it by 32-bit words."""
    aligned = t.device.type == "meta" or t.data_ptr() % 4 == 0
    return aligned and t.element_size() == 2 and all(st % 2 == 0 for st in t.stride()[:3])


def rows_kernel(kop: Operand, vop: Operand, head_dim: int) -> bool:
    """True when a group's K and V run on :func:`_decode_partial_rows`: grouped int4 V and int4 K (grouped
    alike, or per channel), scale/zero rows contiguous per token."""
    if not vop.folds4(head_dim) or not (kop.folds_channel4() or (kop.folds4(head_dim) and kop.group == vop.group)):
        return False
    ops = (kop, vop) if kop.kind == KIND_INTN else (vop,)
    return all(op.scale.stride(-1) == 1 and op.scale.stride(-2) == head_dim // op.group for op in ops)


def _rows_sub(block_n: int, block_size: int, columns: int, wide: bool = False) -> int:
    """Tiles per loop step of :func:`_decode_partial_rows_t` with grouped keys: 2 when a pool block holds two tiles
    and the MMAs have at most 16 (head, group) columns (sm_90a SASS, hd128 GQA 4: int4 409 -> 391, int3 429 -> 411,
    int2 389 -> 371 per 64 tokens; with 32 columns two tiles spill under the 168-register cap), else 1. ``wide``
    (int3 / int2): 4 there instead (two halves of two tiles, each in one pool block; hd128 GQA 4 per 128 tokens,
    both with two pipeline stages, before the truncated probability split: int3 702 -> 660, int2 622 -> 580)."""
    if block_size % (2 * block_n) != 0 or columns > 16:
        return 1
    return 4 if wide else 2


def code_rows_kernel(kop: Operand, vop: Operand, dot: int, head_dim: int) -> bool:
    """True when a group runs on :func:`_decode_partial_rows_t` with grouped int4 / int3 / int2 values
    (:meth:`Operand.code_rows`) and keys grouped alike or per-channel int4, fp16 queries. (Grouped int4 K and V, or
    per-channel int4 keys with them, take it through :func:`rows_kernel`.)"""
    keys = kop.folds_channel4() or (kop.code_rows(head_dim) and kop.group == vop.group)
    return dot == DOT_FP16 and keys and vop.code_rows(head_dim)


#: Whether per-channel int4 keys with fp16 queries may take :func:`_decode_partial_rows_t`: triton releases before
#: 3.7 fail to compile that specialisation for sm_90a (``TritonGPUOptimizeDotOperands``: "Illegal shared layout");
#: with them those groups take :func:`_decode_partial_rows` (mma.sync), which every release compiles.
CHANNEL_KEYS_TRANSPOSED = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 7)


def transposed_kernel(kop: Operand, vop: Operand, dot: int) -> bool:
    """True when a group may run on :func:`_decode_partial_t`: fp16 queries, int8 K and V (per head or per
    token; read by :func:`int8_words_fp16`)."""
    return kop.int8_words(dot) and vop.int8_words(dot)


def block_n_for(head_dim: int) -> int:
    """Partition granularity: a multiple of every group's BLOCK_N."""
    return 64 if head_dim <= 128 else 32


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 off CUDA: the interpreter tests)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


#: Hopper (sm_90) limits per SM: registers, shared memory (bytes), resident warps and programs (CUDA guide, cc 9.0)
REGS_PER_SM, SMEM_PER_SM, WARPS_PER_SM, PROGRAMS_PER_SM = 65536, 228 * 1024, 64, 32
#: programs per SM assumed where the compiled kernel's occupancy is unknown (the CPU interpreter, no compile
#: metadata): the decode kernels' common case at head_dim 128 (166-255 registers x 4 warps)
DEFAULT_PROGRAMS_PER_SM = 2
#: a program's fixed cost in BLOCK_N tiles of history (prologue, masked edge tiles, epilogue, its share of the
#: reduction): the code outside the loop is 4-6 tiles' issue in the sm_90a SASS (hd128 GQA 4: fp16 1506 vs 377 per
#: 64-token tile, int2 1548 vs 257); the term that makes one wave of long partitions beat two of half-length ones
PROGRAM_OVERHEAD_TILES = 4
MAX_SPLITS = 128


def programs_per_sm(regs: int, shared: int, warps: int) -> int:
    """Programs of a compiled kernel resident on one SM (Hopper limits; registers allocated per warp in units
    of 256, 1 KB of shared memory reserved per program); ``regs`` per thread, ``shared`` bytes per program."""
    per_warp = math.ceil(regs * 32 / 256) * 256
    return max(0, min(WARPS_PER_SM // warps, REGS_PER_SM // max(1, per_warp * warps),
                      SMEM_PER_SM // (shared + 1024), PROGRAMS_PER_SM))  # fmt: skip


_OCCUPANCY: dict = {}
_SPLITS: dict = {}  # decode_launches: layer shape -> split count at the runtime's occupancy


def compiled_programs_per_sm(launch: Launch) -> int | None:
    """Programs per SM of ``launch``'s kernel as compiled for the current GPU (Triton's ``n_regs``,
    ``metadata.shared``, ``num_warps``); ``None`` where unknown: under ``TRITON_INTERPRET``, off CUDA, or when
    the compile metadata is missing. Compiling is host work only (no device synchronisation); cached per kernel
    and launch options."""
    import os

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or not hasattr(launch.kernel, "warmup"):
        return None
    dev = next((a.device for a in launch.args if isinstance(a, torch.Tensor)), None)
    if dev is None or dev.type != "cuda":
        return None
    key = (launch.kernel, tuple(sorted(launch.meta.items())), dev.index)
    if key not in _OCCUPANCY:
        try:
            k = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.meta)
            k._init_handles()
            _OCCUPANCY[key] = programs_per_sm(k.n_regs, k.metadata.shared, k.metadata.num_warps) or None
        except Exception:  # noqa: BLE001 - unknown occupancy: the default rule
            _OCCUPANCY[key] = None
    return _OCCUPANCY[key]


@functools.lru_cache(maxsize=4096)
def num_splits(batch: int, kv_heads: int, past_len: int, block_n: int, sms: int, per_sm: int | None = None) -> int:
    """Partitions of the history for ``batch * kv_heads`` programs per partition on ``sms`` SMs holding
    ``per_sm`` programs each (the compiled kernel's occupancy, :func:`programs_per_sm`; ``None``: unknown,
    :data:`DEFAULT_PROGRAMS_PER_SM`).

    Every program of a split launch walks ``ceil(tiles / S)`` tiles, so the launch takes about
    ``waves(S) * (ceil(tiles / S) + PROGRAM_OVERHEAD_TILES)`` with ``waves(S) = ceil(batch * kv_heads * S /
    (sms * per_sm))``; the smallest ``S`` in ``1 .. min(tiles, MAX_SPLITS)`` that minimises it (full waves: at
    batch 8, 8 KV heads, 32K, 132 SMs x 2 it is 4 = 256 programs on 264 slots, not 5 = 320). ``S`` is returned
    as the launcher realises it (``ceil(tiles / ceil(tiles / S))``): no partition is empty."""
    tiles = max(1, math.ceil(past_len / block_n))
    rows = max(1, batch * kv_heads)
    slots = max(1, sms) * max(1, per_sm or DEFAULT_PROGRAMS_PER_SM)
    best, best_cost = 1, math.inf
    for s in range(1, min(tiles, MAX_SPLITS) + 1):
        per = math.ceil(tiles / s)
        s = math.ceil(tiles / per)  # the split count this partition length gives
        cost = math.ceil(rows * s / slots) * (per + PROGRAM_OVERHEAD_TILES)
        if cost < best_cost:
            best, best_cost = s, cost
    return best


def wave_fill(programs: int, sms: int, per_sm: int | None) -> float:
    """Share of the launch's waves' program slots that hold a program (1.0: whole waves)."""
    slots = max(1, sms) * max(1, per_sm or DEFAULT_PROGRAMS_PER_SM)
    return programs / (math.ceil(programs / slots) * slots)


def decode_launches(
    query: torch.Tensor,
    fresh_k: torch.Tensor,
    fresh_v: torch.Tensor,
    groups: list[tuple[torch.Tensor, Operand, Operand]],
    num_kv: int,
    past_len: int,
    ranges: tuple[torch.Tensor, torch.Tensor] | None,
    scaling: float,
    out: torch.Tensor,
    dot_kind: int,
    splits: int | None = None,
    lse: torch.Tensor | None = None,
    softcap: float | None = None,
    sms: int | None = None,
    *,
    table: torch.Tensor,
    block_size: int,
    occupancy: Callable[[Launch], int | None] | None = None,
) -> list[Launch]:
    """The kernel launches of decode attention (``Tq == 1``) into ``out[B, Hq, 1, D]`` (one partial launch
    per head group, then the reduction; ``groups`` = (head_index int32, K, V)), with every argument,
    constexpr and launch option: ``attend_triton`` runs them (``Launch.run``), and the ahead-of-time
    tools (``triton_compile_check``, ``benchmarks/kernel_static.py``) compile exactly these (on
    ``meta`` tensors), so that what they measure is the binary the runtime would build.

    The history is read through ``table[B, max_blocks]`` (int32 block ids of each row, ``block_size``
    tokens per block) from the groups' block tensors.

    ``lse`` (optional, fp32 contiguous ``[B, Hq, 1]``) receives each row's base-2 log-sum-exp of the
    scores times ``scaling * log2(e)`` (``-inf`` for rows with no visible key). ``splits``: the partitions
    of the history (default: :func:`num_splits` for ``sms`` SMs (default: the query's device) holding as many
    programs as the fewest-resident partial kernel's binary allows: ``occupancy(launch)`` (default
    :func:`compiled_programs_per_sm`, the runtime's own compile; ``None`` = unknown, the documented default).
    The ahead-of-time tools pass the occupancy of the sm_90a binary they compile. The grid depends on
    the shapes and the pool's capacity only (not on ``past_len``), and nothing here reads a device
    value: a step can be captured in a CUDA graph (``past_len`` is still a scalar argument, so a
    captured graph serves one length; lengths in a device tensor would lift that).
    """
    B, Hq, Tq, D = query.shape
    if Tq != 1:
        raise Unsupported(f"decode kernel: Tq={Tq}, expected 1")
    rep = Hq // num_kv
    block_h = max(16, triton.next_power_of_2(rep))
    block_n = block_n_for(D)
    # partitions of the pool's capacity, not of past_len: the grid and the buffers are the same at
    # every step of a fixed pool (CUDA-graph capturable); partitions past the history exit at once
    capacity = max(past_len, table.shape[1] * block_size)  # the tokens the block tables address

    def _decode_build(S: int) -> list[Launch]:
        tiles = max(1, math.ceil(capacity / block_n))
        part_len = math.ceil(tiles / S) * block_n
        S = max(1, math.ceil(capacity / part_len))
        o_part = torch.empty((B, Hq, S, D), dtype=torch.float32, device=query.device)
        lse_part = torch.empty((B, Hq, S), dtype=torch.float32, device=query.device)
        qk_scale = scaling * LOG2E
        lo, hi = ranges if ranges is not None else (query, query)  # dummies when there is no mask
        lo_sb = lo.stride(0) if ranges is not None else 0
        launches = []
        for head_index, kop, vop in groups:
            Hg = head_index.numel()
            group_block_n, num_warps = launch_config(kop, vop, dot_kind, D)
            group_block_n = min(group_block_n, block_size)  # every tile lies in one pool block
            args = (
                query, query.stride(0), query.stride(1),
                *kop.args(), *vop.args(), table, table.stride(0),
                head_index, lo, hi, lo_sb, o_part, lse_part,
                qk_scale, past_len, part_len, Hg, S, Hq,
            )  # fmt: skip
            meta = dict(
                REP=rep, BLOCK_H=block_h, D=D, BLOCK_N=group_block_n, HAS_RANGE=ranges is not None, DOT=dot_kind,
                SOFTCAP=(softcap or 0.0) * LOG2E,
                K_KIND=kop.kind, K_BITS=kop.bits, K_GROUP=kop.group,
                V_KIND=vop.kind, V_BITS=vop.bits, V_GROUP=vop.group, BS=block_size,
                K_FOLD=1 if kop.folds4(D) else 2 if kop.folds_channel4() else 0, V_FOLD=vop.folds4(D),
                num_warps=num_warps,
            )  # fmt: skip
            kernel = _decode_partial
            if transposed_kernel(kop, vop, dot_kind) and num_warps == 4:
                # int8 codes by words (channels in perm4 order) on warpgroup MMAs (4 warps; at head_dim 64 the
                # 2-warp mma.sync kernel issues less for int8-token: 0.91 vs 0.95 of the HBM time)
                kernel = _decode_partial_t
                meta.update(K_W8=True, V_W8=True)
            rows_h = max(triton.next_power_of_2(rep), 16 // max(1, D // vop.group))  # query heads per row group
            if not rows_kernel(kop, vop, D) and code_rows_kernel(kop, vop, dot_kind, D):
                # grouped int3 / int2 (or int4 with one of them) K and V: the transposed rows kernel, its int4 launch
                # (64-token tiles, 4 warps, the grouped keys' register cap)
                kernel = _decode_partial_rows_t
                chan = kop.folds_channel4()
                meta.update(BLOCK_N=min(64 if D <= 128 else 32, block_size), BLOCK_H=rows_h, num_warps=4,
                            K_FOLD=2 if chan else 1, V_FOLD=True,
                            OFF32=kop.offsets32() and vop.offsets32(), KZW=_word_rows(kop.zero))  # fmt: skip
                if chan:  # as the per-channel keys' launch below
                    meta["SUB"] = 2 if block_size % (2 * meta["BLOCK_N"]) == 0 else 1
                    if rows_h * (D // vop.group) <= 16:
                        meta["maxnreg"] = 128 if meta["SUB"] == 1 else 168
                else:
                    meta["SUB"] = _rows_sub(meta["BLOCK_N"], block_size, rows_h * (D // vop.group), wide=True)
                    # as grouped int4 (int3 / int2: 166 registers); four tiles per step: 192 (the zero-term MMA: int3 at
                    # hd128 GQA 4 spilled 24 B at 176; 2 programs / SM either way)
                    meta["maxnreg"] = 168 if meta["SUB"] == 1 else 176 if meta["SUB"] == 2 else 192
                    if meta["SUB"] == 4 and kop.bits == 2 and D == 128:
                        # int2 keys at head_dim 128: eight tiles per step (_rows_oct_t, four pool-block parts), one
                        # softmax update per 512 tokens (sm_90a SASS, GQA 4: 1075 -> 1048 per 256 tokens). 242 registers
                        # at the 255 cap: still 2 programs / SM (as 175 at 176: 255 x 128 threads fits twice in 64K).
                        # Triton's default 3 pipeline stages: the block ids of a step are copied two steps ahead (an
                        # async copy). At GQA 1 (one query head), and with int3 values, the zero-term MMA (COLS 2)
                        # spills 8 B with 3: there 2 stages, no spill, but the ids are then read by a synchronous load
                        # one step ahead (sm_90a SASS: 4 LDG.E whose results address the step's copies; at GQA 4: 1935
                        # vs 1930 per 512 tokens)
                        meta["SUB"], meta["OCT"], meta["maxnreg"] = 8, True, 255
                        if rep == 1 or vop.bits != 2:
                            meta["num_stages"] = 2
                        if vop.bits == 4:  # int4 values: the zero-term MMA spills 8 B even so; COLS 1
                            meta["KZW"] = False
                        # the parts' row strides (bytes) as constants: a pool block's second tile at an immediate offset
                        meta["K_ROW"], meta["V_ROW"] = kop.data.stride(2), vop.data.stride(2)
                    if meta["SUB"] == 4:
                        # four tiles per step (two pool-block halves): the 192 cap set above (2 programs / SM),
                        # two pipeline stages (the default 3 issues ~15 more per step)
                        meta["num_stages"] = 2
            elif rows_kernel(kop, vop, D):
                # int4 K and V on (group, head) rows; 32+ rows (GQA 8 at head_dim 128) take 8 warps: 4 spill
                # (int4: 32 B, int4-channel: 176 B), 32-token tiles spill and issue more
                kernel = _decode_partial_rows
                meta["BLOCK_H"] = rows_h
                if dot_kind == DOT_FP16 and (kop.folds4(D) or CHANNEL_KEYS_TRANSPOSED):
                    # fp16 queries (grouped or per-channel int4 K): transposed, on warpgroup MMAs (4 warps, also at
                    # head_dim 64: int4 1.15 -> 1.11 issue/HBM, int4-channel 2.20 -> 1.35 vs the kernel above at 2
                    # warps). Register caps (sm_90a SASS, benchmarks/kernel_static.py): grouped keys 168 (ptxas' own
                    # choice issues ~1% more; at GQA 8 uncapped 218 registers); per-channel keys with 16 (head, group)
                    # columns 168 (below); 32 columns: no cap (128 spilled 544 B)
                    kernel = _decode_partial_rows_t
                    meta["num_warps"] = 4
                    meta["OFF32"] = kop.offsets32() and vop.offsets32()
                    meta["KZW"] = _word_rows(kop.zero)
                    if kop.folds4(D):
                        meta["SUB"] = _rows_sub(meta["BLOCK_N"], block_size, rows_h * (D // vop.group))
                        # two tiles per step: 176 (ptxas then takes 166-167, no spills; at 168 it spilled 8 B before the
                        # probabilities' halves shared one MMA chain)
                        meta["maxnreg"] = 168 if meta["SUB"] == 1 else 176
                    else:
                        # per-channel keys: two tiles per loop step when a pool block holds them (the block's query
                        # operands built once per two tiles)
                        meta["SUB"] = 2 if block_size % (2 * meta["BLOCK_N"]) == 0 else 1
                        if rows_h * (D // vop.group) <= 16:
                            # 168 also with one tile per step: its accumulator holds both probability halves' columns
                            # (_rows_pv); at 128 it spills 88 B (hd128 GQA 4), at 168 468 SASS per 64 tokens, no spills
                            meta["maxnreg"] = 168
                elif rows_h * (D // vop.group) >= 32:
                    meta["num_warps"] = 8
            launches.append(Launch(kernel, (B * Hg, S), args, meta))
        args = (
            o_part, lse_part, query, query.stride(0), query.stride(1),
            fresh_k, fresh_k.stride(0), fresh_k.stride(1), fresh_v, fresh_v.stride(0), fresh_v.stride(1),
            out, out.stride(0), out.stride(1), lse if lse is not None else lse_part,
            lo, hi, lo_sb, qk_scale, past_len, num_kv, S,
        )  # fmt: skip
        meta = dict(REP=rep, BLOCK_H=block_h, D=D, HAS_RANGE=ranges is not None, HAS_LSE=lse is not None,
                    SOFTCAP=(softcap or 0.0) * LOG2E, num_warps=4)  # fmt: skip
        launches.append(Launch(_decode_reduce, (B * num_kv,), args, meta))
        return launches

    sms = sms or sm_count(query.device)
    rows = B * max(int(h.numel()) for h, _, _ in groups)  # programs per partition of the widest group's launch
    if splits:
        return _decode_build(splits)
    # the split count from the compiled kernels' occupancy: build at the default rule's count, ask each
    # partial launch's binary how many programs an SM holds (the fewest), rebuild at that count if it differs.
    # The runtime's answer is remembered per layer shape (one build per step after the first; a stale entry could
    # only cost speed: every split count gives the same result)
    key = None
    if occupancy is None:
        ops = tuple((int(h.numel()), k.data.dtype, *k.meta(), *v.meta(), k.data.shape[1:], v.data.shape[1:])
                    for h, k, v in groups)  # fmt: skip
        key = (query.device, query.dtype, B, Hq, D, num_kv, capacity, block_size, dot_kind, ranges is None,
               softcap or 0.0, sms, ops)  # fmt: skip
        if key in _SPLITS:
            return _decode_build(_SPLITS[key])
    S0 = num_splits(B, rows // B, capacity, block_n, sms)
    launches = _decode_build(S0)
    probe = occupancy or compiled_programs_per_sm
    per_sm = [probe(launch) for launch in launches[:-1]]
    S = num_splits(B, rows // B, capacity, block_n, sms, min(per_sm)) if all(per_sm) else S0
    if key is not None:
        _SPLITS[key] = S
    return _decode_build(S) if S != S0 else launches
