"""Per-(layer, KV head) sensitivity of the final logits to quantizing that head's K or V.

A *unit* is the keys or the values of one KV head of one layer: ``(layer, head, kind)`` with
``kind`` 0 = K, 1 = V. For a candidate precision ``c`` its sensitivity is the mean, over the
calibration tokens, of ``KL(p_base || p_unit@c)``: the drift of the next-token distribution when
that unit alone is stored in ``c`` and every other unit stays in the base precision (the most
precise candidate, usually ``fp16``). Every run goes through :class:`~kvquant.simulate.SimulatedQuantCache`
(the ``simulated`` protocol: K/V fake-quantized at every position), so the quantizers are the very
ones the cache uses.

Two ways to get the numbers:

* ``method="kl"`` measures it: one forward per (unit, candidate). A unit of layer ``l`` cannot change
  the layers before ``l``, so the forward starts at layer ``l`` from the base run's hidden state
  (half the work on average).
* ``method="fisher"`` estimates it from one forward and a few backward passes:
  ``KL ~ 1/2 E_y[(g . delta)^2]`` with ``g`` the gradient of ``log p(y)`` (``y`` sampled from the model's
  own next-token distribution) with respect to that unit's K or V, and ``delta`` the quantization error
  of the candidate. All units and candidates at once; noisier, and second-order only.

The result is a :class:`Sensitivity`: ``values[candidate]`` is a ``[layers, kv_heads, 2]`` tensor.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from .allocate import check_sensitivity, with_plan
from .config import KVPrecision, KVQuantConfig
from .errors import ArgumentError, InputError, OutputError
from .outputs import FORCE_HINT, check_output, write_text
from .shape import ModelShape
from .simulate import SimulatedQuantCache
from .store import LayerStore
from .transformers_compat import cache_kw

KINDS = ("key", "value")
METHODS = {
    "kl": "measured: KL(base || one unit lowered) per unit and candidate, one forward each (exact, slower)",
    "fisher": "estimated: 1/2 E[(grad . quantization error)^2], one forward + a few backwards for all units",
}


@dataclass
class Sensitivity:
    """Mean per-token KL rise for each candidate and unit: ``values[c][layer, head, kind]`` (nats)."""

    base: str
    candidates: list[str]
    values: dict[str, torch.Tensor]
    method: str
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int]:
        t = next(iter(self.values.values()))
        return int(t.shape[0]), int(t.shape[1])

    def to_json(self) -> dict[str, Any]:
        return {
            "base": self.base,
            "candidates": self.candidates,
            "method": self.method,
            "values": {c: v.tolist() for c, v in self.values.items()},
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Sensitivity:
        values = {c: torch.tensor(v, dtype=torch.float64) for c, v in data["values"].items()}
        return cls(data["base"], list(data["candidates"]), values, data["method"], dict(data.get("meta", {})))


# ---------------------------------------------------------------------------------------- data
@dataclass
class CalibrationTokens:
    """The calibration windows ``ids[n, T]`` and where they lie in the tokenized corpus."""

    ids: torch.Tensor
    start: int  # first corpus token used
    end: int  # one past the last corpus token used
    corpus_tokens: int

    def describe(self) -> str:
        n, t = self.ids.shape
        return (
            f"{n} window(s) x {t} tokens = corpus tokens [{self.start}, {self.end}) of {self.corpus_tokens} "
            f"(the last {self.end - self.start} tokens of the text)"
        )


def calibration_windows(ids: torch.Tensor, window: int, n_windows: int) -> CalibrationTokens:
    """The last ``n_windows * window`` tokens of ``ids`` (1-D) as ``[n_windows, window]``.

    Evaluation windows are cut from the start of a corpus; taking calibration text from its end keeps the
    two apart (the header of a calibrated config records the range).
    """
    if window < 2:
        raise ArgumentError(f"--calib-window: {window} must be >= 2 tokens")
    if n_windows < 1:
        raise ArgumentError(f"--calib-windows: {n_windows} must be >= 1")
    n = int(ids.numel())
    need = window * n_windows
    if n < need:
        raise ArgumentError(
            f"--calib-windows: the text has {n} tokens, fewer than {n_windows} x {window} = {need}; "
            "give fewer or shorter windows"
        )
    start = n - need
    return CalibrationTokens(ids[start:].reshape(n_windows, window).clone(), start, n, n)


# ---------------------------------------------------------------------------------------- helpers
#: ``resolve(candidate, layer, head, kind) -> precision``: what a candidate label stores for one unit (a label such
#: as ``tqc4`` names a different ``tqc-<widths>`` per head); the default is the label itself
Resolve = Callable[[str, int, int, int], str]


def _same(candidate: str, layer: int, head: int, kind: int) -> str:
    return candidate


def unit_config(template: KVQuantConfig, base: str, layer: int | None = None, head: int | None = None,
                kind: int | None = None, precision: str | None = None) -> KVQuantConfig:
    """``template``'s options, every unit in ``base``; with a unit given, that unit alone in ``precision``."""
    heads: dict[tuple[int, int], KVPrecision] = {}
    if layer is not None:
        pair = KVPrecision(precision, base) if kind == 0 else KVPrecision(base, precision)
        heads[(layer, head)] = pair
    return with_plan(template, KVPrecision(base, base), heads)


def _decoder_layers(model: Any) -> nn.ModuleList | None:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return layers if isinstance(layers, nn.ModuleList) else None


@contextlib.contextmanager
def _layers_from(model: Any, first: int) -> Iterator[None]:
    """Temporarily drop the decoder layers before ``first`` (their output is fed as ``inputs_embeds``)."""
    inner = model.model
    layers = inner.layers
    inner.layers = nn.ModuleList(list(layers)[first:])
    try:
        yield
    finally:
        inner.layers = layers


def _kl_mean(ref_logp: torch.Tensor, logits: torch.Tensor, chunk: int = 256) -> float:
    """Mean over positions of KL(p || q); ``ref_logp`` and ``logits`` are ``[n, T, V]``."""
    r = ref_logp.reshape(-1, ref_logp.shape[-1])
    q = logits.reshape(-1, logits.shape[-1])
    total = 0.0
    for s in range(0, r.shape[0], chunk):
        lp = r[s : s + chunk].double()
        lq = torch.log_softmax(q[s : s + chunk].double(), dim=-1)
        total += float((lp.exp() * (lp - lq)).sum())
    return max(total / r.shape[0], 0.0)


def _nll_mean(logp: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean negative log-likelihood of ``targets[n, T]`` under ``logp[n, T, V]``."""
    return -float(logp.gather(-1, targets.unsqueeze(-1)).double().mean())


def _call(model: Any, cache: Cache, input_ids: torch.Tensor | None = None,
          inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
    out = model(input_ids=input_ids, inputs_embeds=inputs_embeds, **cache_kw(cache), use_cache=True)
    return out.logits


# ---------------------------------------------------------------------------------------- method: kl
@torch.no_grad()
def measure_kl(
    model: Any,
    ids: torch.Tensor,
    candidates: Sequence[str],
    base: str,
    template: KVQuantConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
    layers_subset: Sequence[int] | None = None,
    resolve: Resolve | None = None,
    target_weight: float = 0.0,
) -> Sensitivity:
    """Measured sensitivities (see module doc); ``ids[n, T]``; ``progress(done, total)`` is called per forward.

    ``layers_subset`` measures only those layers (the others are NaN): for checking a proxy at less cost.
    ``resolve`` maps a candidate label to the precision of each unit (:data:`Resolve`). ``target_weight`` adds
    ``target_weight`` times the unit's rise of the mean NLL of the text's own next tokens (floored at 0) to its
    KL: the misses on unlikely target tokens that perplexity sees and KL barely does.
    """
    resolve = resolve or _same
    template = template or KVQuantConfig()
    shape = ModelShape.of(model)
    L, H = shape.num_layers, shape.num_kv_heads
    lower = [c for c in candidates if c != base]
    values = {c: torch.zeros(L, H, 2, dtype=torch.float64) for c in candidates}
    layers = _decoder_layers(model)
    dev = next(model.parameters()).device
    ids = ids.to(dev)
    hidden: dict[int, torch.Tensor] = {}
    hooks = []
    if layers is not None:
        for i, layer in enumerate(layers):
            def grab(_mod: Any, args: tuple, kwargs: dict, i: int = i) -> None:
                hidden[i] = (args[0] if args else kwargs["hidden_states"]).detach()

            hooks.append(layer.register_forward_pre_hook(grab, with_kwargs=True))
    try:
        ref_logits = _call(model, SimulatedQuantCache(model, unit_config(template, base)), input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    ref_logp = torch.log_softmax(ref_logits.float(), dim=-1)
    del ref_logits
    targets = ids[:, 1:]
    ref_nll = _nll_mean(ref_logp[:, :-1], targets) if target_weight else 0.0
    todo = sorted(set(layers_subset)) if layers_subset is not None else list(range(L))
    for c in lower:
        for layer in set(range(L)) - set(todo):
            values[c][layer] = math.nan
    total, done = len(todo) * H * 2 * len(lower), 0
    t0 = time.perf_counter()
    for layer in todo:
        for c in lower:
            for head in range(H):
                for kind in (0, 1):
                    prec = resolve(c, layer, head, kind)
                    cache = SimulatedQuantCache(model, unit_config(template, base, layer, head, kind, prec))
                    if layers is not None:
                        with _layers_from(model, layer):
                            logits = _call(model, cache, inputs_embeds=hidden[layer])
                    else:
                        logits = _call(model, cache, input_ids=ids)
                    value = _kl_mean(ref_logp, logits.float())
                    if target_weight:
                        lq = torch.log_softmax(logits[:, :-1].float(), dim=-1)
                        value += target_weight * max(_nll_mean(lq, targets) - ref_nll, 0.0)
                    values[c][layer, head, kind] = value
                    done += 1
                    if progress is not None:
                        progress(done, total)
    meta = {"seconds": round(time.perf_counter() - t0, 1), "forwards": total + 1,
            "tokens": int(ids.numel()), "layer_skip": layers is not None, "target_weight": target_weight}
    return Sensitivity(base, list(candidates), values, "kl", meta)


# ---------------------------------------------------------------------------------------- method: fisher
class _GradLayer(DynamicLayer):
    """A cache layer that keeps the K/V it is given with ``retain_grad`` (base-precision fake quant applied)."""

    def __init__(self, store: LayerStore | None) -> None:
        super().__init__()
        self.store = store
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if self.store is not None:
            with torch.no_grad():
                kq, vq = self.store.fake_quantize(key_states, value_states)
            # straight-through: the value of the base precision, the gradient of the identity
            key_states = key_states + (kq - key_states).detach()
            value_states = value_states + (vq - value_states).detach()
        key_states.retain_grad()
        value_states.retain_grad()
        self.k, self.v = key_states, value_states
        return super().update(key_states, value_states)


@contextlib.contextmanager
def _frozen(model: Any) -> Iterator[None]:
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


class _GradCache(Cache):
    def __init__(self, model: Any, cfg: KVQuantConfig, batch: int, device: torch.device) -> None:
        shape = ModelShape.of(model)
        plan = cfg.resolve(shape)
        stores = [LayerStore(row, cfg, shape.head_dim, batch, device) for row in plan]
        super().__init__(layers=[_GradLayer(s) for s in stores])


def estimate_fisher(
    model: Any,
    ids: torch.Tensor,
    candidates: Sequence[str],
    base: str,
    template: KVQuantConfig | None = None,
    samples: int = 4,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    resolve: Resolve | None = None,
    target_weight: float = 0.0,
) -> Sensitivity:
    """Fisher estimate of the sensitivities (see module doc); ``ids[n, T]``, ``samples`` backwards per window.

    ``resolve`` maps a candidate label to the precision of each unit (:data:`Resolve`). ``target_weight`` adds
    that weight times the same estimate with ``y`` the text's own next tokens instead of samples (the empirical
    Fisher; one more backward per window): large where a unit moves the log-probability of the targets, the
    unlikely ones included, which perplexity sees and KL barely does.
    """
    resolve = resolve or _same
    template = template or KVQuantConfig()
    shape = ModelShape.of(model)
    L, H, D = shape.num_layers, shape.num_kv_heads, shape.head_dim
    values = {c: torch.zeros(L, H, 2, dtype=torch.float64) for c in candidates}
    dev = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    base_cfg = unit_config(template, base)
    n_tok = 0
    t0 = time.perf_counter()
    draws = samples + (1 if target_weight else 0)
    total, done = ids.shape[0] * draws, 0
    for w in range(ids.shape[0]):
        x = ids[w : w + 1].to(dev)
        cache = _GradCache(model, base_cfg, 1, dev)
        with torch.enable_grad(), _frozen(model):
            # gradients flow from the embeddings through K/V, never into the weights
            embeds = model.get_input_embeddings()(x).detach().requires_grad_(True)
            logits = model(inputs_embeds=embeds, **cache_kw(cache), use_cache=True).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)
            probs = logp.detach().exp().cpu()
            # quantization errors of every candidate, per layer: [1, H, T, D] each
            deltas: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
            for c in candidates:
                per_layer = []
                for li, layer in enumerate(cache.layers):
                    row = [KVPrecision(resolve(c, li, h, 0), resolve(c, li, h, 1)) for h in range(H)]
                    st = LayerStore(row, with_plan(template, row[0]), D, 1, dev)
                    with torch.no_grad():
                        kq, vq = st.fake_quantize(layer.k.detach(), layer.v.detach())
                    per_layer.append((kq - layer.k.detach(), vq - layer.v.detach()))
                deltas[c] = per_layer
            for s in range(draws):
                if s < samples:
                    y, weight = torch.multinomial(probs, 1, generator=gen).squeeze(1).to(dev), 1.0
                else:  # the text's own next tokens (the last position has none: its sampled token stands in)
                    y = torch.cat([x[0, 1:], torch.multinomial(probs[-1:], 1, generator=gen).squeeze(1).to(dev)])
                    weight = target_weight * samples  # the sampled draws are averaged over ``samples``
                obj = logp.gather(1, y.unsqueeze(1)).sum()
                for layer in cache.layers:
                    layer.k.grad = None
                    layer.v.grad = None
                obj.backward(retain_graph=s < draws - 1)
                for li, layer in enumerate(cache.layers):
                    gk, gv = layer.k.grad, layer.v.grad
                    for c in candidates:
                        dk, dv = deltas[c][li]
                        values[c][li, :, 0] += weight * (gk * dk).sum(dim=(0, 2, 3)).double().pow(2).cpu()
                        values[c][li, :, 1] += weight * (gv * dv).sum(dim=(0, 2, 3)).double().pow(2).cpu()
                done += 1
                if progress is not None:
                    progress(done, total)
        n_tok += x.shape[1]
        del cache, logits, logp
    scale = 0.5 / (samples * n_tok)
    for c in candidates:
        values[c] *= scale
        if c == base:
            values[c].zero_()
    meta = {"seconds": round(time.perf_counter() - t0, 1), "samples": samples, "seed": seed,
            "tokens": int(ids.numel()), "target_weight": target_weight}
    return Sensitivity(base, list(candidates), values, "fisher", meta)


# ---------------------------------------------------------------------------------------- cache on disk
def cache_key(parts: dict[str, Any]) -> str:
    """A short hash of everything a measurement depends on (model, data, windows, candidates, method...)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _read_cache(path: Path) -> dict[str, Any] | None:
    """The cache file's contents if it is a kvquant sensitivity cache (``{"entries": {...}}``), else None."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        return None
    return data


def check_cache_file(path: str | Path, force: bool = False, what: str = "--sens-cache") -> Path:
    """Check a sensitivity cache path before work: a ``.json`` file that is absent or already a kvquant cache
    (which is read and extended); anything else is refused unless ``force`` (then it is replaced)."""
    p = check_output(path, (".json",), what, force=True)
    if p.exists() and not force and _read_cache(p) is None:
        raise OutputError(f"{what}: {p} exists and is not a kvquant sensitivity cache; {FORCE_HINT} it")
    return p


def load_cached(path: Path, key: str) -> Sensitivity | None:
    """The sensitivities stored under ``key`` in the JSON file ``path``, if any.

    Raises :class:`InputError` naming the file and the entry when the entry is malformed or its values are not
    a finite, non-negative ``[layers, kv_heads, 2]`` table per candidate (:func:`kvquant.allocate.check_sensitivity`).
    """
    data = _read_cache(path) if path.is_file() else None
    entry = data["entries"].get(key) if data else None
    if not entry:
        return None
    where = f"--sens-cache: {path}: entry {key}"
    try:
        if not isinstance(entry, dict) or not isinstance(entry.get("values"), dict):
            raise TypeError("no values mapping")
        sens = Sensitivity.from_json(entry)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise InputError(f"{where}: malformed ({type(e).__name__}: {e}); remove it or pass --no-cache") from None
    if not isinstance(sens.candidates, list) or not sens.candidates:
        raise InputError(f"{where}: malformed (no candidates); remove it or pass --no-cache")
    check_sensitivity(sens.values, sens.candidates, where)
    return sens


def save_cached(path: Path, key: str, sens: Sensitivity, description: dict[str, Any]) -> None:
    """Add (or replace) ``key`` in the JSON cache file ``path`` (written atomically; a file that is not a
    kvquant cache is replaced, so check it first with :func:`check_cache_file`)."""
    data = (_read_cache(path) if path.is_file() else None) or {"entries": {}}
    entry = sens.to_json()
    entry["meta"] = {**entry["meta"], "key_parts": description}
    data["entries"][key] = entry
    write_text(path, json.dumps(data, indent=1) + "\n", what="--sens-cache")


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two same-sized tensors (average ranks for ties)."""
    x, y = a.flatten().double(), b.flatten().double()
    if x.numel() < 2:
        return math.nan
    rx, ry = _ranks(x), _ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = float(rx.norm() * ry.norm())
    return float((rx * ry).sum()) / den if den else math.nan


def _ranks(x: torch.Tensor) -> torch.Tensor:
    order = torch.argsort(x)
    ranks = torch.empty_like(x)
    ranks[order] = torch.arange(x.numel(), dtype=torch.float64)
    # ties get their average rank
    uniq, inverse = torch.unique(x, return_inverse=True)
    if uniq.numel() < x.numel():
        sums = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse, ranks)
        counts = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(ranks))
        ranks = (sums / counts)[inverse]
    return ranks
