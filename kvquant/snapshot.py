"""The contract between a layer's store and the attention: what one attention call reads, as an immutable snapshot.

:class:`KVSnapshot` is built by the store (:meth:`kvquant.store.LayerStore.snapshot`) at the start of an
attention call, after the chunk was written, and read by the attention only
(:mod:`kvquant.kernels.dispatch`, the torch walk :mod:`kvquant.kernels.attention_torch`, the Triton adapter
:mod:`kvquant.kernels.triton_attention`): the kernels import this module and the quantizer interface
(:mod:`kvquant.quantizers`), never the store, the cache or the pool.

What it holds, by reference (building one copies no tensor and allocates no history; the records are named tuples,
immutable and cheap to build, since one is built per layer and step):

* the layout: batch rows, KV heads, head_dim, tokens per block, device; the pool end ``q_end`` (tokens
  ``[0, q_end)`` are quantized), the block tables and the tokens they can cover (``capacity``);
* per head group (:class:`GroupSnapshot`): its heads and, for K and V, the part tensors, quantizer and static
  state (:class:`PartSnapshot`: what a kernel operand is made of);
* the full-precision history: sink rows (:class:`SinkRows`) and the residual window / held rows
  (:class:`ResidualRows`);
* the refinement rows: the age ladder's young rows (``ladder_n``) and the heavy rows (``heavy_rows`` a head);
* the storage-space transforms (:class:`StorageSpace`: rotation, key centering, codebook head spaces);
* the eviction slots (:class:`EvictionSlots`, an evicting layer only) and, with offloaded blocks, the staging
  context that brings them into device blocks for kernels that read the arena directly (:meth:`KVSnapshot.staged`).

Reading the history through the store's own decode (sinks merged, the ladder's and heavy rows refined, offloaded
tiles prefetched) goes through typed callables the store binds into the snapshot (:attr:`GroupSnapshot.read`,
:attr:`GroupSnapshot.read_factored`, :attr:`KVSnapshot.tiles`): the snapshot says what is there, the store keeps
how it is decoded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from .quantizers.base import Factored, Quantizer
from .rotation import fwht

#: ``(a, b, K, V)`` pieces covering a token range in order (see :attr:`GroupSnapshot.read_factored`)
Pieces = list[tuple[int, int, Factored, Factored]]
#: a group's heavy rows: positions ``[B, Hg, n]`` (-1: none; None: the group holds none), then per side (K, V)
#: the refined and the base decode (float32, the attention's space; None: a side without refinement)
HeavyRows = tuple[torch.Tensor | None, list[torch.Tensor | None], list[torch.Tensor | None]]


class RowsMemo:
    """A one-entry memo of rows a kernel builds from one part's static state (codebook level tables), owned by
    the part's K or V store (its copies share it) and handed to every snapshot of it: built again only when the
    state tensors it was built from or the shape change."""

    def __init__(self) -> None:
        self._same: tuple[object, ...] = ()
        self._shape: tuple[object, ...] = ()
        self._rows: torch.Tensor | None = None

    def get(
        self, same: tuple[object, ...], shape: tuple[object, ...], build: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        """The rows for the state objects ``same`` (compared by identity: state tensors are replaced, never changed
        in place) and the values ``shape`` (compared by equality), from ``build()`` when either differs from the
        last call's."""
        hit = self._rows is not None and self._shape == shape and len(self._same) == len(same) and all(
            a is b for a, b in zip(self._same, same, strict=True))  # fmt: skip
        if not hit or self._rows is None:
            self._same, self._shape, self._rows = same, shape, build()
        return self._rows


class PartSnapshot(NamedTuple):
    """The K (or V) of one head group: its quantizer, static state and part tensors (the layer's block arena,
    ``[num_blocks, heads, block_size or 1, *shape]``), as a kernel operand is made of."""

    quantizer: Quantizer
    parts: Mapping[str, torch.Tensor]
    state: Mapping[str, torch.Tensor]
    batch: int
    heads: int
    block_size: int
    device: torch.device
    memo: RowsMemo


class GroupSnapshot(NamedTuple):
    """The KV heads of one layer that share a (key, value) precision pair.

    ``read(start, end)``: K and V of tokens ``[start, end)`` as float32 ``[B, Hg, t, D]`` in the attention's space
    (storage space; a codebook side: its head space), sinks, residual, the ladder's and heavy rows as the store
    reads them. ``read_factored(start, end)``: the same values as :data:`Pieces`, pool tokens as codes and scales
    where the quantizer factors them. ``heavy_rows()``: the group's heavy rows (:data:`HeavyRows`)."""

    heads: Sequence[int]
    head_index: torch.Tensor
    all_heads: bool
    key: PartSnapshot
    value: PartSnapshot
    read: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    read_factored: Callable[[int, int], Pieces]
    heavy_rows: Callable[[], HeavyRows]


class SinkRows(NamedTuple):
    """Each row's first ``tokens`` real tokens in full precision, ``k``/``v [B, Hkv, tokens, D]`` (storage space);
    row ``b``'s sinks sit at positions ``row_start[b] + [0, tokens)``."""

    k: torch.Tensor
    v: torch.Tensor
    tokens: int


class ResidualRows(NamedTuple):
    """The history ``[q_end, q_end + held)`` in full precision (residual window, or tokens held while static
    scales wait): ``rows(end)`` gives ``[q_end, end)`` of every KV head ``[B, Hkv, t, D]`` as the attention reads
    it (storage space)."""

    held: int
    rows: Callable[[int], tuple[torch.Tensor, torch.Tensor]]


class StorageSpace(NamedTuple):
    """How fresh K/V, queries and outputs are mapped into the space the history is stored in.

    Storage space: ``rotate_keys`` / ``rotate_values`` (Hadamard) and ``key_mean`` (``[B, Hkv, 1, D]``, centered
    keys); ``to_storage(k, v)`` applies both to fresh K/V. Head spaces (codebook heads, ``head_space``): each such
    head's K / V is read in its own rotated space; ``kv_to_head`` / ``kv_from_head`` map full-precision rows
    ``[B, Hkv, T, D]``, ``query_to_head`` queries ``[B, Hq, T, D]``, ``output_from_head`` the attention output.
    ``centered_keys``: some head space removes a per-channel key mean."""

    rotate_keys: bool
    rotate_values: bool
    key_mean: torch.Tensor | None
    head_space: bool
    centered_keys: bool
    to_storage: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    kv_to_head: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    kv_from_head: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    query_to_head: Callable[[torch.Tensor], torch.Tensor]
    output_from_head: Callable[[torch.Tensor], torch.Tensor]

    @property
    def transforms(self) -> bool:
        """True when K or V are stored rotated and/or centered: fresh K/V (and queries) must be mapped too."""
        return self.rotate_keys or self.rotate_values or self.key_mean is not None

    def query_in(self, query: torch.Tensor) -> torch.Tensor:
        """Queries into storage space (rotated with the keys: the Hadamard matrix is orthogonal)."""
        return fwht(query) if self.rotate_keys else query

    def output_out(self, out: torch.Tensor) -> torch.Tensor:
        """The attention output back from storage space (the Hadamard matrix is its own inverse)."""
        return fwht(out) if self.rotate_values else out


class EvictionSlots(Protocol):
    """The slot map of an evicting layer (:class:`kvquant.slots.SlotMap`): its history axis holds slots."""

    @property
    def tracking(self) -> str | None: ...

    @property
    def holes(self) -> bool: ...

    def attention_mask(self, mask: torch.Tensor | None, past: int, tq: int, rep: int) -> torch.Tensor:
        """The attention mask over the slots of the history and the ``tq`` chunk tokens (``rep`` query heads a
        KV head)."""
        ...

    def observe(self, mass: torch.Tensor) -> None:
        """Take the attention mass ``[B, Hkv, slots]`` each history slot received (tracking policies)."""
        ...


class KVSnapshot(NamedTuple):
    """What one attention call reads of a layer's store (see the module doc).

    ``table``: the rows' block tables, int64 ``[B, max_blocks]`` (released and missing entries point at block 0,
    never visible; ``lanes``: ``[B, Hkv, max_lanes]`` lane ids); ``capacity``: tokens the tables plus the free
    blocks cover per row. ``has_dense_segments``: some history is read from full-precision rows (sinks, residual,
    held tokens). ``ladder_n``: the age ladder's young pool rows ``[q_end - ladder_n, q_end)``, read refined.
    ``heavy_rows``: heavy rows a head (0: none). ``tiles(past_len, size)``: key ranges covering ``[0, past_len)``
    that never straddle the pool / residual boundary (released blocks skipped). ``stage``: with blocks in the
    host tier, a context that stages them into device blocks and gives the snapshot of that state (None: every
    block is on the device). ``slot_shift``: per-row block grids (a left-padded batch with per-channel keys):
    row ``b``'s position ``p`` lives at slot ``p + slot_shift[b]`` of its blocks, the pool holds slots ``[0,
    q_end + max(slot_shift))`` of every row (none while ``q_end`` is 0); ``read`` / ``read_factored`` /
    ``residual`` give positions, kernels that read ``table`` map each row's positions onto its slots; None: slots
    are positions."""

    batch: int
    num_heads: int
    head_dim: int
    block_size: int
    device: torch.device
    q_end: int
    row_start: torch.Tensor
    table: torch.Tensor
    capacity: int
    groups: tuple[GroupSnapshot, ...]
    space: StorageSpace
    has_dense_segments: bool
    sinks: SinkRows | None
    residual: ResidualRows | None
    ladder_n: int
    heavy_rows: int
    lanes: bool
    slots: EvictionSlots | None
    tiles: Callable[[int, int], list[tuple[int, int]]]
    stage: Callable[[], AbstractContextManager[KVSnapshot]] | None
    slot_shift: list[int] | None = None

    @contextlib.contextmanager
    def staged(self) -> Iterator[KVSnapshot]:
        """For kernels that read the arena through :attr:`table`: the snapshot with every host block staged into
        a device block for the duration of the block (this snapshot itself when there is none)."""
        if self.stage is None:
            yield self
            return
        with self.stage() as staged:
            yield staged


@runtime_checkable
class SnapshotSource(Protocol):
    """Something that publishes a :class:`KVSnapshot` (a layer's store)."""

    def snapshot(self) -> KVSnapshot: ...


def as_snapshot(layer: KVSnapshot | SnapshotSource) -> KVSnapshot:
    """``layer`` itself when it is a snapshot, else the snapshot it publishes now."""
    return layer if isinstance(layer, KVSnapshot) else layer.snapshot()


__all__ = [
    "EvictionSlots", "GroupSnapshot", "HeavyRows", "KVSnapshot", "PartSnapshot", "Pieces", "ResidualRows",
    "RowsMemo", "SinkRows", "SnapshotSource", "StorageSpace", "as_snapshot",
]
