"""Choose a precision per (layer, KV head) -- K and V together or separately -- under an average-bits budget.

``allocate`` is a greedy multiple-choice knapsack: every unit starts at the cheapest candidate; then,
while the budget allows, the upgrade (any unit to any more expensive candidate) with the largest
predicted loss decrease per added bit is taken. The predicted loss of a unit at a candidate is its
measured sensitivity (:mod:`kvquant.sensitivity`), and units add up. Bits are the stored bits per
element of each precision, scale and zero-point overhead included (``KVQuantConfig.bits``), so the
result's ``KVQuantConfig.avg_bits`` is what the budget bounds.

Two reference policies for comparisons live here too: ``layer_upgrade`` (a uniform precision widened
to the budget by upgrading whole layers in order, as a per-layer search without measurement would)
and ``random_allocation`` (random units upgraded until the budget is spent).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from .config import KVPrecision, KVQuantConfig
from .errors import ArgumentError, InputError
from .quantizers import PRECISIONS
from .shape import ModelShape

Plan = list[list[KVPrecision]]  # plan[layer][kv_head]


@dataclass
class Allocation:
    plan: Plan
    avg_bits: float
    predicted_kl: float  # sum of the chosen units' sensitivities (nats per token, additive model)


def parse_candidates(text: str | Sequence[str]) -> list[str]:
    """``"int4,int8,fp16"`` -> a checked list, ordered by name as given; errors name ``--candidates``."""
    names = [c.strip() for c in text.split(",")] if isinstance(text, str) else [str(c).strip() for c in text]
    names = [c for c in names if c]
    if not names:
        raise ArgumentError("--candidates: give at least one precision, e.g. int4,int8,fp16")
    for c in names:
        if c not in PRECISIONS:
            raise ArgumentError(f"--candidates: unknown precision {c!r} (known: {', '.join(PRECISIONS)})")
    if len(set(names)) != len(names):
        raise ArgumentError(f"--candidates: {','.join(names)} names a precision twice")
    return names


def candidate_bits(candidates: Sequence[str], template: KVQuantConfig, head_dim: int) -> dict[str, float]:
    """Stored bits per element of each candidate, overhead included."""
    return {c: template.bits(c, head_dim) for c in candidates}


def check_budget(budget: float, bits: dict[str, float]) -> None:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget):
        raise ArgumentError(f"--budget-bits: {budget!r} must be a finite number of bits, e.g. 6.0")
    lo = min(bits.values())
    if not budget >= lo:  # also catches NaN
        cheapest = min(bits, key=bits.get)
        raise ArgumentError(
            f"--budget-bits: {budget} is below the cheapest candidate ({cheapest}: {lo:.3f} bits per element "
            "with its scale/zero overhead); raise the budget or add a cheaper candidate"
        )


NEGATIVE_TOLERANCE = 1e-6  # a measured KL rise below -this is not rounding: the table is wrong


def check_sensitivity(sens: dict[str, torch.Tensor], candidates: Sequence[str], where: str = "sensitivity",
                      shape: tuple[int, int] | None = None) -> None:
    """Refuse a sensitivity table the allocator cannot rank: a candidate missing, tensors not ``[layers,
    kv_heads, 2]`` (or not the model's ``shape``), NaN / Inf or negative values. Raises :class:`InputError`
    naming ``where`` and the first bad entry (``values['int4'][2][1][0]``)."""
    if not isinstance(sens, dict):
        raise InputError(f"{where}: expected a mapping of precision -> [layers, kv_heads, 2] values")
    first = None
    for c in candidates:
        if c not in sens:
            raise InputError(f"{where}: no values for candidate {c!r} (it has {', '.join(map(str, sens))})")
        t = sens[c]
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[2] != 2 or 0 in t.shape:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise InputError(f"{where}: values[{c!r}] has shape {got}, expected [layers, kv_heads, 2]")
        first = first or (c, tuple(t.shape))
        if tuple(t.shape) != first[1]:
            raise InputError(f"{where}: values[{c!r}] has shape {list(t.shape)}, values[{first[0]!r}] "
                             f"{list(first[1])}")
        if shape is not None and tuple(t.shape[:2]) != tuple(shape):
            raise InputError(f"{where}: values[{c!r}] covers {t.shape[0]} layers x {t.shape[1]} KV heads; the model "
                             f"has {shape[0]} x {shape[1]} (measured on another model?)")
        bad = (~torch.isfinite(t)).nonzero()
        if len(bad):
            i = bad[0].tolist()
            raise InputError(f"{where}: values[{c!r}]{i} is {float(t[tuple(i)])}: sensitivities must be finite "
                             "(measure again with --no-cache)")
        neg = (t < -NEGATIVE_TOLERANCE).nonzero()
        if len(neg):
            i = neg[0].tolist()
            raise InputError(f"{where}: values[{c!r}]{i} is {float(t[tuple(i)])}: a KL rise is never negative")


def greedy_upgrades(loss: list[list[float]], cost: list[list[float]], choice: list[int], capacity: float) -> list[int]:
    """A multiple-choice knapsack, greedily: unit ``u`` takes option ``choice[u]`` (its ``loss[u][i]`` at
    ``cost[u][i]``); from there, repeatedly apply the one change of one unit with the largest loss decrease per
    added cost (a change that costs nothing first) while the summed cost stays within ``capacity``, until no change
    lowers a loss. Returns the new choices. Every step lowers one unit's loss strictly (values must be finite), so a
    unit changes at most ``len(options) - 1`` times: the loop is bounded by that, and a longer one is a bug (raised),
    never a hang."""
    choice = list(choice)
    spent = sum(cost[u][choice[u]] for u in range(len(choice)))
    steps = sum(len(c) - 1 for c in cost) + 1
    for _step in range(steps):
        best = None  # (ratio, unit, option)
        for u in range(len(choice)):
            cur = choice[u]
            for ci in range(len(cost[u])):
                extra = cost[u][ci] - cost[u][cur]
                gain = loss[u][cur] - loss[u][ci]
                if not gain > 0 or spent + extra > capacity:
                    continue
                ratio = math.inf if extra <= 0 else gain / extra
                if best is None or ratio > best[0]:
                    best = (ratio, u, ci)
        if best is None:
            return choice
        _, u, ci = best
        spent += cost[u][ci] - cost[u][choice[u]]
        choice[u] = ci
    raise RuntimeError(f"allocate: no convergence after {steps} steps (a bug)")


def allocate(
    sens: dict[str, torch.Tensor],
    bits: dict[str, float],
    budget: float,
    kv_separate: bool = False,
) -> Allocation:
    """Greedy allocation (see module doc). ``sens[c]`` is ``[layers, kv_heads, 2]``; ``budget`` in avg bits."""
    check_budget(budget, bits)
    cands = sorted(bits, key=lambda c: (bits[c], c))
    check_sensitivity(sens, cands)
    for c, b in bits.items():
        if not (isinstance(b, (int, float)) and math.isfinite(b) and b > 0):
            raise ArgumentError(f"--candidates: {c} has {b!r} bits per element; expected a positive number")
    first = sens[cands[0]]
    L, H = int(first.shape[0]), int(first.shape[1])
    if kv_separate:
        units = [(li, h, (k,)) for li in range(L) for h in range(H) for k in (0, 1)]
    else:
        units = [(li, h, (0, 1)) for li in range(L) for h in range(H)]
    loss = [[float(sum(sens[c][li, h, k] for k in kinds)) for c in cands] for li, h, kinds in units]
    cost = [[bits[c] * len(kinds) for c in cands] for _li, _h, kinds in units]
    capacity = budget * 2 * L * H + 1e-9
    choice = greedy_upgrades(loss, cost, [0] * len(units), capacity)
    plan: Plan = [[KVPrecision(cands[0], cands[0]) for _ in range(H)] for _ in range(L)]
    for u, (li, h, kinds) in enumerate(units):
        c = cands[choice[u]]
        old = plan[li][h]
        if kinds == (0, 1):
            plan[li][h] = KVPrecision(c, c)
        elif kinds == (0,):
            plan[li][h] = KVPrecision(c, old.value)
        else:
            plan[li][h] = KVPrecision(old.key, c)
    predicted = sum(loss[u][choice[u]] for u in range(len(units)))
    spent = sum(cost[u][choice[u]] for u in range(len(units)))
    return Allocation(plan, spent / (2 * L * H), predicted)


def plan_avg_bits(plan: Plan, bits: dict[str, float]) -> float:
    n = sum(len(row) for row in plan)
    return sum(bits[p.key] + bits[p.value] for row in plan for p in row) / (2 * n)


def with_plan(template: KVQuantConfig, default: KVPrecision,
              heads: dict[tuple[int, int], KVPrecision] | None = None) -> KVQuantConfig:
    """A copy of ``template``'s storage options with a new default and head overrides (no layer overrides)."""
    return replace(template, default=default, layers={}, heads=dict(heads or {}), model_shape=None,
                   name=None, description=None)


def predicted_kl(plan: Plan, sens: dict[str, torch.Tensor]) -> float:
    return float(sum(sens[p.key][li, h, 0] + sens[p.value][li, h, 1]
                     for li, row in enumerate(plan) for h, p in enumerate(row)))


def plan_to_config(plan: Plan, template: KVQuantConfig | None = None, shape: ModelShape | None = None,
                   name: str | None = None, description: str | None = None) -> KVQuantConfig:
    """A compact config for ``plan``: the commonest pair as default, whole-layer and per-head overrides."""
    counts = Counter(p for row in plan for p in row)
    default = counts.most_common(1)[0][0]
    cfg = with_plan(template or KVQuantConfig(), default)
    for li, row in enumerate(plan):
        if len(set(row)) == 1 and row[0] != default:
            cfg.layers[li] = row[0]
            continue
        for h, p in enumerate(row):
            if p != default:
                cfg.heads[(li, h)] = p
    cfg.model_shape = shape.as_dict() if shape is not None else None
    cfg.name, cfg.description = name, description
    return cfg


def layer_upgrade(shape: ModelShape, bits: dict[str, float], budget: float, low: str = "int4",
                  high: str = "int8") -> Plan:
    """Uniform ``low``, then whole layers 0, 1, 2, ... upgraded to ``high`` while the average fits ``budget``."""
    check_budget(budget, {low: bits[low]})
    L, H = shape.num_layers, shape.num_kv_heads
    plan = [[KVPrecision(low, low)] * H for _ in range(L)]
    for li in range(L):
        trial = [list(r) for r in plan]
        trial[li] = [KVPrecision(high, high)] * H
        if plan_avg_bits(trial, bits) > budget + 1e-9:
            break
        plan = trial
    return plan


def random_allocation(shape: ModelShape, bits: dict[str, float], budget: float, seed: int,
                      kv_separate: bool = False) -> Plan:
    """Units in a random order, each upgraded to a random more expensive candidate that still fits the budget."""
    check_budget(budget, bits)
    rng = random.Random(seed)
    cands = sorted(bits, key=lambda c: (bits[c], c))
    L, H = shape.num_layers, shape.num_kv_heads
    plan = [[KVPrecision(cands[0], cands[0])] * H for _ in range(L)]
    kinds = [(0,), (1,)] if kv_separate else [(0, 1)]
    units = [(li, h, k) for li in range(L) for h in range(H) for k in kinds]
    rng.shuffle(units)
    capacity = budget * 2 * L * H + 1e-9
    spent = bits[cands[0]] * 2 * L * H
    for li, h, k in units:
        options = [c for c in cands[1:] if spent + (bits[c] - bits[cands[0]]) * len(k) <= capacity]
        if not options:
            continue
        c = rng.choice(options)
        spent += (bits[c] - bits[cands[0]]) * len(k)
        old = plan[li][h]
        plan[li][h] = KVPrecision(c if 0 in k else old.key, c if 1 in k else old.value)
    return plan
