"""``kvquant calibrate --target-bytes F``: a complete config for one model at a byte target, from calibration text.

The target is a fraction of the bytes an FP16 cache holds at ``context`` tokens, and bytes are what a cache of
the written config really holds there (:func:`kvquant.memory.sequence_bytes`: pool rows in whole blocks, scales
and codebook state, sink tokens, the residual window). The steps:

1. the text's last ``(heldout + windows) x window`` tokens are read (evaluation windows are cut from a corpus'
   start, so the two do not overlap): the last ``windows`` fit the config, the ``heldout`` before them only
   measure it (:func:`split_calibration`);
2. per-channel key widths for the ``tqc<bits>`` candidates (:mod:`kvquant.calibrate_channels`);
3. each unit's (layer, KV head, K or V) sensitivity at every candidate: KL plus ``target_weight`` times the
   target-token term (:func:`kvquant.sensitivity.estimate_fisher` / :func:`~kvquant.sensitivity.measure_kl`);
4. a greedy multiple-choice knapsack over the units in bytes (:func:`allocate_bytes`), checked against
   ``sequence_bytes`` of the config it makes, and tightened until that fits;
5. the expectation: KL and perplexity change against FP16 on the held-out windows under exact one-token decode
   (the last ``expect_tokens`` of each window fed one at a time through a real :class:`~kvquant.QuantizedKVCache`,
   so the residual window and sinks count as they will), mean +- standard error over the windows.

The template carries the options every layer gets: ``sink_tokens``, an exact fp16 residual window of the newest
``residual_tokens`` (``--residual``, default :data:`RESIDUAL`; quantized ``residual_step`` tokens at a time,
``--residual-step``, default :data:`RESIDUAL_STEP`) and an age ladder
(``ladder_tokens``, ``--ladder``, default :data:`LADDER`), whose bytes the target counts. Per-channel block keys
(``int*-channel``) cannot take an exact window (their block is quantized whole), so they are candidates only with
``--residual 0``; the per-channel key widths of ``tqc*`` serve the same outlier channels per token.

Candidate labels are precisions (:data:`kvquant.quantizers.PRECISIONS`) plus ``tqc<bits>`` (keys only: one
``tqc-<widths>`` per head at ``bits`` average width). Trellis codes (``tqt*``) are not default candidates: their
encoder writes each token an order of magnitude slower on CPU.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .allocate import Plan, greedy_upgrades, plan_to_config
from .config import KVPrecision, KVQuantConfig
from .errors import ArgumentError, ConfigError
from .memory import sequence_bytes
from .plan import logit_softcap
from .quantizers import CHANNEL, CODEBOOK, PRECISIONS, TRELLIS, VECTOR, is_precision
from .shape import ModelShape

#: named tiers: ``--tier NAME`` is ``--target-bytes F``
TIERS: dict[str, float] = {"auto-8bit": 0.5, "auto-4bit": 0.27, "auto-3bit": 0.21}
#: the default candidates: the lowest error per byte (the vector ``tqv*`` and channel-width ``tqc*`` codebooks
#: included). With the default residual step their calibrated mixes decode on the CPU torch path at 0.53-0.81x of
#: ``int4-kchannel-sinks``'s tokens per CPU-second (benchmarks/calibration_speed.py; docs/results/calibration-tiers.md)
KEY_CANDIDATES = "fp16,int8-token,int4,tq4,tq3,tqv4,tqc4,tqc3"
VALUE_CANDIDATES = "fp16,int8-token,int4,tq4,tq3,tqv4,tqv3"
#: ``--fast``: no ``tqv*`` / ``tqc*``: faster CPU decode still, at a higher error
FAST_KEY_CANDIDATES = "fp16,int8-token,int4,tq4,tq3"
FAST_VALUE_CANDIDATES = "fp16,int8-token,int4,tq4,tq3"
#: with ``--residual 0`` the per-channel block keys join the candidates (default and ``--fast``)
BLOCK_KEY_CANDIDATES = "fp16,int8-channel,int8-token,int4-channel,int4,tq4,tq3,tqv4,tqc4,tqc3"
FAST_BLOCK_KEY_CANDIDATES = "fp16,int8-channel,int8-token,int4-channel,int3-channel,int4,tq4,tq3"
#: targets below this fraction also get 2-bit codebook candidates: with the residual window, sinks and ladder
#: counted, 3-bit codes alone cannot go much under 0.22x at 1K tokens
LOW_TARGET = 0.25
LOW_KEY_CANDIDATES = "tqc2"
LOW_VALUE_CANDIDATES = "tqv2,tq2"
LOW_FAST_CANDIDATES = "tq2"
#: ``--residual``: the newest tokens every layer keeps exactly in fp16
RESIDUAL = 16
#: ``--residual-step``: tokens quantized at a time once the window is full (the window holds RESIDUAL to
#: RESIDUAL + RESIDUAL_STEP - 1 tokens). Encoding one token per step costs each codebook head a call per step;
#: 16 at a time is what keeps the calibrated configs' CPU decode at half of int4-kchannel-sinks' or above
#: (docs/results/calibration-tiers.md)
RESIDUAL_STEP = 16
#: ``--ladder``: the newest quantized tokens whose codebook K/V keep one refinement bit (``ladder_tokens``)
LADDER = 64
#: ``--expect-tokens``: the tokens of each held-out window decoded one at a time for the expectation
EXPECT_TOKENS = 64
TARGET_EPILOG = """
a byte target (--target-bytes F or --tier NAME) instead of --budget-bits:
  kvquant calibrate --model smollm2-135m --data wikitext-2 --target-bytes 0.27 -o smollm2-0.27x.yaml
  kvquant calibrate --model qwen2.5-coder-0.5b --data corpus.txt --tier auto-4bit --context 2048 -o qwen-4bit.yaml
  tiers: auto-8bit = 0.5x, auto-4bit = 0.27x, auto-3bit = 0.21x; what each measured (and what is not yet
  measured): docs/results/calibration-tiers.md
  F is the fraction of the bytes an FP16 cache holds at --context tokens that the written config's cache holds
  there (kvquant.memory.sequence_bytes: scales, codebook state and the --sinks fp16 tokens included). The last
  (--heldout-windows + --calib-windows) x --calib-window tokens of --data are read: the last --calib-windows fit
  the config (per-channel tqc key widths, each unit's fisher or kl sensitivity plus --target-weight x a
  target-token NLL term), the held-out ones before them measure the expectation written in the config's header
  (KL and ppl change against FP16, mean +- SE, the last --expect-tokens of each decoded one token at a time).
  Every layer keeps the --residual newest tokens exactly in fp16 (default 16; --residual-step 16 of them are
  quantized at a time once the window is full, so it holds 16 to 31), and the --ladder newest quantized
  tokens of its codebook heads keep one refinement bit (default 64; not on sliding-window layers; a config with a
  ladder excludes evict and offload: give --ladder 0 to combine them); their bytes count in the target.
  Below --target-bytes 0.25 the 2-bit codebooks join the defaults (keys tqc2, values tqv2,tq2; --fast: tq2).
  Per-channel block keys (int*-channel) cannot take that window; they are candidates with --residual 0 or with
  --residual-step 128 (whole blocks).
  Trellis codes (tqt*) decode an order of magnitude slower on CPU and are never default candidates (add them to
  --key/--value-candidates to allow them). The default candidates give the lowest error per byte; their configs
  decoded at 0.53-0.81x of int4-kchannel-sinks' CPU speed on three models. --fast leaves the tqv*/tqc* codebooks
  out (keys fp16,int8-token,int4,tq4,tq3; values fp16,int8-token,int4,tq4,tq3): faster, at a higher error.
  Refused before any work, nothing written: a target below what the candidates can store, codebook keys on a
  model with attention logit softcapping when only they meet the target, less text than the windows need.
"""
TQC_LABEL = re.compile(r"tqc([1-8])")
#: key precisions a model with attention logit softcapping cannot read (kernels.dispatch refuses them)
SOFTCAP_REFUSED_PREFIXES = ("tqc",)


def is_codebook_key(label: str) -> bool:
    """Whether a key candidate is a codebook code (refused under attention logit softcapping)."""
    return label in CODEBOOK or label in VECTOR or label in TRELLIS or label.startswith(SOFTCAP_REFUSED_PREFIXES)


def parse_target(target_bytes: float | None, tier: str | None) -> float:
    """The byte target as a fraction of FP16, from ``--target-bytes`` or ``--tier`` (exactly one)."""
    if (target_bytes is None) == (tier is None):
        raise ArgumentError("--target-bytes: give it or --tier (one of them), e.g. --target-bytes 0.27")
    if tier is not None:
        if tier not in TIERS:
            known = ", ".join(f"{k} ({v}x)" for k, v in TIERS.items())
            raise ArgumentError(f"--tier: unknown {tier!r} (known: {known})")
        return TIERS[tier]
    if isinstance(target_bytes, bool) or not isinstance(target_bytes, (int, float)) or not 0 < target_bytes <= 1:
        raise ArgumentError(f"--target-bytes: {target_bytes!r} must be a fraction of the FP16 bytes in (0, 1], "
                            "e.g. 0.27")
    return float(target_bytes)


def default_candidates(
    residual: int, fast: bool, step: int = RESIDUAL_STEP, block_size: int = KVQuantConfig.block_size,
    target: float = 1.0,
) -> tuple[str, str]:
    """The default ``(key, value)`` candidate lists for ``--residual``, ``--fast``, ``--residual-step`` and the byte
    target (per-channel block keys join them when no window is kept, or when it is quantized a whole block at a
    time; below :data:`LOW_TARGET` the 2-bit codebooks of :data:`LOW_KEY_CANDIDATES` / :data:`LOW_VALUE_CANDIDATES`
    join them)."""
    if residual and step != block_size:
        keys, values = (FAST_KEY_CANDIDATES, FAST_VALUE_CANDIDATES) if fast else (KEY_CANDIDATES, VALUE_CANDIDATES)
    else:
        keys, values = ((FAST_BLOCK_KEY_CANDIDATES, FAST_VALUE_CANDIDATES) if fast
                        else (BLOCK_KEY_CANDIDATES, VALUE_CANDIDATES))  # fmt: skip
    if target < LOW_TARGET:
        low = LOW_FAST_CANDIDATES if fast else None
        keys += "," + (low or LOW_KEY_CANDIDATES)
        values += "," + (low or LOW_VALUE_CANDIDATES)
    return keys, values


def calibration_template(sinks: int = 4, residual: int = RESIDUAL, ladder: int = LADDER,
                         step: int = RESIDUAL_STEP) -> KVQuantConfig:
    """The options every layer of a calibrated config gets: ``sinks`` fp16 sink tokens, an exact fp16 window of
    the ``residual`` newest tokens (0: none), quantized ``step`` tokens at a time once full (``residual_step``), and
    an age ladder of the ``ladder`` newest quantized tokens (``ladder_tokens``: one refinement bit per coordinate of
    their codebook K/V; 0: none)."""
    return KVQuantConfig(sink_tokens=sinks, residual_tokens=residual, residual_step=step if residual else None,
                         ladder_tokens=ladder)


def parse_kind_candidates(text: str, kind: int) -> list[str]:
    """Checked candidate labels for keys (``kind`` 0) or values (1); errors name the option."""
    option = "--key-candidates" if kind == 0 else "--value-candidates"
    names = [c.strip() for c in text.split(",") if c.strip()]
    if not names:
        raise ArgumentError(f"{option}: give at least one precision, e.g. int4,int8-token,fp16")
    for c in names:
        if TQC_LABEL.fullmatch(c):
            if kind == 1:
                raise ArgumentError(f"{option}: {c}: per-channel widths are calibrated for keys only")
        elif c not in PRECISIONS:
            raise ArgumentError(f"{option}: unknown precision {c!r} (known: {', '.join(PRECISIONS)}, tqc<bits>)")
    if len(set(names)) != len(names):
        raise ArgumentError(f"{option}: {text} names a precision twice")
    return names


# ------------------------------------------------------------------------------------------ text
@dataclass
class CalibrationSplit:
    """The fit windows ``fit[n, T]`` and the held-out windows ``heldout[m, T]`` and where they lie in the corpus."""

    fit: torch.Tensor
    heldout: torch.Tensor
    start: int  # first corpus token read (the held-out windows start here)
    end: int  # one past the last (the corpus' length)

    def describe(self) -> str:
        n, T = self.fit.shape
        m = self.heldout.shape[0]
        mid = self.start + m * T
        return (f"corpus tokens {self.start}..{self.end} of {self.end}: held-out {m} x {T} = {self.start}..{mid}, "
                f"fit {n} x {T} = {mid}..{self.end}")


def split_calibration(ids: torch.Tensor, window: int, windows: int, heldout: int,
                      bos_id: int | None = None) -> CalibrationSplit:
    """The last ``(heldout + windows) x window`` tokens of ``ids`` (1-D), as held-out windows then fit windows,
    each led by ``bos_id`` when given. Raises :class:`ArgumentError` naming ``--data`` when the text is too short."""
    body = window - (1 if bos_id is not None else 0)
    need = body * (windows + heldout)
    n = int(ids.numel())
    if n < need:
        raise ArgumentError(f"--data: {n} tokens of calibration text, fewer than the {need} needed "
                            f"({heldout} held-out + {windows} fit windows of {window}); give more text or fewer "
                            "windows")
    rows = ids[n - need:].reshape(windows + heldout, body)
    if bos_id is not None:
        rows = torch.cat([torch.full((rows.shape[0], 1), bos_id, dtype=torch.long), rows], dim=1)
    return CalibrationSplit(rows[heldout:].clone(), rows[:heldout].clone(), n - need, n)


# ------------------------------------------------------------------------------------------ bytes
def fp16_bytes(shape: ModelShape, context: int) -> int:
    """Bytes an FP16 cache (no sinks, no residual) holds at ``context`` tokens: the 1.0x of ``--target-bytes``."""
    return sequence_bytes(shape, KVQuantConfig(default=KVPrecision("fp16", "fp16")), context)["total"]


def config_bytes(shape: ModelShape, cfg: KVQuantConfig, context: int) -> int:
    return sequence_bytes(shape, cfg, context)["total"]


def unit_costs(shape: ModelShape, template: KVQuantConfig, labels: dict[int, list[str]], resolve: Callable,
               context: int) -> dict[tuple[str, int], float]:
    """Bytes one unit (one KV head's K or V) of each label costs at ``context``: the config with every head's
    K (or V) in that label and the other side fp16, less the all-fp16 config, per head, plus half an fp16 head;
    summed over all units of a uniform config this is that config's :func:`sequence_bytes` exactly."""
    n = shape.num_layers * shape.num_kv_heads
    fp = config_bytes(shape, template.with_updates(default=KVPrecision("fp16", "fp16"), layers={}, heads={}), context)
    out = {}
    for kind, names in labels.items():
        for c in names:
            heads = {}
            for li in range(shape.num_layers):
                for h in range(shape.num_kv_heads):
                    p = resolve(c, li, h, kind)
                    heads[(li, h)] = KVPrecision(p, "fp16") if kind == 0 else KVPrecision("fp16", p)
            cfg = template.with_updates(default=KVPrecision("fp16", "fp16"), layers={}, heads=heads)
            out[(c, kind)] = (config_bytes(shape, cfg, context) - fp) / n + fp / (2 * n)
    return out


@dataclass
class ByteAllocation:
    plan: Plan
    labels: list[list[tuple[str, str]]]  # labels[layer][head] = (key label, value label)
    predicted: float  # sum of the chosen units' sensitivities
    bytes: int  # sequence_bytes of the config at the context
    rounds: int  # allocations run until the config's bytes fit


def allocate_bytes(sens: dict[str, torch.Tensor], labels: dict[int, list[str]], costs: dict[tuple[str, int], float],
                   capacity: float) -> tuple[list[list[list[str]]], float]:
    """Greedy multiple-choice knapsack in bytes: every unit at its cheapest label, then the upgrade with the largest
    sensitivity decrease per added byte while the summed cost fits ``capacity``. Returns ``(choice[layer][head][kind]
    labels, predicted loss)``."""
    first = next(iter(sens.values()))
    L, H = int(first.shape[0]), int(first.shape[1])
    units = [(li, h, k) for li in range(L) for h in range(H) for k in (0, 1)]
    opts = {k: sorted(labels[k], key=lambda c, k=k: (costs[(c, k)], c)) for k in (0, 1)}
    loss = [[float(sens[c][li, h, k]) for c in opts[k]] for li, h, k in units]
    cost = [[costs[(c, k)] for c in opts[k]] for _li, _h, k in units]
    choice = [min(range(len(opts[k])), key=lambda i, u=u: (cost[u][i], loss[u][i])) for u, (_li, _h, k) in
              enumerate(units)]
    choice = greedy_upgrades(loss, cost, choice, capacity + 1e-9)
    out = [[["", ""] for _ in range(H)] for _ in range(L)]
    for u, (li, h, k) in enumerate(units):
        out[li][h][k] = opts[k][choice[u]]
    return out, sum(loss[u][choice[u]] for u in range(len(units)))


def fit_bytes(shape: ModelShape, template: KVQuantConfig, sens: dict[str, torch.Tensor], labels: dict[int, list[str]],
              resolve: Callable, context: int, capacity: int) -> ByteAllocation:
    """:func:`allocate_bytes`, then the config's real bytes at ``context``; while they exceed ``capacity`` the
    allocation runs again with the capacity lowered by the excess (layers whose heads mix per-block and per-token
    codes hold more full-precision rows than the per-unit costs say)."""
    costs = unit_costs(shape, template, labels, resolve, context)
    cap = float(capacity)
    for rounds in range(1, 33):
        choice, predicted = allocate_bytes(sens, labels, costs, cap)
        plan = [[KVPrecision(resolve(ch[0], li, h, 0), resolve(ch[1], li, h, 1)) for h, ch in enumerate(row)]
                for li, row in enumerate(choice)]
        held = config_bytes(shape, plan_to_config(plan, template, shape), context)
        if held <= capacity:
            return ByteAllocation(plan, [[(ch[0], ch[1]) for ch in row] for row in choice], predicted, held, rounds)
        cap -= held - capacity
    raise ArgumentError(f"--target-bytes: no allocation of these candidates fits {capacity} bytes at --context "
                        f"{context}")


# ------------------------------------------------------------------------------------------ expectation
@dataclass
class Expectation:
    """KL and perplexity change against FP16 on held-out windows: per-window values, their means and SEs, and the
    ``decoded`` targets of each window scored by exact one-token decode."""

    kl: list[float]
    dnll: list[float]  # mean NLL rise per window (nats per token)
    decoded: int

    @staticmethod
    def _mean_se(xs: Sequence[float]) -> tuple[float, float]:
        m = sum(xs) / len(xs)
        se = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs)) if len(xs) > 1 else math.nan
        return m, se

    def line(self) -> str:
        k, ks = self._mean_se(self.kl)
        d, ds = self._mean_se([math.expm1(x) * 100 for x in self.dnll])
        return (f"KL {k:.4f} +- {ks:.4f} nats/token, ppl {d:+.2f}% +- {ds:.2f}% vs FP16 over {len(self.kl)} held-out "
                f"windows (the last {self.decoded} targets of each; exact one-token decode)")

    def as_dict(self) -> dict[str, float]:
        k, ks = self._mean_se(self.kl)
        d, ds = self._mean_se([math.expm1(x) * 100 for x in self.dnll])
        return {"kl": k, "kl_se": ks, "dppl_pct": d, "dppl_pct_se": ds, "windows": len(self.kl),
                "decoded": self.decoded}


@torch.no_grad()
def expectation(model: Any, windows: torch.Tensor, cfg: KVQuantConfig, decoded: int = EXPECT_TOKENS,
                progress: Callable[[int, int], None] | None = None) -> Expectation:
    """:class:`Expectation` of ``cfg`` against FP16 on ``windows[n, T]``: each window's first ``T - 1 - decoded``
    tokens are prefilled into a :class:`~kvquant.QuantizedKVCache` of ``cfg``, then the next ``decoded`` are fed
    one at a time (exact one-token decode) and their predictions scored against one FP16 forward over the window."""
    from .cache import QuantizedKVCache
    from .sensitivity import _kl_mean, _nll_mean
    from .transformers_compat import cache_kw
    from .wrap import wrapped

    n, T = windows.shape
    prefill = T - 1 - decoded
    if prefill < 1:
        raise ArgumentError(f"--expect-tokens: {decoded} leaves no prefill in a --calib-window of {T}")
    dev = next(model.parameters()).device
    kls, dn = [], []
    with wrapped(model, cfg):  # (without a kvquant cache the wrapped model's attention is plain SDPA: the FP16 side)
        for w in range(n):
            x = windows[w : w + 1].to(dev)
            lp = torch.log_softmax(model(input_ids=x, use_cache=False).logits[:, prefill : T - 1].float(), -1)
            cache = QuantizedKVCache(model, cfg)
            model(x[:, :prefill], **cache_kw(cache), use_cache=True, logits_to_keep=1)
            steps = []
            for s in range(prefill, T - 1):
                steps.append(model(x[:, s : s + 1], **cache_kw(cache), use_cache=True).logits[:, -1:].float())
                if progress is not None:
                    progress(w * decoded + s - prefill + 1, n * decoded)
            logits = torch.cat(steps, dim=1)
            kls.append(_kl_mean(lp, logits))
            target = x[:, prefill + 1 :]
            dn.append(_nll_mean(torch.log_softmax(logits, -1), target) - _nll_mean(lp, target))
    return Expectation(kls, dn, decoded)


# ------------------------------------------------------------------------------------------ the run
@dataclass
class TargetResult:
    config: KVQuantConfig
    allocation: ByteAllocation
    split: CalibrationSplit
    expect: Expectation
    fp16: int
    capacity: int
    shape: ModelShape
    seconds: dict[str, float] = field(default_factory=dict)


def resolver(tqc: dict[int, list[list[str]]]) -> Callable[[str, int, int, int], str]:
    """The :data:`kvquant.sensitivity.Resolve` for labels: ``tqc<bits>`` -> that head's widths, values of a
    key-only label and keys of a value-only label -> fp16 (never chosen there), anything else itself."""

    def resolve(label: str, layer: int, head: int, kind: int) -> str:
        m = TQC_LABEL.fullmatch(label)
        if m:
            return tqc[int(m.group(1))][layer][head] if kind == 0 else "fp16"
        return label

    return resolve


def cheapest_bytes(shape: ModelShape, template: KVQuantConfig, labels: dict[int, list[str]], resolve: Callable,
                   context: int) -> tuple[int, tuple[str, str]]:
    """Bytes of the cheapest uniform config the labels make (per-unit costs), and its (key, value) labels."""
    costs = unit_costs(shape, template, labels, resolve, context)
    k = min(labels[0], key=lambda c: costs[(c, 0)])
    v = min(labels[1], key=lambda c: costs[(c, 1)])
    n = shape.num_layers * shape.num_kv_heads
    return round((costs[(k, 0)] + costs[(v, 1)]) * n), (k, v)


def tqc_bits(labels: dict[int, list[str]]) -> list[int]:
    """The average widths of the ``tqc<bits>`` key labels."""
    return sorted({int(m.group(1)) for c in labels[0] if (m := TQC_LABEL.fullmatch(c))})


def check_reachable(shape: ModelShape, template: KVQuantConfig, labels: dict[int, list[str]], target: float,
                    context: int, softcap: float | None) -> dict[int, list[str]]:
    """The labels to allocate among, after the refusals that need only the model's shape and config: a target
    below the cheapest config the candidates store, and (with attention logit ``softcap``) one that only codebook
    keys meet; codebook keys are dropped on a softcapped model. Raises :class:`ArgumentError`."""
    fp = fp16_bytes(shape, context)
    capacity = int(target * fp)
    # tqc names of any widths cost the same bytes: placeholders size them before any widths are measured
    shape_only = resolver({b: [[f"tqc-{str(b) * shape.head_dim}"] * shape.num_kv_heads] * shape.num_layers
                           for b in tqc_bits(labels)})
    low, low_pair = cheapest_bytes(shape, template, labels, shape_only, context)
    if low > capacity:
        raise ArgumentError(f"--target-bytes: {target} is below the cheapest config these candidates store "
                            f"({low / fp:.3f}x FP16 at --context {context}: keys {low_pair[0]}, values {low_pair[1]}, "
                            f"{template.sink_tokens} sinks); raise it or add cheaper candidates")
    if softcap is None or not any(is_codebook_key(c) for c in labels[0]):
        return labels
    plain = {0: [c for c in labels[0] if not is_codebook_key(c)], 1: labels[1]}
    if not plain[0] or cheapest_bytes(shape, template, plain, shape_only, context)[0] > capacity:
        raise ArgumentError(f"--target-bytes: {target} needs codebook keys on this model, which its attention logit "
                            f"softcapping ({softcap}) rules out; raise the target")
    return plain


def check_template(template: KVQuantConfig, shape: ModelShape, labels: dict[int, list[str]]) -> None:
    """Every plain label must be storable for the model under the template's options (group size, packing, a
    residual step that a per-channel block cannot take)."""
    step = template.residual_step or template.block_size
    for kind, names in labels.items():
        option = "--key-candidates" if kind == 0 else "--value-candidates"
        for c in names:
            if TQC_LABEL.fullmatch(c) or not is_precision(c):
                continue
            if c in CHANNEL and template.residual_tokens and step != template.block_size:
                raise ArgumentError(f"{option}: {c}: a per-channel block cannot take the exact residual window of "
                                    f"{template.residual_tokens} tokens quantized {step} at a time; leave it out, or "
                                    f"give --residual-step {template.block_size} (whole blocks) or --residual 0")
            pair = KVPrecision(c, "fp16") if kind == 0 else KVPrecision("fp16", c)
            try:
                template.with_updates(default=pair, layers={}, heads={}).validate(shape)
            except ConfigError as e:
                raise ArgumentError(f"{option}: {c}: {str(e).split(': ', 1)[-1]}") from None


def _progress(what: str, enabled: bool) -> Callable[[int, int], None] | None:
    """A stderr progress bar for one stage (``done/total``, elapsed, time left), or None."""
    if not enabled:
        return None
    import sys

    t0 = time.perf_counter()
    last = [-1.0]

    def report(done: int, total: int) -> None:
        now = time.perf_counter()
        if now - last[0] < 2 and done != total:
            return
        last[0] = now
        el = now - t0
        bar = "#" * int(20 * done / max(total, 1))
        eta = el / done * (total - done) if done else 0.0
        print(f"\r[kvquant calibrate] {what}: [{bar:<20}] {done}/{total} {el:.0f}s, ~{eta:.0f}s left",
              end="\n" if done == total else "", file=sys.stderr, flush=True)

    return report


def _say(what: str, enabled: bool) -> None:
    if enabled:
        import sys

        print(f"[kvquant calibrate] {what}", file=sys.stderr, flush=True)


def calibrate_target(
    model: Any,
    tokenizer: Any,
    text: str,
    target: float,
    context: int = 1024,
    key_candidates: str = KEY_CANDIDATES,
    value_candidates: str = VALUE_CANDIDATES,
    method: str = "fisher",
    target_weight: float = 1.0,
    window: int = 512,
    windows: int = 2,
    heldout: int = 4,
    expect_tokens: int = EXPECT_TOKENS,
    samples: int = 8,
    seed: int = 0,
    template: KVQuantConfig | None = None,
    bos_id: int | None = None,
    progress: bool = False,
) -> TargetResult:
    """Calibrate a config for ``model`` holding at most ``target`` x the FP16 bytes at ``context`` tokens (see the
    module doc); nothing is written (:func:`write_target_config` does). Every refusal (a target below what the
    candidates can store, codebook keys on a softcapped model when only they meet it, too little text) raises
    :class:`ArgumentError` before any measurement."""
    from .sensitivity import estimate_fisher, measure_kl
    from .text import tokenize

    t0 = time.perf_counter()
    shape = ModelShape.of(model)
    template = template or calibration_template()
    labels = {0: parse_kind_candidates(key_candidates, 0), 1: parse_kind_candidates(value_candidates, 1)}
    check_template(template, shape, labels)
    if not (isinstance(target_weight, (int, float)) and math.isfinite(target_weight) and target_weight >= 0):
        raise ArgumentError(f"--target-weight: {target_weight!r} must be a number >= 0")
    if not 1 <= expect_tokens <= window - 2:
        raise ArgumentError(f"--expect-tokens: {expect_tokens} must be >= 1 and leave a prefill in a --calib-window "
                            f"of {window} (at most {window - 2})")
    fp = fp16_bytes(shape, context)
    capacity = int(target * fp)
    labels = check_reachable(shape, template, labels, target, context, logit_softcap(model))
    ids = tokenize(text, tokenizer)
    split = split_calibration(ids, window, windows, heldout, bos_id)
    seconds = {"tokenize": time.perf_counter() - t0}
    tqc: dict[int, list[list[str]]] = {}
    bits_wanted = tqc_bits(labels)
    if bits_wanted:
        from .calibrate_channels import channel_weights, tqc_names

        t = time.perf_counter()
        names = ", ".join(f"tqc{b}" for b in bits_wanted)
        _say(f"tqc key widths ({names}) from {split.fit.shape[0]} windows", progress)
        weights = channel_weights(model, split.fit, sink_tokens=template.sink_tokens)
        tqc = {b: tqc_names(weights, b) for b in bits_wanted}
        seconds["channel_widths"] = time.perf_counter() - t
    resolve = resolver(tqc)
    cands = sorted(set(labels[0]) | set(labels[1]) | {"fp16"})
    # sensitivities fake-quantize every position: the residual window and the ladder are decode properties, seen
    # by the bytes and the expectation only
    measured = template.with_updates(residual_tokens=0, residual_step=None, ladder_tokens=0, ladder2_tokens=0)
    t = time.perf_counter()
    if method == "kl":
        sens = measure_kl(model, split.fit, cands, "fp16", measured, progress=_progress("kl", progress),
                          resolve=resolve, target_weight=target_weight)
    elif method == "fisher":
        sens = estimate_fisher(model, split.fit, cands, "fp16", measured, samples=samples, seed=seed,
                               progress=_progress("fisher", progress), resolve=resolve, target_weight=target_weight)
    else:
        raise ArgumentError(f"--method: unknown {method!r} (known: fisher, kl)")
    seconds["sensitivity"] = time.perf_counter() - t
    t = time.perf_counter()
    _say("allocating under the byte target", progress)
    alloc = fit_bytes(shape, template, sens.values, labels, resolve, context, capacity)
    cfg = plan_to_config(alloc.plan, template, shape)
    seconds["allocate"] = time.perf_counter() - t
    t = time.perf_counter()
    _say(f"expectation on {split.heldout.shape[0]} held-out windows", progress)
    expect = expectation(model, split.heldout, cfg, expect_tokens, progress=_progress("expectation", progress))
    seconds["expectation"] = time.perf_counter() - t
    seconds["total"] = time.perf_counter() - t0
    return TargetResult(cfg, alloc, split, expect, fp, capacity, shape, {k: round(v, 1) for k, v in seconds.items()})


def _label_counts(res: TargetResult) -> str:
    out = []
    for kind, name in ((0, "K"), (1, "V")):
        counts: dict[str, int] = {}
        for row in res.allocation.labels:
            for pair in row:
                counts[pair[kind]] = counts.get(pair[kind], 0) + 1
        out.append(f"{name}: " + ", ".join(f"{n} {c}" for c, n in sorted(counts.items(), key=lambda x: -x[1])))
    return "; ".join(out)


def _window_words(cfg: KVQuantConfig) -> str:
    """The residual window of ``cfg`` in words."""
    r = cfg.residual_tokens
    step = cfg.residual_step or cfg.block_size
    if not r:
        return "no residual window"
    held = f"the {r} newest tokens" if step == 1 else f"the {r} to {r + step - 1} newest tokens"
    return f"{held} exactly in fp16 (residual window{'' if step == 1 else f', quantized {step} at a time'})"


def target_header(res: TargetResult, *, model_name: str, data_name: str, target: float, context: int, method: str,
                  target_weight: float, command: str | None, version: str) -> str:
    """The provenance comment block of a written config (model, data, target, command, version, expectation, bytes)."""
    from .memory import human

    shape = res.shape
    held = res.allocation.bytes
    lines = [
        "kvquant calibrated KV-cache config: a precision per (layer, KV head), K and V chosen apart, at a byte target",
        f"made {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by: {command or '(library call)'}",
        f"kvquant version: {version}",
        "",
        f"model: {model_name} ({shape.num_layers} layers x {shape.num_kv_heads} KV heads x head_dim "
        f"{shape.head_dim})",
        f"calibration text: {data_name}; {res.split.describe()}",
        "  (evaluation windows are cut from the start of a corpus: score on other text or on its start)",
        f"target: {target}x the FP16 bytes at context {context} tokens = {human(res.capacity)}",
        f"every layer: {res.config.sink_tokens} fp16 sink tokens, {_window_words(res.config)}, an age ladder of "
        f"{res.config.ladder_tokens} rows (codebook heads of full-attention layers)",
        f"bytes held at context {context}: {held} ({human(held)}, {held / res.fp16:.4f}x FP16; kvquant.memory."
        "sequence_bytes: scales, codebook state, sinks and the residual window included)",
        f"objective: {method} KL + {target_weight} x target-token NLL term per unit (layer, KV head, K or V); "
        f"greedy by decrease per byte; predicted {res.allocation.predicted:.5f}",
        f"expected (held-out calibration windows): {res.expect.line()}",
        f"counts: {_label_counts(res)}",
        f"seconds: {res.seconds}",
        "",
        "`kvquant show-config FILE` summarises it per layer; default, layers.N and heads.\"L.H\" may be edited.",
        "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ CLI
def command_line(args: Any) -> str:
    """The ``kvquant calibrate`` command that reproduces a target run, every setting spelled out."""
    import shlex

    parts = ["kvquant", "calibrate", "--model", args.model, "--data", args.data]
    parts += ["--tier", args.tier] if args.tier else ["--target-bytes", str(args.target_bytes)]
    parts += ["--context", str(args.context), "--key-candidates", args.key_candidates, "--value-candidates",
              args.value_candidates, "--method", args.method, "--target-weight", str(args.target_weight),
              "--calib-window", str(args.calib_window), "--calib-windows", str(args.calib_windows),
              "--heldout-windows", str(args.heldout_windows), "--expect-tokens", str(args.expect_tokens),
              "--sinks", str(args.sinks), "--residual", str(args.residual), "--residual-step", str(args.residual_step),
              "--ladder", str(args.ladder)]
    if args.method == "fisher":
        parts += ["--samples", str(args.samples), "--seed", str(args.seed)]
    if args.dtype != "float32":
        parts += ["--dtype", args.dtype]
    parts += ["-o", args.output]
    return " ".join(shlex.quote(str(a)) for a in parts)


def cmd_calibrate_target(args: Any) -> int:
    """``kvquant calibrate --target-bytes F | --tier NAME``: every check first, then calibrate and write ``-o``."""
    from . import __version__
    from .config import CONFIG_SUFFIXES, check_int
    from .inputs import looks_like_path
    from .models import load_model, model_input_paths, parse_dtype, read_model_config
    from .outputs import check_disjoint, check_output, input_paths
    from .text import load_text, window_bos

    if args.budget_bits is not None:
        raise ArgumentError("--budget-bits: give it or --target-bytes / --tier, not both")
    target = parse_target(args.target_bytes, args.tier)
    check_int(args.context, "--context", 1, 1 << 24, ArgumentError)
    check_int(args.calib_window, "--calib-window", 16, 1 << 20, ArgumentError)
    check_int(args.calib_windows, "--calib-windows", 1, 4096, ArgumentError)
    check_int(args.heldout_windows, "--heldout-windows", 2, 4096, ArgumentError)
    check_int(args.samples, "--samples", 1, 4096, ArgumentError)
    check_int(args.seed, "--seed", 0, 2**32 - 1, ArgumentError)
    check_int(args.sinks, "--sinks", 0, 4096, ArgumentError)
    check_int(args.residual, "--residual", 0, 4096, ArgumentError)
    check_int(args.residual_step, "--residual-step", 1, KVQuantConfig.block_size, ArgumentError)
    check_int(args.ladder, "--ladder", 0, 4096, ArgumentError)
    check_int(args.expect_tokens, "--expect-tokens", 1, args.calib_window - 2, ArgumentError)
    if args.method not in ("fisher", "kl"):
        raise ArgumentError(f"--method: unknown {args.method!r} (known: fisher, kl)")
    if not (math.isfinite(args.target_weight) and args.target_weight >= 0):
        raise ArgumentError(f"--target-weight: {args.target_weight} must be a number >= 0")
    parse_dtype(args.dtype)
    if args.fast and (args.key_candidates is not None or args.value_candidates is not None):
        raise ArgumentError("--fast: it sets the candidates; give it or --key/--value-candidates, not both")
    keys, values = default_candidates(args.residual, args.fast, args.residual_step, target=target)
    args.key_candidates = keys if args.key_candidates is None else args.key_candidates
    args.value_candidates = values if args.value_candidates is None else args.value_candidates
    labels = {0: parse_kind_candidates(args.key_candidates, 0), 1: parse_kind_candidates(args.value_candidates, 1)}
    force = bool(args.force)
    out = check_output(args.output, CONFIG_SUFFIXES, "-o", force)
    inputs = model_input_paths(args.model) + (input_paths("--data", args.data) if looks_like_path(args.data) else [])
    check_disjoint([("-o", out)], inputs)
    hf_config = read_model_config(args.model, what="--model")
    shape = ModelShape.from_config(hf_config)
    template = calibration_template(args.sinks, args.residual, args.ladder, args.residual_step)
    check_template(template, shape, labels)
    check_reachable(shape, template, labels, target, args.context, logit_softcap(hf_config))
    text = load_text(args.data)  # before the model: a bad --data fails fast
    loaded = load_model(args.model, dtype=args.dtype, attn_implementation="sdpa", progress=True)
    res = calibrate_target(
        loaded.model, loaded.tokenizer, text.text, target, context=args.context, key_candidates=args.key_candidates,
        value_candidates=args.value_candidates, method=args.method, target_weight=args.target_weight,
        window=args.calib_window, windows=args.calib_windows, heldout=args.heldout_windows,
        expect_tokens=args.expect_tokens, samples=args.samples,
        seed=args.seed, template=template, bos_id=window_bos(loaded.tokenizer, "auto"), progress=True,
    )
    header = target_header(res, model_name=args.model, data_name=f"{args.data} ({text.source})", target=target,
                           context=args.context, method=args.method, target_weight=args.target_weight,
                           command=command_line(args), version=__version__)
    cfg = res.config
    cfg.name = out.stem
    cfg.description = (f"calibrated for {args.model} at {target}x FP16 bytes ({res.allocation.bytes / res.fp16:.4f}x "
                       f"held at {args.context} tokens); expected: {res.expect.line()}")
    import yaml

    KVQuantConfig.from_dict(yaml.safe_load(cfg.to_yaml(header))).validate(shape)  # what is written loads back
    cfg.save(out, header=header, force=force)
    print(f"wrote {out}: {res.allocation.bytes / res.fp16:.4f}x FP16 bytes at {args.context} tokens "
          f"(target {target}x); expected {res.expect.line()}; {res.seconds['total']:.0f}s")
    return 0
