"""The contract between a quantized cache and the ``kvquant`` attention, in one place.

A :class:`~kvquant.QuantizedKVCache` layer's ``update`` quantizes the new tokens into its store and
*publishes* a :class:`LayerView` for the key tensor it returns; the attention of that layer *takes*
the view for the key tensor it is given. Neither side imports the other: both import this module (and the
snapshot contract, :mod:`kvquant.snapshot`).
Nothing is attached to the tensors (the hand-off is one slot per thread, matched by the key
tensor's identity), and a view published by a cache whose model does not run the ``kvquant``
attention is detected at the next update instead of being silently ignored.

The chunk itself is written when the attention commits the view (it knows each row's padding from
the mask). The view names what the attention reads: the layer's store, which publishes its
:class:`~kvquant.snapshot.KVSnapshot` once the chunk is written (head groups with their quantizer layout and
block tensors, the block tables, the dense sink / residual segments...), and the history length ``past_len``
(the tokens before this chunk).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .snapshot import SnapshotSource


@dataclass(frozen=True)
class LayerView:
    """What one attention call reads: ``store`` (a :class:`~kvquant.store.LayerStore`; the attention reads only its
    :meth:`~kvquant.snapshot.SnapshotSource.snapshot`, taken after ``commit``) and the history length ``past_len``.

    ``commit(row_start, context)``: the attention calls it first; it writes the chunk of this update into
    the store (``row_start[B]``: each row's first real token, from the mask, which the first write needs
    for per-row sinks and scales under left padding; ``None``: no padding; ``context``: ``module``,
    ``queries``, ``scaling`` and ``mask``, which an eviction policy may score the chunk with).

    An evicting layer's store (its snapshot's ``slots`` set) holds slots, not positions: ``past_len`` counts its
    history slots, and the attention maps the mask onto them (:meth:`kvquant.slots.SlotMap.attention_mask`)."""

    layer_idx: int
    store: SnapshotSource
    past_len: int
    strict: bool = True  # the cache is bound to a model: the attention must take this view
    commit: Callable[[torch.Tensor | None, dict[str, Any] | None], None] | None = None


@dataclass(frozen=True)
class BatchView:
    """What one attention call over the packed tokens of many sequences reads (a continuous-batching step,
    :class:`kvquant.scheduler.Scheduler`): the chunk is ``[1, H, sum(lengths), D]``, sequence ``i`` owns
    tokens ``[starts[i], starts[i] + lengths[i])`` of it and reads only its own ``views[i]`` (its store and
    history length), causally, with its own positions (the attention ignores the model's mask)."""

    layer_idx: int
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    views: tuple[LayerView, ...]
    strict: bool = True


_slot = threading.local()


def publish(key: torch.Tensor, view: LayerView | BatchView) -> None:
    """Hand ``view`` to the attention call that receives ``key``.

    Raises RuntimeError when the previous view of a model-bound cache was never taken: the model's
    attention is not ``kvquant``, so it ignored the quantized history."""
    pending = getattr(_slot, "item", None)
    _slot.item = (weakref.ref(key), view)
    if pending is not None and pending[1].strict:
        _slot.item = None
        raise RuntimeError(
            f"layer {pending[1].layer_idx}: the quantized history was not read by the kvquant attention. "
            "Call kvquant.wrap(model, config) (or use `with kvquant.wrapped(model, config):`) so that "
            "attention reads the quantized store."
        )


def take(key: torch.Tensor) -> LayerView | BatchView | None:
    """The view published for ``key`` (and clear it), or None (``key`` is not from a quantized cache)."""
    item = getattr(_slot, "item", None)
    if item is None or item[0]() is not key:
        return None
    _slot.item = None
    return item[1]


def clear() -> None:
    """Drop a pending view (a forward that failed between update and attention)."""
    _slot.item = None
