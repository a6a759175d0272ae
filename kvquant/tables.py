"""Block tables of one layer: where a write goes (sharing identical rows' blocks, copy-on-write), and row indices.

A batch row's *block table* lists the ids of the blocks that hold its tokens ``[j * block_size, (j + 1) *
block_size)`` (:mod:`kvquant.blocks`). :func:`place` chooses the blocks a write touches and updates the tables;
:func:`row_index` checks the rows of a reorder / select before anything moves.
"""

from __future__ import annotations

from typing import Any

import torch

from .blocks import LayerBlocks
from .errors import ArgumentError
from .groups import HeadGroup, group_rows
from .tensor_store import WritePlan


def row_index(idx: Any, batch: int, name: str) -> torch.Tensor:
    """``idx`` as a 1-D int64 CPU tensor of row numbers in ``[0, batch)`` (at least one), or
    :class:`~kvquant.errors.ArgumentError` naming ``name``: a reorder / select is checked before anything moves."""
    try:
        t = torch.as_tensor(idx)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ArgumentError(f"{name}: not a tensor of row indices ({e})") from None
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise ArgumentError(f"{name}: row indices must be integers, got {t.dtype}")
    if t.dim() != 1 or t.numel() == 0:
        raise ArgumentError(f"{name}: must be a 1-D tensor of at least one row index, got shape {list(t.shape)}")
    t = t.to("cpu", torch.long)
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= batch:
        bad = lo if lo < 0 else hi
        raise ArgumentError(f"{name}: row index {bad} is out of range for a batch of {batch} rows (0 .. {batch - 1})")
    return t


def place(
    tables: list[list[int]], blocks: LayerBlocks, keys: torch.Tensor, values: torch.Tensor, pos: int,
    has_block_parts: bool, per_block: bool, device: torch.device,
) -> tuple[WritePlan, bool, int]:
    """Choose a block for every (row, block) a write at ``pos`` touches, and update the tables.

    Rows whose tables agree up to a block and whose new tokens for it are equal share one block
    (beam search's identical prompts: written once). A shared partial block is copied before it
    is written (copy-on-write); a block held only by the writing rows is written in place. All
    blocks are reserved before any table changes, so :class:`KVCacheFull` leaves everything as it was.

    ``tables``: the block ids of every row (changed in place); ``has_block_parts``: some part is per block (its rows
    are written by whole blocks too); ``per_block``: the quantizers need whole, aligned blocks. Returns the write
    plan, whether a table entry changed, and the bytes copied (copy-on-write).
    """
    bs, T = blocks.block_size, keys.shape[2]
    if T == 1 and len(tables) == 1 and not has_block_parts:  # decode of one sequence ...
        t, j = tables[0], pos // bs
        if j < len(t) and t[j] >= 0 and blocks.refs[t[j]] == 1:  # ... into its own partial block
            return WritePlan.one(0, 0, t[j], pos - j * bs), False, 0
    end = pos + T
    j0, j1 = pos // bs, -(-end // bs)
    if per_block and (pos % bs or T % bs):
        raise AssertionError("per-channel quantizers write whole, aligned blocks")
    # 1) classes of rows per block: same table prefix (and block), same new tokens
    work = []  # (j, a, c, existing block or -1, [rows], in_place)
    new = 0
    for j in range(j0, j1):
        a, c = max(pos, j * bs) - pos, min(end, (j + 1) * bs) - pos
        by_prefix: dict[tuple[int, ...], list[int]] = {}
        if len(tables) == 1:  # nothing to share with
            t = tables[0]
            by_prefix[(t[j] if j < len(t) else -1,)] = [0]
        for b in range(len(tables) if len(tables) > 1 else 0):
            t = tables[b]
            key = tuple(t[:j + 1]) if j < len(t) else (*t[:j], -1)
            by_prefix.setdefault(key, []).append(b)
        for key, rows in by_prefix.items():
            existing = key[-1]
            classes: list[list[int]] = []
            for b in rows:
                for cls in classes:
                    r = cls[0]
                    same = torch.equal(keys[b, :, a:c], keys[r, :, a:c])
                    if same and torch.equal(values[b, :, a:c], values[r, :, a:c]):
                        cls.append(b)
                        break
                else:
                    classes.append([b])
            for i, cls in enumerate(classes):
                in_place = existing >= 0 and i == 0 and blocks.refs[existing] == len(rows)
                new += not in_place
                work.append((j, a, c, existing, cls, in_place))
    blocks.ensure_free(new)  # may raise KVCacheFull: nothing changed yet
    # 2) allocate / copy, update the tables, and list the scatter
    src_b, src_t, dst_blk, dst_off, bsrc_b, bsrc_j, bdst = [], [], [], [], [], [], []
    changed, moved = False, 0
    for j, a, c, existing, cls, in_place in work:
        if in_place:
            bid = existing
        elif existing >= 0:
            bid = blocks.copy(existing, refs=len(cls))
            blocks.decref([existing] * len(cls))
            moved += blocks.bytes_per_block
        else:
            bid = blocks.allocate(refs=len(cls))
        for b in cls:
            t = tables[b]
            if j < len(t):
                changed |= t[j] != bid
                t[j] = bid
            else:
                t.append(bid)
                changed = True
        r = cls[0]
        n = c - a
        src_b += [r] * n
        src_t += range(a, c)
        dst_blk += [bid] * n
        dst_off += range(pos + a - j * bs, pos + c - j * bs)
        if n == bs:
            bsrc_b.append(r)
            bsrc_j.append(j - j0)
            bdst.append(bid)
    if len(src_b) == 1 and not bdst:  # one token of one row (decode): basic indexing, no index tensors
        return WritePlan.one(src_b[0], src_t[0], dst_blk[0], dst_off[0]), changed, moved
    tok = torch.tensor([src_b, src_t, dst_blk, dst_off], dtype=torch.long).to(device)
    if has_block_parts and bdst:
        blk = torch.tensor([bsrc_b, bsrc_j, bdst], dtype=torch.long).to(device)
    else:
        blk = torch.empty((3, 0), dtype=torch.long, device=device)
    return WritePlan(tok[0], tok[1], tok[2], tok[3], blk[0], blk[1], blk[2]), changed, moved


def write_targets(
    groups: list[HeadGroup], table: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, target: torch.Tensor,
    block_size: int, check_finite: bool,
) -> None:
    """Write the one-token ``keys/values[B, H, 1, D]`` of every (row ``b``, head ``h``) at its slot ``target[b, h]``
    through the block ``table`` ``[B, nb]``, one scatter per part with no host synchronisation: every slot is in the
    pool and no block is shared (one sequence, or beams before a reorder)."""
    B = target.shape[0]
    for g in groups:
        n = len(g.heads)
        t = group_rows(target, g).reshape(-1)
        rows = torch.arange(B, device=table.device).repeat_interleave(n)
        heads = torch.arange(n, device=table.device).repeat(B)
        blk, off = table[rows, t // block_size], t % block_size
        g.key.write_heads(group_rows(keys, g), rows, heads, blk, off, check_finite)
        g.value.write_heads(group_rows(values, g), rows, heads, blk, off, check_finite)


def write_pairs(
    tables: list[list[int]], blocks: LayerBlocks, groups: list[HeadGroup], keys: torch.Tensor, values: torch.Tensor,
    pool: list[tuple[int, int, int]], check_finite: bool, device: torch.device,
) -> int:
    """Write the one-token ``keys/values[B, H, 1, D]`` of (row ``b``, head ``h``) at pool slot ``t`` for every
    ``(b, h, t)`` of ``pool``, a block shared with another row or cache copied first (``tables`` changed in place;
    every copy is reserved before anything changes). Returns the bytes copied."""
    bs, moved = blocks.block_size, 0
    shared = sorted({(b, t // bs) for b, _, t in pool if blocks.refs[tables[b][t // bs]] > 1})
    blocks.ensure_free(len(shared))  # may raise KVCacheFull: nothing changed yet
    for b, j in shared:  # copy-on-write (beams share blocks after a reorder)
        old = tables[b][j]
        tables[b][j] = blocks.copy(old)
        blocks.decref([old])
        moved += blocks.bytes_per_block
    for g in groups:
        local = {h: i for i, h in enumerate(g.heads)}
        sel = [(b, local[h], tables[b][t // bs], t % bs) for b, h, t in pool if h in local]
        if not sel:
            continue
        rows, heads, blk, off = (torch.tensor(x, device=device) for x in zip(*sel, strict=True))
        g.key.write_heads(group_rows(keys, g), rows, heads, blk, off, check_finite)
        g.value.write_heads(group_rows(values, g), rows, heads, blk, off, check_finite)
    return moved


def block_ids(tables: list[list[int]], lanes_per_block: int | None = None) -> list[int]:
    """The distinct live device blocks of ``tables`` (a shared block once; lanes, ``lanes_per_block`` a block:
    the blocks holding them)."""
    if lanes_per_block is not None:
        return sorted({e // lanes_per_block for t in tables for e in t})
    return sorted({b for t in tables for b in t if b >= 0})


def release_blocks(tables: list[list[int]], blocks: LayerBlocks, first: int, dead: int) -> None:
    """Release blocks ``[first, dead)`` of every row of ``tables`` (a sliding window passed them: entries -1)."""
    for t in tables:
        blocks.decref(t[first:dead])
        t[first:dead] = [-1] * (dead - first)


def blocks_for(
    tables: list[list[int]], blocks: LayerBlocks, batch: int, start: int, end: int, in_place: bool
) -> int:
    """Free blocks a write of positions ``[start, end)`` of each of ``batch`` rows may need (an upper bound, no
    dedup): new blocks, or a copy of a shared partial block; one row's own partial block (``tables[0]``) is written
    in place (:func:`place`) when ``in_place``."""
    bs = blocks.block_size
    j0, j1 = start // bs, -(-end // bs)
    if batch == 1 and start % bs and in_place:
        t = tables[0]
        if j0 < len(t) and t[j0] >= 0 and blocks.refs[t[j0]] == 1:
            return j1 - j0 - 1  # the partial block is this row's own: written in place
    return batch * (j1 - j0)
