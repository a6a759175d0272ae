"""Quantizers: one small class per storage scheme, each naming its granularity.

``make_quantizer(precision, head_dim, ...)`` builds the quantizer a config precision names.
"""

from __future__ import annotations

from .base import Parts, PartSpec, Quantizer
from .codebook import (
    CHANNEL_PREFIX,
    GAINS,
    ChannelCodebook,
    Codebook,
    VectorCodebook,
    allocate_widths,
    channel_precision,
    lloyd_max_levels,
    uniform_levels,
)
from .fp8 import FP8_DTYPES, Fp8
from .int8 import Int8PerToken, Int8SharedScale
from .intn import Int3Grouped, IntNChannel, IntNGrouped, pack_codes, unpack_codes
from .passthrough import FLOAT_DTYPES, Passthrough
from .trellis import TrellisCodebook

#: Every precision a config may name, with a one-line description.
PRECISIONS: dict[str, str] = {
    "fp16": "float16 passthrough (exact for fp16 models)",
    "bf16": "bfloat16 passthrough",
    "fp32": "float32 passthrough (exact for fp32 models)",
    "int8": "symmetric INT8, one scale per (layer, KV head) shared by K and V",
    "int8-token": "symmetric INT8, one fp16 scale per token and KV head",
    "int4": "asymmetric INT4 packed 2 per byte, fp16 scale+zero per token and group along head_dim",
    "int3": "asymmetric INT3 packed 8 per 3 bytes, fp16 scale+zero per token and group along head_dim",
    "int2": "asymmetric INT2 packed 4 per byte, fp16 scale+zero per token and group along head_dim",
    "int8-channel": "asymmetric INT8 per channel over each block of tokens, newest tokens fp16",
    "int4-channel": "asymmetric INT4 per channel over each block of tokens (KIVI keys), newest tokens fp16",
    "int3-channel": "asymmetric INT3 per channel over each block of tokens (KIVI keys), newest tokens fp16",
    "int2-channel": "asymmetric INT2 per channel over each block of tokens (KIVI keys), newest tokens fp16",
    "tq4": "4-bit Lloyd-Max codebook on randomized-Hadamard-rotated rows, one 8-bit log norm per token and KV head",
    "tq3": "3-bit Lloyd-Max codebook on randomized-Hadamard-rotated rows, one 8-bit log norm per token and KV head",
    "tq2": "2-bit Lloyd-Max codebook on randomized-Hadamard-rotated rows, one 8-bit log norm per token and KV head",
    "tqv4": "tq4 with pairs of rotated coordinates coded jointly (256 Gaussian 2-D codewords; read in-kernel)",
    "tqv3": "tq3 with pairs of rotated coordinates coded jointly (64 Gaussian 2-D codewords; read in-kernel)",
    "tqv2": "tq2 with pairs of rotated coordinates coded jointly (16 Gaussian 2-D codewords; read in-kernel)",
    "tqt4": "tq4 with the rotated row coded by a tail-biting 1024-state bit-shift trellis (same bytes; read in-kernel)",
    "tqt3": "tq3 with the rotated row coded by a tail-biting 512-state bit-shift trellis (same bytes; read in-kernel)",
    "tqt2": "tq2 with the rotated row coded by a tail-biting 256-state bit-shift trellis (same bytes; read in-kernel)",
    "fp8-e4m3": "FP8 e4m3 storage, one scale per (layer, KV head)",
    "fp8-e5m2": "FP8 e5m2 storage, one scale per (layer, KV head)",
}

GROUPED = {"int4": 4, "int3": 3, "int2": 2}
CHANNEL = {"int8-channel": 8, "int4-channel": 4, "int3-channel": 3, "int2-channel": 2}
CODEBOOK = {"tq4": 4, "tq3": 3, "tq2": 2}
VECTOR = {"tqv4": 4, "tqv3": 3, "tqv2": 2}
TRELLIS = {"tqt4": 4, "tqt3": 3, "tqt2": 2}
#: Precision families whose name carries parameters: prefix -> description.
PRECISION_FAMILIES: dict[str, str] = {
    CHANNEL_PREFIX: "tqc-<one width digit 0-8 per channel>: per-channel Gaussian Lloyd-Max codes of calibrated "
    "widths, channel mean/spread per sequence, one 8-bit log norm per token and KV head (keys; torch path)",
}


def is_precision(name: object) -> bool:
    """True when ``name`` is a precision a config may name: one of :data:`PRECISIONS` or of a
    :data:`PRECISION_FAMILIES` family (checked in full when its quantizer is built)."""
    return isinstance(name, str) and (
        name in PRECISIONS or (name.startswith(CHANNEL_PREFIX) and name[len(CHANNEL_PREFIX):].isdigit())
    )


def make_quantizer(
    precision: str, head_dim: int, group_size: int = 32, headroom: float = 1.0, block_size: int = 128,
    gain: str = "unbiased", search: bool = True,
) -> Quantizer:
    """Build the quantizer for one config ``precision`` (see :data:`PRECISIONS`); ``gain``: how a codebook
    precision (``tq*``, ``tqv*``, ``tqt*``, ``tqc-*``) picks each row's norm (:func:`~.codebook.row_gain`);
    ``search``: whether ``tqc-*`` searches each row's code scale (:class:`~.codebook.ChannelCodebook`)."""
    if precision in FLOAT_DTYPES:
        return Passthrough(head_dim, precision)
    if precision == "int8":
        return Int8SharedScale(head_dim, headroom=headroom)
    if precision == "int8-token":
        return Int8PerToken(head_dim)
    if precision == "int3":
        return Int3Grouped(head_dim, group_size=group_size)
    if precision in GROUPED:
        return IntNGrouped(head_dim, bits=GROUPED[precision], group_size=group_size)
    if precision in CHANNEL:
        return IntNChannel(head_dim, bits=CHANNEL[precision], token_group=block_size)
    if precision in CODEBOOK:
        return Codebook(head_dim, bits=CODEBOOK[precision], gain=gain)
    if precision in VECTOR:
        return VectorCodebook(head_dim, bits=VECTOR[precision], gain=gain)
    if precision in TRELLIS:
        return TrellisCodebook(head_dim, bits=TRELLIS[precision], gain=gain)
    if precision.startswith(CHANNEL_PREFIX):
        return ChannelCodebook.from_name(precision, head_dim, gain, search)
    if precision in FP8_DTYPES:
        return Fp8(head_dim, precision, headroom=headroom)
    raise ValueError(f"precision: unknown {precision!r} (known: {', '.join(PRECISIONS)})")


__all__ = [
    "CHANNEL_PREFIX",
    "CODEBOOK",
    "GAINS",
    "TRELLIS",
    "TrellisCodebook",
    "VECTOR",
    "VectorCodebook",
    "PRECISION_FAMILIES",
    "ChannelCodebook",
    "allocate_widths",
    "channel_precision",
    "is_precision",
    "PRECISIONS",
    "Codebook",
    "Fp8",
    "Int8PerToken",
    "Int8SharedScale",
    "Int3Grouped",
    "IntNChannel",
    "IntNGrouped",
    "PartSpec",
    "Parts",
    "Passthrough",
    "Quantizer",
    "lloyd_max_levels",
    "make_quantizer",
    "pack_codes",
    "uniform_levels",
    "unpack_codes",
]
