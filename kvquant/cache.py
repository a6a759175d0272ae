"""``QuantizedKVCache``: a transformers 5.x ``Cache`` whose layers store K/V quantized.

One ``QuantizedLayer`` per model layer (the ``CacheLayerMixin`` interface: ``update``,
``get_seq_length``, ``get_mask_sizes``, ``reorder_cache``, ``crop``, ``reset``). ``update`` quantizes
the new tokens into the layer's :class:`~kvquant.store.LayerStore` and returns the fresh K/V
tagged with a :class:`StoreView`; the ``kvquant`` attention implementation reads the history from
the store through that view, so the cache never hands out a full-precision copy of the history.
"""

from __future__ import annotations

import itertools
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .config import KVPrecision, KVQuantConfig
from .shape import ModelShape
from .store import LayerStore

_session_ids = itertools.count(1)
VIEW_ATTR = "_kvquant_view"
CLIP_WARN_RATE = 1e-3  # warn (once per cache) when static scales clip more than this fraction of values


class ClipMonitor:
    """Clipping by static scales over all layers of one cache: the rate, and one warning when it is high.

    Checked after a multi-token chunk (prefill) and every ``block_size`` decode steps (each check reads
    the device counters once), and by :meth:`QuantizedKVCache.memory_report`.
    """

    def __init__(self, layers: list[QuantizedLayer], name: str) -> None:
        self.layers = layers
        self.name = name
        self.warned = False

    def counts(self) -> tuple[int, int]:
        """(values clipped, values written through static scales)."""
        stores = [layer.store for layer in self.layers if layer.store is not None]
        return sum(s.clipped() for s in stores), sum(s.static_values() for s in stores)

    def rate(self) -> float:
        clipped, total = self.counts()
        return clipped / total if total else 0.0

    def check(self) -> None:
        if self.warned:
            return
        clipped, total = self.counts()
        if total and clipped / total > CLIP_WARN_RATE:
            self.warned = True
            warnings.warn(
                f"kvquant: static K/V scales clipped {clipped / total:.2%} of the values written so far "
                f"({clipped} of {total}, cache {self.name}); raise headroom, use a scales_file or a "
                "per-token precision (int8-token)",
                stacklevel=3,
            )


@dataclass
class StoreView:
    """What the attention needs to read one layer: the store and the history length."""

    layer: QuantizedLayer
    past_len: int

    @property
    def store(self) -> LayerStore:
        assert self.layer.store is not None
        return self.layer.store


class QuantizedLayer(CacheLayerMixin):
    """One layer of a :class:`QuantizedKVCache`: a :class:`LayerStore` created on the first update."""

    is_compileable = False
    is_sliding = False

    @property
    def is_croppable(self) -> bool:
        """Crop can undo any token (see :meth:`LayerStore.crop`), except that per-channel blocks without a
        full-precision window (``residual_tokens: 0``) can only be cut at block boundaries."""
        return self.store is None or not self.store.per_block or self.store.residual_tokens > 0

    def __init__(
        self,
        layer_idx: int,
        row: list[KVPrecision],
        config: KVQuantConfig,
        head_dim: int,
        static_amax: dict[str, torch.Tensor] | None = None,
        capacity: int | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.row = row
        self.config = config
        self.head_dim = head_dim
        self.static_amax = static_amax
        self.capacity = capacity
        self.store: LayerStore | None = None
        self._unread = False
        # bound to a model: the chunk of the last update, written when the kvquant attention reads it
        # (the attention has the mask, hence each row's left padding, which the first write needs)
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.monitor: ClipMonitor | None = None  # set by the cache: clipping over all layers
        # when bound to a model, every update must be read by the kvquant attention before the next one
        self.strict = True

    def __repr__(self) -> str:
        pos = self.store.cache_pos if self.store else 0
        return f"QuantizedLayer(layer={self.layer_idx}, cache_pos={pos})"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.shape[1] != len(self.row):
            raise ValueError(
                f"key_states: layer {self.layer_idx} got {key_states.shape[1]} KV heads, "
                f"the config was resolved for {len(self.row)}"
            )
        if key_states.shape[-1] != self.head_dim:
            raise ValueError(f"key_states: head_dim {key_states.shape[-1]}, expected {self.head_dim}")
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.store = LayerStore(
            self.row,
            self.config,
            self.head_dim,
            batch=key_states.shape[0],
            device=key_states.device,
            static_amax=self.static_amax,
            capacity=self.capacity,
        )
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize and store the new tokens; return them tagged with a :class:`StoreView`."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.store is not None
        if self._unread and self.strict:
            raise RuntimeError(
                f"layer {self.layer_idx}: the previous update was not read by the kvquant attention. "
                "Call kvquant.wrap(model, config) (or build QuantizedKVCache(model, config)) so that "
                "attention reads the quantized store."
            )
        if key_states.shape[0] != self.store.batch:
            raise ValueError(
                f"key_states: batch {key_states.shape[0]} does not match the cache's batch {self.store.batch}"
            )
        past = self.store.cache_pos
        if self.strict:
            self._pending = (key_states, value_states)
        else:
            self.store.append(key_states, value_states)
            self._check_clipping(key_states.shape[2])
        setattr(key_states, VIEW_ATTR, StoreView(self, past))
        self._unread = True
        return key_states, value_states

    def commit(self, row_start: torch.Tensor | None = None) -> None:
        """Write the chunk of the last :meth:`update` (called by the kvquant attention, which reads it).

        ``row_start[B]``: each row's first real token (from the attention mask); used by the first write.
        """
        if self._pending is not None:
            keys, values = self._pending
            self._pending = None
            assert self.store is not None
            self.store.append(keys, values, row_start)
            self._check_clipping(keys.shape[2])
        self._unread = False

    def _check_clipping(self, chunk: int) -> None:
        """After the last layer's write of a chunk, or every ``block_size`` decode steps: warn if clipping."""
        store = self.store
        last = self.monitor is not None and self.monitor.layers[-1] is self
        if last and store is not None and (chunk > 1 or store.cache_pos % store.block_size == 0):
            self.monitor.check()

    def mark_read(self) -> None:
        self.commit()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        if self.store is None:
            return 0
        return self.store.cache_pos + (self._pending[0].shape[2] if self._pending is not None else 0)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if self.store is not None:
            self.store.reset()
        self._unread = False
        self._pending = None

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop: {tokens_to_remove} is positive; pass a negative number of tokens to remove"
            )
        if self.store is not None and tokens_to_remove:
            self.store.crop(self.store.cache_pos + tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.store is not None and self.store.cache_pos:
            self.store.index_batch(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.store is not None:
            idx = torch.arange(self.store.batch, device=self.store.device).repeat_interleave(repeats)
            self.store.index_batch(idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.store is not None:
            self.store.index_batch(torch.as_tensor(indices, device=self.store.device).long())

    def offload(self) -> None:  # offloading a quantized store is not supported (kept resident)
        return None

    def prefetch(self) -> None:
        return None


class QuantizedKVCache(Cache):
    """A KV cache that stores each (layer, KV head)'s K and V in the precision a config assigns.

    Args:
        model: the transformers model (its config gives layers, KV heads and head_dim). The
            ``kvquant`` attention is installed on it if it is not already (see :func:`kvquant.wrap`).
            A :class:`~kvquant.ModelShape` builds a free-standing cache (``update`` / ``memory_report``
            without a model).
        config: a :class:`KVQuantConfig`, a preset name (``"int8"``) or a YAML/JSON path.
        capacity: tokens to preallocate per sequence (optional; otherwise blocks are added on demand).

    Example::

        cache = kvquant.QuantizedKVCache(model, "int8")
        out = model.generate(**inputs, cache=cache, max_new_tokens=200)
        print(cache.memory_report()["ratio_vs_fp16"])
    """

    def __init__(
        self, model: Any, config: KVQuantConfig | str | Path = "int8", capacity: int | None = None
    ) -> None:
        from .attention import install_attention

        self.kv_config = KVQuantConfig.load(config)
        self.shape = ModelShape.of(model)
        self.plan = self.kv_config.resolve(self.shape)
        if model is not None and hasattr(model, "config") and hasattr(model, "set_attn_implementation"):
            install_attention(model)
        static = load_static_amax(self.kv_config.scales_file, self.shape)
        layers = [
            QuantizedLayer(i, row, self.kv_config, self.shape.head_dim, static[i] if static else None, capacity)
            for i, row in enumerate(self.plan)
        ]
        bound = model is not None and hasattr(model, "config")
        self.session_id = f"kvq-{next(_session_ids):04d}"
        self.clip_monitor = ClipMonitor(layers, self.session_id)
        for layer in layers:
            layer.strict = bound
            layer.monitor = self.clip_monitor
        super().__init__(layers=layers)

    @property
    def cache_pos(self) -> int:
        """Tokens written so far (the write cursor)."""
        return self.get_seq_length()

    def __repr__(self) -> str:
        name = self.kv_config.name or "custom"
        return (
            f"QuantizedKVCache(session_id={self.session_id!r}, cache_pos={self.cache_pos}, config={name!r}, "
            f"layers={len(self.layers)}, kv_heads={self.shape.num_kv_heads}, head_dim={self.shape.head_dim})"
        )

    def memory_report(self) -> dict[str, Any]:
        """Bytes held for K, V and scales, per layer and per precision, and the ratio to FP16."""
        from .memory import memory_report

        self.clip_monitor.check()
        return memory_report(self)

    def clipped_values(self) -> int:
        """Values that exceeded a static (per-head) scale and were clipped, over all layers."""
        return self.clip_monitor.counts()[0]

    def clipped_rate(self) -> float:
        """Fraction of the values written through static scales that were clipped (0.0 if none)."""
        return self.clip_monitor.rate()


def load_static_amax(path: str | None, shape: ModelShape) -> list[dict[str, torch.Tensor]] | None:
    """Per-layer ``{"key": amax[H], "value": amax[H]}`` from a scales JSON file (``kvquant calibrate``)."""
    if not path:
        return None
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"scales_file: {path!r} does not exist")
    try:
        data = json.loads(p.read_text())
        layers = data["layers"]
        out = [
            {"key": torch.tensor(x["key_amax"], dtype=torch.float32),
             "value": torch.tensor(x["value_amax"], dtype=torch.float32)}
            for x in layers
        ]
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"scales_file: {path!r} is not a kvquant scales file ({e})") from None
    if len(out) != shape.num_layers or any(t["key"].numel() != shape.num_kv_heads for t in out):
        raise ValueError(
            f"scales_file: {path!r} holds {len(out)} layers; the model has {shape.num_layers} layers "
            f"x {shape.num_kv_heads} KV heads"
        )
    return out
