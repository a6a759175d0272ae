"""Drift of a quantized run against the reference, on the same tokens (llama.cpp's ``--kl-divergence`` metrics).

For every scored position, with ``p`` the reference's next-token distribution and ``q`` the quantized one:

- ``KL(p || q) = sum_v p_v (log p_v - log q_v)``, reported as the mean and the 99th percentile over positions;
- top-1 agreement: the fraction of positions where ``argmax p == argmax q``;
- mean ``|p(correct) - q(correct)|``: how much the probability of the actual next token moved;
- perplexity ``exp(mean NLL)`` of each run, and ``delta_ppl = ppl(q) - ppl(p)``.

Everything is computed in float64 from the logits, row-chunked to bound memory. Identical logits give exactly
``KL = 0``, top-1 ``1.0`` and ``delta_ppl = 0``. The same computation is packaged as an ``evaluate`` module
(``evaluate.load(kvquant.eval.metrics.EVALUATE_MODULE)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

#: A path ``evaluate.load`` accepts: the drift metric as an ``evaluate`` module.
EVALUATE_MODULE = str(Path(__file__).with_name("kv_drift.py"))

ROWS_PER_CHUNK = 128


def token_drift(ref_logits: torch.Tensor, q_logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-position drift of ``q_logits`` from ``ref_logits`` ([n, vocab] each) for next tokens ``targets`` [n].

    Returns float64 / bool tensors of length n: ``kl``, ``top1`` (argmax equal), ``nll_ref``, ``nll_q``,
    ``abs_dp`` (|p_ref(target) - p_q(target)|).
    """
    if ref_logits.shape != q_logits.shape:
        raise ValueError(f"logits: shapes differ, reference {tuple(ref_logits.shape)} vs {tuple(q_logits.shape)}")
    n = ref_logits.shape[0]
    if targets.shape[0] != n:
        raise ValueError(f"targets: {targets.shape[0]} targets for {n} positions")
    out: dict[str, list[torch.Tensor]] = {k: [] for k in ("kl", "top1", "nll_ref", "nll_q", "abs_dp")}
    targets = targets.to(ref_logits.device)
    for s in range(0, n, ROWS_PER_CHUNK):
        r = ref_logits[s : s + ROWS_PER_CHUNK].double()
        q = q_logits[s : s + ROWS_PER_CHUNK].to(r.device).double()
        t = targets[s : s + ROWS_PER_CHUNK].unsqueeze(1)
        lp = torch.log_softmax(r, dim=-1)
        lq = torch.log_softmax(q, dim=-1)
        # KL is >= 0 mathematically; clamp only the rounding noise of nearly equal rows
        kl = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)
        out["kl"].append(kl)
        out["top1"].append(r.argmax(-1) == q.argmax(-1))
        lpt, lqt = lp.gather(1, t).squeeze(1), lq.gather(1, t).squeeze(1)
        out["nll_ref"].append(-lpt)
        out["nll_q"].append(-lqt)
        out["abs_dp"].append((lpt.exp() - lqt.exp()).abs())
    return {k: torch.cat(v).cpu() for k, v in out.items()}


#: The metrics that get a per-window paired standard error (``<metric>_se`` beside each).
SE_METRICS = ("delta_ppl", "kl_mean", "top1")


def window_metrics(drift: dict[str, torch.Tensor]) -> dict[str, float]:
    """One window's summary: perplexities of both runs, their difference, mean KL and top-1 agreement."""
    ppl_ref = math.exp(drift["nll_ref"].mean().item())
    ppl = math.exp(drift["nll_q"].mean().item())
    return {
        "n": int(drift["kl"].numel()),
        "ppl": ppl,
        "ppl_ref": ppl_ref,
        "delta_ppl": ppl - ppl_ref,
        "kl_mean": drift["kl"].mean().item(),
        "top1": drift["top1"].double().mean().item(),
    }


def standard_error(values: list[float]) -> float | None:
    """Standard error of the mean of ``values`` (sample standard deviation / sqrt(n)); None for n < 2."""
    n = len(values)
    if n < 2:
        return None
    return float(np.std(np.asarray(values, dtype=np.float64), ddof=1) / math.sqrt(n))


@dataclass
class DriftAccumulator:
    """Collects :func:`token_drift` over windows (one :meth:`add` per window) and summarizes it.

    Every window is compared with the reference on the same tokens, so the per-window differences are paired:
    ``<metric>_se`` is the standard error of the per-window values of ``delta_ppl``, ``kl_mean`` and ``top1``
    (sample standard deviation over windows / sqrt(windows)); None with a single window.
    """

    parts: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    windows: list[dict[str, float]] = field(default_factory=list)

    def add(self, drift: dict[str, torch.Tensor], window: int | None = None) -> None:
        for k, v in drift.items():
            self.parts.setdefault(k, []).append(v)
        w = window_metrics(drift)
        self.windows.append({"window": len(self.windows) if window is None else window, **w})

    @property
    def n_tokens(self) -> int:
        return int(sum(t.numel() for t in self.parts.get("kl", [])))

    def summary(self) -> dict[str, Any]:
        if not self.parts:
            raise ValueError("no tokens scored")
        cat = {k: torch.cat(v) for k, v in self.parts.items()}
        ppl_ref = math.exp(cat["nll_ref"].mean().item())
        ppl = math.exp(cat["nll_q"].mean().item())
        kl = cat["kl"]
        out: dict[str, Any] = {
            "ppl": ppl,
            "ppl_ref": ppl_ref,
            "delta_ppl": ppl - ppl_ref,
            "kl_mean": kl.mean().item(),
            "kl_p99": float(np.percentile(kl.numpy(), 99)),
            "kl_max": kl.max().item(),
            "top1": cat["top1"].double().mean().item(),
            "mean_abs_dp": cat["abs_dp"].mean().item(),
            "n_tokens": int(kl.numel()),
        }
        for m in SE_METRICS:
            out[f"{m}_se"] = standard_error([w[m] for w in self.windows])
        out["n_windows"] = len(self.windows)
        out["windows"] = [dict(w) for w in self.windows]
        return out


def summarize(ref_logits: torch.Tensor, q_logits: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    """All metrics for one pair of logit tensors ([n, vocab]) and their targets [n]."""
    acc = DriftAccumulator()
    acc.add(token_drift(ref_logits, q_logits, targets))
    out = acc.summary()
    out.pop("windows")
    return out


def generation_agreement(ref: list[list[int]], other: list[list[int]]) -> dict[str, object]:
    """Greedy continuations vs the reference's: token agreement and where they first diverge.

    ``token_agreement``: fraction of positions with the same token (position by position, over all prompts);
    ``first_divergence``: for each prompt, the index of the first differing new token, or ``None`` if the
    continuations are identical; ``identical``: fraction of prompts with no divergence.
    """
    if len(ref) != len(other):
        raise ValueError("generation: different numbers of prompts")
    same = total = 0
    firsts: list[int | None] = []
    for a, b in zip(ref, other, strict=True):
        n = min(len(a), len(b))
        eq = [a[i] == b[i] for i in range(n)]
        same += sum(eq)
        total += max(len(a), len(b))
        first = next((i for i, e in enumerate(eq) if not e), None)
        if first is None and len(a) != len(b):
            first = n
        firsts.append(first)
    diverged = sorted(f for f in firsts if f is not None)
    return {
        "token_agreement": same / total if total else 1.0,
        "identical": sum(f is None for f in firsts) / len(firsts) if firsts else 1.0,
        "first_divergence": firsts,
        "first_divergence_median": (diverged[len(diverged) // 2] if diverged else None),
    }
