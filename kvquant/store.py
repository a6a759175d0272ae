"""Block-granular quantized KV storage for one layer.

Layout: the KV heads of a layer are split into *head groups*, one per distinct (key precision,
value precision) pair. Each group stores its K and V as the parts of its quantizers, one
preallocated tensor per part::

    part tensor: [batch, heads_in_group, capacity_tokens, *part_shape]

``capacity_tokens`` is a whole number of blocks (``block_size`` tokens). Blocks are added on
demand when the ``cache_pos`` cursor reaches the end, so memory follows the real length, never a
max_seq_len; pass ``capacity`` to preallocate (then nothing is ever copied). When the capacity
must grow, the pool grows by at least a quarter (amortised O(1) per token, O(log n) copies of
the *quantized* bytes); a token is written once, quantized once, never re-quantized.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .config import KVPrecision, KVQuantConfig
from .quantizers import Quantizer, make_quantizer

GROWTH = 1.25


class QuantizedTensorStore:
    """The K (or V) of one head group: quantizer, static state and preallocated part tensors."""

    def __init__(self, quantizer: Quantizer, batch: int, heads: int, device: torch.device) -> None:
        self.quantizer = quantizer
        self.batch, self.heads, self.device = batch, heads, device
        self.state: dict[str, torch.Tensor] = {}
        self.parts: dict[str, torch.Tensor] = {
            name: torch.empty((batch, heads, 0, *spec.shape), dtype=spec.dtype, device=device)
            for name, spec in quantizer.parts().items()
        }
        self.clipped = torch.zeros((), dtype=torch.int64, device=device)

    @property
    def capacity(self) -> int:
        return next(iter(self.parts.values())).shape[2]

    def grow(self, capacity: int, used: int) -> None:
        """Reallocate every part to ``capacity`` tokens, keeping the first ``used``."""
        for name, old in self.parts.items():
            new = torch.empty((*old.shape[:2], capacity, *old.shape[3:]), dtype=old.dtype, device=old.device)
            if used:
                new[:, :, :used].copy_(old[:, :, :used])
            self.parts[name] = new

    def write(self, x: torch.Tensor, pos: int) -> None:
        """Quantize ``x[B, H, T, D]`` and write it at token positions ``pos .. pos+T``."""
        if self.quantizer.static:
            self.clipped += self.quantizer.clipped(x, self.state)
        q = self.quantizer.quantize(x, self.state)
        end = pos + x.shape[2]
        for name, t in q.items():
            self.parts[name][:, :, pos:end].copy_(t)

    def read(self, start: int, end: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantize tokens ``start .. end`` -> ``[B, H, end-start, D]``."""
        parts = {n: t[:, :, start:end] for n, t in self.parts.items()}
        return self.quantizer.dequantize(parts, self.state, dtype)

    def index_batch(self, idx: torch.Tensor) -> None:
        self.parts = {n: t.index_select(0, idx) for n, t in self.parts.items()}
        self.batch = int(idx.numel())

    def nbytes(self, tokens: int) -> int:
        """Bytes held by ``tokens`` tokens of every part (no static state)."""
        if not self.parts:
            return 0
        return sum(t[:, :, :tokens].numel() * t.element_size() for t in self.parts.values())

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
        self.calibrated = False
        self._static_amax = static_amax
        gs = config.effective_group_size(head_dim)
        by_pair: dict[KVPrecision, list[int]] = {}
        for h, p in enumerate(row):
            by_pair.setdefault(p, []).append(h)
        self.groups: list[HeadGroup] = []
        for pair, heads in by_pair.items():
            kq = make_quantizer(pair.key, head_dim, gs, config.headroom)
            vq = make_quantizer(pair.value, head_dim, gs, config.headroom)
            self.groups.append(
                HeadGroup(
                    precision=pair,
                    heads=heads,
                    key=QuantizedTensorStore(kq, batch, len(heads), device),
                    value=QuantizedTensorStore(vq, batch, len(heads), device),
                    head_index=torch.tensor(heads, dtype=torch.long, device=device),
                    all_heads=heads == list(range(self.num_heads)),
                )
            )
        if capacity:
            self.reserve(capacity)

    # ---------------------------------------------------------------- capacity
    @property
    def capacity(self) -> int:
        return self.groups[0].key.capacity

    def reserve(self, tokens: int) -> None:
        """Make room for ``tokens`` tokens in total (whole blocks)."""
        if tokens <= self.capacity:
            return
        blocks = math.ceil(tokens / self.block_size)
        new_cap = blocks * self.block_size
        for g in self.groups:
            g.key.grow(new_cap, self.cache_pos)
            g.value.grow(new_cap, self.cache_pos)

    def _ensure(self, tokens: int) -> None:
        if tokens > self.capacity:
            grown = self.capacity and int(self.capacity * GROWTH)
            self.reserve(max(tokens, grown))

    # ---------------------------------------------------------------- writing
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Quantize and write ``keys/values[B, H, T, D]`` at the cursor; returns the past length."""
        if self.config.check_finite and not bool(torch.isfinite(keys).all() & torch.isfinite(values).all()):
            raise ValueError("key_states/value_states: NaN or Inf values cannot be quantized")
        if not self.calibrated:
            self._calibrate(keys, values)
        past = self.cache_pos
        self._ensure(past + keys.shape[2])
        for g in self.groups:
            k = keys if g.all_heads else keys.index_select(1, g.head_index)
            v = values if g.all_heads else values.index_select(1, g.head_index)
            g.key.write(k, past)
            g.value.write(v, past)
        self.cache_pos = past + keys.shape[2]
        return past

    def fake_quantize(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize-then-dequantize ``keys/values[B, H, T, D]`` without storing them (``simulated`` protocol)."""
        if not self.calibrated:
            self._calibrate(keys, values)
        k_out, v_out = torch.empty_like(keys), torch.empty_like(values)
        for g in self.groups:
            for src, dst, s in ((keys, k_out, g.key), (values, v_out, g.value)):
                x = src if g.all_heads else src.index_select(1, g.head_index)
                y = s.quantizer.dequantize(s.quantizer.quantize(x, s.state), s.state, src.dtype)
                dst[:, g.head_index] = y
        return k_out, v_out

    def _calibrate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Set the static per-(layer, head) scales, from a scales file or from this first chunk."""
        if self._static_amax is not None:
            k_amax = self._static_amax["key"].to(self.device)
            v_amax = self._static_amax["value"].to(self.device)
        else:
            k_amax = keys.detach().float().abs().amax(dim=(0, 2, 3))
            v_amax = values.detach().float().abs().amax(dim=(0, 2, 3))
        for g in self.groups:
            ka, va = k_amax[g.head_index], v_amax[g.head_index]
            both_int8 = g.key.quantizer.name == g.value.quantizer.name == "int8"
            if both_int8 and self.config.share_kv_scale:
                ka = va = torch.maximum(ka, va)
            g.key.state = g.key.quantizer.calibrate(ka)
            g.value.state = g.value.quantizer.calibrate(va)
        self.calibrated = True

    # ---------------------------------------------------------------- cache operations
    def crop(self, tokens: int) -> None:
        """Keep the first ``tokens`` tokens (blocks stay allocated)."""
        self.cache_pos = max(0, min(tokens, self.cache_pos))

    def reset(self) -> None:
        """Forget all tokens and static scales (allocations are kept for reuse)."""
        self.cache_pos = 0
        self.calibrated = False
        for g in self.groups:
            for s in (g.key, g.value):
                s.clipped.zero_()
                s.state = {}

    def index_batch(self, idx: torch.Tensor) -> None:
        """Reorder / select / repeat batch rows (beam search)."""
        idx = idx.to(self.device)
        for g in self.groups:
            g.key.index_batch(idx)
            g.value.index_batch(idx)
        self.batch = int(idx.numel())

    # ---------------------------------------------------------------- accounting
    def used_tokens(self) -> int:
        """Tokens held, rounded up to whole blocks."""
        return math.ceil(self.cache_pos / self.block_size) * self.block_size

    def memory(self) -> dict[str, int]:
        """Bytes held for keys, values and scales in the used blocks, and bytes reserved."""
        used = self.used_tokens()
        out = {"keys": 0, "values": 0, "scales": 0, "reserved": 0}
        for g in self.groups:
            for kind, s in (("keys", g.key), ("values", g.value)):
                for name, t in s.parts.items():
                    b = t[:, :, :used].numel() * t.element_size()
                    out["scales" if name in ("scale", "zero") else kind] += b
                    out["reserved"] += t.numel() * t.element_size()
                out["scales"] += s.state_nbytes()
        return out

    def clipped(self) -> int:
        return int(sum(int(g.key.clipped) + int(g.value.clipped) for g in self.groups))
