"""Static K/V scales: measured on calibration text, written to a file, read back by configs and engines.

One statistic of ``|K|`` and ``|V|`` per (layer, KV head) -- or per layer tensor, broadcast over its KV
heads -- taken over calibration windows from the END of a corpus (evaluation windows come from its start,
so static scales never see the tokens they are scored on). A config's ``scales_file`` names one of:

* a **kvquant scales file** (``.safetensors``, written by ``kvquant export --format kvquant``)::

      key_amax    float32 [layers, H]     H = KV heads, or 1 (one per layer tensor, all heads share it)
      value_amax  float32 [layers, H]
      metadata    format=kvquant-scales, version=1, statistic=max | percentile:P, granularity, space, ...

  or the same as JSON (``{"format": "kvquant-scales", "statistic": ..., "layers": [{"key_amax": [...],
  "value_amax": [...]}, ...]}``); never a pickle;
* a **serving-engine export directory** (``kvquant export --format vllm``): compressed-tensors'
  ``kv_cache_scheme`` in ``config.json`` and FP8 scales ``model.layers.N.self_attn.k_scale`` / ``v_scale``
  (``scale = amax / 448``, per tensor ``[1]`` or per KV head ``[H, 1, 1]``), read back as the amax whose
  kvquant FP8 scale equals the engine's scale bit for bit (:func:`amax_for_fp8_scale`).

The statistic is the amax a static quantizer maps to its largest code: ``max`` (nothing clipped on the
calibration text) or ``percentile:P`` (the P-th percentile of ``|x|``: clips the top 100-P % for resolution).
Every check fails with one line that names the file.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import ArgumentError, InputError
from .shape import ModelShape, held_dtype
from .transformers_compat import cache_kw

SCALES_FORMAT = "kvquant-scales"
SCALES_VERSION = "1"
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448: compressed-tensors' and vLLM's range
EXPORT_INFO = "kvquant_export.json"  # what kvquant export records beside the engine files
ENGINE_SCALE_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.([kv])_scale$")


def engine_scale_name(layer: int, kind: str) -> str:
    """The checkpoint name of a K (``kind="k"``) or V scale that vLLM / SGLang / compressed-tensors load."""
    return f"model.layers.{layer}.self_attn.{kind}_scale"


class ScalesError(InputError):
    """A scales file is missing, malformed or holds unusable values; the message names the file."""


# ------------------------------------------------------------------------------------------ statistic
def parse_statistic(spec: str) -> tuple[str, float | None]:
    """``"max"`` -> ``("max", None)``; ``"percentile:99.9"`` -> ``("percentile", 99.9)``."""
    if spec == "max":
        return "max", None
    name, _, arg = spec.partition(":")
    if name == "percentile":
        try:
            p = float(arg)
        except ValueError:
            p = float("nan")
        if 0 < p <= 100:
            return "percentile", p
    raise ArgumentError(f"--statistic: {spec!r} must be max or percentile:P with 0 < P <= 100 (e.g. percentile:99.9)")


def _reduce(x: torch.Tensor, statistic: str) -> torch.Tensor:
    """The statistic of ``|x|`` over the last dimension (``x`` already absolute, float32)."""
    kind, p = parse_statistic(statistic)
    if kind == "max":
        return x.amax(dim=-1)
    k = max(1, min(x.shape[-1], math.ceil(p / 100.0 * x.shape[-1])))
    return x.kthvalue(k, dim=-1).values


# ------------------------------------------------------------------------------------------ the scales
@dataclass
class KVScales:
    """Static K and V amax per layer: ``[layers, H]`` with H = KV heads (per head) or 1 (per layer tensor)."""

    key_amax: torch.Tensor
    value_amax: torch.Tensor
    statistic: str = "max"
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def granularity(self) -> str:
        """``"head"`` (one amax per KV head) or ``"tensor"`` (one per layer's K or V tensor)."""
        return "tensor" if self.key_amax.shape[1] == 1 else "head"

    def check(self, where: str, shape: ModelShape | None = None, dtype: torch.dtype | None = None) -> KVScales:
        """Raise :class:`ScalesError` naming ``where`` unless the values are finite, positive and shaped right, and
        no amax lies beyond the range of the dtype the cache holds this model's K/V in (:func:`held_dtype` of the
        model's ``dtype``: bfloat16 for a bfloat16 model, float16 for a float16 or float32 one or when unknown): no
        cached K/V reaches such an amax, and with it every stored value rounds to zero."""
        limit_dtype = held_dtype(dtype)
        limit = float(torch.finfo(limit_dtype).max)
        for name, t in (("key_amax", self.key_amax), ("value_amax", self.value_amax)):
            if t.dim() != 2 or t.shape != self.key_amax.shape:
                raise ScalesError(f"scales_file: {where}: {name} has shape {list(t.shape)}, expected [layers, heads] "
                                  f"like key_amax {list(self.key_amax.shape)}")
            if not bool(torch.isfinite(t).all()):
                raise ScalesError(f"scales_file: {where}: {name} holds NaN or Inf values")
            if not bool((t > 0).all()):
                bad = (t <= 0).nonzero()[0].tolist()
                raise ScalesError(f"scales_file: {where}: {name}[{bad[0]}][{bad[1]}] = {float(t[bad[0], bad[1]])} "
                                  "is not positive")
            if bool((t > limit).any()):  # every value would round to zero: logits silently wrong
                bad = (t > limit).nonzero()[0].tolist()
                held = str(limit_dtype).removeprefix("torch.")
                raise ScalesError(f"scales_file: {where}: {name}[{bad[0]}][{bad[1]}] = {float(t[bad[0], bad[1]]):g} "
                                  f"is beyond {held}'s range ({limit:g}), the dtype the cache holds this model's K/V "
                                  "in: no cached K/V reaches it")
        if shape is not None:
            layers, heads = self.key_amax.shape
            if layers != shape.num_layers or heads not in (1, shape.num_kv_heads):
                raise ScalesError(
                    f"scales_file: {where}: holds {layers} layers x {heads} heads; the model has {shape.num_layers} "
                    f"layers x {shape.num_kv_heads} KV heads (scales for another model?)"
                )
        parse_statistic(self.statistic)
        return self

    def per_layer(self, shape: ModelShape) -> list[dict[str, torch.Tensor]]:
        """``[{"key": amax[kv_heads], "value": amax[kv_heads]}]`` per layer (per-tensor values broadcast)."""
        h = shape.num_kv_heads
        # no cast: float64 amax read from an engine export must reach the FP8 quantizer unrounded
        return [{"key": self.key_amax[i].expand(h).clone(), "value": self.value_amax[i].expand(h).clone()}
                for i in range(self.key_amax.shape[0])]


def collect_amax(
    model: Any,
    windows: torch.Tensor | Sequence[torch.Tensor],
    statistic: str = "max",
    granularity: str = "head",
    rotate: str = "none",
    sink_tokens: int = 0,
) -> KVScales:
    """Measure the K/V statistic of ``model`` on token ``windows`` (``[n, T]`` or a list of 1-D ids).

    K is taken as the cache holds it (after RoPE). ``rotate`` and ``sink_tokens`` measure the values in the
    space a kvquant store quantizes (Hadamard-rotated; the first sink tokens, kept in fp16, left out).
    """
    from transformers.cache_utils import DynamicCache

    from .rotation import fwht

    parse_statistic(statistic)
    if granularity not in ("head", "tensor"):
        raise ArgumentError(f"--granularity: {granularity!r} must be head or tensor")
    dev = model.get_input_embeddings().weight.device
    per_layer: dict[int, list[list[torch.Tensor]]] = {}
    with torch.no_grad():
        for ids in windows:
            ids = torch.as_tensor(ids).reshape(1, -1).to(dev)
            cache = DynamicCache(config=model.config)
            model(input_ids=ids, **cache_kw(cache), use_cache=True)
            for i, layer in enumerate(cache.layers):
                k, v = layer.keys, layer.values  # [1, H, T, D]
                k = fwht(k) if rotate in ("keys", "kv") else k
                v = fwht(v) if rotate == "kv" else v
                skip = sink_tokens if sink_tokens < k.shape[2] else 0
                slot = per_layer.setdefault(i, [[], []])
                slot[0].append(k[0, :, skip:].detach().float().abs().cpu())
                slot[1].append(v[0, :, skip:].detach().float().abs().cpu())
    out = []
    for kind in (0, 1):
        rows = []
        for i in sorted(per_layer):
            x = torch.cat(per_layer[i][kind], dim=1)  # [H, tokens, D]
            flat = x.reshape(1, -1) if granularity == "tensor" else x.reshape(x.shape[0], -1)
            rows.append(_reduce(flat, statistic))
        out.append(torch.stack(rows))
    tokens = sum(int(torch.as_tensor(w).numel()) for w in windows)
    meta = {"granularity": granularity, "space": f"rotate={rotate}, sink_tokens={sink_tokens}",
            "calibration_tokens": str(tokens)}
    return KVScales(out[0], out[1], statistic, meta)


# ------------------------------------------------------------------------------------------ files
def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary sibling and a rename: never half-written."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_scales(scales: KVScales, path: str | Path) -> Path:
    """Write a kvquant scales file: safetensors (default) or JSON (``.json``), atomically."""
    p = Path(path)
    scales.check(str(p))
    meta = {"format": SCALES_FORMAT, "version": SCALES_VERSION, "statistic": scales.statistic,
            "granularity": scales.granularity, **{k: str(v) for k, v in scales.meta.items()}}
    if p.suffix == ".json":
        doc = {**meta, "layers": [{"key_amax": k.tolist(), "value_amax": v.tolist()}
                                  for k, v in zip(scales.key_amax, scales.value_amax, strict=True)]}
        atomic_write_bytes(p, (json.dumps(doc, indent=1) + "\n").encode())
    else:
        from safetensors.torch import save

        tensors = {"key_amax": scales.key_amax.float().contiguous(),
                   "value_amax": scales.value_amax.float().contiguous()}
        atomic_write_bytes(p, save(tensors, metadata=meta))
    return p


def load_scales(path: str | Path, shape: ModelShape | None = None, dtype: torch.dtype | None = None) -> KVScales:
    """Read and check a kvquant scales file (safetensors or JSON) or an engine export directory (``dtype``: the
    model's, for the amax range check of :meth:`KVScales.check`)."""
    p = Path(path)
    if p.is_dir():
        return read_engine_scales(p, shape, dtype)
    if not p.is_file():
        raise ScalesError(f"scales_file: {str(path)!r} does not exist")
    if p.suffix == ".json":
        try:
            data = json.loads(p.read_text())
            fmt = data.get("format", SCALES_FORMAT)  # files from before the format field are read too
            layers = data["layers"]
            key = torch.tensor([x["key_amax"] for x in layers], dtype=torch.float32)
            value = torch.tensor([x["value_amax"] for x in layers], dtype=torch.float32)
            statistic = str(data.get("statistic", "max"))
            meta = {k: str(v) for k, v in data.items() if k not in ("layers", "format", "statistic")}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ScalesError(f"scales_file: {str(path)!r} is not a kvquant scales file ({e})") from None
    else:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(p), framework="pt") as f:
                raw = dict(f.metadata() or {})
                key, value = f.get_tensor("key_amax").float(), f.get_tensor("value_amax").float()
        except (SafetensorError, OSError, KeyError, ValueError) as e:
            raise ScalesError(f"scales_file: {str(path)!r} is not a kvquant scales file ({e})") from None
        fmt = raw.pop("format", None)
        statistic = raw.pop("statistic", "max")
        meta = raw
    if fmt != SCALES_FORMAT:
        raise ScalesError(f"scales_file: {str(path)!r}: format {fmt!r}, expected {SCALES_FORMAT!r}")
    if key.dim() == 1:  # one value per layer
        key, value = key[:, None], value[:, None]
    try:
        return KVScales(key, value, statistic, meta).check(str(path), shape, dtype)
    except ValueError as e:
        raise ScalesError(str(e) if str(e).startswith("scales_file:") else f"scales_file: {str(path)!r}: {e}") from None


def amax_for_fp8_scale(scale: torch.Tensor, fp8_max: float = FP8_E4M3_MAX) -> torch.Tensor:
    """The amax (float64) whose kvquant FP8 scale at headroom 1 equals the engine's ``scale`` bit for bit.

    ``scale * fp8_max`` is exact in float64 (a float32 times 7 x 2^6), and the FP8 quantizer computes its scale
    as ``float32(amax * headroom / fp8_max)`` in float64, so the round trip returns ``scale`` unchanged. (In
    float32 about one scale in nine has no amax that maps onto it.)
    """
    return scale.double() * fp8_max


def read_engine_scales(
    directory: str | Path, shape: ModelShape | None = None, dtype: torch.dtype | None = None
) -> KVScales:
    """The K/V scales a serving engine loads from an export directory, as amax (see :func:`amax_for_fp8_scale`)."""
    from safetensors import safe_open

    d = Path(directory)
    where = str(d)
    cfg_path = d / "config.json"
    try:
        scheme = json.loads(cfg_path.read_text())["quantization_config"]["kv_cache_scheme"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ScalesError(f"scales_file: {where}: no compressed-tensors kv_cache_scheme in config.json ({e})") from None
    if not isinstance(scheme, dict) or (scheme.get("type"), scheme.get("num_bits")) != ("float", 8):
        raise ScalesError(f"scales_file: {where}: kv_cache_scheme is not FP8 (type float, num_bits 8): {scheme}")
    if scheme.get("strategy") not in ("tensor", "attn_head") or scheme.get("dynamic") or not scheme.get("symmetric"):
        raise ScalesError(f"scales_file: {where}: kv_cache_scheme must be static, symmetric, strategy tensor or "
                          f"attn_head: {scheme}")
    found: dict[tuple[int, str], torch.Tensor] = {}
    from safetensors import SafetensorError

    for f in sorted(d.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    m = ENGINE_SCALE_RE.search(name)
                    if m:
                        found[(int(m.group(1)), m.group(2))] = sf.get_tensor(name).float().reshape(-1)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            why = " ".join(str(e).split())
            raise ScalesError(f"scales_file: {where}: {f.name} is damaged or missing ({why})") from None
    if not found:
        raise ScalesError(f"scales_file: {where}: no self_attn.k_scale / v_scale tensors in its *.safetensors")
    layers = max(i for i, _ in found) + 1
    missing = [engine_scale_name(i, k) for i in range(layers) for k in "kv" if (i, k) not in found]
    if missing:
        raise ScalesError(f"scales_file: {where}: missing {missing[0]} ({len(missing)} scales missing)")
    widths = {t.numel() for t in found.values()}
    if len(widths) != 1:
        raise ScalesError(f"scales_file: {where}: scales of different sizes {sorted(widths)}")
    key = torch.stack([found[(i, "k")] for i in range(layers)])
    value = torch.stack([found[(i, "v")] for i in range(layers)])
    for name, t in (("k_scale", key), ("v_scale", value)):
        if not bool(torch.isfinite(t).all() & (t > 0).all()):
            raise ScalesError(f"scales_file: {where}: a {name} is not a finite positive number")
    meta = {"source": f"compressed-tensors export ({scheme.get('strategy')})"}
    try:
        meta.update(json.loads((d / EXPORT_INFO).read_text()).get("scales_meta", {}))
        statistic = json.loads((d / EXPORT_INFO).read_text())["statistic"]
    except (OSError, ValueError, KeyError):
        statistic = "max"  # an export from another tool: its statistic is not recorded here
    return KVScales(amax_for_fp8_scale(key), amax_for_fp8_scale(value), statistic, meta).check(where, shape, dtype)



def load_static_amax(
    path: str | Path | None, shape: ModelShape, dtype: torch.dtype | None = None
) -> list[dict[str, torch.Tensor]] | None:
    """Per-layer ``{"key": amax[H], "value": amax[H]}`` from a config's ``scales_file`` (None: no file); ``dtype``:
    the model's (see :meth:`KVScales.check`)."""
    return load_scales(path, shape, dtype).per_layer(shape) if path else None
