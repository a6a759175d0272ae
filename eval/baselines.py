"""What an evaluation compares: the reference, kvquant configs, and the usual alternatives as baselines.

Every entry of a recipe's ``configs`` becomes a :class:`Method`:

==================  ==========================================================================================
``reference``       transformers' ``DynamicCache`` in the model's dtype: the unquantized run every metric is
                    measured against (always run first; listing it just adds its row, which is 0 by definition)
preset / file       a kvquant config (``fp16``, ``int8``, ``int8-token``, ``int4``, ``fp8-e4m3``, a YAML path ...)
                    through ``kvquant.QuantizedKVCache`` (``decode``) or ``kvquant.SimulatedQuantCache``
                    (``simulated``)
``hf-hqq-int{2,4,8}``   transformers ``QuantizedCache(backend="hqq", nbits=N)`` with its defaults (axis 0,
                    q_group_size 64, residual_length 128: the newest <= 128 tokens stay unquantized, and the
                    whole history is re-quantized each time the residual fills)
``hf-quanto-int{2,4}``  the same with ``backend="quanto"`` (optimum-quanto supports 2 and 4 bits only)
``hf-fp8``          transformers ``QuantizedCache(backend="fp8")``: float8_e4m3fn, one scale per layer tensor,
                    calibrated on the first chunk and frozen
``bnb-int8``, ``bnb-nf4``, ``bnb-fp4``   bitsandbytes blockwise quantization (dynamic 8-bit, NF4, FP4), blocks of
                    64 consecutive values of the [batch, head, token, head_dim] layout (one token's head vector
                    when head_dim is 64), each chunk quantized once when written
==================  ==========================================================================================

In the ``simulated`` protocol a transformers backend cannot be used as shipped: its first ``update`` returns the
unquantized K/V, so a single forward would see no quantization at all. There the baseline is run as a
quantize-then-dequantize round trip of its own ``_quantize`` / ``_dequantize`` on the whole window, so all
methods are compared under the same protocol. An unavailable backend is skipped with the reason.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

BASELINES: dict[str, str] = {
    "hf-hqq-int2": "transformers QuantizedCache, HQQ backend, 2 bits (axis 0, group 64, residual 128 unquantized)",
    "hf-hqq-int4": "transformers QuantizedCache, HQQ backend, 4 bits (axis 0, group 64, residual 128 unquantized)",
    "hf-hqq-int8": "transformers QuantizedCache, HQQ backend, 8 bits (axis 0, group 64, residual 128 unquantized)",
    "hf-quanto-int2": "transformers QuantizedCache, quanto backend, 2 bits (axis 0, group 64, residual 128)",
    "hf-quanto-int4": "transformers QuantizedCache, quanto backend, 4 bits (axis 0, group 64, residual 128)",
    "hf-fp8": "transformers QuantizedCache, fp8 backend (e4m3fn, one scale per layer tensor, frozen at 1st chunk)",
    "bnb-int8": "bitsandbytes blockwise dynamic 8-bit, block 64, fp32 absmax per block",
    "bnb-nf4": "bitsandbytes blockwise NF4, block 64, fp32 absmax per block",
    "bnb-fp4": "bitsandbytes blockwise FP4, block 64, fp32 absmax per block",
}

#: nbits each transformers backend accepts (transformers 5.x); other requests are skipped with this reason.
HF_SUPPORTED_BITS = {"hqq": (1, 2, 3, 4, 8), "quanto": (2, 4)}

REFERENCE = "reference"


def nbytes(obj: Any) -> int:
    """Bytes held by tensors inside ``obj`` (tensors, tensor subclasses such as quanto's, tuples, dicts)."""
    if obj is None:
        return 0
    if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
        names, _ = obj.__tensor_flatten__()
        return sum(nbytes(getattr(obj, n)) for n in names)
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


def elements_per_token(model: Any) -> int:
    """K and V values per token over all layers (batch 1): 2 x layers x kv_heads x head_dim."""
    from kvquant import ModelShape

    s = ModelShape.of(model)
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim


@dataclass
class Storage:
    """Measured KV storage: bytes per token (batch 1) and the equivalent bits per value."""

    bytes_per_token: float
    avg_bits: float
    note: str = ""


class Method:
    """One row of the comparison. Subclasses build caches for the two protocols and measure storage."""

    name: str = ""
    kind: str = ""  # "reference" | "kvquant" | "baseline"
    description: str = ""
    uses_kvquant_attention = False

    def unavailable(self) -> str | None:
        """None when the method can run here, else the reason it is skipped."""
        return None

    def decode_cache(self, model: Any) -> Cache:
        raise NotImplementedError

    def simulated_cache(self, model: Any) -> Cache:
        raise NotImplementedError

    def storage(self, model: Any, cache: Cache | None, tokens: int) -> Storage:
        raise NotImplementedError


class ReferenceMethod(Method):
    name = REFERENCE
    kind = "reference"
    description = "unquantized DynamicCache in the model's dtype (the reference)"

    def decode_cache(self, model: Any) -> Cache:
        return DynamicCache(config=model.config)

    simulated_cache = decode_cache

    def storage(self, model: Any, cache: Cache | None, tokens: int) -> Storage:
        bits = torch.finfo(model.dtype).bits
        return Storage(elements_per_token(model) * bits / 8, float(bits))


class KVQuantMethod(Method):
    """A kvquant config (preset name or YAML/JSON file)."""

    kind = "kvquant"
    uses_kvquant_attention = True

    def __init__(self, spec: str) -> None:
        from kvquant import KVQuantConfig

        self.spec = spec
        self.config = KVQuantConfig.load(spec)
        self.name = spec if spec in _presets() else (self.config.name or Path(spec).stem)
        from kvquant import PRESETS

        if spec in PRESETS:
            self.description = f"kvquant preset {spec}: {PRESETS[spec][1]}"
        else:
            desc = getattr(self.config, "description", "") or ""
            self.description = f"kvquant config {spec}" + (f": {' '.join(desc.split())}" if desc else "")

    def decode_cache(self, model: Any) -> Cache:
        from kvquant import QuantizedKVCache
        from kvquant.attention import install_attention

        install_attention(model)  # the cache is read by the kvquant attention (SDPA for every other cache)
        return QuantizedKVCache(model, self.config)

    def simulated_cache(self, model: Any) -> Cache:
        from kvquant import SimulatedQuantCache

        return SimulatedQuantCache(model, self.config)

    def storage(self, model: Any, cache: Cache | None, tokens: int) -> Storage:
        bits = float(self.config.avg_bits(model))
        report = getattr(cache, "memory_report", None)
        if report is not None:
            r = report()
            if r.get("bytes_per_token"):
                return Storage(float(r["bytes_per_token"]), bits, "measured (memory_report)")
        return Storage(elements_per_token(model) * bits / 8, bits, "from the config's avg bits")


def _presets() -> set[str]:
    from kvquant import PRESETS

    return set(PRESETS)


# --- transformers QuantizedCache ---------------------------------------------------------------------------


class RoundTripLayer(DynamicLayer):
    """A DynamicLayer that stores ``roundtrip(x)``: each chunk is quantized once when written, then dequantized.

    Used for the ``simulated`` protocol of transformers' backends and for bitsandbytes in both protocols. The
    dequantized history is memoized (as a DynamicLayer keeps it) only to run fast; what attention reads is
    exactly what the quantized storage holds. ``stored_bytes`` counts the quantized storage.
    """

    def __init__(self, roundtrip: Callable[[torch.Tensor, str], tuple[torch.Tensor, int]]) -> None:
        super().__init__()
        self.roundtrip = roundtrip
        self.stored_bytes = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        k, kb = self.roundtrip(key_states, "key")
        v, vb = self.roundtrip(value_states, "value")
        self.stored_bytes += kb + vb
        return super().update(k.to(key_states.dtype), v.to(value_states.dtype))


class RoundTripCache(Cache):
    def __init__(self, model: Any, make_roundtrip: Callable[[], Callable]) -> None:
        n = model.config.get_text_config(decoder=True).num_hidden_layers
        super().__init__(layers=[RoundTripLayer(make_roundtrip()) for _ in range(n)])

    def stored_bytes(self) -> int:
        return sum(layer.stored_bytes for layer in self.layers)


@dataclass
class HFQuantizedMethod(Method):
    backend: str
    nbits: int | None = None
    name: str = ""
    kind: str = "baseline"
    description: str = ""
    _helper: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.description = BASELINES.get(self.name, f"transformers QuantizedCache({self.backend})")

    def unavailable(self) -> str | None:
        pkg = {"hqq": "hqq", "quanto": "optimum.quanto", "fp8": None}[self.backend]
        if pkg:
            try:
                found = importlib.util.find_spec(pkg) is not None
            except ModuleNotFoundError:
                found = False
            if not found:
                pip = {"hqq": "hqq", "optimum.quanto": "optimum-quanto"}[pkg]
                return f"{pip} is not installed (pip install {pip}, or pip install 'kvquant[baselines]')"
        ok = HF_SUPPORTED_BITS.get(self.backend)
        if ok is not None and self.nbits not in ok:
            return f"the {self.backend} backend of transformers supports nbits {ok}, not {self.nbits}"
        return None

    def _kwargs(self) -> dict[str, Any]:
        return {} if self.backend == "fp8" else {"nbits": self.nbits}

    def decode_cache(self, model: Any) -> Cache:
        from transformers import QuantizedCache

        return QuantizedCache(self.backend, model.config, **self._kwargs())

    def simulated_cache(self, model: Any) -> Cache:
        from transformers import QuantizedCache

        def make():
            # one backend layer object per model layer, used only for its _quantize / _dequantize
            layer = QuantizedCache(self.backend, model.config, **self._kwargs()).layers[0]
            return lambda x, kind: self._roundtrip(layer, x, kind)

        return RoundTripCache(model, make)

    def _roundtrip(self, layer: Any, x: torch.Tensor, kind: str) -> tuple[torch.Tensor, int]:
        if not layer.is_initialized:
            DynamicLayer.lazy_initialization(layer, x, x)  # HQQ reads keys.dtype/device
        if self.backend == "fp8":
            q = layer._quantize(x.contiguous())
        else:
            axis = layer.axis_key if kind == "key" else layer.axis_value
            q = layer._quantize(x.contiguous(), axis=axis)
        return layer._dequantize(q), nbytes(q)

    def storage(self, model: Any, cache: Cache | None, tokens: int) -> Storage:
        per_tok_elems = elements_per_token(model)
        if isinstance(cache, RoundTripCache):
            b = cache.stored_bytes() / max(tokens, 1)
            return Storage(b, b * 8 / per_tok_elems, "measured on the quantized round trip (no residual)")
        total = 0
        for layer in cache.layers:
            total += nbytes(getattr(layer, "_quantized_keys", None)) + nbytes(getattr(layer, "_quantized_values", None))
            if self.backend != "fp8":  # the unquantized residual window
                total += nbytes(layer.keys if layer.keys is not None and layer.keys.dim() == 4 else None)
                total += nbytes(layer.values if layer.values is not None and layer.values.dim() == 4 else None)
        b = total / max(tokens, 1)
        note = (
            "measured at the end of the window, unquantized residual included" if self.backend != "fp8" else "measured"
        )
        return Storage(b, b * 8 / per_tok_elems, note)


# --- bitsandbytes blockwise -------------------------------------------------------------------------------


@dataclass
class BnbMethod(Method):
    quant_type: str = "int8"  # int8 | nf4 | fp4
    blocksize: int = 64
    name: str = ""
    kind: str = "baseline"
    description: str = ""

    def __post_init__(self) -> None:
        self.description = BASELINES.get(self.name, f"bitsandbytes {self.quant_type}")

    def unavailable(self) -> str | None:
        if importlib.util.find_spec("bitsandbytes") is None:
            return "bitsandbytes is not installed (pip install bitsandbytes, or pip install 'kvquant[bnb]')"
        return None

    def _make(self) -> Callable:
        import bitsandbytes.functional as F

        def roundtrip(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, int]:
            xc = x.contiguous()
            if self.quant_type == "int8":
                q, st = F.quantize_blockwise(xc.float(), blocksize=self.blocksize)
                y = F.dequantize_blockwise(q, st)
                return y.reshape(x.shape), nbytes(q) + nbytes(st.absmax)
            q, st = F.quantize_4bit(xc.float(), blocksize=self.blocksize, quant_type=self.quant_type)
            y = F.dequantize_4bit(q, st)
            return y.reshape(x.shape), nbytes(q) + nbytes(st.absmax)

        return roundtrip

    def decode_cache(self, model: Any) -> Cache:
        return RoundTripCache(model, self._make)

    simulated_cache = decode_cache

    def storage(self, model: Any, cache: Cache | None, tokens: int) -> Storage:
        b = cache.stored_bytes() / max(tokens, 1)
        return Storage(b, b * 8 / elements_per_token(model), "measured (codes + fp32 absmax per block)")


# --- the registry -----------------------------------------------------------------------------------------


def make_method(spec: str) -> Method:
    """The :class:`Method` a recipe's ``configs`` entry names (raises ValueError/ConfigError if unknown)."""
    if spec == REFERENCE:
        return ReferenceMethod()
    if spec.startswith("hf-"):
        parts = spec.split("-")
        if len(parts) == 2 and parts[1] == "fp8":
            return HFQuantizedMethod("fp8", None, name=spec)
        if len(parts) == 3 and parts[1] in HF_SUPPORTED_BITS and parts[2].startswith("int") and parts[2][3:].isdigit():
            return HFQuantizedMethod(parts[1], int(parts[2][3:]), name=spec)
        raise ValueError(f"unknown baseline {spec!r} (known: {', '.join(BASELINES)})")
    if spec.startswith("bnb-"):
        qt = spec[4:]
        if qt not in ("int8", "nf4", "fp4"):
            raise ValueError(f"unknown baseline {spec!r} (known: bnb-int8, bnb-nf4, bnb-fp4)")
        return BnbMethod(qt, name=spec)
    return KVQuantMethod(spec)
