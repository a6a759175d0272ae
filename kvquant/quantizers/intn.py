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

from .base import Factored, Parts, PartSpec, Quantizer, WidenableScales
from .int8 import FP16_TINY


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """``q[..., D]`` integer codes in ``[0, 2^bits)`` -> ``uint8[..., D * bits / 8]`` (split layout)."""
    if bits == 3:
        return _pack3(q)
    per_byte = 8 // bits
    chunks = q.to(torch.uint8).chunk(per_byte, dim=-1)
    packed = chunks[0].clone()
    for k in range(1, per_byte):
        packed |= chunks[k] << (k * bits)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``uint8[..., D*bits/8]`` -> ``uint8[..., D]``."""
    if bits == 3:
        return _unpack3(packed)
    if bits == 8:
        return packed
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    return torch.cat([(packed >> (k * bits)) & mask for k in range(per_byte)], dim=-1)


def _pack3(q: torch.Tensor) -> torch.Tensor:
    """3-bit codes, 8 per 3 bytes: channels ``j + k*D/8`` (k = 0..7) form one 24-bit word, stored
    as three byte planes ``[low | mid | high]`` of ``D/8`` bytes each."""
    chunks = q.to(torch.int32).chunk(8, dim=-1)
    word = chunks[0].clone()
    for k in range(1, 8):
        word |= chunks[k] << (3 * k)
    return torch.cat([(word >> s) & 0xFF for s in (0, 8, 16)], dim=-1).to(torch.uint8)


def _unpack3(packed: torch.Tensor) -> torch.Tensor:
    lo, mid, hi = packed.to(torch.int32).chunk(3, dim=-1)
    word = lo | (mid << 8) | (hi << 16)
    return torch.cat([(word >> (3 * k)) & 7 for k in range(8)], dim=-1).to(torch.uint8)


def _minmax_codes(
    g: torch.Tensor, levels: float, dim: int, dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric codes of ``g`` with one (scale, zero) per slice along ``dim`` (rounded to ``dtype`` first)."""
    lo = g.amin(dim=dim, keepdim=True)
    hi = g.amax(dim=dim, keepdim=True)
    scale = ((hi - lo) / levels).clamp_min(FP16_TINY).to(dtype)
    zero = lo.to(dtype)
    q = torch.round((g - zero.float()) / scale.float()).clamp_(0, levels)
    return q, scale, zero


class IntNGrouped(WidenableScales, Quantizer):
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
            "scale": PartSpec((groups,), self.scale_dtype),
            "zero": PartSpec((groups,), self.scale_dtype),
        }

    def quantize(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Parts:
        *lead, d = x.shape
        g = x.float().reshape(*lead, d // self.group_size, self.group_size)
        q, scale, zero = _minmax_codes(g, self.levels, dim=-1, dtype=self.scale_dtype)
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


class Int3Grouped(IntNGrouped):
    """INT3, 8 codes per 3 bytes (see :func:`_pack3`); same grouping and math as :class:`IntNGrouped`."""

    def __init__(self, head_dim: int, group_size: int = 32) -> None:
        Quantizer.__init__(self, head_dim)
        self.bits, self.group_size, self.levels, self.name = 3, group_size, 7.0, "int3"
        self.granularity = f"per token and KV head, groups of {group_size} along head_dim (fp16 scale+zero)"


class IntNChannel(WidenableScales, Quantizer):
    """Asymmetric INT8/INT4/INT3/INT2 keys quantized *per channel* over a block of tokens (KIVI's keys).

    Granularity: per KV head and channel of head_dim, one (scale, zero) pair per block of
    ``token_group`` tokens (the store's block size), stored once per block in fp16::

        lo[c], hi[c] = min/max over the block's tokens of x[:, c]
        q = round((x - lo) / scale)        scale = (hi - lo) / (2^bits - 1)

    Key outliers live in a few channels; per-channel ranges keep them from flattening every other
    channel of the token. Needs whole blocks: the store keeps the newest tokens in full precision
    until a block fills (``residual`` mode), then quantizes the block once.
    """

    per_block = True

    def __init__(self, head_dim: int, bits: int = 4, token_group: int = 128) -> None:
        super().__init__(head_dim)
        if bits not in (2, 3, 4, 8):
            raise ValueError(f"bits: {bits} is not supported by the per-channel quantizer (2, 3, 4 or 8)")
        self.bits, self.token_group, self.levels = bits, token_group, float(2**bits - 1)
        self.name = f"int{bits}-channel"
        self.granularity = f"per channel and KV head, over blocks of {token_group} tokens (fp16 scale+zero)"

    def parts(self) -> dict[str, PartSpec]:
        return {
            "q": PartSpec((self.head_dim * self.bits // 8,), torch.uint8),
            "scale": PartSpec((self.head_dim,), self.scale_dtype, per_block=True),
            "zero": PartSpec((self.head_dim,), self.scale_dtype, per_block=True),
        }

    def bits_per_element(self) -> float:
        return self.bits + 2 * torch.finfo(self.scale_dtype).bits / self.token_group

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        B, H, T, D = x.shape
        n = -(-T // self.token_group)
        if T % self.token_group:  # a ragged last block (simulated protocol only): pad by repeating its last token
            pad = x[:, :, -1:].expand(B, H, n * self.token_group - T, D)
            x = torch.cat([x, pad], dim=2)
        return x.float().reshape(B, H, n, self.token_group, D)

    def quantize(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Parts:
        B, H, T, D = x.shape
        q, scale, zero = _minmax_codes(self._blocks(x), self.levels, dim=3, dtype=self.scale_dtype)
        codes = q.reshape(B, H, -1, D)[:, :, :T]
        return {"q": pack_codes(codes, self.bits), "scale": scale.squeeze(3), "zero": zero.squeeze(3)}

    def dequantize(self, parts: Parts, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        q = unpack_codes(parts["q"], self.bits)
        B, H, T, D = q.shape
        scale, zero = parts["scale"].float(), parts["zero"].float()
        n = -(-T // self.token_group)
        if T % self.token_group == 0:  # whole blocks (the store's reads): broadcast each block's scale and zero
            g = q.view(B, H, n, self.token_group, D)
            x = g * scale[:, :, :n].unsqueeze(3) + zero[:, :, :n].unsqueeze(3)
            return x.view(B, H, T, D).to(dtype)
        idx = torch.arange(T, device=q.device) // self.token_group
        return (q * scale.index_select(2, idx) + zero.index_select(2, idx)).to(dtype)

    def factored(self, parts: Parts, state: dict[str, torch.Tensor]) -> Factored | None:
        q = unpack_codes(parts["q"], self.bits)
        T, n = q.shape[2], q.shape[2] // self.token_group
        if T % self.token_group:
            return None
        scale, zero = parts["scale"][:, :, :n].float(), parts["zero"][:, :, :n].float()
        return Factored(q.float(), scale, zero, block=self.token_group)
