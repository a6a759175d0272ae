"""Symmetric INT8 quantizers.

* ``Int8SharedScale`` -- granularity: one scale per (layer, KV head), shared by K and V::

      scale[h] = headroom * max(|K[h]|max, |V[h]|max) / 127        (set once, from the prefill)
      q = clamp(round(x / scale[h]), -127, 127)                      x_hat = q * scale[h]

  Values that later exceed ``127 * scale`` are clipped, and counted.

* ``Int8PerToken`` -- granularity: one scale per token and head, K and V scaled separately::

      scale[t, h] = max_d |x[t, h, d]| / 127   (stored in fp16)      q = round(x / scale)
"""

from __future__ import annotations

import torch

from .base import Factored, Parts, PartSpec, Quantizer, WidenableScales, head_view, require_finite

QMAX = 127.0
FP16_TINY = 2.0**-14  # smallest normal fp16: per-token scales are stored in fp16
CLIP = QMAX + 0.5  # |x / scale| beyond it is clipped
_CLIP = torch.tensor(CLIP)  # the same as a 0-dim tensor (no scalar wrap per call)


def _codes(scaled: torch.Tensor) -> torch.Tensor:
    """``x / scale`` -> int8 codes: rounded to nearest, clamped to [-127, 127]."""
    return torch.round(scaled).clamp_(-QMAX, QMAX).to(torch.int8)


class Int8SharedScale(Quantizer):
    name = "int8"
    granularity = "per (layer, KV head), shared by K and V"
    static = True
    pairable = True
    checks_finite = True

    def __init__(self, head_dim: int, headroom: float = 1.0) -> None:
        super().__init__(head_dim)
        self.headroom = headroom

    def parts(self) -> dict[str, PartSpec]:
        return {"q": PartSpec((self.head_dim,), torch.int8)}

    def calibrate(self, amax: torch.Tensor) -> dict[str, torch.Tensor]:
        scale = (amax.float() * self.headroom / QMAX).clamp_min(torch.finfo(torch.float32).tiny)
        return {"scale": scale}

    def quantize(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Parts:
        return {"q": _codes(x.float() / head_view(state["scale"]))}

    def quantize_counted(
        self, x: torch.Tensor, state: dict[str, torch.Tensor], real: torch.Tensor | None = None
    ) -> tuple[Parts, torch.Tensor | int]:
        """On CPU one min / max pass over ``x / scale`` answers the common case (finite, nothing clipped:
        the count is 0); otherwise NaN / Inf raise and the clipped values are counted exactly."""
        y = x.float() / head_view(state["scale"])
        if y.device.type == "cpu":
            lo, hi = (e.item() for e in torch.aminmax(y)) if y.numel() else (0.0, 0.0)
            if lo >= -CLIP and hi <= CLIP:
                return {"q": _codes(y)}, 0
            require_finite(x)  # (x / a tiny scale may overflow where x is finite: then x is clipped, not refused)
        over = y.abs() > _CLIP  # the same test as clipped(), on the scaled values
        if real is not None:
            over &= real[:, None, :, None]
        return {"q": _codes(y)}, over.sum()

    def dequantize(self, parts: Parts, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return (parts["q"] * head_view(state["scale"]).float()).to(dtype)  # int8 x fp32: one pass, no copy

    def factored(self, parts: Parts, state: dict[str, torch.Tensor]) -> Factored:
        return Factored(parts["q"].float(), head_view(state["scale"]).float())

    def clipped(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        limit = head_view(state["scale"]) * CLIP
        return (x.float().abs() > limit).sum()


class Int8PerToken(WidenableScales, Quantizer):
    name = "int8-token"
    granularity = "per token and KV head (dynamic, fp16 scale)"

    def parts(self) -> dict[str, PartSpec]:
        return {"q": PartSpec((self.head_dim,), torch.int8), "scale": PartSpec((1,), self.scale_dtype)}

    def quantize(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Parts:
        xf = x.float()
        scale = (xf.abs().amax(dim=-1, keepdim=True) / QMAX).clamp_min(FP16_TINY).to(self.scale_dtype)
        q = torch.round(xf / scale.float()).clamp_(-QMAX, QMAX)
        return {"q": q.to(torch.int8), "scale": scale}

    def dequantize(self, parts: Parts, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return (parts["q"] * parts["scale"].float()).to(dtype)  # int8 x fp32 promotes: one pass

    def factored(self, parts: Parts, state: dict[str, torch.Tensor]) -> Factored:
        return Factored(parts["q"].float(), parts["scale"].float())
