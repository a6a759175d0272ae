"""Chunk / prefill attention (``Tq > 1``): queries of a chunk over the quantized history plus the chunk.

One kernel, ``_chunk_attn``, grid ``(B * Hg, cdiv(rep * Tq, BLOCK_M))``. A program owns one
(batch row, KV head of the group) and ``BLOCK_M`` query rows, where the rows are the
(query head, position) pairs of that KV head flattened (``row = head_in_kv_group * Tq + t``), so
GQA heads share every K/V tile a program loads. It runs one online softmax (base 2) over

1. the quantized history ``[0, past_len)``: K/V dequantized in registers (:mod:`triton_dequant`),
   per-head K scale folded into the softmax scale, per-token scales on the score / probability
   columns, the per-head V scale applied once when the history loop ends;
2. the fresh chunk in full precision, causal: query ``t`` sees chunk keys ``j <= t``.

Visibility: row ``(b, t)`` sees the keys ``lo[b, t] <= position < hi[b, t]`` of the concatenated
(history + chunk) axis; without a mask, ``lo = 0, hi = past_len + t + 1`` (causal). Key tiles
outside the union of the rows' ranges are never loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_codebook import codebook_norms, part_bases
from .triton_decode import LOG2E
from .triton_dequant import (
    Operand,
    cap_scores,
    dot_pv,
    dot_qk,
    load_head_scale,
    load_tile,
    load_token_scale,
    online_rescale,
    paged_rows,
    reduce_max,
    reduce_min,
    reduce_sum,
)
from .triton_launch import Launch
from .unsupported import Unsupported


@triton.jit
def _chunk_attn(
    Q, q_sb, q_sh, q_st,
    K, KS, KZ, KH, k_sb, k_sh, k_st, ks_sb, ks_sh, ks_st,
    V, VS, VZ, VH, v_sb, v_sh, v_st, vs_sb, vs_sh, vs_st, TBL, tbl_sb,
    FK, fk_sb, fk_sh, fk_st, FV, fv_sb, fv_sh, fv_st,
    HEAD_IDX, LO, HI, lo_sb, lo_st, OUT, o_sb, o_sh, o_st, LSE_OUT,
    qk_scale, past_len, Tq, Hg, n_qheads,
    REP: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_RANGE: tl.constexpr, DOT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_LSE: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr, BS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pm = tl.program_id(1)
    b = pid // Hg
    hg = pid % Hg
    b64 = b.to(tl.int64)
    h = tl.load(HEAD_IDX + hg)

    r = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_r = r < REP * Tq
    t = r % Tq
    qh = h * REP + r // Tq
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b64 * q_sb + qh[:, None] * q_sh + t[:, None] * q_st + offs_d[None, :],
                mask=mask_r[:, None], other=0.0)  # fmt: skip
    if HAS_RANGE:
        lo_r = tl.load(LO + b * lo_sb + t * lo_st, mask=mask_r, other=0)
        hi_r = tl.load(HI + b * lo_sb + t * lo_st, mask=mask_r, other=0)
    else:
        lo_r = tl.full([BLOCK_M], 0, tl.int32)
        hi_r = past_len + t + 1
    # padding rows take no part in the tile bounds
    lo_r = tl.where(mask_r, lo_r, 2147483647)
    hi_r = tl.where(mask_r, hi_r, 0)
    k_lo = reduce_min(lo_r, 0)
    k_hi = reduce_max(hi_r, 0)

    # block tensors [num_blocks, Hg, block_size, ...]: one head's base; rows come from the block table
    k_base, ks_base, kz_base = part_bases(K, KS, KZ, KH, k_sh, ks_sh, hg, pid, K_KIND, K_BITS, D)
    v_base, vs_base, vz_base = part_bases(V, VS, VZ, VH, v_sh, vs_sh, hg, pid, V_KIND, V_BITS, D)
    tbl = TBL + b64 * tbl_sb
    scale = qk_scale * load_head_scale(KH, pid, K_KIND)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0, tl.float32)
    acc = tl.full([BLOCK_M, D], 0, tl.float32)

    # 1) quantized history
    h_start = k_lo
    h_end = tl.minimum(k_hi, past_len)
    for n0 in range(h_start - h_start % BLOCK_N, h_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = (offs_n >= h_start) & (offs_n < h_end)
        vis = (offs_n[None, :] >= lo_r[:, None]) & (offs_n[None, :] < hi_r[:, None]) & mask_n[None, :]
        k_rows, ks_rows = paged_rows(tbl, offs_n, mask_n, k_sb, k_st, ks_sb, ks_st, BS, K_KIND)
        v_rows, vs_rows = paged_rows(tbl, offs_n, mask_n, v_sb, v_st, vs_sb, vs_st, BS, V_KIND)
        k = load_tile(k_base, ks_base, kz_base, k_rows, ks_rows, mask_n, offs_d, K_KIND, K_BITS, K_GROUP, D)
        s = dot_qk(q, tl.trans(k), DOT, K_KIND == 3 or K_KIND >= 7) * scale
        if K_KIND == 2:
            s = s * load_token_scale(ks_base, ks_rows, mask_n)[None, :]
        elif K_KIND >= 8:
            s = s * codebook_norms(ks_base, ks_rows, mask_n, kz_base)[None, :]
        s = cap_scores(s, SOFTCAP)
        s = tl.where(vis, s, float("-inf"))
        m_new, m_safe, alpha = online_rescale(m_i, reduce_max(s, 1))
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + reduce_sum(p, 1)
        v = load_tile(v_base, vs_base, vz_base, v_rows, vs_rows, mask_n, offs_d, V_KIND, V_BITS, V_GROUP, D)
        if V_KIND == 2:
            p = p * load_token_scale(vs_base, vs_rows, mask_n)[None, :]
        elif V_KIND >= 8:
            p = p * codebook_norms(vs_base, vs_rows, mask_n, vz_base)[None, :]
        acc = acc * alpha[:, None] + dot_pv(p, v, DOT, V_KIND == 3 or V_KIND >= 7)
        m_i = m_new
    # per-head V scale, once, before the (unscaled) fresh values join the accumulator
    acc = acc * load_head_scale(VH, pid, V_KIND)

    # 2) the fresh chunk, full precision; chunk key j sits at position past_len + j
    f_start = tl.maximum(k_lo - past_len, 0)
    f_end = tl.minimum(k_hi - past_len, Tq)
    fk_base = FK + b64 * fk_sb + h * fk_sh
    fv_base = FV + b64 * fv_sb + h * fv_sh
    for j0 in range(f_start - f_start % BLOCK_N, f_end, BLOCK_N):
        offs_j = j0 + tl.arange(0, BLOCK_N)
        mask_j = (offs_j >= f_start) & (offs_j < f_end)
        pos = past_len + offs_j
        vis = (pos[None, :] >= lo_r[:, None]) & (pos[None, :] < hi_r[:, None]) & mask_j[None, :]
        fk = tl.load(fk_base + offs_j[:, None] * fk_st + offs_d[None, :], mask=mask_j[:, None], other=0.0)
        s = cap_scores(dot_qk(q, tl.trans(fk), DOT, False) * qk_scale, SOFTCAP)
        s = tl.where(vis, s, float("-inf"))
        m_new, m_safe, alpha = online_rescale(m_i, reduce_max(s, 1))
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + reduce_sum(p, 1)
        fv = tl.load(fv_base + offs_j[:, None] * fv_st + offs_d[None, :], mask=mask_j[:, None], other=0.0)
        acc = acc * alpha[:, None] + dot_pv(p, fv, DOT, False)
        m_i = m_new

    out = acc / tl.where(l_i != 0, l_i, 1.0)[:, None]
    out = tl.where((l_i != 0)[:, None], out, 0.0)  # rows with no visible key give 0
    o_ptr = OUT + b64 * o_sb + qh[:, None] * o_sh + t[:, None] * o_st + offs_d[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=mask_r[:, None])
    if HAS_LSE:
        # base-2 log-sum-exp of the scaled scores, [B, Hq, Tq] contiguous (-inf: no visible key)
        lse = tl.where(l_i != 0, m_i + tl.log2(tl.where(l_i != 0, l_i, 1.0)), float("-inf"))
        tl.store(LSE_OUT + (b64 * n_qheads + qh) * Tq + t, lse, mask=mask_r)


# Defaults chosen from ptxas register / spill counts (sm_90, head_dim 128, fp16 MMAs; see
# triton_compile_check): BLOCK_M 32 x BLOCK_N 64 with 8 warps is the largest tile without spills for
# int8 and int4 (BLOCK_M 64 with 4 warps spilled 0.7-2 KB). Not timed: no GPU was available.
BLOCK_M = 32
NUM_WARPS = 8


def block_n_for(head_dim: int) -> int:
    return 64 if head_dim <= 128 else 32


def chunk_launches(
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
    block_m: int = BLOCK_M,
    block_n: int | None = None,
    num_warps: int = NUM_WARPS,
    lse: torch.Tensor | None = None,
    softcap: float | None = None,
    *,
    table: torch.Tensor,
    block_size: int,
) -> list[Launch]:
    """The launches (one per head group) of chunk attention (any ``Tq``) into ``out[B, Hq, Tq, D]``;
    ``groups`` = (head_index int32, K, V); as data, see :func:`~kvquant.kernels.triton_decode.decode_launches`.

    The history is read through ``table[B, max_blocks]`` (int32 block ids of each row, ``block_size``
    tokens per block) from the groups' block tensors.

    ``lse`` (optional, fp32 contiguous ``[B, Hq, Tq]``) receives each row's base-2 log-sum-exp of the
    scores times ``scaling * log2(e)`` (``-inf`` for rows with no visible key).
    """
    B, Hq, Tq, D = query.shape
    if fresh_k.shape[2] != Tq:
        raise Unsupported(f"chunk kernel: fresh K has {fresh_k.shape[2]} tokens, the query {Tq}")
    rep = Hq // num_kv
    block_n = block_n or block_n_for(D)
    lo, hi = ranges if ranges is not None else (query, query)
    lo_sb, lo_st = (lo.stride(0), lo.stride(1)) if ranges is not None else (0, 0)
    launches = []
    for head_index, kop, vop in groups:
        Hg = head_index.numel()
        grid = (B * Hg, triton.cdiv(rep * Tq, block_m))
        args = (
            query, query.stride(0), query.stride(1), query.stride(2),
            *kop.args(), *vop.args(), table, table.stride(0),
            fresh_k, fresh_k.stride(0), fresh_k.stride(1), fresh_k.stride(2),
            fresh_v, fresh_v.stride(0), fresh_v.stride(1), fresh_v.stride(2),
            head_index, lo, hi, lo_sb, lo_st, out, out.stride(0), out.stride(1), out.stride(2),
            lse if lse is not None else out, scaling * LOG2E, past_len, Tq, Hg, Hq,
        )  # fmt: skip
        meta = dict(
            REP=rep, BLOCK_M=block_m, D=D, BLOCK_N=block_n, HAS_RANGE=ranges is not None, DOT=dot_kind,
            SOFTCAP=(softcap or 0.0) * LOG2E,
            HAS_LSE=lse is not None,
            K_KIND=kop.kind, K_BITS=kop.bits, K_GROUP=kop.group,
            V_KIND=vop.kind, V_BITS=vop.bits, V_GROUP=vop.group, BS=block_size,
            num_warps=num_warps,
        )  # fmt: skip
        launches.append(Launch(_chunk_attn, grid, args, meta))
    return launches
