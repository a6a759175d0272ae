"""Block-granular quantized KV storage for one layer.

Layout: the KV heads of a layer are split into *head groups*, one per distinct (key precision,
value precision) pair. Each group stores its K and V as the parts of its quantizers, one
preallocated tensor per part::

    per-token part:  [batch, heads_in_group, capacity_tokens, *part_shape]
    per-block part:  [batch, heads_in_group, capacity_tokens / block_size, *part_shape]

``capacity_tokens`` is a whole number of blocks (``block_size`` tokens). Blocks are added on
demand when the cursor reaches the end, so memory follows the real length, never a max_seq_len;
pass ``capacity`` to preallocate (then nothing is ever copied). When the capacity must grow, the
pool grows by at least a quarter (amortised O(1) per token, O(log n) copies of the *quantized*
bytes). A token is written once, quantized once, never re-quantized.

Outlier options (all in the config, composable with per-head precision):

* ``rotate``: K (and V) are stored Hadamard-rotated (:mod:`kvquant.rotation`); the attention
  rotates the queries alike and un-rotates the output, so scores are unchanged.
* ``center_keys`` (default with ``rotate``): one per-channel key mean per (sequence, KV head),
  ``key_mean``, taken from the first chunk written (the prefill, sink tokens left out), is
  subtracted from every key before rotation and quantization. Every key a query sees is shifted
  by the same ``mu``, so each score moves by the same ``q.mu`` and softmax is unchanged; a large
  per-channel offset (q/k/v bias) is then neither spread over every channel by the rotation nor
  spent in the quantization range.
* ``sink_tokens = N``: the first N tokens are also kept in full precision (fp16; the model's
  dtype if that is 16-bit) and read from there; their quantized rows are zeroed so that they do
  not widen any scale.
* ``residual_tokens = R`` (and per-channel key precisions): new tokens first go to a full-precision
  residual buffer; once it holds ``R + block_size`` tokens, its oldest block is quantized, once.
  The pool then holds ``[0, q_end)``, the residual ``[q_end, cache_pos)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .config import KVPrecision, KVQuantConfig
from .quantizers import Quantizer, make_quantizer
from .rotation import fwht

GROWTH = 1.25
# Static (per-head) scales are calibrated on at least this many real tokens of every row; until then the
# tokens are held in full precision (a 1-token prompt says little about later magnitudes) ...
CALIB_MIN_TOKENS = 16
# ... and while a (row, head) has only seen zeros, up to this many tokens: then its scale falls back to
# the layer's largest calibrated max (1.0 if every value was zero), and clipping is counted and reported.
CALIB_MAX_TOKENS = 512


def row_amax(x: torch.Tensor, use: torch.Tensor) -> torch.Tensor:
    """``|x|`` max per (row, head) of ``x[B, H, T, D]`` over the tokens where ``use[B, T]`` is True."""
    return torch.where(use[:, None, :, None], x.detach().float().abs(), 0.0).amax(dim=(2, 3))


def safe_amax(amax: torch.Tensor) -> torch.Tensor:
    """Calibrated maxima with zeros (a row / head that only saw zeros) replaced by the largest one, or
    1.0 when all are zero: a scale of 0 would turn every later value into 0."""
    top = amax.max()
    return torch.where(amax > 0, amax, torch.where(top > 0, top, torch.ones_like(top)))


class StoredOverflow(ValueError):
    """K/V values that the configured storage cannot hold (e.g. |x| > 65504 in fp16 passthrough)."""


def stored_finite(parts: dict[str, torch.Tensor]) -> bool:
    """True when every 16/32-bit float part is finite (fp8 parts saturate and integer codes cannot overflow)."""
    wide = (torch.float16, torch.bfloat16, torch.float32)
    checks = [torch.isfinite(t).all() for t in parts.values() if t.dtype in wide]
    return bool(torch.stack(checks).all()) if checks else True


class QuantizedTensorStore:
    """The K (or V) of one head group: quantizer, static state and preallocated part tensors."""

    def __init__(
        self, quantizer: Quantizer, batch: int, heads: int, device: torch.device, block_size: int
    ) -> None:
        self.quantizer = quantizer
        self.block_size = block_size
        self.batch, self.heads, self.device = batch, heads, device
        self.state: dict[str, torch.Tensor] = {}
        self.specs = quantizer.parts()
        self.parts: dict[str, torch.Tensor] = {
            name: torch.empty((batch, heads, 0, *spec.shape), dtype=spec.dtype, device=device)
            for name, spec in self.specs.items()
        }
        self.clipped = torch.zeros((), dtype=torch.int64, device=device)
        # real (non-pad) values written through a static scale: the denominator of the clip rate
        self.static_values = torch.zeros((), dtype=torch.int64, device=device)

    def _rows(self, name: str, tokens: int) -> int:
        """Rows of part ``name`` that cover ``tokens`` tokens."""
        return -(-tokens // self.block_size) if self.specs[name].per_block else tokens

    @property
    def capacity(self) -> int:
        return next(t.shape[2] for n, t in self.parts.items() if not self.specs[n].per_block)

    def grow(self, capacity: int, used: int) -> None:
        """Reallocate every part to ``capacity`` tokens (whole blocks), keeping the first ``used``."""
        for name, old in self.parts.items():
            rows, keep = self._rows(name, capacity), self._rows(name, used)
            new = torch.empty((*old.shape[:2], rows, *old.shape[3:]), dtype=old.dtype, device=old.device)
            if keep:
                new[:, :, :keep].copy_(old[:, :, :keep])
            self.parts[name] = new

    def write(self, x: torch.Tensor, pos: int, check: bool = True, real: torch.Tensor | None = None) -> None:
        """Quantize ``x[B, H, T, D]`` and write it at token positions ``pos .. pos+T``.

        ``check``: verify that what is *stored* is finite (one reduction). fp16 scales / zeros that
        overflow (|x| > 65504) are widened to fp32 for this store (exact, bytes counted) and the chunk
        quantized again; anything else non-finite (fp16 passthrough storage) raises :class:`StoredOverflow`.
        ``real[B, T]``: False at left-padding positions, which static-scale clipping does not count.
        """
        if self.quantizer.per_block and (pos % self.block_size or x.shape[2] % self.block_size):
            raise AssertionError("per-channel quantizers write whole, aligned blocks")
        if self.quantizer.static:
            counted = x if real is None else torch.where(real[:, None, :, None], x, 0.0)
            self.clipped += self.quantizer.clipped(counted, self.state)
            self.static_values += x.numel() if real is None else real.sum() * x.shape[1] * x.shape[3]
        q = self.quantizer.quantize(x, self.state)
        if check and not stored_finite(q):
            if self.quantizer.widen_scales():
                self._widen_parts()
                q = self.quantizer.quantize(x, self.state)
            if not stored_finite(q):
                raise StoredOverflow(
                    f"precision: {self.quantizer.name} cannot store |K/V| up to {x.abs().max().item():.3g} "
                    "(the stored values overflow); use bf16 or fp32 storage for this layer / head"
                )
        for name, t in q.items():
            start = self._rows(name, pos) if self.specs[name].per_block else pos
            self.parts[name][:, :, start:start + t.shape[2]].copy_(t)

    def _widen_parts(self) -> None:
        """Re-type the parts whose dtype the quantizer changed (fp16 scales -> fp32; values kept exactly)."""
        self.specs = self.quantizer.parts()
        for name, t in self.parts.items():
            if t.dtype != self.specs[name].dtype:
                self.parts[name] = t.to(self.specs[name].dtype)

    def read(self, start: int, end: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantize tokens ``start .. end`` -> ``[B, H, end-start, D]`` (block-aligned for per-block parts)."""
        parts = {}
        for n, t in self.parts.items():
            if self.specs[n].per_block:
                parts[n] = t[:, :, start // self.block_size:self._rows(n, end)]
            else:
                parts[n] = t[:, :, start:end]
        if self.quantizer.space:  # codebook rows stay in their head space (see LayerStore.read)
            return self.quantizer.decode_space(parts, self.state).to(dtype)
        return self.quantizer.dequantize(parts, self.state, dtype)

    def index_batch(self, idx: torch.Tensor) -> None:
        self.parts = {n: t.index_select(0, idx) for n, t in self.parts.items()}
        # per-sequence static scales [B, H] follow their rows
        self.state = {n: t.index_select(0, idx) if t.dim() == 2 else t for n, t in self.state.items()}
        self.batch = int(idx.numel())

    def nbytes(self, tokens: int) -> int:
        """Bytes held by ``tokens`` tokens of every part (no static state)."""
        return sum(t[:, :, :self._rows(n, tokens)].numel() * t.element_size() for n, t in self.parts.items())

    def part_nbytes(self, tokens: int) -> dict[str, int]:
        return {n: t[:, :, :self._rows(n, tokens)].numel() * t.element_size() for n, t in self.parts.items()}

    def state_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())


@dataclass
class HeadGroup:
    """KV heads of one layer that share a (key precision, value precision) pair."""

    precision: KVPrecision
    heads: list[int]
    key: QuantizedTensorStore
    value: QuantizedTensorStore
    head_index: torch.Tensor = field(repr=False)
    all_heads: bool = False  # the group holds every head, in order (no gather needed)


class LayerStore:
    """All K/V of one layer: head groups, the ``cache_pos`` cursor, block-granular capacity."""

    def __init__(
        self,
        row: list[KVPrecision],
        config: KVQuantConfig,
        head_dim: int,
        batch: int,
        device: torch.device,
        static_amax: dict[str, torch.Tensor] | None = None,
        capacity: int | None = None,
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        self.head_dim = head_dim
        self.num_heads = len(row)
        self.batch = batch
        self.device = device
        self.cache_pos = 0
        self.q_end = 0  # tokens [0, q_end) are in the quantized pool
        # per row, the position of its first real token (left padding before it), set by the first append
        self.row_start = torch.zeros(batch, dtype=torch.long, device=device)
        self.sink_end = 0  # sink tokens lie below this position in every row
        self.pad_end = 0  # left padding lies below this position in every row
        self.calibrated = False
        self._static_amax = static_amax
        self.rotate_keys = config.rotate in ("keys", "kv")
        self.rotate_values = config.rotate == "kv"
        self.center_keys = config.centers_keys
        self.key_mean: torch.Tensor | None = None  # [B, H, 1, D] float32, set by the first write
        self.sink_tokens = config.sink_tokens
        gs = config.effective_group_size(head_dim)
        by_pair: dict[KVPrecision, list[int]] = {}
        for h, p in enumerate(row):
            by_pair.setdefault(p, []).append(h)
        self.groups: list[HeadGroup] = []
        for pair, heads in by_pair.items():
            kq = make_quantizer(pair.key, head_dim, gs, config.headroom, self.block_size)
            vq = make_quantizer(pair.value, head_dim, gs, config.headroom, self.block_size)
            self.groups.append(
                HeadGroup(
                    precision=pair,
                    heads=heads,
                    key=QuantizedTensorStore(kq, batch, len(heads), device, self.block_size),
                    value=QuantizedTensorStore(vq, batch, len(heads), device, self.block_size),
                    head_index=torch.tensor(heads, dtype=torch.long, device=device),
                    all_heads=heads == list(range(self.num_heads)),
                )
            )
        per_block = any(g.key.quantizer.per_block or g.value.quantizer.per_block for g in self.groups)
        self.per_block = per_block
        # residual mode: newest tokens in full precision, quantized a whole block at a time
        self.residual_tokens = config.residual_tokens
        self.residual_mode = config.residual_tokens > 0 or per_block
        self.dense_dtype: torch.dtype | None = None
        self.sink_k = self.sink_v = self.res_k = self.res_v = None
        if capacity:
            self.reserve(capacity)

    @property
    def has_dense_segments(self) -> bool:
        """True when some history is read from full-precision buffers (sinks, residual, or tokens held
        while static-scale calibration is deferred)."""
        return self.sink_tokens > 0 or self.residual_mode or self.q_end < self.cache_pos

    # ---------------------------------------------------------------- capacity
    @property
    def capacity(self) -> int:
        return self.groups[0].key.capacity

    def reserve(self, tokens: int) -> None:
        """Make room for ``tokens`` tokens in total (whole blocks)."""
        if tokens <= self.capacity:
            return
        new_cap = math.ceil(tokens / self.block_size) * self.block_size
        for g in self.groups:
            g.key.grow(new_cap, self.q_end)
            g.value.grow(new_cap, self.q_end)

    def _ensure(self, tokens: int) -> None:
        if tokens > self.capacity:
            grown = self.capacity and int(self.capacity * GROWTH)
            self.reserve(max(tokens, grown))

    # ---------------------------------------------------------------- writing
    @property
    def transforms(self) -> bool:
        """True when K or V are stored transformed (rotated and/or centered): fresh K/V must be mapped too."""
        return self.rotate_keys or self.rotate_values or self.center_keys

    def _set_key_mean(self, keys: torch.Tensor, past: int) -> None:
        """Fix the per-channel key mean of each sequence and head from its first chunk (sinks left out)."""
        skip = max(0, self.sink_tokens - past)
        if skip >= keys.shape[2]:
            skip = 0
        self.key_mean = keys[:, :, skip:].detach().float().mean(dim=2, keepdim=True)

    def to_storage_space(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply the configured key centering and Hadamard rotation (identity when both are off)."""
        if self.key_mean is not None:
            keys = (keys.float() - self.key_mean).to(keys.dtype)
        return (fwht(keys) if self.rotate_keys else keys), (fwht(values) if self.rotate_values else values)

    def append(self, keys: torch.Tensor, values: torch.Tensor, row_start: torch.Tensor | None = None) -> int:
        """Quantize and write ``keys/values[B, H, T, D]`` at the cursor; returns the past length.

        ``row_start[B]`` (first append only): each row's first real token; the positions before it are
        left padding. Sink tokens are then each row's first real tokens, and static scales ignore pads.
        """
        if self.config.check_finite:
            finite = torch.isfinite(keys).all() & torch.isfinite(values).all()
            msg = "key_states/value_states: NaN or Inf values cannot be quantized"
            if keys.device.type == "cpu":
                if not bool(finite):
                    raise ValueError(msg)
            else:  # asynchronous: no host synchronisation per append (raises at the next synchronisation)
                torch._assert_async(finite, msg)
        past = self.cache_pos
        if self.center_keys and self.key_mean is None:
            self._set_key_mean(keys, past)
        keys, values = self.to_storage_space(keys, values)
        T = keys.shape[2]
        if past == 0:
            self._set_row_start(row_start)
        if self.dense_dtype is None:
            self.dense_dtype = torch.float16 if keys.dtype == torch.float32 else keys.dtype
        if self.config.check_finite and (self.has_dense_segments or not self.calibrated):
            self._fit_dense(keys, values)
        if past < self.sink_end:
            self._keep_sinks(keys, values, past)
        held = self.res_k.shape[2] if self.res_k is not None and not self.calibrated else 0
        if not self.calibrated:
            if self._hold_for_calibration(keys, values, past):
                self.cache_pos = past + T
                return past
            if held:  # calibrate on the held tokens and this chunk together
                hk = torch.cat([self.res_k.float(), keys.float()], dim=2)
                hv = torch.cat([self.res_v.float(), values.float()], dim=2)
                self._calibrate(hk, hv, self.q_end)
            else:
                self._calibrate(keys, values, past)
        if self.residual_mode:
            self._append_residual(keys, values)
        else:
            if held:  # tokens held while calibration was deferred go to the pool first
                self._write_pool(self.res_k.to(keys.dtype), self.res_v.to(values.dtype), self.q_end)
                self.res_k = self.res_v = None
            self._write_pool(keys, values, past)
        self.cache_pos = past + T
        return past

    def _hold_for_calibration(self, keys: torch.Tensor, values: torch.Tensor, past: int) -> bool:
        """Defer static-scale calibration (holding this chunk in full precision) while some row has fewer
        than ``CALIB_MIN_TOKENS`` real tokens, or only zeros in a head, and fewer than ``CALIB_MAX_TOKENS``."""
        static = any(q.static for g in self.groups for q in (g.key.quantizer, g.value.quantizer))
        end = past + keys.shape[2]
        if not static or self._static_amax is not None or end >= CALIB_MAX_TOKENS:
            return False
        seen = (end - self.row_start).clamp_min(0)  # real tokens per row, this chunk included
        if bool((seen >= CALIB_MIN_TOKENS).all()):
            start = self.q_end
            ks, vs = keys.float(), values.float()
            if self.res_k is not None and self.res_k.shape[2]:
                ks = torch.cat([self.res_k.float(), ks], dim=2)
                vs = torch.cat([self.res_v.float(), vs], dim=2)
            use = self.real_tokens(start, end)
            if bool(((row_amax(ks, use) > 0) & (row_amax(vs, use) > 0)).all()):
                return False
        dk, dv = keys.to(self.dense_dtype), values.to(self.dense_dtype)
        if self.res_k is not None and self.res_k.shape[2]:
            dk, dv = torch.cat([self.res_k, dk], dim=2), torch.cat([self.res_v, dv], dim=2)
        self.res_k, self.res_v = dk, dv
        return True

    def _fit_dense(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """fp16 sink / residual buffers (fp32 models) become fp32 when a value would overflow fp16."""
        if self.dense_dtype != torch.float16:
            return
        if float(torch.maximum(keys.abs().amax(), values.abs().amax())) <= torch.finfo(torch.float16).max:
            return
        self.dense_dtype = torch.float32
        for name in ("sink_k", "sink_v", "res_k", "res_v"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.float())

    def _set_row_start(self, row_start: torch.Tensor | None) -> None:
        if row_start is None:
            self.row_start = torch.zeros(self.batch, dtype=torch.long, device=self.device)
        else:
            if row_start.shape != (self.batch,):
                raise ValueError(f"row_start: shape {tuple(row_start.shape)}, expected ({self.batch},)")
            self.row_start = row_start.to(self.device, torch.long)
        self.pad_end = int(self.row_start.max())  # one read, at the first write
        self.sink_end = self.pad_end + self.sink_tokens if self.sink_tokens else 0

    def real_tokens(self, start: int, end: int) -> torch.Tensor:
        """``[B, end - start]``: True where position ``start + t`` of a row is a real token (not left padding)."""
        pos = torch.arange(start, end, device=self.device)
        return pos[None, :] >= self.row_start[:, None]

    def sink_slots(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The sink tokens among positions ``[start, end)``: index tensors (row, offset from ``start``,
        slot of the row's sink buffer), or None. A row's sinks are its first ``sink_tokens`` real tokens."""
        if start >= self.sink_end:
            return None
        slot = torch.arange(start, end, device=self.device)[None, :] - self.row_start[:, None]
        rows, offs = ((slot >= 0) & (slot < self.sink_tokens)).nonzero(as_tuple=True)
        return rows, offs, slot[rows, offs]

    def _keep_sinks(self, keys: torch.Tensor, values: torch.Tensor, past: int) -> None:
        if self.sink_k is None:
            shape = (self.batch, self.num_heads, self.sink_tokens, self.head_dim)
            self.sink_k = torch.zeros(shape, dtype=self.dense_dtype, device=self.device)
            self.sink_v = torch.zeros_like(self.sink_k)
        sel = self.sink_slots(past, past + keys.shape[2])
        if sel is not None:
            rows, offs, slots = sel
            self.sink_k[rows, :, slots] = keys[rows, :, offs].to(self.dense_dtype)
            self.sink_v[rows, :, slots] = values[rows, :, offs].to(self.dense_dtype)

    def _write_pool(self, keys: torch.Tensor, values: torch.Tensor, pos: int) -> None:
        """Quantize a chunk into the pool at ``pos`` (sink rows zeroed: they are read from the sink buffer)."""
        sel = self.sink_slots(pos, pos + keys.shape[2])
        if sel is not None:
            rows, offs, _ = sel
            keys, values = keys.clone(), values.clone()
            keys[rows, :, offs] = 0
            values[rows, :, offs] = 0
        self._ensure(pos + keys.shape[2])
        real = self.real_tokens(pos, pos + keys.shape[2]) if pos < self.pad_end else None
        for g in self.groups:
            k = keys if g.all_heads else keys.index_select(1, g.head_index)
            v = values if g.all_heads else values.index_select(1, g.head_index)
            g.key.write(k, pos, self.config.check_finite, real)
            g.value.write(v, pos, self.config.check_finite, real)
        self.q_end = pos + keys.shape[2]

    def _append_residual(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Residual mode: keep the newest tokens dense; quantize whole blocks beyond ``residual_tokens``."""
        dk, dv = keys.to(self.dense_dtype), values.to(self.dense_dtype)
        if self.res_k is not None and self.res_k.shape[2]:
            dk = torch.cat([self.res_k, dk], dim=2)  # bounded: the residual holds < R + block tokens
            dv = torch.cat([self.res_v, dv], dim=2)
        pending = dk.shape[2]
        flush = (pending - self.residual_tokens) // self.block_size * self.block_size
        if flush > 0:
            # tokens reach the pool through the residual buffer's dtype (exact for 16-bit models)
            self._write_pool(dk[:, :, :flush].to(keys.dtype), dv[:, :, :flush].to(values.dtype), self.q_end)
        self.res_k, self.res_v = dk[:, :, max(flush, 0):].contiguous(), dv[:, :, max(flush, 0):].contiguous()

    def fake_quantize(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize-then-dequantize ``keys/values[B, H, T, D]`` without storing them (``simulated`` protocol).

        Centering, rotation and sink tokens apply; the residual window does not (it is a property of
        decoding).
        """
        if self.center_keys and self.key_mean is None:
            self._set_key_mean(keys, self.cache_pos)
        ks, vs = self.to_storage_space(keys, values)
        if not self.calibrated:
            self._calibrate(ks, vs, self.cache_pos)
        k_out, v_out = torch.empty_like(ks), torch.empty_like(vs)
        for g in self.groups:
            for src, dst, s in ((ks, k_out, g.key), (vs, v_out, g.value)):
                x = src if g.all_heads else src.index_select(1, g.head_index)
                y = s.quantizer.dequantize(s.quantizer.quantize(x, s.state), s.state, src.dtype)
                dst[:, g.head_index] = y
        if self.cache_pos == 0:
            self._set_row_start(None)
        sel = self.sink_slots(self.cache_pos, self.cache_pos + ks.shape[2])
        if sel is not None:
            rows, offs, _ = sel
            k_out[rows, :, offs], v_out[rows, :, offs] = ks[rows, :, offs], vs[rows, :, offs]
        self.cache_pos += ks.shape[2]
        k_out = fwht(k_out) if self.rotate_keys else k_out
        v_out = fwht(v_out) if self.rotate_values else v_out
        if self.key_mean is not None:
            k_out = (k_out.float() + self.key_mean).to(k_out.dtype)
        return k_out, v_out

    def _calibrate(self, keys: torch.Tensor, values: torch.Tensor, past: int) -> None:
        """Set the static scales per (sequence, KV head), from a scales file or from this first chunk.

        Each row's scale comes from its own real tokens: never from batch-mates or left padding. Sink
        tokens (read in full precision) are left out of the max when the chunk has other tokens.
        """
        use = self.real_tokens(past, past + keys.shape[2])  # data-fitted state (codebook): real, non-sink tokens
        if self._static_amax is not None:
            k_amax = self._static_amax["key"].to(self.device).expand(self.batch, -1)
            v_amax = self._static_amax["value"].to(self.device).expand(self.batch, -1)
        else:
            T = keys.shape[2]
            use = self.real_tokens(past, past + T)
            sel = self.sink_slots(past, past + T)
            if sel is not None:
                not_sink = torch.ones_like(use)
                not_sink[sel[0], sel[1]] = False
                # sinks are left out of a row's max when the chunk holds other real tokens of that row
                use = torch.where((use & not_sink).any(dim=1, keepdim=True), use & not_sink, use)
            k_amax = safe_amax(row_amax(keys, use))
            v_amax = safe_amax(row_amax(values, use))
        for g in self.groups:
            ka, va = k_amax[:, g.head_index], v_amax[:, g.head_index]
            both_int8 = g.key.quantizer.name == g.value.quantizer.name == "int8"
            if both_int8 and self.config.share_kv_scale:
                ka = va = torch.maximum(ka, va)
            for s, x, amax in ((g.key, keys, ka), (g.value, values, va)):
                fitted = s.quantizer.fit(self._group_rows(x, g), use) if s.quantizer.space else None
                s.state = fitted if fitted is not None else s.quantizer.calibrate(amax)
            for st in (g.key, g.value):
                if not stored_finite(st.state):
                    raise StoredOverflow(
                        f"headroom: {self.config.headroom!r} times the calibrated max overflows the static "
                        f"{st.quantizer.name} scale (float32)"
                    )
        self.calibrated = True

    # ---------------------------------------------------------------- head spaces (codebook heads)
    @staticmethod
    def _group_rows(x: torch.Tensor, group: HeadGroup) -> torch.Tensor:
        return x if group.all_heads else x.index_select(1, group.head_index)

    @property
    def has_head_space(self) -> bool:
        """True when some head's K or V is read in a rotated head space (codebook quantizers; once fitted:
        while calibration is deferred every token is held dense, in storage space)."""
        return self.calibrated and any(g.key.quantizer.space or g.value.quantizer.space for g in self.groups)

    @property
    def centered_keys(self) -> bool:
        """True when some head's keys are stored with a per-channel mean removed (codebook quantizers)."""
        return any(g.key.quantizer.space and getattr(g.key.quantizer, "center", False) for g in self.groups)

    def _map_heads(self, x: torch.Tensor, side: str, method: str) -> torch.Tensor:
        """Apply the ``side`` (``key``/``value``) quantizer's ``method`` (``to_space``, ...) to the heads of
        ``x[B, Hkv, ...]`` whose K/V has a head space; other heads are returned unchanged."""
        out = x
        for g in self.groups:
            s = getattr(g, side)
            if not s.quantizer.space:
                continue
            y = getattr(s.quantizer, method)(self._group_rows(x, g), s.state).to(x.dtype)
            if g.all_heads:
                return y
            out = x.clone() if out is x else out
            out.index_copy_(1, g.head_index, y)
        return out

    def kv_to_head_space(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-precision ``keys/values[B, Hkv, T, D]`` (storage space) -> each head's K / V space."""
        return self._map_heads(keys, "key", "to_space"), self._map_heads(values, "value", "to_space")

    def kv_from_head_space(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`kv_to_head_space` (tests and debugging)."""
        return self._map_heads(keys, "key", "from_space"), self._map_heads(values, "value", "from_space")

    def query_to_head_space(self, query: torch.Tensor) -> torch.Tensor:
        """Queries ``[B, Hq, T, D]`` -> each KV head's key space (rotated once per step, never the keys)."""
        B, Hq, T, D = query.shape
        q5 = query.reshape(B, self.num_heads, Hq // self.num_heads, T, D)
        return self._map_heads(q5, "key", "query_to_space").reshape(B, Hq, T, D)

    def output_from_head_space(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output ``[B, Hq, T, D]`` in each head's value space -> storage space (once per step)."""
        B, Hq, T, D = out.shape
        o5 = out.reshape(B, self.num_heads, Hq // self.num_heads, T, D)
        return self._map_heads(o5, "value", "from_space").reshape(B, Hq, T, D)

    def _dense_to_group_space(
        self, group: HeadGroup, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-precision rows of ``group`` -> its head space (float32)."""
        if not self.calibrated:
            return k.float(), v.float()
        k = group.key.quantizer.to_space(k, group.key.state) if group.key.quantizer.space else k.float()
        v = group.value.quantizer.to_space(v, group.value.state) if group.value.quantizer.space else v.float()
        return k, v

    # ---------------------------------------------------------------- reading (storage space)
    def tiles(self, past_len: int, size: int) -> list[tuple[int, int]]:
        """Key ranges covering ``[0, past_len)`` that never straddle the pool / residual boundary."""
        q_end = min(self.q_end, past_len)
        out = [(s, min(q_end, s + size)) for s in range(0, q_end, size)]
        out += [(s, min(past_len, s + size)) for s in range(q_end, past_len, size)]
        return out

    def read(self, group: HeadGroup, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``group`` for tokens ``[start, end)`` as float32 ``[B, Hg, t, D]`` (storage space; for
        codebook K or V, that head space: the attention maps queries / outputs, see ``query_to_head_space``)."""
        if start < self.q_end < end:
            k1, v1 = self.read(group, start, self.q_end)
            k2, v2 = self.read(group, self.q_end, end)
            return torch.cat([k1, k2], dim=2), torch.cat([v1, v2], dim=2)
        if start >= self.q_end:  # residual buffer (dense)
            a, b = start - self.q_end, end - self.q_end
            k, v = self.res_k[:, :, a:b], self.res_v[:, :, a:b]
            return self._dense_to_group_space(group, self._group_rows(k, group), self._group_rows(v, group))
        k, v = group.key.read(start, end), group.value.read(start, end)
        if self.sink_k is not None and start < self.sink_end:
            # each row's sink tokens from the sink buffer, selected on the device (no host synchronisation)
            slot = torch.arange(start, end, device=self.device)[None, :] - self.row_start[:, None]  # [B, t]
            is_sink = ((slot >= 0) & (slot < self.sink_tokens))[:, None, :, None]
            idx = slot.clamp(0, self.sink_tokens - 1)
            rows = torch.arange(self.batch, device=self.device)[:, None]
            sk, sv = self.sink_k[rows, :, idx].transpose(1, 2), self.sink_v[rows, :, idx].transpose(1, 2)
            sk, sv = self._dense_to_group_space(group, self._group_rows(sk, group), self._group_rows(sv, group))
            k, v = torch.where(is_sink, sk.float(), k), torch.where(is_sink, sv.float(), v)
        return k, v

    # ---------------------------------------------------------------- cache operations
    def crop(self, tokens: int) -> None:
        """Keep the first ``tokens`` tokens (blocks stay allocated).

        Nothing is quantized again: kept tokens are read exactly as before. In residual mode a crop
        that reaches into the quantized pool empties the residual window and keeps the pool's first
        ``tokens`` tokens (the window refills with new tokens). Per-channel (``int*-channel``) blocks
        share one scale per block, so their pool can only be cut at a block boundary: a crop to the
        middle of a quantized block is refused (keeping its head would mean re-quantizing it).
        """
        tokens = max(0, min(tokens, self.cache_pos))
        if tokens < self.q_end:
            if self.per_block and tokens % self.block_size:
                raise ValueError(
                    f"crop: keeping {tokens} tokens would split a quantized per-channel block of {self.block_size} "
                    f"(its scales cover the whole block); keep a multiple of {self.block_size} tokens or at "
                    f"least {self.q_end} (the full-precision window)"
                )
            self.q_end = tokens
        if self.res_k is not None:
            keep = tokens - self.q_end
            self.res_k, self.res_v = self.res_k[:, :, :keep], self.res_v[:, :, :keep]
        self.cache_pos = tokens

    def reset(self) -> None:
        """Forget all tokens and static scales (allocations are kept for reuse)."""
        self.cache_pos = self.q_end = self.sink_end = self.pad_end = 0
        self.row_start = torch.zeros(self.batch, dtype=torch.long, device=self.device)
        self.calibrated = False
        self.res_k = self.res_v = None
        self.sink_k = self.sink_v = None
        self.key_mean = None
        for g in self.groups:
            for s in (g.key, g.value):
                s.clipped.zero_()
                s.static_values.zero_()
                s.state = {}

    def index_batch(self, idx: torch.Tensor) -> None:
        """Reorder / select / repeat batch rows (beam search)."""
        idx = idx.to(self.device)
        for g in self.groups:
            g.key.index_batch(idx)
            g.value.index_batch(idx)
        for name in ("sink_k", "sink_v", "res_k", "res_v", "key_mean"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, idx))
        self.row_start = self.row_start.index_select(0, idx)
        self.batch = int(idx.numel())

    # ---------------------------------------------------------------- accounting
    def used_tokens(self) -> int:
        """Tokens held in the pool, rounded up to whole blocks."""
        return math.ceil(self.q_end / self.block_size) * self.block_size

    def dense_buffers(self) -> dict[str, torch.Tensor]:
        out = {}
        if self.sink_k is not None:
            out["sinks"] = (self.sink_k, self.sink_v)
        if self.res_k is not None:
            out["residual"] = (self.res_k, self.res_v)
        return out

    def memory(self) -> dict[str, int]:
        """Bytes held for keys, values and scales (used blocks + full-precision buffers), and reserved."""
        used = self.used_tokens()
        out = {"keys": 0, "values": 0, "scales": 0, "dense": 0, "reserved": 0}
        for g in self.groups:
            for kind, s in (("keys", g.key), ("values", g.value)):
                for name, b in s.part_nbytes(used).items():
                    out["scales" if name in ("scale", "zero", "norm") else kind] += b
                out["reserved"] += sum(t.numel() * t.element_size() for t in s.parts.values())
                out["scales"] += s.state_nbytes()
        if self.key_mean is not None:
            out["scales"] += self.key_mean.numel() * self.key_mean.element_size()
        for k, v in self.dense_buffers().values():
            out["dense"] += k.numel() * k.element_size() + v.numel() * v.element_size()
        return out

    def clipped(self) -> int:
        return int(sum(int(g.key.clipped) + int(g.value.clipped) for g in self.groups))

    def static_values(self) -> int:
        """Real (non-pad) values written through static scales so far (what :meth:`clipped` counts against)."""
        return int(sum(int(g.key.static_values) + int(g.value.static_values) for g in self.groups))
