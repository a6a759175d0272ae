"""The storage space of one layer's store: Hadamard rotation, key centering, and the codebook heads' own spaces.

* ``rotate``: K (and V) are stored Hadamard-rotated (:mod:`kvquant.rotation`); the attention rotates the queries
  alike and un-rotates the output, so scores are unchanged.
* ``center_keys`` (default with ``rotate``): one per-channel key mean per (sequence, KV head), ``key_mean``, taken
  from the first chunk written (the prefill, sink tokens left out), is subtracted from every key before rotation
  and quantization. Every key a query sees is shifted by the same ``mu``, so each score moves by the same ``q.mu``
  and softmax is unchanged; a large per-channel offset (q/k/v bias) is then neither spread over every channel by
  the rotation nor spent in the quantization range.
* Head spaces: a head whose K or V a codebook quantizer stores is read in that quantizer's own (rotated) space,
  once its state is fitted; queries and outputs are mapped per step (:func:`query_to_head`, :func:`output_from_head`),
  never the stored rows.

:class:`Space` is the component of a :class:`~kvquant.store.LayerStore` that holds the storage-space state (the
rotation flags and the key mean, which follows the rows); the head-space maps take the layer's head groups.
"""

from __future__ import annotations

import torch

from .groups import HeadGroup, group_rows
from .rotation import fwht
from .snapshot import StorageSpace


class Space:
    """Rotation and key centering of one layer (see the module doc)."""

    def __init__(self, rotate_keys: bool, rotate_values: bool, center_keys: bool) -> None:
        self.rotate_keys = rotate_keys
        self.rotate_values = rotate_values
        self.center_keys = center_keys
        self.key_mean: torch.Tensor | None = None  # [B, H, 1, D] float32, set by the first write

    @property
    def transforms(self) -> bool:
        """True when K or V are stored transformed (rotated and/or centered): fresh K/V must be mapped too."""
        return self.rotate_keys or self.rotate_values or self.center_keys

    def fix_key_mean(self, keys: torch.Tensor, use: torch.Tensor) -> None:
        """Fix the per-channel key mean of each sequence and head from its first chunk ``keys[B, H, T, D]``, over the
        tokens ``use[B, T]`` selects (a row that selects none: over the whole chunk). No-op without centering or once
        fixed."""
        if not self.center_keys or self.key_mean is not None:
            return
        use = torch.where(use.any(dim=1, keepdim=True), use, torch.ones_like(use))
        w = use[:, None, :, None].float()
        self.key_mean = (keys.detach().float() * w).sum(dim=2, keepdim=True) / w.sum(dim=2, keepdim=True)

    def to_storage(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply the key centering and Hadamard rotation (identity when both are off)."""
        if self.key_mean is not None:
            keys = (keys.float() - self.key_mean).to(keys.dtype)
        return (fwht(keys) if self.rotate_keys else keys), (fwht(values) if self.rotate_values else values)

    def from_storage(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`to_storage` (the Hadamard matrix is its own inverse)."""
        keys = fwht(keys) if self.rotate_keys else keys
        values = fwht(values) if self.rotate_values else values
        if self.key_mean is not None:
            keys = (keys.float() + self.key_mean).to(keys.dtype)
        return keys, values

    def copy(self) -> Space:
        """A copy with its own key mean."""
        new = Space(self.rotate_keys, self.rotate_values, self.center_keys)
        new.key_mean = None if self.key_mean is None else self.key_mean.clone()
        return new

    def index_batch(self, idx: torch.Tensor) -> None:
        """Rows reordered / selected / repeated (``idx`` on the device): each row's key mean follows it."""
        if self.key_mean is not None:
            self.key_mean = self.key_mean.index_select(0, idx)

    def reset(self) -> None:
        """Forget the key mean (the next first write fixes it again)."""
        self.key_mean = None

    def nbytes(self) -> int:
        """Bytes of the key mean held (0 without one)."""
        return 0 if self.key_mean is None else self.key_mean.numel() * self.key_mean.element_size()

    def snapshot(self, groups: list[HeadGroup], num_heads: int, calibrated: bool) -> StorageSpace:
        """The attention's view (:class:`~kvquant.snapshot.StorageSpace`), the head-space maps bound to ``groups``."""
        return StorageSpace(
            self.rotate_keys, self.rotate_values, self.key_mean, has_head_space(groups, calibrated),
            centered_keys(groups), self.to_storage, lambda k, v: kv_to_head(groups, k, v),
            lambda k, v: kv_from_head(groups, k, v), lambda q: query_to_head(groups, num_heads, q),
            lambda o: output_from_head(groups, num_heads, o),
        )  # fmt: skip


def has_head_space(groups: list[HeadGroup], calibrated: bool) -> bool:
    """True when some head's K or V is read in a rotated head space (codebook quantizers; once fitted: while
    calibration is deferred every token is held dense, in storage space)."""
    return calibrated and any(g.key.quantizer.space or g.value.quantizer.space for g in groups)


def centered_keys(groups: list[HeadGroup]) -> bool:
    """True when some head's keys are stored with a per-channel mean removed (codebook quantizers)."""
    return any(g.key.quantizer.space and g.key.quantizer.center for g in groups)


def map_heads(groups: list[HeadGroup], x: torch.Tensor, side: str, method: str) -> torch.Tensor:
    """Apply the ``side`` (``key``/``value``) quantizer's ``method`` (``to_space``, ...) to the heads of
    ``x[B, Hkv, ...]`` whose K/V has a head space; other heads are returned unchanged."""
    out = x
    for g in groups:
        s = g.key if side == "key" else g.value
        if not s.quantizer.space:
            continue
        y = getattr(s.quantizer, method)(group_rows(x, g), s.state).to(x.dtype)
        if g.all_heads:
            return y
        out = x.clone() if out is x else out
        out.index_copy_(1, g.head_index, y)
    return out


def kv_to_head(groups: list[HeadGroup], keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-precision ``keys/values[B, Hkv, T, D]`` (storage space) -> each head's K / V space."""
    return map_heads(groups, keys, "key", "to_space"), map_heads(groups, values, "value", "to_space")


def kv_from_head(
    groups: list[HeadGroup], keys: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`kv_to_head` (tests and debugging)."""
    return map_heads(groups, keys, "key", "from_space"), map_heads(groups, values, "value", "from_space")


def query_to_head(groups: list[HeadGroup], num_heads: int, query: torch.Tensor) -> torch.Tensor:
    """Queries ``[B, Hq, T, D]`` -> each KV head's key space (rotated once per step, never the keys)."""
    B, Hq, T, D = query.shape
    q5 = query.reshape(B, num_heads, Hq // num_heads, T, D)
    return map_heads(groups, q5, "key", "query_to_space").reshape(B, Hq, T, D)


def output_from_head(groups: list[HeadGroup], num_heads: int, out: torch.Tensor) -> torch.Tensor:
    """Attention output ``[B, Hq, T, D]`` in each head's value space -> storage space (once per step)."""
    B, Hq, T, D = out.shape
    o5 = out.reshape(B, num_heads, Hq // num_heads, T, D)
    return map_heads(groups, o5, "value", "from_space").reshape(B, Hq, T, D)


def dense_to_group_space(
    group: HeadGroup, k: torch.Tensor, v: torch.Tensor, calibrated: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-precision rows of ``group`` -> its head space (float32; as they are while not ``calibrated``)."""
    if not calibrated:
        return k.float(), v.float()
    k = group.key.quantizer.to_space(k, group.key.state) if group.key.quantizer.space else k.float()
    v = group.value.quantizer.to_space(v, group.value.state) if group.value.quantizer.space else v.float()
    return k, v
