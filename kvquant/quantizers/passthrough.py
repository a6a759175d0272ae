"""Passthrough storage: K/V kept as floats (fp16, bf16 or fp32), for heads that must stay exact."""

from __future__ import annotations

import torch

from .base import Factored, Parts, PartSpec, Quantizer

FLOAT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class Passthrough(Quantizer):
    """No quantization; granularity does not apply. Stores ``x`` cast to ``dtype``."""

    granularity = "none (float storage)"

    def __init__(self, head_dim: int, name: str = "fp16") -> None:
        super().__init__(head_dim)
        self.name = name
        self.dtype = FLOAT_DTYPES[name]

    def parts(self) -> dict[str, PartSpec]:
        return {"x": PartSpec((self.head_dim,), self.dtype)}

    def quantize(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Parts:
        return {"x": x.to(self.dtype)}

    def dequantize(self, parts: Parts, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return parts["x"].to(dtype)

    def factored(self, parts: Parts, state: dict[str, torch.Tensor]) -> Factored:
        return Factored(parts["x"].float())
