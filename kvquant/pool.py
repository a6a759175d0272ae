"""``PagedKVPool``: the quantized blocks of one model and config, shared by many caches.

One :class:`~kvquant.blocks.LayerBlocks` per layer (block tensors for every head group and part,
a free list, reference counts). Caches built on the pool (:class:`~kvquant.QuantizedKVCache` with
``pool=``, or :meth:`QuantizedKVCache.from_pool`) are views: one block table per row and layer.

Prefix reuse (vLLM's automatic prefix caching, SGLang's radix cache, for quantized blocks): a cache
bound to token ids indexes each full block it writes under a hash of (every token id up to the
block's end, the config, the model). :meth:`QuantizedKVCache.from_pool` starts a new cache from the
longest run of indexed whole blocks of its ids, shared (referenced, not copied), so the model's
forward runs only over the remaining tokens. The index holds one reference per block; a bounded
pool evicts index-only blocks (least recently used first) before it reports :class:`KVCacheFull`.

When a prefix is reusable: per-token and per-group schemes (``int8-token``, ``int4/3/2``) always --
a token's quantized bytes depend on that token alone (per-channel key blocks: on its block alone).
Schemes with a static per-head scale (``int8``, ``fp8-*``) only with a ``scales_file`` (the same calibration for
every request; the file's contents are part of the hash); without one each cache calibrates on its
own first chunk, so nothing is indexed. Not indexed either: ``sink_tokens`` (per-sequence fp16
copies), ``evict`` (blocks hold each sequence's own kept tokens) and models with sliding-window layers
(their old blocks are released).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from .blocks import KVCacheFull, LayerBlocks, block_bytes
from .config import KVQuantConfig
from .errors import ArgumentError, DeviceError
from .shape import ModelShape, sliding_windows
from .store import LayerStore, block_specs, make_groups

__all__ = ["KVCacheFull", "PagedKVPool"]


def _digest(*parts: Any) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\0")
    return h.digest()


class PagedKVPool:
    """Preallocated quantized KV blocks for one model and config, shared by many caches.

    Args:
        model: the transformers model (or a :class:`~kvquant.ModelShape`).
        config: a :class:`KVQuantConfig`, preset name or config file.
        max_bytes: bound on the block tensors of all layers together (sized at the first write; a write
            that does not fit raises :class:`KVCacheFull`). ``None``: grow on demand.
        block_size: tokens per block; defaults to the config's (for per-channel key precisions it is
            also their quantization block).

    Example::

        pool = kvquant.PagedKVPool(model, "int8-token", max_bytes=2**30)
        cache = kvquant.QuantizedKVCache.from_pool(pool, input_ids)   # holds the longest cached prefix already
        out = model.generate(input_ids, cache=cache, max_new_tokens=64)
        print(pool.stats())
    """

    def __init__(
        self,
        model: Any,
        config: KVQuantConfig | str | Path = "int8",
        max_bytes: int | None = None,
        block_size: int | None = None,
    ) -> None:
        cfg = KVQuantConfig.load(config)
        if block_size is not None and block_size != cfg.block_size:
            cfg = KVQuantConfig.load({**cfg.to_dict(), "block_size": block_size})
        self.config = cfg
        self.model = model
        self.shape = ModelShape.of(model)
        self.plan = cfg.resolve(self.shape)
        self.windows = sliding_windows(model, self.shape.num_layers)
        self.block_size = cfg.block_size
        self.max_bytes = max_bytes
        self._specs = [block_specs(make_groups(row, cfg, self.shape.head_dim)) for row in self.plan]
        per_block = sum(block_bytes(s, self.block_size) for s in self._specs)
        self.block_bytes = per_block  # one block of every layer: the unit max_bytes is counted in
        self.blocks_per_layer: int | None = None
        if max_bytes is not None:
            self.blocks_per_layer = int(max_bytes) // per_block
            if self.blocks_per_layer < 1:
                raise ArgumentError(f"max_bytes: {max_bytes} holds no block (one block of every layer: "
                                    f"{per_block} bytes)")
        self.layers: list[LayerBlocks | None] = [None] * self.shape.num_layers
        self.index: dict[bytes, list[int]] = {}  # prefix hash -> block id per layer (-1: not yet written)
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        #: entries added to or dropped from the index so far (a scheduler's refused admission is retried once the
        #: index changed: a new entry may be a prefix hit)
        self.index_changes = 0
        self._root = self._root_digest()

    # ------------------------------------------------------------------ blocks
    def layer_blocks(self, layer: int, device: torch.device) -> LayerBlocks:
        """The blocks of ``layer`` (created on the first use, on ``device``)."""
        blocks = self.layers[layer]
        if blocks is None:
            bounded = self.blocks_per_layer is not None
            blocks = LayerBlocks(self._specs[layer], self.block_size, device, num_blocks=self.blocks_per_layer or 0,
                                 fixed=bounded, layer=layer)  # fmt: skip
            if bounded:
                blocks.on_full = lambda n, i=layer: self.evict(i, n)
            self.layers[layer] = blocks
        elif blocks.device != device:
            raise DeviceError(f"device: layer {layer}'s blocks are on {blocks.device}, the key states on {device}")
        return blocks

    def admit(self, stores: list[LayerStore | None], tokens: int) -> None:
        """Raise :class:`KVCacheFull` before a forward writes ``tokens`` tokens per row into ``stores`` if a
        bounded pool could not hold them without sharing (checked for every layer, so that a failed
        forward leaves no layer half-written)."""
        if self.blocks_per_layer is None:
            return
        for i, store in enumerate(stores):
            if store is None:
                continue
            need = store.blocks_needed(tokens)
            if need > len(store.blocks.free):
                self.evict(i, need - len(store.blocks.free))
            if need > len(store.blocks.free):
                raise KVCacheFull(need, len(store.blocks.free), i)

    def evict(self, layer: int, n: int) -> None:
        """Drop least recently used prefix-index entries whose block in ``layer`` only the index holds,
        until ``n`` more blocks of that layer are free (or none is left to drop)."""
        blocks = self.layers[layer]
        if blocks is None:
            return
        goal = len(blocks.free) + n
        for h in list(self.index):
            if len(blocks.free) >= goal:
                break
            ids = self.index[h]
            if ids[layer] >= 0 and blocks.refs[ids[layer]] == 1:
                self._drop(h)

    def _drop(self, h: bytes) -> None:
        self.index_changes += 1
        for i, b in enumerate(self.index.pop(h)):
            if b >= 0:
                self.layers[i].decref([b])  # type: ignore[union-attr]

    def clear_prefixes(self) -> None:
        """Forget every indexed prefix (their blocks return to the free list unless a cache holds them)."""
        for h in list(self.index):
            self._drop(h)

    # ------------------------------------------------------------------ prefix index
    def _root_digest(self) -> bytes | None:
        """Digest of (config, model, calibration) under which blocks may be shared; None when not."""
        cfg = self.config
        if cfg.sink_tokens or cfg.evict is not None or any(w is not None for w in self.windows):
            return None
        calibration = b""
        static = any(kq.static or vq.static for row in self.plan
                     for _, _, kq, vq in make_groups(row, cfg, self.shape.head_dim))  # fmt: skip
        if static:
            if not cfg.scales_file or not Path(cfg.scales_file).is_file():
                return None
            calibration = Path(cfg.scales_file).read_bytes()
        model_cfg = getattr(self.model, "config", None)
        model_id = (model_cfg.to_json_string(use_diff=False) if hasattr(model_cfg, "to_json_string")
                    else repr(self.shape))  # fmt: skip
        return _digest(json.dumps(cfg.to_dict(), sort_keys=True, default=str), model_id, calibration)

    @property
    def reusable(self) -> bool:
        """True when this pool's config and model allow prefix reuse (see the module doc)."""
        return self._root is not None

    def block_hashes(self, ids: list[int]) -> list[bytes]:
        """Hash of every whole block of ``ids``: block ``j`` hashes ids ``[0, (j + 1) * block_size)``."""
        out, h = [], self._root or b""
        bs = self.block_size
        for j in range(len(ids) // bs):
            h = _digest(h, ",".join(map(str, ids[j * bs:(j + 1) * bs])))
            out.append(h)
        return out

    def record(self, h: bytes, layer: int, block: int) -> None:
        """Index ``block`` of ``layer`` under prefix hash ``h`` (the index takes one reference)."""
        ids = self.index.setdefault(h, [-1] * self.shape.num_layers)
        if ids[layer] < 0:
            self.index_changes += 1
            ids[layer] = block
            self.layers[layer].incref([block])  # type: ignore[union-attr]

    def lookup(self, hashes: list[bytes]) -> list[list[int]]:
        """Block ids per layer of the longest run of fully indexed blocks (refreshing their recency)."""
        found: list[list[int]] = []
        for h in hashes:
            ids = self.index.get(h)
            if ids is None or min(ids) < 0:
                break
            self.index[h] = self.index.pop(h)  # most recently used last
            found.append(ids)
        return found

    def match_prefix(
        self, input_ids: torch.Tensor, align: int | None = None
    ) -> tuple[list[list[int]], list[list[list[int]]], int]:
        """The rows of ``input_ids[B, T]`` (or ``[T]``) as lists, the block ids (per row, per block, per layer) of
        the longest indexed run of whole blocks of every row's ids (at most ``T - 1`` tokens, so a forward has one
        token to run; the same count for every row), and that run's length in tokens. Counted in :meth:`stats`
        (queries and hits); the blocks found become the most recently used.

        ``align``: a multiple of ``block_size``; the run is cut down to a multiple of it (a scheduler that
        prefills in chunks of ``align`` tokens then starts at a chunk boundary, as a run without the hit would)."""
        if align is not None and (align < 1 or align % self.block_size):
            raise ValueError(f"align: {align} is not a positive multiple of block_size {self.block_size}")
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        rows = [r.tolist() for r in ids]
        self.prefix_query_tokens += sum(len(r) for r in rows)
        if not self.reusable:
            return rows, [], 0
        limit = (ids.shape[1] - 1) // self.block_size
        if align is not None:
            limit = limit * self.block_size // align * align // self.block_size
        found = [self.lookup(self.block_hashes(r)[:limit]) for r in rows]
        n = min(len(f) for f in found)
        self.prefix_hit_tokens += n * self.block_size * len(rows)
        return rows, [[f[j] for j in range(n)] for f in found], n * self.block_size

    # ------------------------------------------------------------------ accounting
    def stats(self) -> dict[str, int]:
        """Blocks (summed over layers) and bytes in use (device and, with ``offload``, host), and the prefix index's
        counters."""
        made = [b for b in self.layers if b is not None]
        return {
            "blocks_total": sum(b.num_blocks for b in made),
            "blocks_used": sum(b.used for b in made),
            "blocks_free": sum(len(b.free) for b in made),
            "blocks_shared": sum(sum(r > 1 for r in b.refs) for b in made),
            "bytes_used": sum(b.used * b.bytes_per_block for b in made),
            "bytes_total": sum(b.nbytes() for b in made),
            # offload: blocks and bytes in the host tier (not in blocks_used / bytes_used, which are device blocks)
            "blocks_host": sum(b.host.used for b in made if b.host is not None),
            "bytes_host": sum(b.host.used * b.host.bytes_per_block for b in made if b.host is not None),
            "indexed_blocks": len(self.index),
            "prefix_query_tokens": self.prefix_query_tokens,
            "prefix_hit_tokens": self.prefix_hit_tokens,
        }

    def __repr__(self) -> str:
        bound = "unbounded" if self.max_bytes is None else f"max_bytes={self.max_bytes}"
        return (f"PagedKVPool(config={self.config.name or 'custom'!r}, layers={self.shape.num_layers}, "
                f"block_size={self.block_size}, {bound})")  # fmt: skip
