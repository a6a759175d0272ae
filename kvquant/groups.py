"""Head groups of one layer: the KV heads that share a (key precision, value precision) pair, with their stores.

A layer's KV heads are split into one :class:`HeadGroup` per distinct precision pair (:func:`make_groups`); each
group holds its K and V as the parts of its quantizers (:class:`~kvquant.tensor_store.QuantizedTensorStore`) in
the layer's blocks, whose tensors :func:`block_specs` describes.
"""

from __future__ import annotations

import copy as _copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .blocks import LayerBlocks
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


def build_groups(
    made: list[tuple[KVPrecision, list[int], Quantizer, Quantizer]], blocks: LayerBlocks, num_heads: int, batch: int,
    device: torch.device,
) -> list[HeadGroup]:
    """The head groups of :func:`make_groups`'s ``made``, their K and V stored in ``blocks`` (group ``gi`` at index
    ``gi``), for ``batch`` rows of a layer of ``num_heads`` KV heads."""
    groups = []
    for gi, (pair, heads, kq, vq) in enumerate(made):
        key, value = QuantizedTensorStore(kq, blocks, gi, "key"), QuantizedTensorStore(vq, blocks, gi, "value")
        key.batch = value.batch = batch
        groups.append(HeadGroup(pair, heads, key, value, torch.tensor(heads, dtype=torch.long, device=device),
                                heads == list(range(num_heads))))  # fmt: skip
    return groups


def copy_groups(groups: list[HeadGroup]) -> list[HeadGroup]:
    """Copies of ``groups`` sharing their blocks, each K / V store with its own static state and clip counts."""
    out = []
    for g in groups:
        kv = []
        for s in (g.key, g.value):
            c = _copy.copy(s)
            c.state = dict(s.state)
            c.counts = s.counts.copy()
            kv.append(c)
        out.append(HeadGroup(g.precision, g.heads, kv[0], kv[1], g.head_index, g.all_heads))
    return out


def index_groups(groups: list[HeadGroup], idx: torch.Tensor) -> None:
    """Rows reordered / selected / repeated (``idx`` on the device): each K / V store's per-sequence static state
    (scales ``[B, H]``, codebook means ...) follows its rows."""
    for g in groups:
        for st in (g.key, g.value):
            q = st.quantizer
            st.state = {n: t.index_select(0, idx) if q.per_sequence(n, t) else t for n, t in st.state.items()}
            st.batch = int(idx.numel())


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


def count_parts(
    groups: list[HeadGroup], out: dict[str, int], held: Callable[[int, QuantizedTensorStore, int], int]
) -> None:
    """Add to ``out`` (``keys`` / ``values`` / ``scales``) the bytes of every part of ``groups`` held
    (``held(group index, K or V store, bytes of one block of the part)``) and their static states."""
    for gi, g in enumerate(groups):
        for kind, s in (("keys", g.key), ("values", g.value)):
            for name, b in s.block_nbytes().items():
                out["scales" if name in ("scale", "zero", "norm") else kind] += held(gi, s, b)
            out["scales"] += s.state_nbytes()


def fake_quantize_groups(
    groups: list[HeadGroup], keys: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys/values[B, H, T, D]`` (storage space) quantized and dequantized with each group's quantizers and state,
    nothing stored."""
    k_out, v_out = torch.empty_like(keys), torch.empty_like(values)
    for g in groups:
        for src, dst, s in ((keys, k_out, g.key), (values, v_out, g.value)):
            y = s.quantizer.dequantize(s.quantizer.quantize(group_rows(src, g), s.state), s.state, src.dtype)
            dst[:, g.head_index] = y
    return k_out, v_out
