"""``SlotMap``: which original position each stored slot of an evicting layer holds, per (row, KV head).

A layer with an eviction policy stores only its kept tokens, compacted: the store's token axis is then an
axis of *slots* (``[0, S)``, the same for every head, read through the block tables exactly like tokens),
and slot ``s`` of (row ``b``, head ``h``) holds the token at original position ``pos[b, h, s]`` (``-1``: an
empty slot, e.g. a head that keeps fewer tokens under an AdaKV budget). Keys are stored after the rotary
embedding, so a kept key keeps its phase; positions matter only to the attention mask, which
:meth:`SlotMap.attention_mask` maps from the model's position axis (``seen`` positions, what the cache
reports as its length, so new tokens get the right rotary phase) onto the slot axis.

For decode-time policies (H2O, TOVA) ``score[b, h, s]`` holds each slot's attention score, which the
attention updates (:meth:`observe`) with the per-key probability mass of every step.
"""

from __future__ import annotations

import copy as _copy

import torch


def compact_kept(
    keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tokens ``keep[B, H, T]`` selects of ``keys/values[B, H, T, D]``, compacted onto slots ``[0, S)`` in their
    original order (``S``: the most any head keeps; a head that keeps fewer leaves its last slots zero-filled):
    ``(K, V [B, H, S, D], kept counts [B, H], kept positions [B, H, S], filled [B, H, S])``."""
    B, H, T, D = keys.shape
    n = keep.sum(dim=-1)  # [B, H]
    S = max(1, int(n.max()))
    t = torch.arange(T, device=keys.device)
    order = torch.where(keep, t, T + t).argsort(dim=-1)[..., :S]  # kept positions first, in order
    filled = torch.arange(S, device=keys.device) < n.unsqueeze(-1)  # [B, H, S]
    idx = order.unsqueeze(-1).expand(B, H, S, D)
    z = filled.unsqueeze(-1)
    ck = torch.where(z, keys.gather(2, idx), torch.zeros((), dtype=keys.dtype, device=keys.device))
    cv = torch.where(z, values.gather(2, idx), torch.zeros((), dtype=values.dtype, device=values.device))
    return ck, cv, n, order, filled


class SlotMap:
    """Slot -> position map (``pos[B, H, S]`` int32, -1 = empty) of one evicting layer, and its scores."""

    @classmethod
    def of_kept(
        cls, order: torch.Tensor, filled: torch.Tensor, seen: int, row_start: torch.Tensor | None,
        score: torch.Tensor | None, tracking: str | None, cap: torch.Tensor | None, device: torch.device,
    ) -> SlotMap:
        """The map of a first write that kept positions ``order[B, H, S]`` where ``filled`` (:func:`compact_kept`)
        of ``seen`` (``row_start[B]``: each row's first real position; ``score[B, H, T]``: the policy's scores, kept
        for ``tracking``; ``cap[B, H]``: the tokens each head keeps while decoding)."""
        B = order.shape[0]
        first = torch.zeros(B, dtype=torch.long, device=order.device) if row_start is None else row_start.long()
        pos = torch.where(filled, order, -1).to(torch.int32)
        kept = None if score is None else score.float().gather(2, order).masked_fill(~filled, 0.0)
        return cls(pos, seen, first.to(device), tracking, kept, cap)

    def __init__(
        self, pos: torch.Tensor, seen: int, first: torch.Tensor, tracking: str | None = None,
        score: torch.Tensor | None = None, cap: torch.Tensor | None = None,
    ) -> None:
        self.pos = pos
        self.seen = seen  # positions written so far (the cache's length)
        self.first = first  # [B] each row's first real position (left padding before it)
        self.tracking = tracking  # "accumulate" (H2O), "last" (TOVA) or None
        self.score = score  # [B, H, S] float32 when tracking
        self.cap = cap  # [B, H] tokens each head keeps while decoding (tracking policies)
        self._holes: bool | None = None  # computed when read (a host sync), see :attr:`holes`
        self._full: bool | None = None  # every head at its cap, see :attr:`full`

    @property
    def slots(self) -> int:
        """Slots on the store's token axis (``S``; some may be empty)."""
        return self.pos.shape[2]

    def counts(self) -> torch.Tensor:
        """Tokens held per (row, head): ``[B, H]``."""
        return (self.pos >= 0).sum(dim=-1)

    def append(self, tokens: int) -> None:
        """``tokens`` new slots for every (row, head), holding the next positions."""
        B, H, _ = self.pos.shape
        new = torch.arange(self.seen, self.seen + tokens, dtype=self.pos.dtype, device=self.pos.device)
        self.pos = torch.cat([self.pos, new.expand(B, H, tokens)], dim=2)
        if self.score is not None:
            self.score = torch.cat([self.score, self.score.new_zeros(B, H, tokens)], dim=2)
        self.seen += tokens

    def place(self, target: torch.Tensor, appended: bool) -> None:
        """Record one new token (position ``seen``) written at slot ``target[b, h]`` of each (row, head);
        ``appended``: slot ``S`` was added for it (heads that wrote elsewhere leave that slot empty)."""
        B, H, _ = self.pos.shape
        if appended:
            self.pos = torch.cat([self.pos, self.pos.new_full((B, H, 1), -1)], dim=2)
            if self.score is not None:
                self.score = torch.cat([self.score, self.score.new_zeros(B, H, 1)], dim=2)
        idx = target.unsqueeze(-1)
        self.pos.scatter_(2, idx, torch.full_like(idx, self.seen, dtype=self.pos.dtype))
        if self.score is not None:
            self.score.scatter_(2, idx, torch.zeros_like(idx, dtype=self.score.dtype))
        self.seen += 1
        self._holes = None  # recomputed when read: no host sync per decode step
        if appended:
            self._full = None

    @property
    def full(self) -> bool:
        """Every (row, head) holds its decode budget ``cap`` (tracking policies): each new token replaces one,
        none is appended, and that stays so (read once on the host, then cached until a slot is appended)."""
        if self.cap is None:
            return False
        if self._full is None:
            self._full = bool((self.counts() >= self.cap).all())
        return self._full

    @property
    def holes(self) -> bool:
        """Some slot is empty: heads see different key sets (read by the Triton dispatch only; cached)."""
        if self._holes is None:
            self._holes = bool((self.pos < 0).any())
        return self._holes

    def attention_mask(self, mask: torch.Tensor | None, past: int, tq: int, rep: int) -> torch.Tensor:
        """The attention mask on the slot axis: ``[B, H * rep, tq, past + tq]`` (True = attend), from the
        model's ``mask`` on the position axis (``[B | 1, 1 | Hq, tq, >= seen]``, ``None``: causal).

        History slot ``s`` of head ``h`` is visible to a query where the mask shows position ``pos[b, h, s]``,
        if it holds a token written before this chunk (empty slots and a slot that already holds this
        chunk's token, attended as fresh, are not); the chunk's own keys keep the mask's columns."""
        B, H, S = self.pos.shape
        start = self.seen - tq  # the chunk's first position
        pos = self.pos[:, :, :past].long()
        held = (pos >= 0) & (pos < start)  # [B, H, past]
        if mask is None:
            hist = held.unsqueeze(2).expand(B, H, tq, past)
            qpos = torch.arange(tq, device=pos.device).view(-1, 1)
            fresh = (torch.arange(tq, device=pos.device).view(1, -1) <= qpos).expand(B, H, tq, tq)
        else:
            m = mask[..., : self.seen].expand(B, -1, tq, -1)
            # per query head: one row per KV head (the query heads of a KV head share its keys)
            m = m.view(B, H, rep, tq, -1)[:, :, 0] if m.shape[1] != 1 else m.expand(B, H, tq, -1)
            idx = pos.clamp_min(0).unsqueeze(2).expand(B, H, tq, past)
            hist = m.gather(3, idx) & held.unsqueeze(2)
            fresh = m[..., start : self.seen]
        out = torch.cat([hist, fresh], dim=3)
        return out.repeat_interleave(rep, dim=1) if rep > 1 else out

    def observe(self, mass: torch.Tensor) -> None:
        """Fold one step's attention mass per history slot ``mass[B, H, past]`` into the scores."""
        if self.score is None:
            return
        n = mass.shape[2]
        if self.tracking == "last":
            self.score[:, :, :n] = mass
        else:
            self.score[:, :, :n] += mass

    def index_batch(self, idx: torch.Tensor) -> None:
        """Rows follow ``idx`` (beam search reorder / repeat)."""
        idx = idx.to(self.pos.device)
        self.pos = self.pos.index_select(0, idx)
        self.first = self.first.index_select(0, idx)
        self._holes = None
        for name in ("score", "cap"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, idx))

    def copy(self) -> SlotMap:
        """An independent copy (the cache's deep copy)."""
        new = _copy.copy(self)
        for name in ("pos", "first", "score", "cap"):
            t = getattr(self, name)
            setattr(new, name, None if t is None else t.clone())
        return new

    def nbytes(self) -> int:
        """Bytes of the slot positions and scores (the eviction's bookkeeping, counted as held)."""
        return sum(t.numel() * t.element_size() for t in (self.pos, self.score, self.cap) if t is not None)
