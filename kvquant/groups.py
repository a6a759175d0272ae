"""Head groups of one layer: the KV heads that share a (key precision, value precision) pair, with their stores.

A layer's KV heads are split into one :class:`HeadGroup` per distinct precision pair (:func:`make_groups`); each
group holds its K and V as the parts of its quantizers (:class:`~kvquant.tensor_store.QuantizedTensorStore`) in
the layer's blocks, whose tensors :func:`block_specs` describes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import KVPrecision, KVQuantConfig
from .quantizers import Quantizer, make_quantizer
from .quantizers.base import PartSpec
from .tensor_store import QuantizedTensorStore


@dataclass
class HeadGroup:
    """KV heads of one layer that share a (key precision, value precision) pair."""

    precision: KVPrecision
    heads: list[int]
    key: QuantizedTensorStore
    value: QuantizedTensorStore
    head_index: torch.Tensor = field(repr=False)
    all_heads: bool = False  # the group holds every head, in order (no gather needed)

    @property
    def per_block(self) -> bool:
        """True when the group's K or V has per-block (per-channel) scales."""
        return bool(self.key.quantizer.per_block or self.value.quantizer.per_block)


def group_rows(x: torch.Tensor, group: HeadGroup) -> torch.Tensor:
    """The heads of ``group`` of ``x[B, H, ...]`` (every KV head of the layer), in the group's order."""
    return x if group.all_heads else x.index_select(1, group.head_index)


def make_groups(
    row: list[KVPrecision], config: KVQuantConfig, head_dim: int
) -> list[tuple[KVPrecision, list[int], Quantizer, Quantizer]]:
    """Split a layer's KV heads by (key, value) precision: ``(pair, heads, key quantizer, value quantizer)``."""
    gs = config.effective_group_size(head_dim)
    by_pair: dict[KVPrecision, list[int]] = {}
    for h, p in enumerate(row):
        by_pair.setdefault(p, []).append(h)
    return [
        (pair, heads,
         make_quantizer(pair.key, head_dim, gs, config.headroom, config.block_size, config.codebook_gain,
                        config.codebook_search),
         make_quantizer(pair.value, head_dim, gs, config.headroom, config.block_size, config.codebook_gain,
                        config.codebook_search))
        for pair, heads in by_pair.items()
    ]  # fmt: skip


def block_specs(
    groups: list[tuple[KVPrecision, list[int], Quantizer, Quantizer]],
) -> list[tuple[int, dict[str, PartSpec], dict[str, PartSpec]]]:
    """``(heads, key part specs, value part specs)`` per group: what :class:`~kvquant.blocks.LayerBlocks`
    allocates."""
    return [(len(heads), kq.parts(), vq.parts()) for _, heads, kq, vq in groups]
