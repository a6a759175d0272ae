"""FP8 storage (e4m3 / e5m2) with one scale per (layer, KV head).

Granularity: per (layer, KV head); K and V have their own scale::

    scale[h] = headroom * |x[h]|max / fp8_max      (set once, from the prefill)
    stored = fp8(clamp(x / scale[h], -fp8_max, fp8_max))       x_hat = float(stored) * scale[h]

Stored as torch ``float8_e4m3fn`` / ``float8_e5m2``: native on Hopper GPUs, a storage format elsewhere.
"""

from __future__ import annotations

import torch

from .base import Factored, Parts, PartSpec, Quantizer, head_view

FP8_DTYPES = {"fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}


class Fp8(Quantizer):
    granularity = "per (layer, KV head)"
    static = True
    pairable = True

    def __init__(self, head_dim: int, name: str = "fp8-e4m3", headroom: float = 1.0) -> None:
        super().__init__(head_dim)
        self.name = name
        self.dtype = FP8_DTYPES[name]
        self.fp8_max = float(torch.finfo(self.dtype).max)
        self.headroom = headroom

    def parts(self) -> dict[str, PartSpec]:
        return {"q": PartSpec((self.head_dim,), self.dtype)}

    def calibrate(self, amax: torch.Tensor) -> dict[str, torch.Tensor]:
        # computed in float64 and rounded once: the scale a serving engine stores for the same amax
        # (kvquant.scales), and an engine's float32 scale read back as amax = scale * fp8_max maps onto itself
        wide = amax.detach().to(torch.float32 if amax.device.type == "mps" else torch.float64)  # MPS: no float64
        scale = (wide * self.headroom / self.fp8_max).float().clamp_min(torch.finfo(torch.float32).tiny)
        return {"scale": scale}

    def quantize(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Parts:
        scaled = (x.float() / head_view(state["scale"])).clamp_(-self.fp8_max, self.fp8_max)
        return {"q": scaled.to(self.dtype)}

    def dequantize(self, parts: Parts, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return (parts["q"].float() * head_view(state["scale"])).to(dtype)

    def factored(self, parts: Parts, state: dict[str, torch.Tensor]) -> Factored:
        return Factored(parts["q"].float(), head_view(state["scale"]).float())

    def clipped(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        # beyond the largest fp8 value, with fp32 rounding slack: the calibration max itself is not clipped
        limit = head_view(state["scale"]) * (self.fp8_max * (1 + 1e-6))
        return (x.float().abs() > limit).sum()
