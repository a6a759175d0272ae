"""Asymmetric low-bit integer quantizer (INT4, and INT2), grouped along head_dim.

Granularity: per token and KV head, one (scale, zero) pair per group of ``group_size``
consecutive channels of head_dim, both stored in fp16 (KIVI's value quantization)::

    lo, hi  = min/max of x over the group
    scale   = (hi - lo) / (2^bits - 1)         zero = lo
    q       = clamp(round((x - zero) / scale), 0, 2^bits - 1)      x_hat = q * scale + zero

Packing ("split" layout, 8/bits codes per byte): byte ``j`` holds the codes of channels
``j, j + D/n, j + 2D/n, ...`` (n = 8/bits) at bit offsets ``0, bits, 2*bits, ...``. A kernel
then unpacks contiguous slices of head_dim with shifts alone, with no interleave.
"""

from __future__ import annotations

import torch

from .base import Parts, PartSpec, Quantizer
from .int8 import FP16_TINY


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """``q[..., D]`` integer codes in ``[0, 2^bits)`` -> ``uint8[..., D * bits / 8]`` (split layout)."""
    per_byte = 8 // bits
    chunks = q.to(torch.uint8).chunk(per_byte, dim=-1)
    packed = chunks[0].clone()
    for k in range(1, per_byte):
        packed |= chunks[k] << (k * bits)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``uint8[..., D*bits/8]`` -> ``uint8[..., D]``."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    return torch.cat([(packed >> (k * bits)) & mask for k in range(per_byte)], dim=-1)


class IntNGrouped(Quantizer):
    static = False

    def __init__(self, head_dim: int, bits: int = 4, group_size: int = 32) -> None:
        super().__init__(head_dim)
        if bits not in (2, 4):
            raise ValueError(f"bits: {bits} is not supported by the grouped integer quantizer (2 or 4)")
        self.bits = bits
        self.group_size = group_size
        self.levels = float(2**bits - 1)
        self.name = f"int{bits}"
        self.granularity = f"per token and KV head, groups of {group_size} along head_dim (fp16 scale+zero)"

    def parts(self) -> dict[str, PartSpec]:
        groups = self.head_dim // self.group_size
        return {
            "q": PartSpec((self.head_dim * self.bits // 8,), torch.uint8),
            "scale": PartSpec((groups,), torch.float16),
            "zero": PartSpec((groups,), torch.float16),
        }

    def quantize(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Parts:
        *lead, d = x.shape
        g = x.float().reshape(*lead, d // self.group_size, self.group_size)
        lo = g.amin(dim=-1, keepdim=True)
        hi = g.amax(dim=-1, keepdim=True)
        # scale and zero are rounded to fp16 *before* the codes are chosen, so that the
        # stored (fp16) values are exactly the ones the codes were computed against.
        scale = ((hi - lo) / self.levels).clamp_min(FP16_TINY).to(torch.float16)
        zero = lo.to(torch.float16)
        q = torch.round((g - zero.float()) / scale.float()).clamp_(0, self.levels)
        return {
            "q": pack_codes(q.reshape(*lead, d), self.bits),
            "scale": scale.squeeze(-1),
            "zero": zero.squeeze(-1),
        }

    def dequantize(self, parts: Parts, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        q = unpack_codes(parts["q"], self.bits).float()
        *lead, d = q.shape
        g = q.reshape(*lead, d // self.group_size, self.group_size)
        x = g * parts["scale"].float().unsqueeze(-1) + parts["zero"].float().unsqueeze(-1)
        return x.reshape(*lead, d).to(dtype)
