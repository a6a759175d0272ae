"""``kvquant.Scheduler``: continuous batching of many requests over one quantized :class:`~kvquant.PagedKVPool`.

Every :meth:`Scheduler.step` runs **one** forward over the tokens of all scheduled requests, packed into one
row (:mod:`kvquant.packed`): a decode token of every decoding request and prefill chunks of others, mixed, at
most ``max_step_tokens`` tokens. Each request has its own :class:`~kvquant.QuantizedKVCache` on the shared pool
(its block tables, its positions); the attention reads each request's own blocks only, the requests' reads of
one layer batched over the shared pool (:mod:`kvquant.packed_attention`). A request that finishes
(a stop token or ``max_new_tokens``) or is cancelled gives its blocks back at once.

Scheduling, per step: decode tokens of running requests first (oldest first), then the next prefill chunk of
running requests, then new requests from the queue (first come, first served) while the step's token budget and
the pool allow. A request is admitted when the pool can hold its next step and still keep free the blocks the
running requests grow into (one per layer each, or what their next ``reserve_tokens`` tokens need); when the pool
is full new requests wait, and when the running requests' next tokens do not fit, the newest running request is
**preempted**: its blocks go back to the pool and it is queued first, to be recomputed later. ``max_dense_bytes``
bounds the running requests' full-precision buffers (sinks, unfilled per-channel tails) the same way, by what they
hold. :class:`~kvquant.KVCacheFull` never reaches the caller; every request finishes.

Outputs do not depend on batch-mates, arrival order or preemption: a prompt is prefilled in chunks of
``prefill_chunk`` tokens counted from position 0 (never split by the budget), a prefix hit from the pool's
index is cut to a chunk boundary, and a preempted request is recomputed the way it ran: its prompt chunk by
chunk, then its generated tokens one per step (their logits unused), so its quantized state is rebuilt exactly
and it continues where it stopped (sampling uses the request's own seeded generator, which replay does not
draw from). So each request's tokens are those of its solo run with the same ``prefill_chunk`` (with a prompt
of at most ``prefill_chunk`` tokens: those of ``model.generate`` with a :class:`~kvquant.QuantizedKVCache`),
up to the floating-point differences of batched matrix products.

Not supported (refused with a one-line error): eviction policies (``evict``), ``offload``, and models with
sliding-window layers.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import view as handoff
from .attention import ATTN_NAME, install_attention
from .blocks import KVCacheFull
from .cache import QuantizedKVCache
from .config import DEFAULT_PRESET, ConfigError, KVQuantConfig
from .errors import InputError, RequestError
from .packed import PackedCache, Segment
from .pool import PagedKVPool
from .shape import sliding_windows
from .store import LayerStore
from .transformers_compat import cache_kw

__all__ = ["Event", "Scheduler"]

DEFAULT_STEP_TOKENS = 512
DEFAULT_PREFILL_CHUNK = 256


@dataclass(frozen=True)
class Event:
    """One streamed result: request ``request_id`` produced ``token`` (``None`` for a cancelled request);
    ``finished`` with ``reason`` (``"stop"``, ``"length"`` or ``"cancelled"``) on its last event."""

    request_id: int
    token: int | None
    finished: bool = False
    reason: str | None = None


@dataclass
class _Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stop: frozenset[int]
    generator: torch.Generator | None
    out: list[int] = field(default_factory=list)
    cache: QuantizedKVCache | None = None
    written: int = 0  # tokens of prompt + out in the cache
    preemptions: int = 0
    finished: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    def next_piece(self, chunk: int) -> tuple[int, int]:
        """Positions ``[start, end)`` this request feeds in its next step: its next prompt chunk (chunks counted
        from position 0), else one token (a decode step, or the replay of a generated token)."""
        start, n = self.written, len(self.prompt)
        if start < n:
            return start, min(n, (start // chunk + 1) * chunk)
        return start, start + 1


class Scheduler:
    """Continuous batching over one quantized :class:`~kvquant.PagedKVPool` (see the module doc).

    Args:
        model: a transformers decoder; its attention is switched to ``kvquant`` if it is not (as
            :func:`kvquant.wrap` does; ``generate`` is left alone; :func:`kvquant.unwrap` restores it).
        config: a :class:`KVQuantConfig`, preset name or config file (default ``int8-kchannel``); with ``pool``,
            ``None`` or the pool's config.
        max_bytes: bound on the pool's block tensors (``None``: grow on demand); ignored with ``pool``.
        pool: a pool to serve from (its prefix index is shared with its other users).
        block_size: tokens per block of a new pool (default: the config's).
        max_step_tokens: tokens one step's forward runs at most (decode tokens and prefill chunks together).
        prefill_chunk: tokens of one prefill chunk, a multiple of the block size and at most
            ``max_step_tokens`` (default: the largest such multiple up to 256).
        max_running: requests held at once at most (default: as many as the pool and the budget allow).
        max_dense_bytes: bound on the full-precision buffers of all running requests together (fp16 sinks, the
            unfilled tail of a per-channel key block or a residual window), counted by what they hold after each
            step, not reserved per request (``None``: unbounded). A request is admitted when its next step fits
            it with room for one more token of every running request; when the running requests' next tokens do
            not fit, the newest is preempted, as for blocks. :meth:`dense_bytes` is what they hold now.
        reserve_tokens: the growth room a request is admitted with: the pool keeps free, besides the step's blocks,
            the blocks every running request needs for its next ``reserve_tokens`` tokens (a request whose current
            block or unfilled per-channel tail still has room needs none). ``None``: one block per layer for each
            running request. Less room holds more requests and preempts more often.

    Example::

        sched = kvquant.Scheduler(model, "int8-kchannel", max_bytes=64 * 2**20)
        outs = sched.generate_batch([ids_a, ids_b, ids_c], max_new_tokens=64)   # token lists, in order
        rid = sched.submit(ids_d, max_new_tokens=32, temperature=0.7, seed=1)
        for event in sched.stream():                 # runs steps until every request finished
            print(event.request_id, event.token)
    """

    def __init__(
        self,
        model: Any,
        config: KVQuantConfig | str | Path | None = None,
        max_bytes: int | None = None,
        *,
        pool: PagedKVPool | None = None,
        block_size: int | None = None,
        max_step_tokens: int = DEFAULT_STEP_TOKENS,
        prefill_chunk: int | None = None,
        max_running: int | None = None,
        max_dense_bytes: int | None = None,
        reserve_tokens: int | None = None,
    ) -> None:
        if pool is None:
            pool = PagedKVPool(model, DEFAULT_PRESET if config is None else config, max_bytes, block_size)
        elif config is not None and KVQuantConfig.load(config).to_dict() != pool.config.to_dict():
            raise ConfigError("config: differs from the pool's config (pass config=None to use the pool's)")
        cfg = pool.config
        if cfg.evict is not None:
            raise ConfigError("evict: eviction policies are not supported by kvquant.Scheduler; serve without evict")
        if cfg.offload is not None:
            raise ConfigError("offload: host offload is not supported by kvquant.Scheduler; serve without offload")
        if any(w is not None for w in sliding_windows(model, pool.shape.num_layers)):
            raise InputError("model: sliding-window layers are not supported by kvquant.Scheduler")
        bs = pool.block_size
        if not isinstance(max_step_tokens, int) or max_step_tokens < bs:
            raise RequestError(f"max_step_tokens: {max_step_tokens!r} must be an integer >= block_size ({bs})")
        if prefill_chunk is None:
            prefill_chunk = max(bs, min(DEFAULT_PREFILL_CHUNK, max_step_tokens) // bs * bs)
        if not isinstance(prefill_chunk, int) or prefill_chunk % bs or not bs <= prefill_chunk <= max_step_tokens:
            raise RequestError(f"prefill_chunk: {prefill_chunk!r} must be a multiple of block_size ({bs}) "
                               f"between {bs} and max_step_tokens ({max_step_tokens})")  # fmt: skip
        if max_running is not None and (not isinstance(max_running, int) or max_running < 1):
            raise RequestError(f"max_running: {max_running!r} must be a positive integer")
        if reserve_tokens is not None and (not isinstance(reserve_tokens, int) or reserve_tokens < 0):
            raise RequestError(f"reserve_tokens: {reserve_tokens!r} must be a non-negative integer")
        if max_dense_bytes is not None and (not isinstance(max_dense_bytes, int) or max_dense_bytes < 0):
            raise RequestError(f"max_dense_bytes: {max_dense_bytes!r} must be a non-negative integer")
        if getattr(model.config, "_attn_implementation", None) != ATTN_NAME:
            install_attention(model)
        self.model = model
        self.pool = pool
        self.config = cfg
        self.max_step_tokens = max_step_tokens
        self.prefill_chunk = prefill_chunk
        self.max_running = max_running
        self.max_dense_bytes = max_dense_bytes
        self.reserve_tokens = reserve_tokens
        self._dense = 0  # the plan's full-precision bytes of the running requests after the step
        self.device = next(model.parameters()).device
        #: the most bytes one request's full-precision buffers hold after a step (sinks, a tail one token short
        #: of a quantized step): ``max_dense_bytes`` below it could never run a request
        self.dense_per_request = self._dense_worst()
        if max_dense_bytes is not None and max_dense_bytes < self.dense_per_request:
            raise RequestError(f"max_dense_bytes: {max_dense_bytes} is below one request's full-precision buffers "
                               f"({self.dense_per_request} bytes: sinks and an unfilled tail)")  # fmt: skip
        self.waiting: collections.deque[_Request] = collections.deque()
        self.running: list[_Request] = []  # in admission order: the newest last (preempted first)
        self.requests: dict[int, _Request] = {}
        self._ids = itertools.count()
        self._need: list[int] = []
        self._cancelled: list[_Request] = []  # cancelled since the last step: their events are due
        self._released = 0  # requests whose blocks went back (finished, cancelled, preempted), over the life
        self._refused: tuple[Any, ...] | None = None  # the state a queued request was last refused in
        #: counters over the scheduler's life: steps, tokens run, preemptions, requests held per step
        self.counters = {"steps": 0, "tokens": 0, "decode_tokens": 0, "prefill_tokens": 0, "replay_tokens": 0,
                         "preemptions": 0, "running_sum": 0, "running_max": 0, "dense_max": 0}  # fmt: skip

    # ------------------------------------------------------------------ requests
    def submit(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[int] | None = None,
    ) -> int:
        """Queue a request; returns its id. ``temperature`` 0: greedy; else sampling with ``top_k`` (0: off) and
        ``top_p`` from a generator seeded with ``seed``. ``stop``: token ids that end it (default: the model's
        ``eos_token_id``)."""
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point:
            raise RequestError(f"input_ids: expected a non-empty 1-D sequence of token ids, got {tuple(ids.shape)}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise RequestError(f"max_new_tokens: {max_new_tokens!r} must be a positive integer")
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
            raise RequestError(f"sampling: temperature {temperature} >= 0, top_k {top_k} >= 0 and top_p {top_p} "
                               "in (0, 1] are required")  # fmt: skip
        prompt = [int(t) for t in ids.tolist()]
        total = len(prompt) + max_new_tokens
        per_layer = self.pool.blocks_per_layer
        if per_layer is not None and -(-total // self.pool.block_size) > per_layer:
            raise RequestError(f"input_ids: prompt + max_new_tokens = {total} tokens exceed the pool "
                               f"({per_layer * self.pool.block_size} tokens per layer)")  # fmt: skip
        if stop is None:
            eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
            stop = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        gen = None
        if temperature > 0:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed if seed is not None else torch.seed())
        rid = next(self._ids)
        req = _Request(rid, prompt, max_new_tokens, float(temperature), int(top_k), float(top_p),
                       frozenset(int(s) for s in stop), gen)  # fmt: skip
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def cancel(self, request_id: int) -> bool:
        """Stop a request and give its blocks back; True if it was waiting or running. Its last event is
        ``Event(request_id, None, True, "cancelled")``, delivered by the next :meth:`step`."""
        req = self._get(request_id)
        if req.finished is not None:
            return False
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "cancelled")
        self._cancelled.append(req)
        return True

    def output(self, request_id: int) -> list[int]:
        """The tokens request ``request_id`` generated so far."""
        return list(self._get(request_id).out)

    def status(self, request_id: int) -> str:
        """``"waiting"``, ``"running"``, or how it finished (``"stop"``, ``"length"``, ``"cancelled"``)."""
        req = self._get(request_id)
        return req.finished or ("running" if req in self.running else "waiting")

    def preemptions(self, request_id: int) -> int:
        """How often request ``request_id`` was preempted (its blocks freed, recomputed later)."""
        return self._get(request_id).preemptions

    def _get(self, request_id: int) -> _Request:
        req = self.requests.get(request_id)
        if req is None:
            raise RequestError(f"request_id: {request_id!r} is not a request of this scheduler")
        return req

    @property
    def busy(self) -> bool:
        """True while some request is waiting or running."""
        return bool(self.waiting or self.running or self._cancelled)

    # ------------------------------------------------------------------ driving
    def stream(self) -> Iterator[Event]:
        """Run steps until no request is left, yielding every event as it happens (requests submitted meanwhile,
        e.g. between two events, are served too)."""
        while self.busy:
            yield from self.step()

    def generate_batch(self, prompts: Sequence[Sequence[int] | torch.Tensor], max_new_tokens: int = 32,
                       **sampling: Any) -> list[list[int]]:  # fmt: skip
        """Serve ``prompts`` together; returns each one's generated tokens, in the order given."""
        ids = [self.submit(p, max_new_tokens=max_new_tokens, **sampling) for p in prompts]
        for _ in self.stream():
            pass
        return [self.output(i) for i in ids]

    def step(self) -> list[Event]:
        """Run one forward over the scheduled tokens of the running requests; returns the step's events."""
        events = [Event(r.id, None, True, "cancelled") for r in self._cancelled]
        self._cancelled.clear()
        plan = self._plan()
        if not plan:
            return events
        try:
            logits = self._forward(plan)
        except KVCacheFull as e:  # the plan's bound held no write; recompute the step's requests from scratch
            handoff.clear()
            if len(plan) == 1:
                raise RuntimeError("kvquant.Scheduler: a step of one request did not fit its planned blocks") from e
            for req, _, _ in sorted(plan, key=lambda p: -self.running.index(p[0])):
                self._preempt(req)
            return events
        c = self.counters
        c["steps"] += 1
        c["running_sum"] += len(self.running)
        c["running_max"] = max(c["running_max"], len(self.running))
        if self.max_dense_bytes is not None:
            c["dense_max"] = max(c["dense_max"], self.dense_bytes())
        row = 0
        for req, start, end in plan:
            req.written = end
            n = end - start
            c["tokens"] += n
            kind = "prefill_tokens" if start < len(req.prompt) else (
                "decode_tokens" if end == len(req.tokens) else "replay_tokens")
            c[kind] += n
            if end != len(req.tokens):
                continue
            token = self._sample(logits[row], req)
            row += 1
            req.out.append(token)
            reason = "stop" if token in req.stop else "length" if len(req.out) >= req.max_new_tokens else None
            if reason is not None:
                self.running.remove(req)
                self._finish(req, reason)
            events.append(Event(req.id, token, reason is not None, reason))
        return events

    # ------------------------------------------------------------------ planning
    def _plan(self) -> list[tuple[_Request, int, int]]:
        """The step's pieces ``(request, start, end)``, after any preemption and admission (see the module doc)."""
        while True:
            self._need = [0] * self.pool.shape.num_layers
            self._dense = self.dense_bytes()
            plan: list[tuple[_Request, int, int]] = []
            budget = self.max_step_tokens
            decoding = [r for r in self.running if r.written >= len(r.prompt)][:budget]
            ok = True
            for req in decoding:
                start, end = req.next_piece(self.prefill_chunk)
                if not self._room(req, end - start):
                    ok = False
                    break
                plan.append((req, start, end))
            if not ok:
                self._preempt(self.running[-1])
                continue
            budget -= len(plan)
            for req in self.running:
                if req.written >= len(req.prompt):
                    continue
                start, end = req.next_piece(self.prefill_chunk)
                if end - start > budget or not self._room(req, end - start):
                    break
                plan.append((req, start, end))
                budget -= end - start
            while self.waiting and (self.max_running is None or len(self.running) < self.max_running):
                if self._still_refused(self.waiting[0], budget) or not self._admit(self.waiting[0], budget):
                    break
                req = self.waiting.popleft()
                self.running.append(req)
                start, end = req.next_piece(self.prefill_chunk)
                plan.append((req, start, end))
                budget -= end - start
            if plan or not self.running:
                if not plan and self.waiting:
                    raise RuntimeError("kvquant.Scheduler: the pool is held by caches outside the scheduler; "
                                       "the next request does not fit")  # fmt: skip
                return plan
            self._preempt(self.running[-1])  # nothing runnable fits: free the newest

    def _room(self, req: _Request, tokens: int, spare: int = 0, spare_blocks: int | None = None) -> bool:
        """Reserve, in the step's plan, the blocks ``tokens`` more tokens of ``req`` may need; False if the pool
        cannot hold them besides what the plan holds already and ``spare_blocks`` more blocks per layer (default
        ``spare``; index-only prefix blocks are evicted first), or if the running requests' full-precision buffers
        would then exceed ``max_dense_bytes`` with room for ``spare`` more tokens."""
        assert req.cache is not None
        for layer in req.cache.layers:
            if layer.store is None:
                layer.make_store(1, self.device)
        stores = [layer.store for layer in req.cache.layers]
        dense = 0
        if self.max_dense_bytes is not None:
            dense = sum(_dense_after(st, tokens) - _dense_held(st) for st in stores)  # type: ignore[arg-type]
            room = sum(_dense_token(st) for st in stores) * spare  # type: ignore[arg-type]
            if self._dense + dense + room > self.max_dense_bytes:
                return False
        if self.pool.blocks_per_layer is not None:
            need = [st.blocks_needed(tokens) for st in stores]  # type: ignore[union-attr]
            for i, n in enumerate(need):
                blocks = self.pool.layer_blocks(i, self.device)
                total = self._need[i] + n + (spare if spare_blocks is None else spare_blocks)
                if total > len(blocks.free):
                    self.pool.evict(i, total - len(blocks.free))
                if total > len(blocks.free):
                    return False
            self._need = [a + b for a, b in zip(self._need, need, strict=True)]
        self._dense += dense
        return True

    def _admit(self, req: _Request, budget: int) -> bool:
        """Give ``req`` a cache on the pool (from the longest indexed prefix, cut to a chunk boundary) if its
        first piece fits the step's budget and the pool; else leave it queued with nothing held."""
        if budget < 1:
            return False
        queried, hit = self.pool.prefix_query_tokens, self.pool.prefix_hit_tokens
        req.cache = QuantizedKVCache.from_pool(self.pool, torch.tensor(req.prompt), align=self.prefill_chunk)
        req.written = req.cache.get_seq_length()
        start, end = req.next_piece(self.prefill_chunk)
        # keep room for the running requests to grow into (reserve_tokens): admitting into the last free blocks
        # would only preempt someone at the next block boundary
        if end - start <= budget and self._room(req, end - start, len(self.running), self._growth_blocks()):
            return True
        req.cache.release()
        req.cache = None
        req.written = 0
        # not admitted: this look-up does not count as a query of the prefix index
        self.pool.prefix_query_tokens, self.pool.prefix_hit_tokens = queried, hit
        self._refused = self._admission_state(req, budget)
        return False

    def _growth_blocks(self) -> int:
        """Blocks per layer that admission keeps free for the running requests to grow into: with
        ``reserve_tokens`` None one per running request, else what each needs for its next ``reserve_tokens``
        tokens (the most over its layers), summed."""
        if self.reserve_tokens is None:
            return len(self.running)
        return sum(max((layer.store.blocks_needed(self.reserve_tokens) for layer in r.cache.layers
                        if layer.store is not None), default=0)  # fmt: skip
                   for r in self.running if r.cache is not None)  # fmt: skip

    def _admission_state(self, req: _Request, budget: int) -> tuple[Any, ...]:
        """What admitting ``req`` depends on, beyond ``req`` itself: the step's token budget, the releases and prefix
        index changes so far, the running requests, per layer the free blocks less the step's plan, and the growth
        room kept for the running requests."""
        slack = tuple(len(b.free) - n if b is not None else None
                      for b, n in zip(self.pool.layers, self._need, strict=True))  # fmt: skip
        return (req.id, self._released, self.pool.index_changes, len(self.running), budget, self._dense, slack,
                self._growth_blocks())  # fmt: skip

    def _still_refused(self, req: _Request, budget: int) -> bool:
        """True when ``req`` was refused before and nothing it needs grew since: no request released its blocks,
        the prefix index is unchanged, no fewer requests run, the growth room is no smaller, and the step's budget,
        the free full-precision bytes and every layer's free blocks less the step's plan are no larger. Admission
        would fail again, so the retry, which builds and drops a cache, is skipped."""
        if self._refused is None:
            return False
        rid, released, changes, running, budget0, dense0, slack0, growth0 = self._refused
        state = self._admission_state(req, budget)
        if (rid, released, changes) != state[:3] or state[3] < running or budget > budget0 or self._dense < dense0:
            return False
        if state[7] < growth0:
            return False
        return all(a is None or b is not None and a <= b for a, b in zip(state[6], slack0, strict=True))

    def _preempt(self, req: _Request) -> None:
        """Free ``req``'s blocks and queue it first, to be recomputed from its tokens."""
        self.running.remove(req)
        self._released += 1
        if req.cache is not None:
            req.cache.release()
        req.cache = None
        req.written = 0
        req.preemptions += 1
        self.counters["preemptions"] += 1
        self.waiting.appendleft(req)

    def _finish(self, req: _Request, reason: str) -> None:
        self._released += 1
        if req.cache is not None:
            req.cache.release()
        req.cache = None
        req.finished = reason

    # ------------------------------------------------------------------ running
    def _forward(self, plan: list[tuple[_Request, int, int]]) -> torch.Tensor:
        """One forward over the plan's tokens packed into one row; the logits of the pieces that sample."""
        ids, pos, segments, keep = [], [], [], []
        for req, start, end in plan:
            assert req.cache is not None
            segments.append(Segment(req.cache, len(ids), end - start))
            ids += req.tokens[start:end]
            pos += range(start, end)
            if end == len(req.tokens):
                keep.append(len(ids) - 1)
        input_ids = torch.tensor([ids], device=self.device)
        position_ids = torch.tensor([pos], device=self.device)
        cache = PackedCache(self.pool.shape.num_layers, segments)
        with torch.no_grad():
            out = self.model(input_ids=input_ids, position_ids=position_ids, **cache_kw(cache), use_cache=True,
                             logits_to_keep=torch.tensor(keep or [0], device=self.device))  # fmt: skip
        return out.logits[0].float()

    @staticmethod
    def _sample(logits: torch.Tensor, req: _Request) -> int:
        if req.temperature == 0:
            return int(torch.argmax(logits))
        x = logits / req.temperature
        if req.top_k:
            kth = torch.topk(x, min(req.top_k, x.numel())).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if req.top_p < 1:
            sorted_x, order = torch.sort(x, descending=True)
            cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
            drop = cum - torch.softmax(sorted_x, dim=-1) > req.top_p  # keep the smallest set reaching top_p
            x = x.scatter(0, order, sorted_x.masked_fill(drop, float("-inf")))
        probs = torch.softmax(x, dim=-1).cpu()
        return int(torch.multinomial(probs, 1, generator=req.generator))

    # ------------------------------------------------------------------ accounting
    def _dense_worst(self) -> int:
        cache = QuantizedKVCache(self.model, pool=self.pool)
        try:
            stores = [layer.make_store(1, self.device) for layer in cache.layers]
            return sum(_dense_token(st) * (st.sink_tokens + (st.residual_tokens + st.residual_step - 1
                                                             if st.residual_mode else 0)) for st in stores)
        finally:
            cache.release()

    def dense_bytes(self) -> int:
        """Bytes the running requests' full-precision buffers (sinks, unfilled tails, held rows) hold now."""
        return sum(_dense_held(layer.store) for r in self.running if r.cache is not None
                   for layer in r.cache.layers if layer.store is not None)  # fmt: skip

    def stats(self) -> dict[str, Any]:
        """The counters (steps, tokens by kind, preemptions, requests held per step: mean and max), requests
        waiting and running now, and the pool's :meth:`~kvquant.PagedKVPool.stats`."""
        c = dict(self.counters)
        c["running_mean"] = c["running_sum"] / c["steps"] if c["steps"] else 0.0
        c["dense_bytes"] = self.dense_bytes()
        c["waiting"] = len(self.waiting)
        c["running"] = len(self.running)
        c["pool"] = self.pool.stats()
        return c


def _dense_held(store: LayerStore) -> int:
    """Bytes of ``store``'s full-precision buffers now."""
    return sum(t.numel() * t.element_size() for pair in store.dense_buffers().values() for t in pair)


def _dense_token(store: LayerStore) -> int:
    """Bytes one token takes in ``store``'s full-precision buffers (K and V of every head)."""
    itemsize = 2 if store.dense.dtype is None else torch.empty((), dtype=store.dense.dtype).element_size()
    return 2 * store.batch * store.num_heads * store.head_dim * itemsize


def _dense_after(store: LayerStore, tokens: int) -> int:
    """Bytes of ``store``'s full-precision buffers after a write of ``tokens`` more tokens: its sink buffer (made
    at the first write) and, in residual mode, the tokens left in the tail once whole steps are quantized."""
    per = _dense_token(store)
    held = _dense_held(store)
    if "held" in store.dense_buffers() or not store.residual_mode:
        return held + (store.sink_tokens * per if store.sink_tokens and store.dense.sink_k is None else 0)
    sinks = store.sink_tokens * per if store.sink_tokens else 0
    pending = (store.dense.res_k.shape[2] if store.dense.res_k is not None else 0) + tokens
    flush = (pending - store.residual_tokens) // store.residual_step * store.residual_step
    return sinks + (pending - max(flush, 0)) * per
