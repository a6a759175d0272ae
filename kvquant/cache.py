"""``QuantizedKVCache``: a transformers 5.x ``Cache`` whose layers store K/V quantized, in blocks.

One ``QuantizedLayer`` per model layer (the ``CacheLayerMixin`` interface: ``update``,
``get_seq_length``, ``get_mask_sizes``, ``reorder_cache``, ``crop``, ``reset``). ``update`` quantizes
the new tokens into the layer's :class:`~kvquant.store.LayerStore` (block tables over the blocks of
a :class:`~kvquant.PagedKVPool`, or private blocks) and publishes a :class:`~kvquant.view.LayerView`
for the ``kvquant`` attention (:mod:`kvquant.view`), so the cache never hands out a full-precision
copy of the history.
"""

from __future__ import annotations

import copy
import secrets
import sys
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import view as handoff
from .config import DEFAULT_PRESET, MAX_CAPACITY, KVPrecision, KVQuantConfig, check_int
from .errors import ArgumentError, InputError
from .evict import Policy, choose_slots, window_attention
from .outliers import OutlierWatch
from .plan import LayerPlan
from .plan import resolve as resolve_plan
from .scales import load_static_amax
from .shape import ModelShape, model_dtype, sliding_windows
from .store import LayerStore, row_index

if TYPE_CHECKING:
    from .pool import PagedKVPool

ATTN_NAME = "kvquant"
CLIP_WARN_RATE = 1e-3  # warn (once per cache) when static scales clip more than this fraction of values
HEAVY_SCORE_ELEMENTS = 1 << 24  # fp32 scores per query tile when a prompt picks its heavy rows (64 MiB)


class BoundIdsError(InputError):
    """A forward's input ids do not extend the token ids a prefix-reuse cache is bound to (its blocks would be
    indexed under another prompt's hashes); the message names ``reset()``."""


def check_removal(tokens_to_remove: Any) -> int:
    """``tokens_to_remove`` of a crop when it is an integer <= 0 (transformers' convention), else ArgumentError."""
    if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
        raise ArgumentError(f"crop: tokens_to_remove {tokens_to_remove!r} must be an integer (a negative count)")
    if tokens_to_remove > 0:
        raise ArgumentError(f"crop: tokens_to_remove {tokens_to_remove} is positive; pass a negative number of "
                            "tokens to remove")
    return tokens_to_remove


def new_session_id() -> str:
    """A fresh random id for one sequence's cache (creation, reset, deep copy)."""
    return f"kvq-{secrets.token_hex(6)}"


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


class QuantizedLayer(CacheLayerMixin):
    """One layer of a :class:`QuantizedKVCache`: a :class:`LayerStore` created on the first update."""

    is_compileable = False
    is_sliding = False  # sliding layers keep absolute positions (the mask hides old keys); see ``window``

    @property
    def is_croppable(self) -> bool:
        """Crop can undo any token (see :meth:`LayerStore.crop`), except that per-channel blocks without a
        full-precision window (``residual_tokens: 0``) can only be cut at block boundaries, and that a layer
        with an eviction policy cannot be cropped."""
        if self.policy is not None:  # an evicting layer holds kept tokens, not a prefix of the sequence
            return False
        return self.store is None or not self.store.per_block or self.store.residual_tokens > 0

    def __init__(
        self,
        layer_idx: int,
        row: list[KVPrecision],
        config: KVQuantConfig,
        head_dim: int,
        static_amax: dict[str, torch.Tensor] | None = None,
        capacity: int | None = None,
        pool: PagedKVPool | None = None,
        window: int | None = None,
        watch: OutlierWatch | None = None,
        policy: Policy | None = None,
        *,
        plan: LayerPlan,
    ) -> None:
        super().__init__()
        #: what this layer gets (kvquant.plan): the store is built from it
        self.layer_plan = plan
        self.watch = watch
        # eviction (kvquant.evict): which tokens this layer keeps; sliding-window layers keep their window
        self.policy = policy if window is None else None
        self.layer_idx = layer_idx
        self.row = row
        self.config = config
        self.head_dim = head_dim
        self.static_amax = static_amax
        self.capacity = capacity
        self.pool = pool
        self.window = window
        self.store: LayerStore | None = None
        # bound to a model: the chunk of the last update, written when the kvquant attention reads it
        # (the attention has the mask, hence each row's left padding, which the first write needs)
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.monitor: ClipMonitor | None = None  # set by the cache: clipping over all layers
        # when bound to a model, every update must be read by the kvquant attention before the next one
        self.strict = True
        self.owner: QuantizedKVCache | None = None

    def __repr__(self) -> str:
        pos = self.store.cache_pos if self.store else 0
        return f"QuantizedLayer(layer={self.layer_idx}, cache_pos={pos})"

    def make_store(self, batch: int, device: torch.device) -> LayerStore:
        blocks = self.pool.layer_blocks(self.layer_idx, device) if self.pool is not None else None
        self.store = LayerStore(
            self.row, self.config, self.head_dim, batch=batch, device=device, static_amax=self.static_amax,
            capacity=self.capacity, blocks=blocks, window=self.window, plan=self.layer_plan,
        )  # fmt: skip
        self.is_initialized = True
        return self.store

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
        self.make_store(key_states.shape[0], key_states.device)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize and store the new tokens; publish the layer's view for the attention."""
        if self.store is None:
            self.lazy_initialization(key_states, value_states)
        assert self.store is not None
        self.device, self.dtype = key_states.device, key_states.dtype
        if key_states.shape[0] != self.store.batch:
            raise ValueError(
                f"key_states: batch {key_states.shape[0]} does not match the cache's batch {self.store.batch}"
            )
        if self.owner is not None and self.pool is not None and self.layer_idx == 0:
            self.owner.admit(key_states.shape[2], key_states.shape[0], key_states.device)
        if self.watch is not None and self.store.cache_pos == 0:
            self.watch.observe(self.layer_idx, key_states)
        past = self.store.cache_pos
        if self.strict:
            self._pending = (key_states, value_states)
        else:
            self._write(key_states, value_states)
        handoff.publish(key_states, handoff.LayerView(self.layer_idx, self.store, past, self.strict, self.commit))
        return key_states, value_states

    def _write(
        self, keys: torch.Tensor, values: torch.Tensor, row_start: torch.Tensor | None = None,
        context: dict[str, Any] | None = None,
    ) -> None:
        assert self.store is not None
        q_end = self.store.q_end
        if self.policy is None:
            self.store.append(keys, values, row_start, self._heavy_scores(keys, context or {}))
        else:
            self._write_evicting(keys, values, row_start, context or {})
        if self.owner is not None:
            self.owner.index_new_blocks(self.layer_idx, q_end)
        self._check_clipping(keys.shape[2])

    def _heavy_scores(self, keys: torch.Tensor, context: dict[str, Any]) -> torch.Tensor | None:
        """What the store picks heavy rows by (``heavy_tokens``, :mod:`kvquant.heavy`), while it has none: the
        softmax weight each key of a multi-token chunk received from the chunk's queries, summed over them and over
        the query heads of its KV head (H2O's score), ``[B, H, T]``; else None."""
        store = self.store
        assert store is not None
        if not store.refine.heavy_tokens or store.refine.heavy or keys.shape[2] < 2:
            return None
        if context.get("queries") is None:
            raise ValueError(
                "heavy_tokens: heavy rows are picked by the model's queries; build the cache for a model whose "
                "attention is kvquant's (kvquant.wrap), not for a bare ModelShape"
            )
        mask, past = context.get("mask"), store.cache_pos
        if mask is not None:  # the chunk's own keys
            mask = mask[..., past:past + keys.shape[2]]
        q = context["queries"]
        tile = max(1, min(256, HEAVY_SCORE_ELEMENTS // (q.shape[0] * q.shape[1] * keys.shape[2])))  # a long prompt
        return window_attention(q, keys, context.get("scaling") or keys.shape[-1] ** -0.5, mask, tile)

    def _write_evicting(
        self, keys: torch.Tensor, values: torch.Tensor, row_start: torch.Tensor | None, context: dict[str, Any]
    ) -> None:
        """Write through the layer's eviction policy: the first chunk (the prompt) is scored and only its
        kept tokens stored; later chunks are appended, except that a decode-time policy (H2O, TOVA) writes
        each new token over its lowest-scoring token once a head holds its budget."""
        store, policy = self.store, self.policy
        assert store is not None and policy is not None
        B, H, T, _ = keys.shape
        slots = store.slots
        if slots is None:
            if policy.needs_queries and context.get("queries") is None:
                raise ValueError(
                    f"evict.policy: {policy.name} scores tokens with the model's queries; build the cache for a "
                    "model whose attention is kvquant's (kvquant.wrap), not for a bare ModelShape"
                )
            pos = torch.arange(T, device=keys.device)
            valid = (pos[None, :] >= (row_start.view(-1, 1) if row_start is not None else 0)).expand(B, T)
            kwargs = {"attention_mask": context.get("mask"), "queries": context.get("queries"),
                      "scaling": context.get("scaling"), "valid": valid}  # fmt: skip
            scores = policy.scorer.score(context.get("module"), None, keys, values, None, kwargs)
            keep = policy.budget.keep_mask(scores, valid)
            cap = None
            if policy.tracking:  # the budget while decoding: what the prompt kept (keep 1.0: no limit)
                b = policy.budget
                cap = keep.sum(dim=-1).clamp_min(b.sinks + b.window)
                if b.keep >= 1.0:
                    cap = torch.full_like(cap, torch.iinfo(cap.dtype).max)
            store.append_kept(keys, values, keep, row_start, scores if policy.tracking else None, policy.tracking, cap)
            return
        if store.lanes:  # per-head lanes (AdaKV): each head writes each token at its own next slot (or victim)
            for t in range(T):
                k, v = keys[:, :, t:t + 1], values[:, :, t:t + 1]
                b = policy.budget
                victim = None if not policy.tracking or T != 1 else choose_slots(
                    slots.pos, slots.score, slots.cap, slots.first, slots.seen + 1, b.sinks, b.window)
                S = slots.slots
                target, appended = store.lanes.grow(victim)
                if appended:
                    store.append(k, v)
                store.overwrite(k, v, target, target < S)
                slots.place(target, appended)
            return
        if not policy.tracking or T != 1:
            store.append(keys, values)
            slots.append(T)
            return
        b = policy.budget
        target = choose_slots(slots.pos, slots.score, slots.cap, slots.first, slots.seen + 1, b.sinks, b.window)
        S = slots.slots
        appended = False if slots.full else bool((target == S).any())  # at the cap no head appends: no sync
        if appended:  # some head grows: every head gets slot S (heads that replace a token leave it empty)
            store.append(keys, values)
        store.overwrite(keys, values, target, target < S)
        slots.place(target, appended)

    def commit(self, row_start: torch.Tensor | None = None, context: dict[str, Any] | None = None) -> None:
        """Write the chunk of the last :meth:`update` (called by the kvquant attention, which reads it).

        ``row_start[B]``: each row's first real token (from the attention mask); used by the first write.
        ``context``: what an eviction policy may score with: ``module``, ``queries`` (rotary-embedded
        ``[B, Hq, T, D]``), ``scaling`` and the boolean ``mask``.
        """
        if self._pending is not None:
            keys, values = self._pending
            self._pending = None
            self._write(keys, values, row_start, context)

    def _check_clipping(self, chunk: int) -> None:
        """After the last layer's write of a chunk, or every ``block_size`` decode steps: warn if clipping."""
        store = self.store
        last = self.monitor is not None and self.monitor.layers[-1] is self
        if last and store is not None and (chunk > 1 or store.cache_pos % store.block_size == 0):
            self.monitor.check()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        """Positions written so far (an evicting layer keeps fewer tokens; new ones still get the next position)."""
        if self.store is None:
            return 0
        held = self.store.slots.seen if self.store.slots is not None else self.store.cache_pos
        return held + (self._pending[0].shape[2] if self._pending is not None else 0)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if self.store is not None:
            self.store.reset()
        self._pending = None

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count)."""
        check_removal(tokens_to_remove)
        if self.store is not None and tokens_to_remove:
            self.store.crop(self.store.cache_pos + tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows take the block tables of ``beam_idx``: references change, no quantized byte moves. A bad index
        (not integer, not 1-D, out of range) raises :class:`~kvquant.errors.ArgumentError` and changes nothing."""
        if self.store is not None and self.store.cache_pos:
            self.store.index_batch(row_index(beam_idx, self.store.batch, "beam_idx"))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times in place (row ``b`` becomes rows ``b * repeats ...``)."""
        check_int(repeats, "repeats", 1, MAX_CAPACITY, ArgumentError)
        if self.store is not None:
            idx = torch.arange(self.store.batch).repeat_interleave(repeats)
            self.store.index_batch(idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (checked first, as for :meth:`reorder_cache`)."""
        if self.store is not None:
            self.store.index_batch(row_index(indices, self.store.batch, "indices"))

    def offload(self) -> None:  # offloading a quantized store is not supported (kept resident)
        return None

    def prefetch(self) -> None:
        return None


def _release(layers: list[QuantizedLayer]) -> None:
    for layer in layers:
        if layer.store is not None:
            layer.store.release()


class QuantizedKVCache(Cache):
    """A KV cache that stores each (layer, KV head)'s K and V in the precision a config assigns.

    Args:
        model: the transformers model (its config gives layers, KV heads, head_dim and sliding
            windows); its attention must be ``kvquant`` (:func:`kvquant.wrap` or
            ``with kvquant.wrapped(model, config):``; building a cache changes nothing on the model).
            A :class:`~kvquant.ModelShape` builds a free-standing cache (``update`` / ``memory_report``
            without a model).
        config: a :class:`KVQuantConfig`, a preset name (``"int8-kchannel"``, the default) or a YAML/JSON path;
            with ``pool``, ``None`` (the pool's config) or the same config.
        capacity: tokens to preallocate per sequence (optional; otherwise blocks are added on demand).
        pool: a :class:`~kvquant.PagedKVPool` to take blocks from (shared with its other caches);
            ``None``: private blocks.

    Example::

        model = kvquant.wrap(model, "int8")
        cache = kvquant.QuantizedKVCache(model, "int8")
        out = model.generate(**inputs, cache=cache, max_new_tokens=200)
        print(cache.memory_report()["ratio_vs_fp16"])
    """

    def __init__(
        self,
        model: Any,
        config: KVQuantConfig | str | Path | None = None,
        capacity: int | None = None,
        pool: PagedKVPool | None = None,
    ) -> None:
        self.session_id = new_session_id()
        if capacity is not None:
            check_int(capacity, "capacity", 1, MAX_CAPACITY)
        if pool is not None:
            cfg = pool.config if config is None else KVQuantConfig.load(config)
            if cfg.to_dict() != pool.config.to_dict():
                raise ValueError("config: differs from the pool's config (pass config=None to use the pool's)")
            cfg = pool.config
        else:
            cfg = KVQuantConfig.load(DEFAULT_PRESET if config is None else config)
        self.kv_config = cfg
        self.shape = ModelShape.of(model)
        #: what each layer really gets (precisions per KV head, options; see :mod:`kvquant.plan`)
        self.plan = resolve_plan(self.kv_config, model if model is not None else self.shape)
        self.plan.report()
        bound = model is not None and hasattr(model, "config") and not isinstance(model, ModelShape)
        if bound and hasattr(model, "set_attn_implementation"):
            impl = getattr(model.config, "_attn_implementation", None)
            if impl != ATTN_NAME:
                raise ValueError(
                    f"model: its attention implementation is {impl!r}, which cannot read a quantized cache; "
                    "call kvquant.wrap(model, config) first, or use `with kvquant.wrapped(model, config):`"
                )
        self.pool = pool
        windows = sliding_windows(model, self.shape.num_layers)
        static = load_static_amax(self.kv_config.scales_file, self.shape, model_dtype(model))
        #: checks the prefill's keys for outlier / offset channels; logs one warning if the config cannot hold them
        self.outlier_watch = OutlierWatch(self.kv_config, self.plan.rows)
        evict = self.kv_config.evict
        layers = [
            QuantizedLayer(i, list(lp.row), self.kv_config, self.shape.head_dim, static[i] if static else None,
                           capacity, pool, windows[i], self.outlier_watch,
                           evict.for_layer(i) if evict and lp.evict else None, plan=lp)
            for i, lp in enumerate(self.plan.layers)
        ]  # fmt: skip
        self.clip_monitor = ClipMonitor(layers, self.session_id)
        for layer in layers:
            layer.strict = bound
            layer.owner = self
            layer.monitor = self.clip_monitor
        super().__init__(layers=layers)
        self.token_ids: list[list[int]] | None = None
        self._hashes: list[list[bytes]] = []
        self._finalizer = weakref.finalize(self, _release, layers) if pool is not None else None

    # ------------------------------------------------------------------ pool / prefix reuse
    @classmethod
    def from_pool(cls, pool: PagedKVPool, input_ids: torch.Tensor, align: int | None = None) -> QuantizedKVCache:
        """A new cache on ``pool`` bound to ``input_ids[B, T]`` (or ``[T]``) that already holds the longest
        indexed run of whole blocks of every row's ids (:meth:`PagedKVPool.match_prefix`, cut to a multiple of
        ``align`` tokens when given), shared with the index, not copied. The blocks it fills later are indexed
        under its ids."""
        cache = cls(pool.model, pool.config, pool=pool)
        rows, found, tokens = pool.match_prefix(input_ids, align)
        cache.bind_ids(rows)
        if tokens:
            cache.adopt_prefix(found, tokens)
        return cache

    def bind_ids(self, rows: list[list[int]]) -> None:
        """Index the full blocks this cache writes under ``rows`` (the token ids of each row).

        A bound cache only extends its own prompt: a forward whose ``input_ids`` differ from the bound ids at
        the positions they cover raises :class:`BoundIdsError` (:meth:`check_ids`). To use the cache for a
        new prompt call :meth:`reset` (every token forgotten, the binding dropped, a fresh session id), or take a
        new cache from :meth:`from_pool`."""
        self.token_ids = [list(r) for r in rows]
        reusable = self.pool is not None and self.pool.reusable
        self._hashes = [self.pool.block_hashes(r) for r in rows] if reusable else []

    def check_ids(self, input_ids: torch.Tensor) -> None:
        """Raise :class:`BoundIdsError` (nothing written) unless ``input_ids[B, T]``, written at the cache's
        current length, agree with the bound token ids wherever those cover (positions past them are new
        tokens: free). Called by the kvquant model hook before every forward with this cache; a no-op when the
        cache is not bound."""
        if self.token_ids is None:
            return
        ids = torch.as_tensor(input_ids)
        ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
        past = self.get_seq_length()
        if ids.shape[0] == len(self.token_ids) and past >= max(map(len, self.token_ids), default=0):
            return  # decoding past the bound prompt: nothing to compare (and no read of the ids)
        if ids.shape[0] != len(self.token_ids):
            raise BoundIdsError(
                f"input_ids: {ids.shape[0]} rows, but cache {self.session_id} is bound to the token ids of "
                f"{len(self.token_ids)}; call cache.reset() to reuse it for a new prompt (or take one from "
                "QuantizedKVCache.from_pool(pool, ids))")
        rows = ids.tolist()
        for b, (new, bound) in enumerate(zip(rows, self.token_ids, strict=True)):
            cover = bound[past:past + len(new)]
            if new[:len(cover)] != cover:
                at = past + next(i for i, (x, y) in enumerate(zip(new, cover, strict=False)) if x != y)
                raise BoundIdsError(
                    f"input_ids: row {b} has token {new[at - past]} at position {at} where cache {self.session_id} "
                    f"is bound to {bound[at]} (a prefix-reuse cache only extends its own prompt); call cache.reset() "
                    "to reuse it for a new prompt (or take one from QuantizedKVCache.from_pool(pool, ids))")

    def _rows_follow(self, idx: torch.Tensor) -> None:
        """After a reorder / select / repeat of the rows: the bound ids (and block hashes) follow their rows."""
        rows = idx.tolist()
        if self.token_ids is not None:
            self.token_ids = [self.token_ids[i] for i in rows]
        if self._hashes:
            self._hashes = [self._hashes[i] for i in rows]

    def adopt_prefix(self, tables: list[list[list[int]]], tokens: int) -> None:
        """Start every layer from shared blocks: ``tables[b][j]`` = block ids per layer of row ``b``'s block ``j``."""
        assert self.pool is not None
        device = next((b.device for b in self.pool.layers if b is not None), torch.device("cpu"))
        for layer in self.layers:
            store = layer.make_store(len(tables), device)
            rows = [[blk[layer.layer_idx] for blk in row] for row in tables]
            for r in rows:
                store.blocks.incref(r)
            store.adopt(rows, tokens)

    def index_new_blocks(self, layer_idx: int, old_q_end: int) -> None:
        """After a write: index the newly completed full blocks of this layer under the bound ids."""
        if not self._hashes:
            return
        store = self.layers[layer_idx].store
        bs = store.block_size
        if store.batch != len(self._hashes) or store.grid is not None:
            return  # rows were reordered or expanded, or hold slots of their own grids: the ids do not describe them
        for j in range(old_q_end // bs, store.q_end // bs):
            for b, hashes in enumerate(self._hashes):
                if j < len(hashes) and j < len(store.tables[b]) and store.tables[b][j] >= 0:
                    self.pool.record(hashes[j], layer_idx, store.tables[b][j])

    def admit(self, tokens: int, batch: int, device: torch.device) -> None:
        """Check, before any layer writes, that a bounded pool can hold ``tokens`` more tokens per row."""
        if self.pool is None or self.pool.blocks_per_layer is None:
            return
        for layer in self.layers:
            if layer.store is None:
                layer.make_store(batch, device)
        self.pool.admit([layer.store for layer in self.layers], tokens)

    def release(self) -> None:
        """Give every block back to the pool (the cache is empty afterwards; ``reset`` also forgets scales)."""
        _release(self.layers)
        for layer in self.layers:
            if layer.store is not None:
                layer.store.reset()

    # ------------------------------------------------------------------ cache API
    @property
    def cache_pos(self) -> int:
        """Tokens written so far (the write cursor)."""
        return self.get_seq_length()

    def reset(self) -> None:
        """Forget every token (blocks back to the pool) and static scales, drop the binding to token ids (a
        cache from :meth:`from_pool`), and start a new session id: the way to reuse this cache
        for a new prompt."""
        super().reset()
        self.token_ids = None
        self._hashes = []
        self.session_id = new_session_id()
        self.clip_monitor.name = self.session_id

    def _batch(self) -> int | None:
        """The rows of the layers' stores (None before the first write)."""
        sizes = {layer.store.batch for layer in self.layers if layer.store is not None}
        if len(sizes) > 1:
            raise AssertionError(f"layers hold different batch sizes {sorted(sizes)}")
        return next(iter(sizes), None)

    def _checked_rows(self, idx: Any, name: str) -> torch.Tensor:
        """``idx`` checked against the batch (:func:`~kvquant.store.row_index`) before any layer changes."""
        batch = self._batch()
        if batch is None and self.token_ids is not None:
            batch = len(self.token_ids)
        return row_index(idx, sys.maxsize if batch is None else batch, name)  # (no rows yet: any row number)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows take the block tables of ``beam_idx`` (beam search), in every layer. A bad index (not integer,
        not 1-D, out of range) raises :class:`~kvquant.errors.ArgumentError` and changes nothing."""
        idx = self._checked_rows(beam_idx, "beam_idx")
        for layer in self.layers:
            layer.reorder_cache(idx)
        self._rows_follow(idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices``, in every layer (checked first, as for :meth:`reorder_cache`)."""
        idx = self._checked_rows(indices, "indices")
        for layer in self.layers:
            layer.batch_select_indices(idx)
        self._rows_follow(idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times (``repeats`` checked first)."""
        check_int(repeats, "repeats", 1, MAX_CAPACITY, ArgumentError)
        batch = self._batch()
        for layer in self.layers:
            layer.batch_repeat_interleave(repeats)
        if batch is not None or self.token_ids is not None:
            n = batch if batch is not None else len(self.token_ids or [])
            self._rows_follow(torch.arange(n).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens of every layer (transformers' convention: a negative
        count). Every layer is checked first: a crop one layer refuses (per-channel block split, sliding window,
        eviction) raises before any layer changes."""
        check_removal(tokens_to_remove)
        for layer in self.layers:
            if layer.store is not None and tokens_to_remove:
                layer.store.check_crop(layer.store.cache_pos + tokens_to_remove)
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    def __deepcopy__(self, memo: dict[int, Any]) -> QuantizedKVCache:
        """A copy sharing the blocks (references, no quantized byte copied), with a new session id."""
        new = object.__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k in ("pool", "layers", "_finalizer", "clip_monitor"):
                continue
            setattr(new, k, copy.deepcopy(v, memo))
        new.pool = self.pool
        new.layers = []
        for layer in self.layers:
            lc = copy.copy(layer)
            lc.owner = new
            if layer.store is not None:
                lc.store = layer.store.copy()
            new.layers.append(lc)
        new.session_id = new_session_id()
        new.clip_monitor = ClipMonitor(new.layers, new.session_id)
        for lc in new.layers:
            lc.monitor = new.clip_monitor
        new._finalizer = weakref.finalize(new, _release, new.layers) if self.pool is not None else None
        return new

    def __repr__(self) -> str:
        name = self.kv_config.name or "custom"
        return (
            f"QuantizedKVCache(session_id={self.session_id!r}, cache_pos={self.cache_pos}, config={name!r}, "
            f"layers={len(self.layers)}, kv_heads={self.shape.num_kv_heads}, head_dim={self.shape.head_dim})"
        )

    def memory_report(self) -> dict[str, Any]:
        """Bytes held for K, V and scales (a block shared by rows or caches counted once), per layer
        and per precision, bytes shared, blocks, bytes moved by copy-on-write, and the ratio to FP16."""
        from .memory import memory_report

        self.clip_monitor.check()
        return memory_report(self)

    def clipped_values(self) -> int:
        """Values that exceeded a static (per-head) scale and were clipped, over all layers."""
        return self.clip_monitor.counts()[0]

    def clipped_rate(self) -> float:
        """Fraction of the values written through static scales that were clipped (0.0 if none)."""
        return self.clip_monitor.rate()

    def dump(self) -> dict[str, Any]:
        """A JSON-serialisable summary for debugging: session, config, and per layer the block tables,
        shared blocks, cursors, static-scale statistics and clipped counts."""
        layers = []
        for layer in self.layers:
            st = layer.store
            if st is None:
                layers.append({"layer": layer.layer_idx, "cache_pos": 0})
                continue
            scales = {}
            for g in st.groups:
                for kind, s in (("key", g.key), ("value", g.value)):
                    if "scale" in s.state:
                        t = s.state["scale"].float()
                        scales[f"{g.precision}/{kind}"] = {"heads": g.heads, "min": float(t.min()),
                                                           "max": float(t.max()), "mean": float(t.mean())}
            layers.append({
                "layer": layer.layer_idx,
                "cache_pos": st.cache_pos,
                "q_end": st.q_end,
                "window": st.window,
                "first_live_block": st.first_live,
                # AdaKV lanes: one table of lane ids per (row, KV head), rows first; shared = lanes held twice
                "lanes": st.lanes,
                "block_tables": [list(t) for t in st.tables],
                # per-head tails (kvquant.lanes)
                "tail_tokens": st.lanes.tail_lengths() if st.lanes and st.tail_lanes else None,
                "shared_blocks": ([e for e in st.lane_ids() if st.blocks.lane_refs[e] > 1] if st.lanes
                                  else [b for b in st.block_ids() if st.blocks.refs[b] > 1]),
                "static_scales": scales,
                "clipped": st.clipped(),
                "bytes_moved": st.bytes_moved,
                "evicted": None if st.slots is None else {
                    "policy": layer.policy.name if layer.policy is not None else None, "slots": st.slots.slots,
                    "positions": st.slots.seen, "kept_per_head": st.slots.counts().tolist(),
                },
            })  # fmt: skip
        return {
            "session_id": self.session_id,
            "config": self.kv_config.name or "custom",
            "block_size": self.kv_config.block_size,
            "cache_pos": self.cache_pos,
            "pool": self.pool.stats() if self.pool is not None else None,
            "layers": layers,
        }

