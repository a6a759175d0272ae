"""Dense segments of one layer's store: sink tokens, the residual window, and the tokens held for calibration.

* ``sink_tokens = N``: each row's first ``N`` real tokens are also kept in full precision (fp16; the model's dtype if
  that is 16-bit) and read from there; their quantized rows are masked so that they do not widen any scale
  (:meth:`~kvquant.rows.RowStarts.mask_sinks`).
* ``residual_tokens = R`` (and per-channel key precisions): new tokens first go to a full-precision residual buffer;
  once it holds ``R + block_size`` tokens, its oldest block is quantized, once (``residual_step``: that many tokens at
  a time instead of a block; 1 keeps exactly ``R``). The pool then holds ``[0, q_end)``, the residual
  ``[q_end, cache_pos)``.
* Calibration hold: static (per-head) scales of a row are fitted on its own first real tokens
  (:meth:`DenseRows.hold`); until every row is fitted, the layer holds every row's tokens in full precision, and a
  row fitted already reads them as its pool will (:meth:`DenseRows.held_rows`).

:class:`DenseRows` is the component of a :class:`~kvquant.store.LayerStore` that holds these buffers and the
calibration state; the store's cursor, head groups, row starts and refinement rows come as arguments.
"""

from __future__ import annotations

import copy as _copy
from collections.abc import Callable
from typing import Any

import torch

from .groups import HeadGroup, group_rows
from .heavy import put_rows
from .quantizers import Quantizer
from .refine import Refinement
from .rows import RowStarts
from .snapshot import ResidualRows, SinkRows
from .tensor_store import StoredOverflow, pool_rows, stored_finite

# Static (per-head) scales of a row are calibrated on at least this many of its own real tokens; until then
# its tokens are held in full precision (a 1-token prompt says little about later magnitudes) ...
CALIB_MIN_TOKENS = 16
# ... and while a (row, head) has only seen zeros, up to this many tokens: then its scale falls back to
# the row's largest calibrated max (1.0 if every value was zero), and clipping is counted and reported.
CALIB_MAX_TOKENS = 512


def row_amax(x: torch.Tensor, use: torch.Tensor) -> torch.Tensor:
    """``|x|`` max per (row, head) of ``x[B, H, T, D]`` over the tokens where ``use[B, T]`` is True."""
    return torch.where(use[:, None, :, None], x.detach().float().abs(), 0.0).amax(dim=(2, 3))


def safe_amax(amax: torch.Tensor) -> torch.Tensor:
    """Calibrated maxima ``[B, H]`` (or ``[H]``) with zeros (a head that only saw zeros) replaced by the largest
    one of the same row, or 1.0 when all of that row are zero: a scale of 0 would turn every later value into 0.
    Each row is filled from its own heads only (never from a batch-mate)."""
    top = amax.amax(dim=-1, keepdim=True)
    return torch.where(amax > 0, amax, torch.where(top > 0, top, torch.ones_like(top)))


def merge_rows(
    quantizer: Quantizer, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], rows: torch.Tensor
) -> dict[str, torch.Tensor]:
    """A static state whose per-sequence entries (:meth:`Quantizer.per_sequence`) are ``new``'s in ``rows[B]``
    and ``old``'s elsewhere; shared entries (one per head, not fitted on the data) are ``new``'s."""
    out = {}
    for n, t in new.items():
        if quantizer.per_sequence(n, t) and n in old:
            sel = rows.to(t.device).view(-1, *([1] * (t.dim() - 1)))
            out[n] = torch.where(sel, t, old[n].to(t.dtype))
        else:
            out[n] = t
    return out


class DenseRows:
    """The full-precision rows of one layer and its calibration state (see the module doc).

    Args:
        groups: the layer's head groups (whether some quantizer has static scales).
        static_amax: calibrated maxima from a scales file (``{"key": [H], "value": [H]}``), or None: fitted on the data.
        sink_tokens, residual_tokens, residual_step: the layer's sinks and residual window.
        residual_mode: new tokens go through the residual window (a window, or per-channel blocks).
        row_flush: flush points may be counted per row (:meth:`per_row_flush`).
        headroom, share_kv_scale: static-scale options of the config.
        batch: the layer's rows.
    """

    def __init__(
        self, groups: list[HeadGroup], static_amax: dict[str, torch.Tensor] | None, sink_tokens: int,
        residual_tokens: int, residual_step: int, residual_mode: bool, row_flush: bool, headroom: float,
        share_kv_scale: bool, batch: int, device: torch.device,
    ) -> None:
        self.static = any(q.static for g in groups for q in (g.key.quantizer, g.value.quantizer))
        self.static_amax = static_amax
        self.sink_tokens = sink_tokens
        self.residual_tokens = residual_tokens
        # tokens quantized at a time past the window (block_size: KIVI's whole blocks; 1: the window holds exactly R)
        self.residual_step = residual_step
        self.residual_mode = residual_mode
        self.row_flush = row_flush
        self.headroom = headroom
        self.share_kv_scale = share_kv_scale
        self.device = device
        self.dtype: torch.dtype | None = None  # of the sink / residual buffers, set by the first write
        self.reset(batch)

    def reset(self, batch: int) -> None:
        """No token held, no static scale fitted."""
        self.sink_k: torch.Tensor | None = None
        self.sink_v: torch.Tensor | None = None
        self.res_k: torch.Tensor | None = None
        self.res_v: torch.Tensor | None = None
        # while static scales wait for some rows: what the rows fitted already will be quantized from (held_rows)
        self.exact_k: torch.Tensor | None = None
        self.exact_v: torch.Tensor | None = None
        self.calibrated = False  # every row's static scales are fitted (tokens then go to the pool)
        # per row: its static scales are fitted (on its own first real tokens) while a batch-mate still waits
        self.calibrated_rows = [False] * batch
        self.memo: dict[Any, Any] = {}  # held_rows: K, V base decode (and heavy rows) per group
        # heavy_tokens: (first position, key scores [B, H, T], pool end the scored chunk's write would have reached)
        # of a prompt held for calibration: its write picks the heavy rows when the held tokens reach the pool
        self.held_scores: tuple[int, torch.Tensor, int] | None = None

    def copy(self) -> DenseRows:
        """A copy with its own buffers and calibration state."""
        new = _copy.copy(self)
        for name in _BUFFERS:
            t = getattr(self, name)
            setattr(new, name, None if t is None else t.clone())
        new.calibrated_rows = list(self.calibrated_rows)
        new.memo = {}
        return new

    def index_batch(self, idx: torch.Tensor, rows: list[int]) -> None:
        """Rows reordered / selected / repeated (``idx`` on the device, ``rows`` on the host)."""
        for name in _BUFFERS:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, idx))
        if self.held_scores is not None:
            s0, sc, limit = self.held_scores
            self.held_scores = (s0, sc.index_select(0, idx.to(sc.device)), limit)
        self.calibrated_rows = [self.calibrated_rows[i] for i in rows]
        self.memo = {}

    def crop(self, keep: int, tokens: int) -> None:
        """The held rows keep their first ``keep``; scores of a held prompt cut below ``tokens`` pick nothing."""
        if self.res_k is not None and self.res_v is not None:
            self.res_k, self.res_v = self.res_k[:, :, :keep], self.res_v[:, :, :keep]
            if self.exact_k is not None and self.exact_v is not None:
                self.exact_k, self.exact_v = self.exact_k[:, :, :keep], self.exact_v[:, :, :keep]
            self.memo = {}
        if self.held_scores is not None and tokens < self.held_scores[2]:  # the scored rows are cut: no picks
            self.held_scores = None

    def buffers(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The buffers held, K and V: ``sinks``, ``residual`` and ``held`` (rows fitted while a batch-mate waits)."""
        out = {}
        if self.sink_k is not None and self.sink_v is not None:
            out["sinks"] = (self.sink_k, self.sink_v)
        if self.res_k is not None and self.res_v is not None:
            out["residual"] = (self.res_k, self.res_v)
        if self.exact_k is not None and self.exact_v is not None:
            out["held"] = (self.exact_k, self.exact_v)
        return out

    def residual_rows(
        self, groups: list[HeadGroup], q_end: int, end: int,
        read: Callable[[HeadGroup, int, int], tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The held positions ``[q_end, end)`` of every KV head ``[B, H, t, D]``: as held, or (``read``) each group's
        rows as ``read(group, q_end, end)`` gives them (float32)."""
        assert self.res_k is not None and self.res_v is not None
        k, v = self.res_k[:, :, :end - q_end], self.res_v[:, :, :end - q_end]
        if read is None:
            return k, v
        k, v = k.float().clone(), v.float().clone()
        for g in groups:
            k[:, g.head_index], v[:, g.head_index] = read(g, q_end, end)
        return k, v

    def snapshot(
        self, residual_rows: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[SinkRows | None, ResidualRows | None]:
        """The attention's view of the sink buffer and of the held rows (read through ``residual_rows(end)``)."""
        sinks = None if self.sink_k is None or self.sink_v is None else SinkRows(self.sink_k, self.sink_v,
                                                                                 self.sink_tokens)  # fmt: skip
        return sinks, None if self.res_k is None else ResidualRows(self.res_k.shape[2], residual_rows)

    def append_residual(
        self, keys: torch.Tensor, values: torch.Tensor, q_end: int, starts: RowStarts
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The residual window with ``keys/values`` appended (the dense dtype) and how many of its oldest tokens
        reach the pool now (``residual_step`` at a time past ``residual_tokens``, or the earliest row's own flush
        point, :meth:`per_row_flush`; <= 0: none)."""
        dk, dv = keys.to(self.dtype), values.to(self.dtype)
        if self.res_k is not None and self.res_v is not None and self.res_k.shape[2]:
            dk = torch.cat([self.res_k, dk], dim=2)  # bounded: the residual holds < R + block tokens
            dv = torch.cat([self.res_v, dv], dim=2)
        flush = self.flush_len(dk.shape[2], q_end, starts)
        if self.per_row_flush(starts.pad_end) and flush > 0:
            self.memo = {}  # (held_rows: the residual shifts)
        return dk, dv, flush

    def flush_len(self, pending: int, q_end: int, starts: RowStarts) -> int:
        """Tokens of a residual window holding ``pending`` tokens past the pool's end ``q_end`` that reach the pool
        (``residual_step`` at a time past ``residual_tokens``, or the earliest row's own flush point,
        :meth:`per_row_flush`; <= 0: none)."""
        if self.per_row_flush(starts.pad_end):
            return min(self.row_pool_ends(q_end + pending, starts)) - q_end
        return (pending - self.residual_tokens) // self.residual_step * self.residual_step

    def sink_rows(
        self, start: int, end: int, row_start: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Positions ``[start, end)`` of every row read from the sink buffer, selected on the device (no host
        synchronisation): ``[B, 1, t, 1]`` True at a row's sink token (its first real ones, from ``row_start[B]``),
        and K, V ``[B, H, t, D]`` from the buffer (any row elsewhere)."""
        assert self.sink_k is not None and self.sink_v is not None
        slot = torch.arange(start, end, device=self.device)[None, :] - row_start[:, None]  # [B, t]
        is_sink = ((slot >= 0) & (slot < self.sink_tokens))[:, None, :, None]
        idx = slot.clamp(0, self.sink_tokens - 1)
        rows = torch.arange(row_start.shape[0], device=self.device)[:, None]
        return is_sink, self.sink_k[rows, :, idx].transpose(1, 2), self.sink_v[rows, :, idx].transpose(1, 2)

    def write_held(
        self, keys: torch.Tensor, values: torch.Tensor, b: torch.Tensor, h: torch.Tensor, t: torch.Tensor, q_end: int
    ) -> None:
        """Write the one-token ``keys/values[B, H, 1, D]`` of (row ``b[i]``, head ``h[i]``) over its held slot
        ``t[i] >= q_end`` (the pool's end; decode-time eviction): into the held buffer and, while some rows are fitted
        already, the exact values their pool will be quantized from (:meth:`held_rows` then decodes them again)."""
        self.res_k[b, h, t - q_end] = keys[b, h, 0].to(self.res_k.dtype)
        self.res_v[b, h, t - q_end] = values[b, h, 0].to(self.res_v.dtype)
        if self.exact_k is not None and self.exact_v is not None:
            self.exact_k[b, h, t - q_end] = keys[b, h, 0].to(self.exact_k.dtype)
            self.exact_v[b, h, t - q_end] = values[b, h, 0].to(self.exact_v.dtype)
        self.memo = {}


    def hold(
        self, groups: list[HeadGroup], keys: torch.Tensor, values: torch.Tensor, past: int, q_end: int,
        starts: RowStarts,
    ) -> bool:
        """Fit the static scales of every row that is ready, each on its own real tokens so far (held ones and
        this chunk's), and return True (this chunk held in full precision too) while some row is not.

        A row is ready once it has ``CALIB_MIN_TOKENS`` real tokens and a nonzero value in every head, or
        ``CALIB_MAX_TOKENS`` real tokens. So a row's scales never depend on its batch-mates: a long row is
        fitted on its prompt at once, as alone, while a short batch-mate waits for its own tokens. Until the
        last row is fitted the layer holds every row's tokens in full precision (``res_k``, the dense dtype,
        as alone) and, while some rows are fitted already, also the values those rows' pool will be quantized
        from (``exact_k``: the model's dtype from each row's calibration chunk on, as alone); those rows are
        read as their pool would read them (:meth:`held_rows`)."""
        if not self.static or self.static_amax is not None:  # nothing fitted on the data: one calibration, no wait
            self.calibrate(groups, keys, values, past, starts)
            return False
        end = past + keys.shape[2]
        held = self.res_k.shape[2] if self.res_k is not None else 0
        start, ks, vs = past, keys, values
        if held:  # the held tokens [q_end, past) (as held: rounded to the dense dtype) and this chunk
            start = q_end
            ks = torch.cat([self.res_k.to(keys.dtype), keys], dim=2)
            vs = torch.cat([self.res_v.to(values.dtype), values], dim=2)
        use = starts.real_tokens(start, end)
        seen = starts.real_count(end)  # real tokens per row, this chunk included
        nonzero = ((row_amax(ks, use) > 0) & (row_amax(vs, use) > 0)).all(dim=1)
        ready = ((seen >= CALIB_MIN_TOKENS) & nonzero) | (seen >= CALIB_MAX_TOKENS)
        new = ready.cpu() & ~torch.tensor(self.calibrated_rows, dtype=torch.bool)
        if bool(new.any()):
            self.calibrate(groups, ks, vs, start, starts, rows=new)
            self.memo = {}  # (held_rows: those rows now read quantized)
            if self.exact_k is not None and self.exact_v is not None and held:
                # these rows' tokens before this chunk were held rounded, as alone: their pool is quantized from that
                r = new.to(self.device).view(-1, 1, 1, 1)
                self.exact_k = torch.where(r, self.res_k.to(self.exact_k.dtype), self.exact_k)
                self.exact_v = torch.where(r, self.res_v.to(self.exact_v.dtype), self.exact_v)
        if all(self.calibrated_rows):
            return False
        if any(self.calibrated_rows) and not self.residual_mode:  # (residual: quantized from res)
            if self.exact_k is None:
                self.exact_k, self.exact_v = (ks, vs) if ks is not keys else (keys.clone(), values.clone())
            else:
                self.exact_k = torch.cat([self.exact_k, keys], dim=2)
                self.exact_v = torch.cat([self.exact_v, values], dim=2)
        dk, dv = keys.to(self.dtype), values.to(self.dtype)
        if held:
            dk, dv = torch.cat([self.res_k, dk], dim=2), torch.cat([self.res_v, dv], dim=2)
        self.res_k, self.res_v = dk, dv
        return True


    def per_row_flush(self, pad_end: int) -> bool:
        """True when the residual window's flush points are counted per row, from its own first real token (as
        alone): a left-padded batch (``pad_end > 0``) in residual mode with per-token quantization (per-channel
        blocks, lanes, the age ladder, heavy rows, a sliding window and offload keep the batch's grid: ``row_flush``
        is False, see docs/batch-independence.md). The pool then ends at the earliest row's own flush point; a row
        past it reads the tokens its own pool would hold as that pool will (:meth:`held_rows`)."""
        return self.residual_mode and pad_end > 0 and self.row_flush

    def row_pool_ends(self, cache_pos: int, starts: RowStarts) -> list[int]:
        """Per row, where its pool ends with ``cache_pos`` tokens written when its flush points are its own
        (:meth:`per_row_flush`): ``R`` tokens (``residual_tokens``) after its first real token stay held, the
        rest is quantized ``residual_step`` tokens at a time."""
        R, step = self.residual_tokens, self.residual_step
        return [r + max(0, (cache_pos - r - R) // step) * step if cache_pos > r else r for r in starts.host]

    def virtual_q_end(self, cache_pos: int, q_end: int) -> int:
        """Where the pool (ending at ``q_end``) would end if every row's static scales were fitted: the tokens below
        it are read quantized by a row already fitted while a batch-mate still waits (:meth:`held_rows`)."""
        if not self.residual_mode:
            return cache_pos
        flush = (cache_pos - q_end - self.residual_tokens) // self.residual_step * self.residual_step
        return q_end + max(0, flush)

    def virtual_row_ends(self, cache_pos: int, q_end: int, starts: RowStarts) -> list[int]:
        """Per row, where its pool would end if every row's static scales were fitted and its flush points were its
        own: the tokens below it are read quantized by a fitted row (:meth:`held_rows`)."""
        if self.per_row_flush(starts.pad_end):
            return [max(e, q_end) for e in self.row_pool_ends(cache_pos, starts)]
        return [self.virtual_q_end(cache_pos, q_end)] * starts.batch

    def holds_fitted_rows(self, tails: bool) -> bool:
        """True while some rows' static scales are fitted and a batch-mate's are not (see :meth:`held_rows`; lanes
        with full-precision ``tails`` read their held tokens from the tails, as held)."""
        return not self.calibrated and any(self.calibrated_rows) and not tails

    def reads_held(self, cache_pos: int, q_end: int, starts: RowStarts, tails: bool) -> bool:
        """True when some row reads held tokens as its pool will (:meth:`held_rows`): its static scales are fitted
        while a batch-mate's are not, or its own flush points are past the pool's end (:meth:`per_row_flush`)."""
        if self.holds_fitted_rows(tails):
            return True
        return (self.calibrated and self.per_row_flush(starts.pad_end)
                and max(self.row_pool_ends(cache_pos, starts)) > q_end)  # fmt: skip

    def held_rows(
        self, group: HeadGroup, start: int, end: int, q_end: int, cache_pos: int, starts: RowStarts,
        refine: Refinement,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``group`` for held tokens ``[start, end)`` (``start >= q_end``, static scales of some row
        not fitted yet) as float32 storage-space rows ``[B, Hg, t, D]``: a row not fitted yet as held; a row
        fitted already as it would be read with every row fitted, i.e. as alone: tokens below
        :meth:`virtual_q_end` quantized with its own scales (the age ladder's newest rows refined), the rest
        and its sink tokens as held. Each held token is quantized once (the base decode is kept per group
        until a row's scales change)."""
        assert self.res_k is not None and self.res_v is not None
        q0, n = q_end, self.res_k.shape[2]
        ends = self.virtual_row_ends(cache_pos, q_end, starts)
        pooled = max(ends) - q0  # held tokens the pool would hold (of the row whose pool would hold most)
        dense = group_rows(self.res_k, group).float(), group_rows(self.res_v, group).float()
        out = [dense[0].clone(), dense[1].clone()]
        xk, xv = (self.exact_k, self.exact_v) if self.exact_k is not None else (self.res_k, self.res_v)
        if pooled > 0:
            gi = group.key.group
            base = self.memo.get(gi)
            done = 0 if base is None else base[0].shape[2]
            if done < pooled:  # quantize the tokens that reached the virtual pool since the last read
                mk, mv = starts.mask_sinks(xk[:, :, done:pooled], xv[:, :, done:pooled], q0 + done,
                                                group.per_block)
                new = [pool_rows(s, group_rows(x, group)) for s, x in ((group.key, mk), (group.value, mv))]
                base = tuple(y if base is None else torch.cat([base[i], y], dim=2) for i, y in enumerate(new))
                self.memo[gi] = base
            per_row = min(ends) != max(ends)
            if per_row:  # each row's own flush points: [B, 1, pooled, 1] True below its own pool end
                own = (torch.arange(pooled, device=self.device)[None, :]
                       < torch.tensor(ends, device=self.device)[:, None] - q0)[:, None, :, None]
            for i, (s, x) in enumerate(((group.key, xk), (group.value, xv))):
                if per_row:
                    out[i][:, :, :pooled] = torch.where(own, base[i][:, :, :pooled], out[i][:, :, :pooled])
                else:
                    out[i][:, :, :pooled] = base[i][:, :, :pooled]
                n1 = min(refine.ladder_tokens, pooled) if s.quantizer.rung_parts(1) else 0
                if n1:  # the age ladder's newest rows, refined
                    x1 = x[:, :, pooled - n1:pooled]
                    x1 = starts.mask_sinks(x1, x1, q0 + pooled - n1, False)[0]
                    out[i][:, :, pooled - n1:pooled] = refine.ladder_rows(s, group_rows(x1, group))
            if self.held_scores is not None:  # heavy rows the held tokens will pick (as alone), refined
                key = ("heavy", group.key.group)  # (kept per group until a row's scales change)
                if key not in self.memo:
                    self.memo[key] = refine.held_heavy(group, xk, xv, pooled, q0, self.held_scores,
                                                              starts.row_start + self.sink_tokens)  # fmt: skip
                at, rows = self.memo[key]
                for i in range(2):
                    if rows[i] is not None:
                        out[i] = put_rows(out[i], rows[i], at, q0, q0 + n)
        sel = starts.sink_slots(q0, q0 + n)
        if sel is not None:  # sinks: read from the sink buffer (the dense dtype)
            r, o, _ = sel
            for i in range(2):
                out[i][r, :, o] = dense[i][r, :, o]
        if self.calibrated:  # (per-row flush points: every row fitted)
            a, b = start - q0, end - q0
            return out[0][:, :, a:b], out[1][:, :, a:b]
        fitted = torch.tensor(self.calibrated_rows, device=self.device).view(-1, 1, 1, 1)
        a, b = start - q0, end - q0
        return (torch.where(fitted, out[0], dense[0])[:, :, a:b], torch.where(fitted, out[1], dense[1])[:, :, a:b])


    def fit(self, keys: torch.Tensor, values: torch.Tensor, largest: float | None = None) -> None:
        """fp16 sink / residual buffers (fp32 models) become fp32 when a value would overflow fp16.
        ``largest``: max |K|, |V| when already known (:func:`require_finite` on CPU)."""
        if self.dtype != torch.float16:
            return
        if largest is None:
            largest = float(torch.maximum(keys.abs().amax(), values.abs().amax()))
        if largest <= torch.finfo(torch.float16).max:
            return
        self.dtype = torch.float32
        for name in ("sink_k", "sink_v", "res_k", "res_v"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.float())


    def keep_sinks(self, keys: torch.Tensor, values: torch.Tensor, past: int, starts: RowStarts) -> None:
        """Copy the sink tokens among the chunk ``keys/values`` at ``past`` into the sink buffer (made on first use)."""
        if self.sink_k is None:
            shape = (keys.shape[0], keys.shape[1], self.sink_tokens, keys.shape[3])
            self.sink_k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.sink_v = torch.zeros_like(self.sink_k)
        sel = starts.sink_slots(past, past + keys.shape[2])
        if sel is not None:
            rows, offs, slots = sel
            self.sink_k[rows, :, slots] = keys[rows, :, offs].to(self.dtype)
            self.sink_v[rows, :, slots] = values[rows, :, offs].to(self.dtype)


    def calibrate(
        self, groups: list[HeadGroup], keys: torch.Tensor, values: torch.Tensor, past: int, starts: RowStarts,
        rows: torch.Tensor | None = None,
    ) -> None:
        """Set the static scales per (sequence, KV head), from a scales file or from the chunk ``keys/values``
        at ``past`` (``rows[B]``: only those rows', the others keep theirs; None: every row).

        Each row's scale comes from its own real tokens: never from batch-mates or left padding. Sink
        tokens (read in full precision) are left out of the max when the chunk has other tokens.
        """
        use = starts.real_tokens(past, past + keys.shape[2])  # data-fitted state (codebook): real, non-sink tokens
        if self.static_amax is not None:
            k_amax = self.static_amax["key"].to(self.device).expand(keys.shape[0], -1)
            v_amax = self.static_amax["value"].to(self.device).expand(keys.shape[0], -1)
        else:
            use = starts.fit_tokens(past, keys.shape[2])
            k_amax = safe_amax(row_amax(keys, use))
            v_amax = safe_amax(row_amax(values, use))
        fitted_states = []  # every group's K and V state, checked before any store changes
        for g in groups:
            ka, va = k_amax[:, g.head_index], v_amax[:, g.head_index]
            both_int8 = g.key.quantizer.name == g.value.quantizer.name == "int8"
            if both_int8 and self.share_kv_scale:
                ka = va = torch.maximum(ka, va)
            for s, x, amax in ((g.key, keys, ka), (g.value, values, va)):
                fitted = s.quantizer.fit(group_rows(x, g), use) if s.quantizer.space else None
                state = fitted if fitted is not None else s.quantizer.calibrate(amax)
                mine = state if rows is None else {n: t[rows.to(t.device)] if s.quantizer.per_sequence(n, t) else t
                                                   for n, t in state.items()}  # (the rows fitted now)
                if not stored_finite(mine):
                    raise StoredOverflow(
                        f"headroom: {self.headroom!r} times the calibrated max overflows the static "
                        f"{s.quantizer.name} scale (float32)"
                    )
                fitted_states.append((s, state))
        for s, state in fitted_states:
            s.state = state if rows is None or not s.state else merge_rows(s.quantizer, s.state, state, rows)
        if rows is not None:
            self.calibrated_rows = [a or b for a, b in zip(self.calibrated_rows, rows.tolist(), strict=True)]
        else:
            self.calibrated_rows = [True] * keys.shape[0]
        self.calibrated = all(self.calibrated_rows)


_BUFFERS = ("sink_k", "sink_v", "res_k", "res_v", "exact_k", "exact_v")
