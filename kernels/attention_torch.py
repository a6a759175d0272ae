"""Pure-torch attention over a layer's quantized history, read through its :class:`~kvquant.snapshot.KVSnapshot`.

Two functions with one signature::

    attend_torch(query, fresh_k, fresh_v, layer, past_len, mask, scaling) -> out[B, Hq, Tq, D]
    attend_naive(...)  # same result, by dequantize-everything-then-SDPA (tests only)

* ``query[B, Hq, Tq, D]`` -- queries of the current chunk (``Tq == 1`` when decoding).
* ``fresh_k/fresh_v[B, Hkv, Tq, D]`` -- this chunk's K/V in full precision (also written to the
  store; attention uses them unquantized for the chunk itself, the quantized store for the past).
* ``layer`` -- the layer's snapshot (or its store, which publishes one); its first ``past_len`` tokens are the
  history. Everything here is in the
  store's *storage space*: with ``rotate`` on, the caller (:func:`kvquant.kernels.dispatch.attend`) passes
  Hadamard-rotated queries and fresh K/V, and un-rotates the output.
* ``mask`` -- ``None`` (causal, the chunk's last query at the last position) or a boolean
  ``[B, 1 or Hq, Tq, past_len + Tq]`` mask, True = attend (transformers' SDPA mask).

``attend_torch`` is flash-decoding style: it walks the history tile by tile (a few blocks at a
time), dequantizes each tile and folds it into an online softmax in fp32, so the full-precision
history is never materialised; the workspace is bounded by ``WORKSPACE_BYTES``. It is the CPU
path of the library and the reference the Triton kernels are tested against.
"""

from __future__ import annotations

import math

import torch

from kvquant.quantizers.base import Factored
from kvquant.snapshot import GroupSnapshot, KVSnapshot, SnapshotSource, as_snapshot

WORKSPACE_BYTES = 8 * 2**20  # fp32 scratch per tile: scores and a dequantized K or V tile
QUERY_TILE = 128  # queries per tile when a chunk (prefill) is long


class OnlineSoftmax:
    """Running (max, sum, weighted sum) of one group's attention rows, in fp32."""

    def __init__(self, rows_shape: tuple[int, ...], head_dim: int, device: torch.device) -> None:
        self.m = torch.full((*rows_shape, 1), -math.inf, device=device)
        self.l = torch.zeros((*rows_shape, 1), device=device)
        self.acc = torch.zeros((*rows_shape, head_dim), device=device)

    def update(self, scores: torch.Tensor, values: torch.Tensor) -> None:
        """Fold ``scores[..., t]`` (masked entries = -inf) against ``values[..., t, D]``."""
        m_new = torch.maximum(self.m, scores.amax(dim=-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(scores - m_safe)
        alpha = torch.exp(self.m - m_safe)
        self.l = self.l * alpha + p.sum(dim=-1, keepdim=True)
        self.acc = self.acc * alpha + p @ values
        self.m = m_new

    def result(self) -> torch.Tensor:
        # rows with no visible key (fully padded) give 0, not NaN; NaN in the history stays NaN
        return _normalise(self.acc, self.l)


def _mask_tile(
    mask: torch.Tensor | None,
    group: GroupSnapshot,
    num_kv: int,
    rep: int,
    q_range: tuple[int, int],
    k_range: tuple[int, int],
    past_len: int,
) -> torch.Tensor | None:
    """Boolean keep-mask ``[B, Hg or 1, rep or 1, tq, tk]`` for one (query tile, key tile), or None."""
    q0, q1 = q_range
    k0, k1 = k_range
    if mask is None:
        # causal: query i (absolute position past_len + i) sees keys <= past_len + i
        if k1 <= past_len + q0 + 1:
            return None  # every key of the tile is visible to every query of the tile
        qpos = torch.arange(q0, q1, device=group.head_index.device).view(-1, 1) + past_len
        kpos = torch.arange(k0, k1, device=group.head_index.device).view(1, -1)
        return (kpos <= qpos).view(1, 1, 1, q1 - q0, k1 - k0)
    m = mask[:, :, q0:q1, k0:k1]
    if m.shape[1] == 1:
        return m.unsqueeze(2)  # [B, 1, 1, tq, tk]
    m = m.reshape(m.shape[0], num_kv, rep, q1 - q0, k1 - k0)
    return m if group.all_heads else m.index_select(1, group.head_index)


def _direct(qt, tiles, mask, group, num_kv, rep, q_range, past_len, softcap, mass=None) -> torch.Tensor:
    """Plain softmax over a few tiles that fit the workspace together (the common decode case); ``mass``: add
    each history key's probability mass (summed over the tile's query rows) into ``mass[B, Hg, past_len]``."""
    loaded = [(load(), k_range) for load, k_range in tiles]
    parts = []
    for (keys, _), k_range in loaded:
        scores = cap_scores(qt @ keys.transpose(-1, -2), softcap)
        keep = _mask_tile(mask, group, num_kv, rep, q_range, k_range, past_len)
        parts.append(scores if keep is None else _apply(scores, keep, rep))
    scores = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
    m = scores.amax(dim=-1, keepdim=True)
    p = torch.exp(scores - torch.where(torch.isinf(m), torch.zeros_like(m), m))
    denom = p.sum(dim=-1, keepdim=True)
    if mass is not None:
        probs = _normalise(p, denom).sum(dim=2)  # [B, Hg, tk]
        start = 0
        for _, (k0, k1) in loaded:
            if k1 <= past_len:
                mass[:, :, k0:k1] += probs[:, :, start:start + k1 - k0]
            start += k1 - k0
    out = None
    start = 0
    for (_, values), (k0, k1) in loaded:
        term = p[..., start:start + k1 - k0] @ values
        out = term if out is None else out + term
        start += k1 - k0
    return _normalise(out, denom)


def cap_scores(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Attention logit softcapping (Gemma 2): ``softcap * tanh(scores / softcap)``; identity for None."""
    return scores if not softcap else torch.tanh(scores / softcap) * softcap


def _normalise(acc: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
    """``acc / denom``; rows with no visible key (``denom == 0``) give 0. A NaN anywhere in the history
    propagates (a NaN ``denom`` is not 0), so corruption is never turned into a plausible output."""
    return torch.where(denom == 0, torch.zeros_like(acc), acc / torch.where(denom == 0, 1.0, denom))


def _apply(scores: torch.Tensor, keep: torch.Tensor, rep: int) -> torch.Tensor:
    """Mask ``scores[B, Hg, rep*tq, tk]`` with ``keep[B, Hg|1, rep|1, tq, tk]`` (False -> -inf)."""
    B, Hg, rows, tk = scores.shape
    s5 = scores.view(B, Hg, rep, rows // rep, tk).masked_fill(~keep, -math.inf)
    return s5.view(B, Hg, rows, tk)


def _fresh_extent(mask: torch.Tensor | None, q_range: tuple[int, int], past_len: int, tq: int) -> int:
    """Chunk keys ``[0, n)`` that queries ``q_range`` may see: causal without a mask, else from the mask
    (a non-causal mask lets a query see chunk keys after it, beyond the query tile)."""
    q0, q1 = q_range
    if mask is None:
        return q1
    if tq == 1:  # decode: the one fresh key (read from the mask it would need a host synchronisation)
        return 1
    cols = mask[:, :, q0:q1, past_len:past_len + tq].any(dim=2).any(dim=1).any(dim=0)
    idx = cols.nonzero()
    return int(idx[-1]) + 1 if idx.numel() else 1  # >= 1 key: a fully masked tile still has a (masked) tile


def _tiles(total: int, size: int) -> list[tuple[int, int]]:
    return [(s, min(total, s + size)) for s in range(0, total, size)]


def _fits_at_once(layer: KVSnapshot, batch: int, rows: int, tokens: int) -> bool:
    """True when ``tokens`` history keys of every head group fit the workspace in one tile pair (see
    :func:`attend_torch`'s tile sizes): then one softmax covers them, with no online rescaling."""
    return tokens + 1 <= 2 * _key_tile(layer, batch, layer.num_heads, rows)


def _key_tile(layer: KVSnapshot, batch: int, heads: int, rows: int) -> int:
    """Keys per tile (whole blocks) such that the scores ``[batch, heads, rows, tile]`` and a K/V tile
    ``[batch, heads, tile, head_dim]`` stay within ``WORKSPACE_BYTES`` each."""
    row_bytes = 4 * batch * heads * max(rows, layer.head_dim)
    return max(layer.block_size, (WORKSPACE_BYTES // row_bytes) // layer.block_size * layer.block_size)


def _decode_one(query, fresh_k, fresh_v, layer: KVSnapshot, past_len: int, mask, scaling: float, softcap, key_mass):
    """One query per row (a decode step) over a history that fits the workspace: per head group, one score
    row over the history's pieces (:attr:`~kvquant.snapshot.GroupSnapshot.read_factored`) and the fresh key, one
    softmax. Scales that factor out of the codes are applied to the query / scores (keys) and to the
    probabilities / output (values), never to the history's elements. Same result as the tiled walk with
    a fraction of its passes over the history and of its tensor operations."""
    B, Hq, _, D = query.shape
    Hkv = layer.num_heads
    rep = Hq // Hkv
    spans = layer.tiles(past_len, max(past_len, 1))
    first = spans[0][0] if spans else past_len  # released blocks (sliding window) are skipped
    q = (query.float() * scaling).view(B, Hkv, rep, D)
    keep = None
    if mask is not None:  # [B, 1|Hq, 1, first..past_len] -> [B, 1|Hkv, 1|rep, T + 1]
        keep = mask[:, :, 0, first:past_len + 1]
        keep = keep.unsqueeze(2) if keep.shape[1] == 1 else keep.reshape(B, Hkv, rep, -1)
    out = None
    for g in layer.groups:
        sel = (lambda t: t) if g.all_heads else (lambda t, i=g.head_index: t.index_select(1, i))
        qg, fk, fv = sel(q), sel(fresh_k).float(), sel(fresh_v).float()
        pieces = g.read_factored(first, past_len) if first < past_len else []
        scores = torch.cat([*(_key_scores(qg, k) for _, _, k, _ in pieces), qg @ fk.transpose(-1, -2)], dim=-1)
        scores = cap_scores(scores, softcap)
        kg = None
        if keep is not None:
            kg = keep if keep.shape[1] == 1 else sel(keep)
            scores = scores.masked_fill(~kg, -math.inf)
        p = torch.softmax(scores, dim=-1)  # [B, Hg, rep, T + 1]
        if key_mass is not None and pieces:  # each history key's probability, summed over its query heads
            mass = p[..., :-1].sum(dim=2)
            if g.all_heads:
                key_mass[:, :, first:past_len] += mass
            else:
                key_mass[:, :, first:past_len].index_add_(1, g.head_index, mass)
        res = p[..., -1:] * fv
        for a, b, _, v in pieces:
            res = res + _weighted_values(p[..., a - first:b - first], v)
        if kg is not None:  # rows with no visible key give 0 (softmax over nothing is NaN)
            res = torch.where(kg.any(dim=-1, keepdim=True), res, 0.0)
        if g.all_heads:
            out = res
        else:
            if out is None:
                out = torch.empty((B, Hkv, rep, D), dtype=torch.float32, device=query.device)
            out.index_copy_(1, g.head_index, res)
    return out.view(B, Hq, 1, D).to(query.dtype)


def _key_scores(q: torch.Tensor, k: Factored) -> torch.Tensor:
    """``q[B, H, R, D] . k_hat[B, H, T, D]`` -> ``[B, H, R, T]`` with ``k_hat = codes * scale + zero``."""
    if k.block:  # per (block, channel): fold each block's channel scales into the query, add q . zero
        B, H, T, D = k.codes.shape
        n = T // k.block
        qs = q.unsqueeze(2) * k.scale.unsqueeze(3)  # [B, H, n, R, D]
        s = qs @ k.codes.view(B, H, n, k.block, D).transpose(-1, -2)  # [B, H, n, R, block]
        s = s + (q @ k.zero.transpose(-1, -2)).transpose(-1, -2).unsqueeze(-1)  # + q . zero[block]
        return s.permute(0, 1, 3, 2, 4).reshape(B, H, q.shape[2], T)
    if k.scale is not None and k.scale.shape[2] == 1:  # per head: scale the query's R x D, not R x T scores
        return (q * k.scale) @ k.codes.transpose(-1, -2)
    s = q @ k.codes.transpose(-1, -2)
    if k.scale is not None:  # [.., T, 1] per token -> one factor per score column
        s = s * k.scale.transpose(-1, -2)
    return s


def _weighted_values(p: torch.Tensor, v: Factored) -> torch.Tensor:
    """``p[B, H, R, T] @ v_hat[B, H, T, D]`` with ``v_hat = codes * scale + zero``."""
    if v.block:  # per (block, channel): scale each block's partial sum
        B, H, T, D = v.codes.shape
        n = T // v.block
        pb = p.reshape(B, H, p.shape[2], n, v.block).transpose(2, 3)  # [B, H, n, R, block]
        part = pb @ v.codes.view(B, H, n, v.block, D)  # [B, H, n, R, D]
        part = part * v.scale.unsqueeze(3) + pb.sum(dim=-1, keepdim=True) * v.zero.unsqueeze(3)
        return part.sum(dim=2)
    if v.scale is not None and v.scale.shape[2] > 1:  # per token: scale the probabilities
        p = p * v.scale.transpose(-1, -2)
    out = p @ v.codes
    if v.scale is not None and v.scale.shape[2] == 1:  # per head: scale the output
        out = out * v.scale
    return out


def attend_torch(
    query: torch.Tensor,
    fresh_k: torch.Tensor,
    fresh_v: torch.Tensor,
    layer: KVSnapshot | SnapshotSource,
    past_len: int,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    key_mass: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query`` over ``layer``'s quantized history plus the fresh chunk (see module doc).

    ``softcap``: attention logit softcapping (Gemma 2), applied to the scaled scores before masking.
    ``key_mass``: a float32 ``[B, Hkv, past_len]`` tensor to which each history key's attention probability
    (summed over the query heads of its KV head and over the chunk's queries) is added -- the per-key score
    mass H2O / TOVA evict by. It costs one exp per (query, key) more, and keeps the scores of the tiles of
    one query tile until its softmax is final."""
    layer = as_snapshot(layer)
    B, Hq, Tq, D = query.shape
    Hkv = layer.num_heads
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    rep = Hq // Hkv
    if Tq == 1 and _fits_at_once(layer, B, rep, past_len):
        return _decode_one(query, fresh_k, fresh_v, layer, past_len, mask, scaling, softcap, key_mass)
    device = query.device
    out = torch.empty((B, Hkv, rep, Tq, D), dtype=torch.float32, device=device)
    q5 = query.float().view(B, Hkv, rep, Tq, D) * scaling
    for g in layer.groups:
        Hg = len(g.heads)
        q = q5 if g.all_heads else q5.index_select(1, g.head_index)
        # tile sizes: scores [B, Hg, rep, tq, tk] and a K/V tile [B, Hg, tk, D] within the workspace
        tq = min(Tq, QUERY_TILE)
        tk = _key_tile(layer, B, Hg, rep * tq)
        fk = fresh_k if g.all_heads else fresh_k.index_select(1, g.head_index)
        fv = fresh_v if g.all_heads else fresh_v.index_select(1, g.head_index)
        for q0, q1 in _tiles(Tq, tq):
            # all query heads of a KV head share its keys: one [rep*tq, D] x [D, tk] product, no broadcast copy
            qt = q[:, :, :, q0:q1].reshape(B, Hg, rep * (q1 - q0), D)
            # (keys, values, keep-mask) tiles: the quantized history (dequantized one tile at a time),
            # then the fresh chunk in full precision, up to the last chunk key that a query of the tile sees
            f_end = _fresh_extent(mask, (q0, q1), past_len, Tq)
            tiles = [
                (lambda a=k0, b=k1, grp=g: grp.read(a, b), (k0, k1)) for k0, k1 in layer.tiles(past_len, tk)
            ] + [
                (lambda a=f0, b=f1, k=fk, v=fv: (k[:, :, a:b].float(), v[:, :, a:b].float()),
                 (past_len + f0, past_len + f1))
                for f0, f1 in _tiles(f_end, tk)
            ]
            gm = None
            if key_mass is not None:
                gm = key_mass if g.all_heads else torch.zeros((B, Hg, past_len), device=device)
            if sum(b - a for _, (a, b) in tiles) <= 2 * tk:  # fits the workspace at once: one plain softmax
                res = _direct(qt, tiles, mask, g, Hkv, rep, (q0, q1), past_len, softcap, gm)
            else:
                acc = OnlineSoftmax((B, Hg, rep * (q1 - q0)), D, device)
                kept = []  # history tiles' scores, for the per-key mass once the softmax is final
                for load, k_range in tiles:
                    keys, values = load()
                    scores = cap_scores(qt @ keys.transpose(-1, -2), softcap)
                    keep = _mask_tile(mask, g, Hkv, rep, (q0, q1), k_range, past_len)
                    if keep is not None:
                        scores = _apply(scores, keep, rep)
                    acc.update(scores, values)
                    if gm is not None and k_range[1] <= past_len:
                        kept.append((scores, k_range))
                res = acc.result()
                for scores, (k0, k1) in kept:
                    m_safe = torch.where(torch.isinf(acc.m), torch.zeros_like(acc.m), acc.m)
                    gm[:, :, k0:k1] += _normalise(torch.exp(scores - m_safe), acc.l).sum(dim=2)
            if gm is not None and not g.all_heads:
                key_mass.index_add_(1, g.head_index, gm)
            res = res.view(B, Hg, rep, q1 - q0, D)
            if g.all_heads:
                out[:, :, :, q0:q1] = res
            else:
                out[:, :, :, q0:q1].index_copy_(1, g.head_index, res)
    return out.view(B, Hq, Tq, D).to(query.dtype)


def dequantize_history(
    layer: KVSnapshot | SnapshotSource, past_len: int, head_space: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole history as float32 ``[B, Hkv, past_len, D]`` K and V, in storage space (rotated if
    the config rotates), sinks and residual included (tests and debugging only). ``head_space``: codebook
    heads stay in their rotated head space (what the attention functions read)."""
    layer = as_snapshot(layer)
    B, D = layer.batch, layer.head_dim
    k = torch.empty((B, layer.num_heads, past_len, D), device=layer.device)
    v = torch.empty_like(k)
    for g in layer.groups:
        k[:, g.head_index], v[:, g.head_index] = g.read(0, past_len)
    if not head_space and layer.space.head_space:
        k, v = layer.space.kv_from_head(k, v)
    return k, v


def attend_naive(
    query: torch.Tensor,
    fresh_k: torch.Tensor,
    fresh_v: torch.Tensor,
    layer: KVSnapshot | SnapshotSource,
    past_len: int,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Reference: dequantize the whole history, concatenate the fresh chunk, softmax attention in fp32."""
    layer = as_snapshot(layer)
    B, Hq, Tq, D = query.shape
    rep = Hq // layer.num_heads
    hk, hv = dequantize_history(layer, past_len, head_space=True)  # same space as the query it is given
    k = torch.cat([hk, fresh_k.float()], dim=2).repeat_interleave(rep, dim=1)
    v = torch.cat([hv, fresh_v.float()], dim=2).repeat_interleave(rep, dim=1)
    L = past_len + Tq
    if mask is None:
        qpos = torch.arange(Tq, device=query.device).view(-1, 1) + past_len
        mask = (torch.arange(L, device=query.device).view(1, -1) <= qpos).view(1, 1, Tq, L)
    scores = cap_scores(query.float() @ k.transpose(-1, -2) * scaling, softcap)
    out = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1) @ v
    visible = mask.any(dim=-1, keepdim=True).expand(B, Hq, Tq, 1)
    return torch.where(visible, out, torch.zeros_like(out)).to(query.dtype)
