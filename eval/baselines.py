"""What an evaluation compares: the reference, kvquant configs, and the usual alternatives as baselines.

Every entry of a recipe's ``configs`` becomes a :class:`Method`:

==================  ==========================================================================================
``reference``       transformers' ``DynamicCache`` in the model's dtype: the unquantized run every metric is
                    measured against (always run first; listing it just adds its row, which is 0 by definition)
``vllm:DIR``        a serving engine's FP8 e4m3 KV cache as exported by ``kvquant export --format vllm -o DIR``
                    (the engine's per-tensor or per-head scales, saturating cast), run through kvquant's store
preset / file       a kvquant config (``fp16``, ``int8``, ``int8-token``, ``int4``, ``fp8-e4m3``, a YAML path ...)
                    through ``kvquant.QuantizedKVCache`` (``decode``) or ``kvquant.simulate.SimulatedQuantCache``
                    (``simulated``)
``hf-hqq-int{1,2,3,4,8}``  transformers ``QuantizedCache(backend="hqq", nbits=N)`` at its strongest documented
                    setting: ``axis_key=1, axis_value=1`` (what transformers' docs recommend for HQQ; groups of
                    ``q_group_size`` consecutive channels of one token), ``q_group_size`` 64, ``residual_length``
                    128 (the newest <= 128 tokens stay unquantized, and the whole history is re-quantized each
                    time the residual fills)
``hf-quanto-int{2,4}``  the same with ``backend="quanto"`` (optimum-quanto supports 2 and 4 bits only; axis 0, the
                    setting transformers recommends for quanto, which is also its default)
``...:key=value``   options after the name, separated by colons, override the settings above: ``axis`` (both),
                    ``axis_key``, ``axis_value``, ``group`` (``q_group_size``) and ``residual``
                    (``residual_length``); e.g. ``hf-hqq-int4:axis=0`` is transformers' default HQQ setting,
                    labelled as such in reports
``hf-fp8``          transformers ``QuantizedCache(backend="fp8")``: float8_e4m3fn, one scale per layer tensor,
                    calibrated on the first chunk and frozen
``bnb-int8``, ``bnb-nf4``, ``bnb-fp4``   bitsandbytes blockwise quantization (dynamic 8-bit, NF4, FP4), blocks of
                    64 consecutive values of the [batch, head, token, head_dim] layout (one token's head vector
                    when head_dim is 64), each chunk quantized once when written
==================  ==========================================================================================

In the ``simulated`` protocol a transformers backend cannot be used as shipped: its first ``update`` returns the
unquantized K/V, so a single forward would see no quantization at all. There the baseline is run as a
quantize-then-dequantize round trip of its own ``_quantize`` / ``_dequantize`` on the whole window, so all
methods are compared under the same protocol.

A method that cannot run is not run, with the reason: :meth:`Method.unavailable` when this installation lacks
it (a backend not installed, a backend this transformers does not have, bits it does not support), and
:meth:`Method.unsupported_on` when the model is the obstacle (transformers' ``QuantizedCache`` refuses models
with sliding-window layers, for example). Neither is an error of the run.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from kvquant.export import ENGINE_PREFIX, engine_config
from kvquant.transformers_compat import HF_QUANTIZED_BACKENDS

BASELINES: dict[str, str] = {
    "hf-hqq-int2": "transformers QuantizedCache, HQQ backend, 2 bits",
    "hf-hqq-int3": "transformers QuantizedCache, HQQ backend, 3 bits",
    "hf-hqq-int4": "transformers QuantizedCache, HQQ backend, 4 bits",
    "hf-hqq-int8": "transformers QuantizedCache, HQQ backend, 8 bits",
    "hf-quanto-int2": "transformers QuantizedCache, quanto backend, 2 bits",
    "hf-quanto-int4": "transformers QuantizedCache, quanto backend, 4 bits",
    "hf-fp8": "transformers QuantizedCache, fp8 backend (e4m3fn, one scale per layer tensor, frozen at 1st chunk)",
    "bnb-int8": "bitsandbytes blockwise dynamic 8-bit, block 64, fp32 absmax per block",
    "bnb-nf4": "bitsandbytes blockwise NF4, block 64, fp32 absmax per block",
    "bnb-fp4": "bitsandbytes blockwise FP4, block 64, fp32 absmax per block",
}

#: nbits each transformers backend accepts (transformers 5.x); other requests are skipped with this reason.
HF_SUPPORTED_BITS = {"hqq": (1, 2, 3, 4, 8), "quanto": (2, 4)}

#: transformers' own defaults for its group-wise quantized caches (``QuantizedLayer.__init__``).
HF_DEFAULTS: dict[str, int] = {"axis_key": 0, "axis_value": 0, "q_group_size": 64, "residual_length": 128}

#: The strongest documented setting of each backend, used unless a spec overrides it. transformers' KV-cache
#: docs recommend ``axis_key=axis_value=1`` for HQQ (per-token groups; axis 0 is 8x worse in KL on SmolLM2) and
#: axis 0 for quanto (whose transformers layer accepts only 0 or -1); group size and residual stay at the defaults.
HF_STRONGEST: dict[str, dict[str, int]] = {
    "hqq": {**HF_DEFAULTS, "axis_key": 1, "axis_value": 1},
    "quanto": dict(HF_DEFAULTS),
}

#: Spellings accepted after ``:`` in a baseline spec, and the QuantizedCache argument each sets.
HF_OPTIONS: dict[str, tuple[str, ...]] = {
    "axis": ("axis_key", "axis_value"),
    "axis_key": ("axis_key",),
    "axis_value": ("axis_value",),
    "group": ("q_group_size",),
    "q_group_size": ("q_group_size",),
    "residual": ("residual_length",),
    "residual_length": ("residual_length",),
}

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
    """Measured KV storage of one window (batch 1).

    ``bytes_held``: bytes the cache holds after the last token of the window (``tokens`` tokens), fixed-size
    full-precision parts (residual window, sinks) included; ``bytes_per_token``: that divided by ``tokens``;
    ``asymptotic_bytes_per_token``: the cost of one more token at long context, where fixed-size parts no longer
    matter; ``avg_bits``: the asymptotic bits per stored K/V value (scales and zero-points included).
    """

    bytes_per_token: float
    avg_bits: float
    note: str = ""
    bytes_held: float = 0.0
    tokens: int = 0
    asymptotic_bytes_per_token: float = 0.0


def _storage(model: Any, held: float, tokens: int, asymptotic_bpt: float, note: str) -> Storage:
    return Storage(
        bytes_per_token=held / max(tokens, 1),
        avg_bits=asymptotic_bpt * 8 / elements_per_token(model),
        note=note,
        bytes_held=float(held),
        tokens=tokens,
        asymptotic_bytes_per_token=float(asymptotic_bpt),
    )


class Method:
    """One row of the comparison. Subclasses build caches for the two protocols and measure storage."""

    name: str = ""
    kind: str = ""  # "reference" | "kvquant" | "baseline"
    description: str = ""
    uses_kvquant_attention = False

    def unavailable(self) -> str | None:
        """None when the method can run in this installation, else the reason it is not run."""
        return None

    def unsupported_on(self, model: Any) -> str | None:
        """None when the method can run on ``model``, else the reason it is not run on it (one line)."""
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
        bpt = elements_per_token(model) * torch.finfo(model.dtype).bits / 8
        return _storage(model, bpt * tokens, tokens, bpt, "the model's dtype")


class KVQuantMethod(Method):
    """A kvquant config (preset name or YAML/JSON file)."""

    kind = "kvquant"
    uses_kvquant_attention = True

    def __init__(self, spec: str) -> None:
        from kvquant import KVQuantConfig

        self.spec = spec
        if spec.startswith(ENGINE_PREFIX):  # a serving engine's FP8 cache, from a `kvquant export --format vllm` dir
            self.config = engine_config(spec[len(ENGINE_PREFIX):])
        else:
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
        from kvquant.simulate import SimulatedQuantCache

        return SimulatedQuantCache(model, self.config)

    def storage(self, model: Any, cache: Cache | None, tokens: int) -> Storage:
        asym = elements_per_token(model) * float(self.config.avg_bits(model)) / 8
        report = getattr(cache, "memory_report", None)
        if report is not None:
            r = report()
            if r.get("bytes_total"):
                return _storage(model, float(r["bytes_total"]), int(r["tokens"]), asym,
                                "held: measured (memory_report); asymptotic: the config's bits")
        return _storage(model, asym * tokens, tokens, asym, "from the config's bits (simulated: nothing is stored)")


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
    """transformers' ``QuantizedCache`` with ``backend`` and ``nbits``; ``options`` are its group-wise arguments."""

    backend: str
    nbits: int | None = None
    name: str = ""
    kind: str = "baseline"
    description: str = ""
    options: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.backend != "fp8":
            self.options = {**HF_STRONGEST[self.backend], **self.options}
        self.description = self.describe()

    def describe(self) -> str:
        """What runs, from the effective settings (and whether they are the strongest or transformers' default)."""
        base = BASELINES.get(f"hf-{self.backend}" + (f"-int{self.nbits}" if self.nbits else ""))
        base = base or f"transformers QuantizedCache, {self.backend} backend, {self.nbits} bits"
        if self.backend == "fp8":
            return base
        o = self.options
        text = (
            f"{base}: axis_key {o['axis_key']}, axis_value {o['axis_value']}, q_group_size {o['q_group_size']}, "
            f"residual_length {o['residual_length']} (the newest tokens stay unquantized; the whole history is "
            "re-quantized whenever the residual fills)"
        )
        labels = []
        if o == HF_STRONGEST[self.backend]:
            labels.append("the strongest documented setting")
        if o == HF_DEFAULTS:
            labels.append("transformers' default setting")
        return text + (f" [{' = '.join(labels)}]" if labels else "")

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
        if self.backend not in HF_QUANTIZED_BACKENDS:
            import transformers

            return (f"transformers {transformers.__version__} has no {self.backend!r} backend for QuantizedCache "
                    f"(it has {', '.join(sorted(HF_QUANTIZED_BACKENDS))})")
        ok = HF_SUPPORTED_BITS.get(self.backend)
        if ok is not None and self.nbits not in ok:
            return f"the {self.backend} backend of transformers supports nbits {ok}, not {self.nbits}"
        return None

    def unsupported_on(self, model: Any) -> str | None:
        """transformers' own verdict: ``QuantizedCache`` checks the model's layers when it is built (it refuses
        sliding-window and other non-full-attention layers); its one-line message is the reason."""
        from transformers import QuantizedCache

        try:
            QuantizedCache(self.backend, model.config, **self._kwargs())
        except ValueError as e:
            return f"transformers' QuantizedCache refuses this model: {' '.join(str(e).split())}"
        return None

    def _kwargs(self) -> dict[str, Any]:
        return {} if self.backend == "fp8" else {"nbits": self.nbits, **self.options}

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
        if isinstance(cache, RoundTripCache):
            held = cache.stored_bytes()
            return _storage(model, held, tokens, held / max(tokens, 1),
                            "measured on the quantized round trip (no residual)")
        quantized = residual = 0
        residual_tokens = 0
        for layer in cache.layers:
            quantized += nbytes(getattr(layer, "_quantized_keys", None))
            quantized += nbytes(getattr(layer, "_quantized_values", None))
            if self.backend != "fp8" and layer.keys is not None and layer.keys.dim() == 4:  # the unquantized residual
                residual += nbytes(layer.keys) + nbytes(layer.values)
                residual_tokens = layer.keys.shape[-2]
        # the quantized part covers the tokens not in the residual: its bytes per token are the long-context cost
        asym = quantized / max(tokens - residual_tokens, 1)
        note = "measured at the end of the window: quantized part + unquantized residual; asymptotic: quantized part"
        return _storage(model, quantized + residual, tokens, asym, note if self.backend != "fp8" else "measured")


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
        held = cache.stored_bytes()
        return _storage(model, held, tokens, held / max(tokens, 1), "measured (codes + fp32 absmax per block)")


# --- the registry -----------------------------------------------------------------------------------------


def parse_hf_spec(spec: str) -> HFQuantizedMethod:
    """``hf-BACKEND-intN[:option=value...]`` or ``hf-fp8`` -> the method (raises ValueError naming the problem)."""
    head, *opts = spec.split(":")
    parts = head.split("-")
    if len(parts) == 2 and parts[1] == "fp8":
        if opts:
            raise ValueError(f"{spec!r}: the fp8 backend takes no options (it quantizes per tensor)")
        return HFQuantizedMethod("fp8", None, name=spec)
    bits = parts[2][3:] if len(parts) == 3 and parts[2].startswith("int") else ""
    if not (parts[1:2] and parts[1] in HF_SUPPORTED_BITS and bits.isdigit()):
        raise ValueError(f"unknown baseline {spec!r} (known: {', '.join(BASELINES)}, with :option=value suffixes)")
    options: dict[str, int] = {}
    for opt in opts:
        key, sep, value = opt.partition("=")
        if not sep or key not in HF_OPTIONS:
            raise ValueError(f"{spec!r}: option {opt!r} must be one of {', '.join(k + '=N' for k in HF_OPTIONS)}")
        try:
            v = int(value)
        except ValueError:
            raise ValueError(f"{spec!r}: option {key}: {value!r} is not an integer") from None
        if key in ("group", "q_group_size", "residual", "residual_length") and v < 1:
            raise ValueError(f"{spec!r}: option {key}: must be >= 1, got {v}")
        for name in HF_OPTIONS[key]:
            options[name] = v
    backend = parts[1]
    axes_ok = {"hqq": (0, 1), "quanto": (0, -1)}[backend]
    for name in ("axis_key", "axis_value"):
        if name in options and options[name] not in axes_ok:
            raise ValueError(f"{spec!r}: {name} must be one of {axes_ok} for the {backend} backend, "
                             f"got {options[name]}")
    return HFQuantizedMethod(backend, int(bits), name=spec, options=options)


def make_method(spec: str) -> Method:
    """The :class:`Method` a recipe's ``configs`` entry names (raises ValueError/ConfigError if unknown)."""
    if spec == REFERENCE:
        return ReferenceMethod()
    if spec.startswith("hf-"):
        return parse_hf_spec(spec)
    if spec.startswith("bnb-"):
        qt = spec[4:]
        if qt not in ("int8", "nf4", "fp4"):
            raise ValueError(f"unknown baseline {spec!r} (known: bnb-int8, bnb-nf4, bnb-fp4)")
        return BnbMethod(qt, name=spec)
    return KVQuantMethod(spec)
