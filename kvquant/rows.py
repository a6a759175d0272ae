"""Which positions of each batch row of one layer's store are real tokens, and which of them are its sink tokens.

A left-padded batch row ``b`` starts at ``row_start[b]``: positions before it are padding, never a real token
(never fitted on, never a sink, never a heavy row). An evicting layer's first write holds slots, not positions:
``slot_real[b, s]`` says which of them hold a kept token. A row's sink tokens (``sink_tokens``) are its first real
ones; they are also kept in full precision and read from there, so their quantized rows are masked
(:meth:`RowStarts.mask_sinks`) so that they widen no scale.

:class:`RowStarts` is the component of a :class:`~kvquant.store.LayerStore` that holds these (set by the first
write, following the rows through reorders); every other part asks it.
"""

from __future__ import annotations

import copy as _copy

import torch


class RowStarts:
    """Each row's first real token, its sink tokens and (an evicting layer) its real slots (see the module doc)."""

    def __init__(self, batch: int, sink_tokens: int, device: torch.device) -> None:
        self.sink_tokens = sink_tokens
        self.device = device
        self.reset(batch)

    def reset(self, batch: int) -> None:
        """No token written yet: no padding, no sink."""
        self.batch = batch
        # per row, the position of its first real token (left padding before it), set by the first append
        self.row_start = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.host = [0] * batch  # (row_start on the host: flush points per row)
        self.pad_end = 0  # left padding lies below this position in every row
        self.sink_end = 0  # sink tokens lie below this position in every row
        # an evicting layer's first write: [B, S] True where a row's slot holds a kept token (of some head); its
        # empty slots are no real tokens (slots past S, appended later, are)
        self.slot_real: torch.Tensor | None = None

    def set(self, row_start: torch.Tensor | None) -> None:
        """The first write: ``row_start[B]`` is each row's first real position (None: no padding)."""
        if row_start is None:
            self.row_start = torch.zeros(self.batch, dtype=torch.long, device=self.device)
        else:
            if row_start.shape != (self.batch,):
                raise ValueError(f"row_start: shape {tuple(row_start.shape)}, expected ({self.batch},)")
            self.row_start = row_start.to(self.device, torch.long)
        self.host = self.row_start.tolist()  # one read, at the first write
        self.pad_end = max(self.host)
        self.sink_end = self.pad_end + self.sink_tokens if self.sink_tokens else 0

    def copy(self) -> RowStarts:
        """A copy (tensors shared: they are replaced, never written in place)."""
        new = _copy.copy(self)
        new.host = list(self.host)
        return new

    def index_batch(self, idx: torch.Tensor, rows: list[int]) -> None:
        """Rows reordered / selected / repeated (``idx`` on the device, ``rows`` the same on the host)."""
        self.row_start = self.row_start.index_select(0, idx)
        self.host = [self.host[i] for i in rows]
        if self.slot_real is not None:
            self.slot_real = self.slot_real.index_select(0, idx)
        self.batch = len(rows)

    def real_tokens(self, start: int, end: int, starts: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, end - start]``: True where position ``start + t`` of a row is a real token (not left padding; in an
        evicting layer, not an empty slot of its first write, :attr:`slot_real`). ``starts[B]``: each row's first
        real one on another axis (the slots of per-row block grids, :meth:`~kvquant.grid.RowGrid.slot_starts`)
        instead of ``row_start``."""
        pos = torch.arange(start, end, device=self.device)
        real = pos[None, :] >= (self.row_start if starts is None else starts)[:, None]
        if self.slot_real is not None and start < self.slot_real.shape[1]:
            first = self.slot_real[:, start:end]
            real = torch.cat([first, real[:, first.shape[1]:]], dim=1)
        return real

    def real_count(self, end: int) -> torch.Tensor:
        """``[B]``: the real tokens (see :meth:`real_tokens`) of each row below position ``end``."""
        if self.slot_real is None:
            return (end - self.row_start).clamp_min(0)
        S = self.slot_real.shape[1]
        return self.slot_real[:, :min(end, S)].sum(dim=1) + max(0, end - S)

    def sink_slots(
        self, start: int, end: int, starts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The sink tokens among positions ``[start, end)``: index tensors (row, offset from ``start``,
        slot of the row's sink buffer), or None. A row's sinks are its first ``sink_tokens`` real tokens.
        ``starts``: see :meth:`real_tokens`."""
        if starts is None and start >= self.sink_end or not self.sink_tokens:
            return None
        first = self.row_start if starts is None else starts
        slot = torch.arange(start, end, device=self.device)[None, :] - first[:, None]
        rows, offs = ((slot >= 0) & (slot < self.sink_tokens)).nonzero(as_tuple=True)
        return rows, offs, slot[rows, offs]

    def fit_tokens(self, past: int, T: int) -> torch.Tensor:
        """``[B, T]`` bool: the tokens of positions ``past .. past + T`` a row's fitted state is taken from: its
        own real tokens (never its left padding), its sink tokens left out when the chunk holds others."""
        use = self.real_tokens(past, past + T)
        sel = self.sink_slots(past, past + T)
        if sel is not None:
            not_sink = torch.ones_like(use)
            not_sink[sel[0], sel[1]] = False
            use = torch.where((use & not_sink).any(dim=1, keepdim=True), use & not_sink, use)
        return use

    def mask_sinks(
        self, keys: torch.Tensor, values: torch.Tensor, pos: int, copy: bool, starts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk at ``pos`` with its sink rows (read from the sink buffer, never from the pool) masked:
        zeroed, or with ``copy`` replaced by the row's first real non-sink token of the chunk (zeros when
        the chunk has none). ``starts``: see :meth:`real_tokens`.

        Per-channel (``int*-channel``) blocks take ``copy``: a copy of a token quantized anyway widens
        no channel's min / max, while a zero row widens every per-channel range of a key with a large
        offset (q/k/v bias) in the sinks' block. Other quantizers take zeros: a zero row widens no
        per-token or static scale, and counts as no clipped value."""
        sel = self.sink_slots(pos, pos + keys.shape[2], starts)
        if sel is None:
            return keys, values
        rows, offs, _ = sel
        keys, values = keys.clone(), values.clone()
        if copy:
            keep = self.real_tokens(pos, pos + keys.shape[2], starts)
            keep[rows, offs] = False
            src = keep.to(torch.uint8).argmax(dim=1)[rows]  # first kept token of each sink's row
            has = keep.any(dim=1)[rows][:, None, None]
            keys[rows, :, offs] = torch.where(has, keys[rows, :, src], 0)
            values[rows, :, offs] = torch.where(has, values[rows, :, src], 0)
        else:
            keys[rows, :, offs] = 0
            values[rows, :, offs] = 0
        return keys, values
