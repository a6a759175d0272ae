"""``PackedCache``: the transformers ``Cache`` of one continuous-batching step over many sequences' caches.

The step's forward runs on the tokens of every scheduled sequence packed into one row (``[1, sum(lengths)]``,
each token with its own position id). Each layer's :meth:`PackedLayer.update` hands every sequence its slice of
the new K/V (its :class:`~kvquant.QuantizedKVCache` layer quantizes nothing yet: it publishes its
:class:`~kvquant.view.LayerView`, taken here at once), then publishes one :class:`~kvquant.view.BatchView` for
the whole chunk, which the ``kvquant`` attention splits again: every sequence writes its slice into its own
store and attends over its own blocks only (:func:`kvquant.attention._attend_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import view as handoff
from .cache import QuantizedKVCache


@dataclass(frozen=True)
class Segment:
    """Sequence ``cache`` owns tokens ``[start, start + length)`` of the packed step."""

    cache: QuantizedKVCache
    start: int
    length: int


class PackedLayer(CacheLayerMixin):
    """One layer of a :class:`PackedCache`: splits the packed K/V over the segments' own cache layers."""

    def __init__(self, layer_idx: int, segments: list[Segment]) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.segments = segments

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Give every segment its slice (its cache layer admits it and publishes its view), then publish the
        step's :class:`~kvquant.view.BatchView` for ``key_states``."""
        if key_states.shape[0] != 1:
            raise ValueError(f"key_states: a packed step has one row, got {key_states.shape[0]}")
        views = []
        for seg in self.segments:
            k = key_states[:, :, seg.start:seg.start + seg.length]
            v = value_states[:, :, seg.start:seg.start + seg.length]
            seg.cache.layers[self.layer_idx].update(k, v)
            taken = handoff.take(k)
            assert isinstance(taken, handoff.LayerView)
            views.append(taken)
        handoff.publish(key_states, handoff.BatchView(
            self.layer_idx, tuple(s.start for s in self.segments), tuple(s.length for s in self.segments),
            tuple(views)))  # fmt: skip
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # the attention ignores the mask of a packed step (each segment is causal)

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class PackedCache(Cache):
    """The cache a packed step's forward is called with: one :class:`PackedLayer` per model layer."""

    def __init__(self, num_layers: int, segments: list[Segment]) -> None:
        super().__init__(layers=[PackedLayer(i, segments) for i in range(num_layers)])
