"""Eviction policies: which cached tokens a layer keeps (StreamingLLM, SnapKV, key norm, H2O, TOVA, AdaKV budgets).

A policy is two small objects with one job each:

1. a **scorer** rates every cached token per (batch row, KV head); higher means more worth keeping. Its
   method has kvpress's signature, ``score(module, hidden_states, keys, values, attentions, kwargs) ->
   scores[B, H, T]``, so a kvpress-style scorer plugs in unchanged (kvpress itself is not a dependency);
2. a **budget** turns scores into a keep-mask ``[B, H, T]``: sink tokens and the recent window are always kept,
   the rest by score, either the same number of tokens in every head or, with ``per_head=True`` (AdaKV), the
   layer's total spread over heads by score (each head keeps at least its sinks and window).

Configured by the ``evict:`` field of a :class:`~kvquant.KVQuantConfig` (:class:`EvictConfig`, one
:class:`Policy` per layer). Prefill-time policies (``streaming``, ``snapkv``, ``knorm``, a kvpress-style
scorer) compress the prompt when it is first written; decode-time policies (``h2o``, ``tova``) also
compress the prompt, then keep each layer at that budget while decoding: each new token replaces, per
(row, KV head), the kept token with the lowest attention score (H2O: attention mass accumulated over
every step; TOVA: the attention of the newest query), sinks and the recent window excepted.

Scores are compared only within one (row, head) (uniform budget) or one (row, layer) (AdaKV); pad positions
(``valid`` False) are never kept. Positions are not renumbered: kept tokens keep the rotary phase they were
written with, so attention over them is the attention of the full cache restricted to the kept keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from .errors import ConfigError


class Scorer(Protocol):
    """kvpress's scorer interface: ``keys/values[B, H, T, D]`` -> ``scores[B, H, T]`` (higher = keep)."""

    def score(
        self,
        module: torch.nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> torch.Tensor: ...


class KeyScorer:
    """A scorer that needs only the keys: subclasses implement ``score_keys(keys[B, H, T, D]) -> [B, H, T]``."""

    def score(
        self,
        module: Any,
        hidden_states: torch.Tensor | None,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        return self.score_keys(keys)

    def score_keys(self, keys: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class StreamingScorer(KeyScorer):
    """StreamingLLM (Xiao et al., 2024): newer tokens score higher, so a budget keeps its sinks + the most recent."""

    def score_keys(self, keys: torch.Tensor) -> torch.Tensor:
        B, H, T, _ = keys.shape
        return torch.arange(T, dtype=torch.float32, device=keys.device).expand(B, H, T)


@dataclass(frozen=True)
class KeyNormScorer(KeyScorer):
    """Key norm (Devoto et al., 2024): keys with a small L2 norm draw more attention, so they are kept."""

    def score_keys(self, keys: torch.Tensor) -> torch.Tensor:
        return -keys.float().norm(dim=-1)


def window_attention(
    queries: torch.Tensor, keys: torch.Tensor, scaling: float, mask: torch.Tensor | None = None, tile: int = 256
) -> torch.Tensor:
    """Softmax attention of the last ``w`` queries ``[B, Hq, w, D]`` to every key ``[B, H, T, D]``, summed over
    those queries and over the query heads of each KV head: ``[B, H, T]`` float32.

    Causal (query ``i`` of the window sits at position ``T - w + i``), and restricted by ``mask`` (a boolean
    ``[B | 1, 1 | Hq, >= w, >= T]`` mask over the whole chunk, True = attend; its last ``w`` query rows are
    used) when given. Queries are processed ``tile`` at a time, so the score matrix stays small."""
    B, H, T, D = keys.shape
    Hq, w = queries.shape[1], queries.shape[2]
    rep = Hq // H
    k = keys.float().repeat_interleave(rep, dim=1)
    out = torch.zeros(B, Hq, T, device=keys.device)
    for a in range(0, w, tile):
        b = min(w, a + tile)
        logits = queries[:, :, a:b].float() @ k.transpose(-1, -2) * scaling  # [B, Hq, t, T]
        qpos = torch.arange(T - w + a, T - w + b, device=keys.device).view(-1, 1)
        visible = torch.arange(T, device=keys.device).view(1, -1) <= qpos
        if mask is not None:
            if mask.dtype != torch.bool:  # an additive float mask: 0 = attend
                mask = mask > torch.finfo(mask.dtype).min / 2
            rows = mask.shape[2]
            visible = visible & mask[:, :, rows - w + a : rows - w + b, :T]
        p = logits.masked_fill(~visible, -math.inf).softmax(dim=-1).nan_to_num(0.0)
        out += p.sum(dim=2)
    return out.view(B, H, rep, T).sum(dim=2)


def _queries(module: Any, hidden_states: torch.Tensor | None, kwargs: dict[str, Any], w: int, D: int) -> torch.Tensor:
    """The last ``w`` rotary-embedded queries: ``kwargs["queries"]`` (given by kvquant's attention) when present,
    else recomputed from ``hidden_states`` with the module's own projection (kvpress's way)."""
    if kwargs.get("queries") is not None:
        return kwargs["queries"][:, :, -w:]
    return observation_queries(module, hidden_states[:, -w:], kwargs, D)


def _scaling(module: Any, kwargs: dict[str, Any], D: int) -> float:
    return kwargs.get("scaling") or getattr(module, "scaling", None) or D**-0.5


@dataclass(frozen=True)
class SnapKVScorer:
    """SnapKV (Li et al., 2024): attention of the last ``window`` prompt queries to each earlier key.

    The observation queries are ``kwargs["queries"]`` (kvquant's attention passes the rotary-embedded queries
    of the chunk) or, kvpress's way, recomputed from ``hidden_states`` with the module's own ``q_proj`` (and
    ``q_norm`` where the model has one, as Qwen3 does) and rotary embedding (``kwargs["position_embeddings"]``),
    softmax-normalised over all keys (causal inside the window), averaged over the window and the query heads
    of each KV head, then smoothed with an average pool of ``kernel`` tokens. Tokens inside the window score
    +inf (they are the observation window, always kept).
    """

    window: int = 32
    kernel: int = 5

    def score(
        self,
        module: Any,
        hidden_states: torch.Tensor | None,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        B, H, T, D = keys.shape
        w = min(self.window, T)
        q = _queries(module, hidden_states, kwargs, w, D)  # [B, Hq, w, D]
        rep = q.shape[1] // H
        attn = window_attention(q, keys, _scaling(module, kwargs, D), kwargs.get("attention_mask")) / (w * rep)
        if self.kernel > 1:
            attn = F.avg_pool1d(attn, self.kernel, stride=1, padding=self.kernel // 2, count_include_pad=False)
        attn[..., T - w :] = math.inf
        return attn


@dataclass(frozen=True)
class H2OScorer:
    """H2O (Zhang et al., 2023), prefill part: the attention mass each key received from every prompt query
    (summed over queries and the query heads of its KV head). While decoding, the attention adds each
    step's mass to it (``tracking = "accumulate"``)."""

    tracking = "accumulate"

    def score(self, module: Any, hidden_states: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
              attentions: torch.Tensor | None, kwargs: dict[str, Any]) -> torch.Tensor:
        T, D = keys.shape[2], keys.shape[3]
        q = _queries(module, hidden_states, kwargs, T, D)
        return window_attention(q, keys, _scaling(module, kwargs, D), kwargs.get("attention_mask"))


@dataclass(frozen=True)
class TOVAScorer:
    """TOVA (Oren et al., 2024): the attention of the newest query to each key (summed over the query heads
    of its KV head); while decoding, each step's attention replaces it (``tracking = "last"``)."""

    tracking = "last"

    def score(self, module: Any, hidden_states: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
              attentions: torch.Tensor | None, kwargs: dict[str, Any]) -> torch.Tensor:
        D = keys.shape[3]
        q = _queries(module, hidden_states, kwargs, 1, D)
        return window_attention(q, keys, _scaling(module, kwargs, D), kwargs.get("attention_mask"))


def observation_queries(
    module: torch.nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any], head_dim: int
) -> torch.Tensor:
    """Rotary-embedded queries ``[B, Hq, w, D]`` of ``hidden[B, w, hidden]`` for a Llama-style attention module."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    B, w, _ = hidden.shape
    q = module.q_proj(hidden).view(B, w, -1, head_dim)
    if getattr(module, "q_norm", None) is not None:
        q = module.q_norm(q)
    q = q.transpose(1, 2).float()
    cos, sin = kwargs["position_embeddings"]
    q, _ = apply_rotary_pos_emb(q, q, cos[:, -w:].float(), sin[:, -w:].float())
    return q


@dataclass(frozen=True)
class Budget:
    """How many tokens a layer keeps: a fraction ``keep`` of the valid tokens, sinks and a recent window always.

    ``per_head=False``: every (row, head) keeps ``ceil(keep x valid)`` tokens. ``per_head=True`` (AdaKV, Feng et
    al., 2024): the layer's total ``H x ceil(keep x valid)`` is filled by the best scores across all heads of the
    row, so heads whose attention is concentrated give tokens to heads whose attention is spread; scores are
    normalised per head (softmax over its tokens) to be comparable.
    """

    keep: float = 0.5
    sinks: int = 4
    window: int = 32
    per_head: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.keep <= 1.0:
            raise ConfigError(f"evict.keep: {self.keep} is not a fraction in (0, 1]")
        if self.sinks < 0 or self.window < 0:
            raise ConfigError(f"evict.sinks / evict.window: must be >= 0, got {self.sinks} / {self.window}")

    def tokens(self, valid: int) -> int:
        """Tokens one head keeps out of ``valid`` (never fewer than sinks + window, never more than ``valid``)."""
        return min(valid, max(math.ceil(self.keep * valid), self.sinks + self.window))

    def keep_mask(self, scores: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Boolean ``[B, H, T]``: tokens to keep, given ``scores[B, H, T]`` and ``valid[B, T]`` (True = real token)."""
        B, H, T = scores.shape
        if valid is None:
            valid = torch.ones(B, T, dtype=torch.bool, device=scores.device)
        out = torch.zeros(B, H, T, dtype=torch.bool, device=scores.device)
        for b in range(B):
            pos = valid[b].nonzero().flatten()  # real tokens of this row, in order
            n = int(pos.numel())
            if n == 0:
                continue
            s = scores[b][:, pos].float().clone()  # [H, n]
            forced = torch.zeros(n, dtype=torch.bool, device=s.device)
            forced[: self.sinks] = True
            if self.window:
                forced[max(0, n - self.window) :] = True
            per_head = self.tokens(n)
            if self.per_head:
                s = s.masked_fill(forced, -math.inf).softmax(dim=-1).nan_to_num(0.0)
                s = s.masked_fill(forced, math.inf)
                flat = s.flatten().topk(per_head * H).indices
                chosen = torch.zeros(H * n, dtype=torch.bool, device=s.device)
                chosen[flat] = True
                chosen = chosen.view(H, n) | forced
            else:
                s = s.masked_fill(forced, math.inf)
                idx = s.topk(per_head, dim=-1).indices
                chosen = torch.zeros(H, n, dtype=torch.bool, device=s.device).scatter_(1, idx, True)
            out[b][:, pos] = chosen
        return out


POLICIES: dict[str, type] = {
    "streaming": StreamingScorer, "knorm": KeyNormScorer, "snapkv": SnapKVScorer, "h2o": H2OScorer, "tova": TOVAScorer,
}
#: policies that keep evicting while decoding (they need the attention's per-key score mass)
DECODE_POLICIES = ("h2o", "tova")
#: policies whose scores need the model's queries (a cache built without a model cannot run them)
QUERY_POLICIES = ("snapkv", "h2o", "tova")
BUDGETS = ("uniform", "adakv")


def make_scorer(name: str, **options: Any) -> Scorer:
    """A scorer by policy name (``streaming``, ``knorm``, ``snapkv``, ``h2o``, ``tova``) with its options
    (e.g. ``window`` for SnapKV)."""
    if name not in POLICIES:
        raise ConfigError(f"evict.policy: {name!r} is not one of {', '.join(POLICIES)}")
    try:
        return POLICIES[name](**options)
    except TypeError as e:
        raise ConfigError(f"evict: bad option for policy {name!r} ({e})") from None


@dataclass(frozen=True)
class Policy:
    """What one layer does: ``scorer`` rates the prompt's tokens, ``budget`` picks the kept ones; ``tracking``
    (``"accumulate"`` for H2O, ``"last"`` for TOVA, ``None``) says whether, and how, the attention's per-key
    score mass updates the scores while decoding (a tracking policy then keeps the layer at its budget)."""

    name: str
    scorer: Scorer
    budget: Budget
    tracking: str | None = None

    @property
    def needs_queries(self) -> bool:
        """True unless the scorer rates keys alone (a kvpress-style scorer may look at anything: True)."""
        return not isinstance(self.scorer, KeyScorer)


@dataclass
class EvictConfig:
    """The ``evict:`` field of a config: ``{policy, keep, window, sinks, budget, layers}``.

    ``policy``: ``streaming``, ``snapkv``, ``knorm``, ``h2o``, ``tova``, or (Python API only) an object with
    kvpress's ``score(module, hidden_states, keys, values, attentions, kwargs)`` method; kvquant calls it with
    ``hidden_states=None`` (its attention does not see them), the prompt's rotary-embedded ``keys`` and
    ``values`` ``[B, H, T, D]``, ``attentions=None``, and ``kwargs`` holding ``queries`` (rotary-embedded,
    ``[B, Hq, T, D]``), ``scaling``, ``attention_mask`` (boolean, or None) and ``valid`` (``[B, T]``, False at
    left padding). ``keep``: fraction of
    each (row, KV head)'s prompt tokens kept; ``window``: the most recent tokens always kept (also SnapKV's
    observation window); ``sinks``: the first tokens always kept; ``budget``: ``uniform`` (every head keeps as
    many tokens) or ``adakv`` (the layer's total spread over heads by score). ``layers``: per-layer overrides
    of these fields, or ``None`` (that layer keeps everything).
    """

    policy: Any = "snapkv"
    keep: float = 0.5
    window: int = 32
    sinks: int = 4
    budget: str = "uniform"
    layers: dict[int, EvictConfig | None] = field(default_factory=dict)

    FIELDS = ("policy", "keep", "window", "sinks", "budget")

    @property
    def policy_name(self) -> str:
        """The policy's name, or the class name of a scorer object."""
        return self.policy if isinstance(self.policy, str) else type(self.policy).__name__

    @property
    def decode_time(self) -> bool:
        """True when this config or a layer override evicts while decoding (``h2o``, ``tova``)."""
        specs = [self, *(c for c in self.layers.values() if c is not None)]
        return any(c.policy in DECODE_POLICIES for c in specs if isinstance(c.policy, str))

    def for_layer(self, layer: int) -> Policy | None:
        """The layer's :class:`Policy` (``None``: the layer keeps every token)."""
        spec = self.layers.get(layer, self)
        if spec is None:
            return None
        budget = Budget(keep=spec.keep, sinks=spec.sinks, window=spec.window, per_head=spec.budget == "adakv")
        if not isinstance(spec.policy, str):
            return Policy(spec.policy_name, spec.policy, budget, getattr(spec.policy, "tracking", None))
        options = {"window": spec.window} if spec.policy == "snapkv" else {}
        scorer = make_scorer(spec.policy, **options)
        return Policy(spec.policy, scorer, budget, getattr(scorer, "tracking", None))

    def to_dict(self) -> dict[str, Any]:
        """The YAML form (a layer override lists only the fields it changes)."""
        out: dict[str, Any] = {name: getattr(self, name) for name in self.FIELDS}
        if self.layers:
            out["layers"] = {
                i: None if c is None else {n: getattr(c, n) for n in self.FIELDS if getattr(c, n) != getattr(self, n)}
                for i, c in sorted(self.layers.items())
            }
        return out


def choose_slots(
    pos: torch.Tensor, score: torch.Tensor, cap: torch.Tensor, first: torch.Tensor, seen: int, sinks: int,
    window: int,
) -> torch.Tensor:
    """Where a decode-time policy writes one new token, per (row, KV head): ``target[B, H]``.

    ``pos[B, H, S]``: each slot's position (-1: empty), ``score[B, H, S]``: its score, ``cap[B, H]``: tokens the
    head may keep, ``first[B]``: each row's first real position, ``seen``: positions after the new token.
    Below its cap a head takes its first empty slot, else slot ``S`` (a new one); at its cap the slot of its
    lowest-scoring token that is neither a sink (``first + sinks``) nor among the ``window`` newest positions
    (the new token included)."""
    B, H, S = pos.shape
    filled = pos >= 0
    count = filled.sum(dim=-1)
    empty = ~filled
    first_empty = torch.where(empty.any(dim=-1), empty.int().argmax(dim=-1), S)
    protected = (pos < first.view(-1, 1, 1) + sinks) | (pos >= seen - window)
    victim_score = score.float().masked_fill(protected | ~filled, math.inf)
    victim = victim_score.argmin(dim=-1)
    none_left = torch.isinf(victim_score.gather(-1, victim.unsqueeze(-1)).squeeze(-1))
    # every kept token protected (a cap of at most sinks + window): the oldest non-sink token goes
    oldest = pos.masked_fill(~filled | (pos < first.view(-1, 1, 1) + sinks), torch.iinfo(pos.dtype).max).argmin(-1)
    victim = torch.where(none_left, oldest, victim)
    return torch.where(count < cap, first_empty, victim)
