"""The per-head partial decode kernels and the reduction of split-K (flash-decoding) attention of one new token,
each kernel followed by its launch options or its launcher (raw tensors in).

Two steps:

* ``_decode_partial`` (and ``_decode_partial_t``, the same transposed for int8 K / V and fp16 queries:
  tokens as the MMA rows) -- grid ``(B * Hg, S)``: one program per (batch row, KV head of the group,
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

Mixed precisions: the launcher runs a partial kernel once per head group (see
:mod:`triton_attention` for why) into one shared partial buffer, and ``_decode_reduce`` once for
all heads.

Variable lengths / left padding: ``lo[b], hi[b]`` (from the mask) bound the visible history of row
``b``; partitions outside it exit without loading anything.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_codebook import part_bases
from .triton_decode_tiles import _program_span, _tile, _tile_t
from .triton_dequant import (
    Operand,
    cap_scores,
    load_head_scale,
    load_q_halves,
    online_rescale,
    perm4,
    reduce_sum,
)
from .triton_launch import Launch


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


def partial_args(query: torch.Tensor, kop: Operand, vop: Operand, table: torch.Tensor, head_index: torch.Tensor,
                 lo: torch.Tensor, hi: torch.Tensor, lo_sb: int, o_part: torch.Tensor, lse_part: torch.Tensor,
                 qk_scale: float, past_len: int, part_len: int, S: int) -> tuple:
    """The positional arguments every partial decode kernel takes (one head group): the query, the group's K and
    V parts (:meth:`Operand.args`), the block table, the group's head index, the visible range ``lo`` / ``hi``
    (dummies without a mask, ``lo_sb`` 0), the partial buffers ``[B, Hq, S, D]`` / ``[B, Hq, S]``, the softmax scale
    in base 2, the history length, the partition length and count."""
    return (
        query, query.stride(0), query.stride(1),
        *kop.args(), *vop.args(), table, table.stride(0),
        head_index, lo, hi, lo_sb, o_part, lse_part,
        qk_scale, past_len, part_len, head_index.numel(), S, query.shape[1],
    )  # fmt: skip


def partial_options(meta: dict, kop: Operand, vop: Operand, rep: int, block_size: int) -> dict:
    """Launch options of :func:`_decode_partial`: the base constexprs as they are."""
    return {}


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


def partial_t_options(meta: dict, kop: Operand, vop: Operand, rep: int, block_size: int) -> dict:
    """Launch options of :func:`_decode_partial_t`: int8 codes read by 32-bit words (channels in perm4 order)."""
    return {"K_W8": True, "V_W8": True}


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


def reduce_launch(o_part: torch.Tensor, lse_part: torch.Tensor, query: torch.Tensor, fresh_k: torch.Tensor,
                  fresh_v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None, lo: torch.Tensor,
                  hi: torch.Tensor, lo_sb: int, has_range: bool, qk_scale: float, past_len: int, num_kv: int,
                  softcap: float, block_h: int) -> Launch:
    """The launch of :func:`_decode_reduce` (grid ``B * num_kv``, 4 warps): the partitions of ``o_part`` /
    ``lse_part`` merged with the fresh token into ``out`` (``lse``: optional base-2 log-sum-exp out); ``softcap``
    already in base 2 (0: none)."""
    B, Hq, S, D = o_part.shape
    args = (
        o_part, lse_part, query, query.stride(0), query.stride(1),
        fresh_k, fresh_k.stride(0), fresh_k.stride(1), fresh_v, fresh_v.stride(0), fresh_v.stride(1),
        out, out.stride(0), out.stride(1), lse if lse is not None else lse_part,
        lo, hi, lo_sb, qk_scale, past_len, num_kv, S,
    )  # fmt: skip
    meta = dict(REP=Hq // num_kv, BLOCK_H=block_h, D=D, HAS_RANGE=has_range, HAS_LSE=lse is not None,
                SOFTCAP=softcap, num_warps=4)  # fmt: skip
    return Launch(_decode_reduce, (B * num_kv,), args, meta)
