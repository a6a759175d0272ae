"""Eviction policies: which cached tokens a layer keeps (StreamingLLM, SnapKV, key norm, AdaKV budgets).

A policy is two small objects with one job each:

1. a **scorer** rates every cached token per (batch row, KV head); higher means more worth keeping. Its
   method has kvpress's signature, ``score(module, hidden_states, keys, values, attentions, kwargs) ->
   scores[B, H, T]``, so a kvpress-style scorer plugs in unchanged (kvpress itself is not a dependency);
2. a **budget** turns scores into a keep-mask ``[B, H, T]``: sink tokens and the recent window are always kept,
   the rest by score, either the same number of tokens in every head or, with ``per_head=True`` (AdaKV), the
   layer's total spread over heads by score (each head keeps at least its sinks and window).

Scores are compared only within one (row, head) (uniform budget) or one (row, layer) (AdaKV); pad positions
(``valid`` False) are never kept. Positions are not renumbered: kept tokens keep the rotary phase they were
written with, so attention over them is the attention of the full cache restricted to the kept keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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


@dataclass(frozen=True)
class SnapKVScorer:
    """SnapKV (Li et al., 2024): attention of the last ``window`` prompt queries to each earlier key.

    The observation queries are recomputed from ``hidden_states`` with the module's own ``q_proj`` (and
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
        q = observation_queries(module, hidden_states[:, -w:], kwargs, D)  # [B, Hq, w, D]
        rep = q.shape[1] // H
        k = keys.float().repeat_interleave(rep, dim=1)
        logits = q @ k.transpose(-1, -2) * getattr(module, "scaling", D**-0.5)  # [B, Hq, w, T]
        qpos = torch.arange(T - w, T, device=keys.device).view(-1, 1)
        logits = logits.masked_fill(torch.arange(T, device=keys.device).view(1, -1) > qpos, -math.inf)
        attn = logits.softmax(dim=-1).mean(dim=2).view(B, H, rep, T).mean(dim=2)  # [B, H, T]
        if self.kernel > 1:
            attn = F.avg_pool1d(attn, self.kernel, stride=1, padding=self.kernel // 2, count_include_pad=False)
        attn[..., T - w :] = math.inf
        return attn


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


POLICIES: dict[str, type] = {"streaming": StreamingScorer, "knorm": KeyNormScorer, "snapkv": SnapKVScorer}


def make_scorer(name: str, **options: Any) -> Scorer:
    """A scorer by policy name (``streaming``, ``knorm``, ``snapkv``) with its options (e.g. ``window`` for SnapKV)."""
    if name not in POLICIES:
        raise ConfigError(f"evict.policy: {name!r} is not one of {', '.join(POLICIES)}")
    try:
        return POLICIES[name](**options)
    except TypeError as e:
        raise ConfigError(f"evict: bad option for policy {name!r} ({e})") from None
