"""Heavy rows (``heavy_tokens``): the prompt rows each (layer, KV head) attends to most keep a refinement bit.

The age ladder (``ladder_tokens``) refines the *youngest* pool rows; this refines the *heaviest*: at the prompt's
write, each KV head's ``N`` pool rows with the most attention from the prompt's own queries (H2O's accumulated
score: softmax weight summed over every prompt query and the query heads of the KV head) keep the first rung of
their codebook code (``Quantizer.refine``: one bit per coordinate and a norm byte), picked once and kept for good.
The torch attention reads those rows refined in place of their base decode (:func:`put_rows`); the Triton kernels
read the pool as it is and each heavy row's base softmax term is then swapped for its refined one
(:func:`kvquant.kernels.triton_attention.swap_rows`). A row position costs 2 bytes (4 past 32,767 tokens) per
(sequence, KV head).

Three small functions with one job each (the store holds the state, see :class:`~kvquant.store.LayerStore`):
:func:`pick_rows` chooses the positions, :func:`gather_parts` reads the picked rows' base parts out of the pool's
blocks, :func:`put_rows` writes decoded rows into a read tile.
"""

from __future__ import annotations

import math

import torch

SHORT_POSITIONS = 2**15  # positions below this are held as int16, else int32


def pick_rows(scores: torch.Tensor, eligible: torch.Tensor, n: int) -> torch.Tensor:
    """Per (row, head), the indices ``[B, H, n']`` (``n' = min(n, T)``) of the ``n`` highest ``scores[B, H, T]``
    among the ``eligible[B, T]`` tokens, in ascending order; ``-1`` where a row has fewer eligible tokens."""
    n = min(n, scores.shape[-1])
    s = scores.float().masked_fill(~eligible[:, None, :], -math.inf)
    top, idx = s.topk(n, dim=-1)
    idx = torch.where(torch.isfinite(top), idx, -1)
    return idx.sort(dim=-1).values


def position_dtype(end: int) -> torch.dtype:
    """The narrowest dtype that holds row positions below ``end``."""
    return torch.int16 if end <= SHORT_POSITIONS else torch.int32


def take_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx[B, H, n]`` (``-1``: row 0, a placeholder) of ``x[B, H, T, ...]`` -> ``[B, H, n, ...]``."""
    i = idx.clamp_min(0).long().view(*idx.shape, *([1] * (x.dim() - 3))).expand(*idx.shape, *x.shape[3:])
    return x.gather(2, i)


def gather_parts(parts: dict[str, torch.Tensor], table: torch.Tensor, pos: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-token parts of pool rows ``pos[B, H, n]`` (``-1``: a placeholder row) from block tensors
    ``[num_blocks, H, block_size, ...]`` through the block tables ``table[B, max_blocks]`` -> ``[B, H, n, ...]``."""
    p = pos.clamp_min(0).long()
    out = {}
    for name, t in parts.items():
        bs = t.shape[2]
        blk = table.gather(1, (p // bs).flatten(1)).view_as(p)
        heads = torch.arange(t.shape[1], device=t.device).view(1, -1, 1)
        out[name] = t[blk, heads, p % bs]
    return out


def put_rows(x: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """``x[B, H, t, D]`` (tokens ``[start, start + t)``) with ``rows[B, H, n, D]`` written at the positions
    ``pos[B, H, n]`` that fall in ``[start, end)`` (others, and ``-1``, left out). Returns a new tensor."""
    t = x.shape[2]
    p = pos.long()
    inside = (p >= start) & (p < min(end, start + t))
    idx = torch.where(inside, p - start, t)  # outside rows go to a spare column, dropped after
    out = torch.cat([x, x.new_zeros(*x.shape[:2], 1, x.shape[3])], dim=2)
    out.scatter_(2, idx.unsqueeze(-1).expand(*idx.shape, x.shape[3]), rows.to(x.dtype))
    return out[:, :, :t]
