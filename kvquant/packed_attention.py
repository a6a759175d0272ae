"""Attention of a continuous-batching step: one batched block walk for many sequences of one shared pool.

A packed step (:class:`~kvquant.packed.PackedCache`) holds the new tokens of many sequences, each with its own
:class:`~kvquant.store.LayerStore` over the same :class:`~kvquant.blocks.LayerBlocks` of a
:class:`~kvquant.PagedKVPool`. After every sequence has written its slice (its ``commit``), :func:`attend_segments`
reads all their histories together: the sequences whose chunks have the same length (every decode token of the
step; prefill chunks of equal length) form one batch. For a batch it gathers every sequence's block ids into one
padded ``[N, blocks]`` table and walks it a tile of blocks at a time, vectorised over the sequences: each tile is
dequantized (never the whole history) and folded into an online softmax in fp32, with each sequence's own
history length masking what lies past it. Then the dense segments (fp16 sinks, the unfilled tail of per-channel
key blocks, padded to the longest) and the fresh chunk (causal) are folded in the same way. When the whole history
fits one tile (the common case), pool and dense keys go through one fused ``scaled_dot_product_attention`` call
with the same mask instead.

Stores the walk does not cover (see :func:`batchable`: eviction slots, per-head lanes, the age ladder, heavy
rows, rotation / centering, codebook head spaces, static scales, sliding windows, offloaded blocks, rows still
waiting for calibration) and non-torch backends go through :func:`kvquant.kernels.dispatch.attend` one sequence
at a time, as before. Both give each sequence the attention over its own history only.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .kernels.attention_torch import OnlineSoftmax
from .store import HeadGroup, LayerStore

__all__ = ["attend_segments", "batchable", "attend_batched"]

WORKSPACE_BYTES = 8 * 2**20  # fp32 scratch of one dequantized K or V tile, over all sequences of a batch


def batchable(store: LayerStore) -> bool:
    """True when the batched walk reads ``store`` exactly as :func:`kvquant.kernels.dispatch.attend` would:
    one row, no padding, every token in the pool or in the dense sink / tail buffers, dynamic scales."""
    if store.batch != 1 or store.lanes or store.slots is not None or store.window is not None:
        return False
    refine = store.refine
    if refine.ladder_n or refine.ladder_tokens or refine.heavy or refine.heavy_tokens or store.space.transforms:
        return False
    if store.has_head_space or store.holds_fitted_rows or store.dense.exact_k is not None or store.first_live:
        return False
    if store.config.offload is not None or int(store.starts.pad_end) != 0:
        return False
    return all(not s.quantizer.static and not s.quantizer.space and not s.state
               for g in store.groups for s in (g.key, g.value))  # fmt: skip


def attend_segments(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, stores: Sequence[LayerStore],
    past_lens: Sequence[int], starts: Sequence[int], lengths: Sequence[int], scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of the packed chunk ``query[1, Hq, T, D]`` (``key/value[1, Hkv, T, D]``: its fresh K/V), whose
    tokens ``[starts[i], starts[i] + lengths[i])`` belong to sequence ``i`` with store ``stores[i]`` (written
    already) and ``past_lens[i]`` history tokens; each sequence attends causally over its own history and its
    own slice. Returns ``out[1, Hq, T, D]`` in ``query``'s dtype."""
    from kvquant.kernels.dispatch import attend, backend_for

    out = torch.empty_like(query)
    batched: dict[int, list[int]] = {}
    rest: list[int] = []
    same_pool = all(s.blocks is stores[0].blocks for s in stores)
    fast = softcap is None and same_pool and backend_for(query.device) == "torch"
    for i, st in enumerate(stores):
        (batched.setdefault(lengths[i], []) if fast and batchable(st) else rest).append(i)
    for n, idx in batched.items():
        if len(idx) == 1:  # a lone chunk: nothing to batch (the per-sequence walk has its own fast paths)
            rest += idx
            continue
        a, m = starts[idx[0]], len(idx) * n
        run = all(starts[i] == a + j * n for j, i in enumerate(idx))  # side by side (a step's decode tokens)
        pos = None if run else _positions(tuple(starts[i] for i in idx), n, query.device)
        q, k, v = ((x[0, :, a:a + m] if pos is None else x[0].index_select(1, pos))
                   .view(x.shape[1], len(idx), n, -1).transpose(0, 1) for x in (query, key, value))  # fmt: skip
        res = attend_batched(q, k, v, [stores[i] for i in idx], [past_lens[i] for i in idx], scaling)
        res = res.transpose(0, 1).reshape(query.shape[1], m, -1)
        if pos is None:
            out[0, :, a:a + m] = res
        else:
            out[0].index_copy_(1, pos, res)
    for i in rest:
        s, n = starts[i], lengths[i]
        out[:, :, s:s + n] = attend(query[:, :, s:s + n], key[:, :, s:s + n], value[:, :, s:s + n], stores[i],
                                    past_lens[i], None, scaling, softcap)  # fmt: skip
    return out


def attend_batched(
    query: torch.Tensor, fresh_k: torch.Tensor, fresh_v: torch.Tensor, stores: Sequence[LayerStore],
    past_lens: Sequence[int], scaling: float,
) -> torch.Tensor:
    """Attention of ``query[N, Hq, T, D]`` (sequence ``i``'s chunk of ``T`` tokens at positions
    ``past_lens[i] ..``) over each ``stores[i]``'s history ``[0, past_lens[i])`` and its own fresh chunk
    ``fresh_k/fresh_v[N, Hkv, T, D]`` (causal). Every store is :func:`batchable` and on the same pool blocks.
    Returns ``[N, Hq, T, D]`` in ``query``'s dtype."""
    N, Hq, T, D = query.shape
    s0 = stores[0]
    Hkv, bs, dev = s0.num_heads, s0.block_size, query.device
    rep = Hq // Hkv
    R = rep * T
    q_end = [min(st.q_end, p) for st, p in zip(stores, past_lens, strict=True)]  # history read from the pool
    sink_lo = [min(st.starts.sink_end, e) if st.dense.sink_k is not None else 0
               for st, e in zip(stores, q_end, strict=True)]
    res_n = [max(0, p - st.q_end) for st, p in zip(stores, past_lens, strict=True)]  # from the dense tail
    # the pool's blocks of every sequence, one padded table (missing entries: block 0, masked)
    nb = -(-max(q_end) // bs)
    table = torch.tensor([st.tables[0][:nb] + [0] * (nb - len(st.tables[0][:nb])) for st in stores],
                         dtype=torch.long, device=dev)  # fmt: skip
    tile = max(1, WORKSPACE_BYTES // (4 * N * Hkv * bs * D))  # blocks per tile
    S = s0.sink_tokens if s0.dense.sink_k is not None else 0
    rmax = max(res_n)
    hide_pool, hide_dense, see_all, idx = _masks(tuple(q_end), tuple(sink_lo), tuple(res_n), nb * bs, S, T, rep, dev)
    # dense keys after the pool: sinks, the unfilled tails (padded to the longest), the fresh chunk
    dk, dv = [], []
    if S:
        dk.append(torch.cat([st.dense.sink_k for st in stores]).float())
        dv.append(torch.cat([st.dense.sink_v for st in stores]).float())
    if rmax:  # every tail in one row, then gathered padded (a short tail repeats a token of its own, masked)
        for side, out_list in (("res_k", dk), ("res_v", dv)):
            flat = torch.cat([getattr(st.dense, side)[0, :, :r] for st, r in zip(stores, res_n, strict=True) if r],
                             dim=1)
            out_list.append(flat.index_select(1, idx).view(Hkv, N, rmax, D).transpose(0, 1).float())
    dense_k = torch.cat([*dk, fresh_k.float()], dim=2)
    dense_v = torch.cat([*dv, fresh_v.float()], dim=2)
    q5 = (query.float() * scaling).view(N, Hkv, rep, T, D)
    out = torch.empty((N, Hkv, rep, T, D), dtype=torch.float32, device=dev)
    for g in s0.groups:
        sel = (lambda t: t) if g.all_heads else (lambda t, h=g.head_index: t.index_select(1, h))
        Hg = len(g.heads)
        q = sel(q5).reshape(N, Hg, R, D)
        kd, vd = sel(dense_k), sel(dense_v)
        if nb <= tile:  # the common case: every pool block in one tile, one fused softmax with the dense keys
            k, v = _dequantized(g, table)
            # SDPA over [pool keys | dense keys]; ``q`` is scaled already. A row sees its own fresh key, so no row
            # is fully masked
            res = F.scaled_dot_product_attention(q, torch.cat([k, kd], dim=2), torch.cat([v, vd], dim=2),
                                                 attn_mask=see_all, scale=1.0)  # fmt: skip
        else:
            fold = OnlineSoftmax((N, Hg, R), D, dev)
            for j0 in range(0, nb, tile):
                j1 = min(nb, j0 + tile)
                k, v = _dequantized(g, table[:, j0:j1])
                fold.update((q @ k.transpose(-1, -2)).masked_fill(hide_pool[..., j0 * bs:j1 * bs], -math.inf), v)
            fold.update((q @ kd.transpose(-1, -2)).masked_fill(hide_dense, -math.inf), vd)
            res = fold.result()
        res = res.view(N, Hg, rep, T, D)
        if g.all_heads:
            out = res
        else:
            out.index_copy_(1, g.head_index, res)
    return out.view(N, Hq, T, D).to(query.dtype)


def _dequantized(group: HeadGroup, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks ``table[N, nb]`` of ``group``, float32 ``[N, Hg, nb * block_size, D]``."""
    k = group.key.quantizer.dequantize(group.key.gather(table), group.key.state, torch.float32)
    v = group.value.quantizer.dequantize(group.value.gather(table), group.value.state, torch.float32)
    return k, v


@functools.lru_cache(maxsize=8)
def _positions(starts: tuple[int, ...], n: int, dev: torch.device) -> torch.Tensor:
    """The packed positions of chunks of ``n`` tokens at ``starts`` (the layers of a step share it)."""
    return torch.tensor([s + t for s in starts for t in range(n)], device=dev)


_last_masks: list = [None, None]  # (key, masks) of the latest call: the layers of one step share them


def _masks(
    q_end: tuple[int, ...], sink_lo: tuple[int, ...], res_n: tuple[int, ...], pool_len: int, S: int, T: int,
    rep: int, dev: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What each sequence must not see: ``hide_pool[N, 1, 1, pool_len]`` (past its pool tokens, its sink rows),
    ``hide_dense[N, 1, rep * T, S + rmax + T]`` (sink slots not held, padding past its tail, later fresh tokens),
    what it may see of both side by side (``see_all``, the complement), and the gather index of the padded tails
    (None without tails). Computed once for the layers of a step."""
    key = (q_end, sink_lo, res_n, pool_len, S, T, rep, dev)
    if _last_masks[0] == key:
        return _last_masks[1]
    N, rmax, R = len(q_end), max(res_n), rep * T
    lo = torch.tensor(sink_lo, device=dev).view(N, 1)
    hi = torch.tensor(q_end, device=dev).view(N, 1)
    pos = torch.arange(pool_len, device=dev).view(1, -1)
    hide_pool = ((pos < lo) | (pos >= hi)).view(N, 1, 1, -1)
    slot = torch.arange(S + rmax, device=dev).view(1, -1)
    keep = torch.where(slot < S, slot < lo, slot - S < torch.tensor(res_n, device=dev).view(N, 1))
    t_q = torch.arange(R, device=dev) % T  # row r = (query head in its group) * T + token
    fresh = torch.arange(T, device=dev).view(1, T) <= t_q.view(R, 1)  # [R, T] causal
    hide_dense = ~torch.cat([keep.view(N, 1, 1, -1).expand(N, 1, R, -1), fresh.expand(N, 1, R, T)], dim=-1)
    idx = None
    if rmax:
        starts = [0, *itertools.accumulate(res_n)][:-1]
        idx = torch.tensor([a + min(t, r - 1) if r else 0 for a, r in zip(starts, res_n, strict=True)
                            for t in range(rmax)], device=dev)  # fmt: skip
    see_all = ~torch.cat([hide_pool.expand(N, 1, R, pool_len), hide_dense], dim=-1)
    _last_masks[:] = [key, (hide_pool, hide_dense, see_all, idx)]
    return hide_pool, hide_dense, see_all, idx
