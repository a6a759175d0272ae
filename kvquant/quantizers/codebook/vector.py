"""2-D vector codebooks ``tqv{bits}``: rotated rows, pairs of coordinates coded jointly (:class:`VectorCodebook`)."""

from __future__ import annotations

import functools
import math

import torch

from ..base import Parts, PartSpec, Quantizer
from .rows import (
    check_gain,
    code_of_norm,
    head_signs,
    norm_code_range,
    norm_of_code,
    pack_bits,
    row_gain,
    rscale_code,
    rscale_of_code,
    token_weights,
    unpack_bits,
)
from .rungs import refinement_parts
from .scalar import Codebook
from .tables import (
    VQ_DIM,
    gaussian_vq,
    refined_vq,
    vq_nearest,
)

VECTOR_PREFIX = "tqv"


class VectorCodebook(Quantizer):
    """``tqv{bits}``: :class:`Codebook`'s rotation, mean and 8-bit log norm, but each pair of rotated
    coordinates is coded jointly by one of ``2^(2 bits)`` Gaussian codewords (:func:`gaussian_vq`).

    Same bits as ``tq{bits}`` (a ``2 bits``-bit code per pair, packed; ``b + 8 / D`` bits per element);
    a 2-D code fills the plane with near-hexagonal cells instead of the scalar code's rectangles, which
    lowers the MSE on Gaussian-like coordinates by ~13% at 3 bits (0.0299 vs 0.0345). Decode is one
    table lookup per pair, ``norm * c[code]`` (``[2^(2 bits), 2]`` table: 512 B at 3 bits, registers or
    shared memory in a kernel; or a per-query table of ``q_pair . c`` for all codewords, then one lookup
    and add per pair and key). Read in the same head space as ``tq{bits}``, by the torch path and in-kernel by the
    Triton decode / chunk kernels (:func:`~kvquant.kernels.triton_codebook.tqv_tile`).
    """

    static = True
    space = True
    center = True

    def __init__(self, head_dim: int, bits: int = 3, dim: int = VQ_DIM, gain: str = "unbiased") -> None:
        super().__init__(head_dim)
        self.gain = check_gain(gain)
        if bits not in (2, 3, 4):
            raise ValueError(f"bits: {bits} is not supported by the vector codebook quantizer (2, 3 or 4)")
        if head_dim & (head_dim - 1) or head_dim < 8:
            raise ValueError(f"head_dim: {head_dim} is not a power of two >= 8; tqv{bits} rotates by Hadamard")
        self.bits, self.dim = bits, dim
        self.width = bits * dim  # bits of one code
        # codewords for the coordinates of a unit vector (variance 1 / D each), so that the norm is ~|y|
        self.codewords = gaussian_vq(bits, dim) / math.sqrt(head_dim)
        self.name = f"{VECTOR_PREFIX}{bits}"
        self.granularity = (
            f"per token and KV head: randomized Hadamard rotation, 8-bit log norm, {dim}-D codebook of "
            f"{2**self.width} Gaussian codewords"
        )

    to_space = Codebook.to_space
    query_to_space = Codebook.query_to_space
    from_space = Codebook.from_space
    per_sequence = Codebook.per_sequence

    def parts(self) -> dict[str, PartSpec]:
        return {
            "q": PartSpec((self.head_dim * self.bits // 8,), torch.uint8),
            "norm": PartSpec((1,), torch.uint8),
        }

    def rung_parts(self, rung: int) -> dict[str, PartSpec]:
        """One rung (:func:`refinement_parts`): a second is not defined for pair codes."""
        return refinement_parts(self.head_dim) if rung == 1 else {}

    def fit(self, x: torch.Tensor, use: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Static state from the first chunk, per sequence and head: mean, norm code range; signs per head."""
        B, H, T, D = x.shape
        xf = x.detach().float()
        w = token_weights(use, B, T, x.device)
        mean = (xf * w).sum(2) / w.sum(2)
        state = {"sign": head_signs(H, D).to(device=x.device, dtype=torch.int8), "mean": mean}
        lo, step = norm_code_range(self.to_space(xf, state).norm(dim=-1), w)
        state["params"] = torch.stack([lo, step], dim=2).contiguous()
        return state

    def quantize(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Parts:
        y = self.to_space(x, state)
        n = y.norm(dim=-1, keepdim=True)
        u = y / n.clamp_min(1e-30)
        cw = self.codewords.to(x.device)
        codes = vq_nearest(u.reshape(-1, self.dim), cw).view(*y.shape[:-1], self.head_dim // self.dim)
        c = cw[codes].flatten(-2)
        ncode = code_of_norm(row_gain(y, c, self.gain), state["params"], x)
        return {"q": pack_bits(codes, self.width), "norm": ncode}

    def clipped(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Rows of ``x`` whose norm falls outside the 8-bit norm code's range (stored at its nearest end)."""
        return Codebook.clipped(self, x, state)

    def decode_space(self, parts: Parts, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Stored rows in head space: ``norm * c[code]`` per pair, float32 ``[B, H, T, D]``."""
        codes = unpack_bits(parts["q"], self.width, self.head_dim // self.dim)
        c = self.codewords.to(codes.device)[codes].flatten(-2)
        return c * norm_of_code(parts["norm"], state["params"])

    def dequantize(self, parts: Parts, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return self.from_space(self.decode_space(parts, state), state).to(dtype)

    # -- embedded refinement (the store's age ladder, ``ladder_tokens``) ----------------------
    @functools.cached_property
    def refined_codewords(self) -> torch.Tensor:
        """:func:`refined_vq` scaled like :attr:`codewords` (``[K, 2^dim, dim]``; built on first use, kept)."""
        return refined_vq(self.bits, self.dim) / math.sqrt(self.head_dim)

    def refine(self, x: torch.Tensor, state: dict[str, torch.Tensor], parts: Parts) -> Parts:
        """Refinement parts of rows ``x`` (base parts ``parts``): per pair, the nearest of its codeword's ``2^dim``
        children (:func:`refined_vq`), ``dim`` bits a pair (one per coordinate), and the norm correction."""
        y = self.to_space(x, state)
        u = y / y.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        n = self.head_dim // self.dim
        codes = unpack_bits(parts["q"], self.width, n)  # [B, H, T, n]
        cand = self.refined_codewords.to(x.device)[codes]  # [..., n, m, dim]
        sub = ((u.view(*u.shape[:-1], n, 1, self.dim) - cand) ** 2).sum(-1).argmin(-1)  # [B, H, T, n]
        c = torch.gather(cand, -2, sub[..., None, None].expand(*sub.shape, 1, self.dim)).flatten(-3)
        rscale = rscale_code(y, c, norm_of_code(parts["norm"], state["params"]), self.gain)
        return {"r": pack_bits(sub, self.dim), "rscale": rscale}

    def decode_refined(self, parts: Parts, rparts: Parts, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Refined rows in head space, float32 ``[B, H, T, D]``: ``norm * rscale * children[code, sub]`` per pair."""
        n = self.head_dim // self.dim
        codes = unpack_bits(parts["q"], self.width, n)
        sub = unpack_bits(rparts["r"], self.dim, n)
        ch = self.refined_codewords.to(codes.device)
        norm = norm_of_code(parts["norm"], state["params"]) * rscale_of_code(rparts["rscale"])
        return ch[codes, sub].flatten(-2) * norm
