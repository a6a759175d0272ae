"""Rotated codebook quantizers ``tq2``, ``tq3``, ``tq4`` (TurboQuant / HIGGS class), per token and KV head;
their 2-D vector-codebook variants ``tqv2/3/4`` (:class:`VectorCodebook`) and per-channel-width keys ``tqc-...``
(:class:`ChannelCodebook`) below.

Each K or V row ``x`` (``head_dim = D`` channels, a power of two) is stored as::

    y     = H (s * (x - mu))          randomized Hadamard rotation: s = seeded +-1 signs per head,
                                      mu = per-channel mean of the head (fitted on the first chunk)
    code  = nearest level of a Lloyd-Max codebook c[0..2^b) to each coordinate of y / |y|
    norm  = |y|^2 / <y, c[code]>, stored as an 8-bit log code (one byte per row)
    x_hat = mu + s * H (norm * c[code])

**The row's gain** (``gain``, :func:`row_gain`). A Lloyd-Max code shrinks: its levels are the
centroids of their cells, so ``c[code]`` regresses on the row with slope ``1 - D`` (``D``: the code's
relative MSE, 3.4% at 3 bits). The least-squares norm ``<y, c> / |c|^2`` (``gain: mse``, the smallest
row error) keeps that shrinkage, and it is not noise: every score ``q . k_hat`` comes out ~``1 - D`` of
``q . k`` (a hotter softmax) and every attention output ~``1 - D`` of its value mix, in every layer.
``gain: unbiased`` (the default) stores ``|y|^2 / <y, c>`` instead: ``<x_hat - mu, x - mu> = |x - mu|^2``,
the row's own direction exact and the error orthogonal to it, at ``1 / cos^2`` the MSE (+3.5% at 3
bits). What each gain costs in perplexity and KL: docs/guide.md (`codebook_gain`).

The coordinates of a randomly rotated vector are close to i.i.d. with the density of one
coordinate of a uniform unit vector in ``D`` dims (~N(0, 1/D)), so one data-oblivious codebook of
``2^b`` MSE-optimal (Lloyd-Max) levels for that density serves every head; the codes are packed
``b`` bits per value exactly like ``int4/3/2`` (:func:`pack_codes`). Stored bits per element:
``b + 8 / D`` (4.125 / 3.125 / 2.125 at D = 64).

**Head space.** Attention never un-rotates a stored row. A head whose K (or V) is codebook-stored
lives in its own *head space* ``y = H (s * (x - mu))``: :meth:`Codebook.decode_space` returns the
rows there (``norm * c[code]``), the store maps its few full-precision rows (sinks, residual, the
fresh chunk) there with :meth:`Codebook.to_space`, queries are rotated once per step
(:meth:`Codebook.query_to_space`: ``H (s * q)``, no mean) and the attention output of a V head is
mapped back once (:meth:`Codebook.from_space`). Both are exact:

* ``(H s q) . (H s (k - mu)) = q . k - q . mu``: the same shift for every key a query sees, so the
  softmax is unchanged (this is what removes a q/k-bias model's large per-channel key offset
  before it is spread over every channel by the rotation);
* the probabilities sum to one, so ``sum p_i (mu + y_i) = mu + sum p_i y_i``.

The signs (int8, per head), the mean (fp32: a q/k-bias offset may exceed fp16) and ``params``
(log2 of the smallest norm code, the log2 step, the ``2^b`` levels; what the kernels read), both
per sequence and head, are the quantizer's static state, set from each sequence's real tokens of
the first chunk written (like the static INT8 scales: a request does not depend on its
batch-mates) and counted in the bytes held.

The table builders are in :mod:`.tables`, the row helpers in :mod:`.rows`, the ladder's rungs in :mod:`.rungs`.
"""

from __future__ import annotations

import functools

import torch

from ...rotation import fwht
from ..base import Parts, PartSpec
from ..intn import pack_codes, unpack_codes
from .rows import (
    NORM_CODES,
    _per_head,
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
from .rungs import Refinable
from .tables import (
    lloyd_max_levels,
    refined_levels,
)


class Codebook(Refinable):
    """``tq{bits}``: randomized-Hadamard-rotated rows, one 8-bit log norm, a ``2^bits``-level codebook.

    ``levels`` overrides the data-oblivious Lloyd-Max codebook (e.g. :func:`uniform_levels`, or
    levels refitted on calibration data); ``center`` (default True) removes a per-channel mean
    fitted on the first chunk (see the module doc: exact for attention); ``gain``: how each row's norm
    is chosen, ``unbiased`` (default) or ``mse`` (:func:`row_gain`).
    """

    static = True
    space = True

    def __init__(
        self, head_dim: int, bits: int = 4, levels: tuple[float, ...] | None = None, center: bool = True,
        gain: str = "unbiased",
    ) -> None:
        super().__init__(head_dim)
        self.gain = check_gain(gain)
        if bits not in (2, 3, 4):
            raise ValueError(f"bits: {bits} is not supported by the codebook quantizer (2, 3 or 4)")
        if head_dim & (head_dim - 1) or head_dim < 8:
            raise ValueError(f"head_dim: {head_dim} is not a power of two >= 8; tq{bits} rotates by Hadamard")
        self.bits = bits
        self.center = center
        self.levels = torch.tensor(levels or lloyd_max_levels(bits, head_dim), dtype=torch.float32)
        if self.levels.numel() != 2**bits:
            raise ValueError(f"levels: {self.levels.numel()} given, tq{bits} needs {2**bits}")
        self.name = f"tq{bits}"
        self.granularity = (
            f"per token and KV head: randomized Hadamard rotation, 8-bit log norm, {2**bits}-level Lloyd-Max codebook"
        )

    def parts(self) -> dict[str, PartSpec]:
        return {
            "q": PartSpec((self.head_dim * self.bits // 8,), torch.uint8),
            "norm": PartSpec((1,), torch.uint8),
        }

    # -- static state -----------------------------------------------------------------------
    def fit(self, x: torch.Tensor, use: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Static state from the first chunk ``x[B, H, T, D]``, per sequence and head over the tokens where
        ``use[B, T]`` (real, non-sink tokens; None: all): mean, norm code range; signs per head."""
        B, H, T, D = x.shape
        xf = x.detach().float()
        w = token_weights(use, B, T, x.device)
        mean = (xf * w).sum(2) / w.sum(2) if self.center else torch.zeros(B, H, D, device=x.device)
        state = {"sign": head_signs(H, D).to(device=x.device, dtype=torch.int8), "mean": mean}
        lo, step = norm_code_range(self.to_space(xf, state).norm(dim=-1), w)
        # what the kernels read, one row per (sequence, head): [log2 of norm code 1, log2 step, the 2^b levels]
        levels = self.levels.to(x.device).expand(B, H, -1)
        state["params"] = torch.cat([lo[..., None], step[..., None], levels], dim=2).contiguous()
        return state

    def per_sequence(self, name: str, t: torch.Tensor) -> bool:
        """Everything :meth:`fit` returns is per sequence and head except the per-head signs ``[H, D]``."""
        return name != "sign"

    # -- head space ---------------------------------------------------------------------------
    def to_space(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Model-space rows ``x[B, H, ..., D]`` -> head space ``H (s * (x - mu))`` (float32)."""
        return fwht((x.float() - _per_head(state["mean"].float(), x)) * _per_head(state["sign"].float(), x))

    def query_to_space(self, q: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Queries ``[B, H, ..., D]`` (grouped by KV head) -> ``H (s * q)``, so that scores are exact."""
        return fwht(q.float() * _per_head(state["sign"].float(), q)).to(q.dtype)

    def from_space(self, y: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Head space ``y[B, H, ..., D]`` -> model space ``mu + s * H y`` (float32)."""
        return fwht(y.float()) * _per_head(state["sign"].float(), y) + _per_head(state["mean"].float(), y)

    # -- math -------------------------------------------------------------------------------
    def quantize(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Parts:
        y = self.to_space(x, state)
        n = y.norm(dim=-1, keepdim=True)
        u = y / n.clamp_min(1e-30)
        lv = self.levels.to(x.device)
        codes = torch.bucketize(u, (lv[1:] + lv[:-1]) / 2)
        c = lv[codes]
        ncode = code_of_norm(row_gain(y, c, self.gain), state["params"], x)
        return {"q": pack_codes(codes, self.bits), "norm": ncode}

    def clipped(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Rows of ``x`` whose norm falls outside the 8-bit norm code's range (stored at its nearest end)."""
        logn = torch.log2(self.to_space(x, state).norm(dim=-1).clamp_min(1e-30))
        lo, step = state["params"][..., 0].unsqueeze(-1), state["params"][..., 1].unsqueeze(-1)
        hi = lo + step * (NORM_CODES - 2)
        real = x.abs().amax(dim=-1) > 0  # the store's zeroed sink rows are read from the sink buffer
        return (real & ((logn < lo - step / 2) | (logn > hi + step / 2))).sum()

    def decode_space(self, parts: Parts, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Stored rows in head space: ``norm * c[code]``, float32 ``[B, H, T, D]`` (what the kernels compute)."""
        codes = unpack_codes(parts["q"], self.bits).long()
        params = state["params"]
        cb = params[..., 2:].unsqueeze(2).expand(*codes.shape[:3], -1)
        return torch.gather(cb, 3, codes) * norm_of_code(parts["norm"], params)

    def dequantize(self, parts: Parts, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return self.from_space(self.decode_space(parts, state), state).to(dtype)

    # -- embedded refinement (the store's age ladder, ``ladder_tokens``) ----------------------
    @functools.cached_property
    def refinement(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(children [2 * 2^b], splits [2^b])`` float32 of this codebook's levels (:func:`refined_levels`; built
        on first use, kept: the ladder reads it every step)."""
        ch, sp, _ = refined_levels(tuple(self.levels.tolist()), self.head_dim)
        return torch.tensor(ch, dtype=torch.float32), torch.tensor(sp, dtype=torch.float32)

    @functools.cached_property
    def child_mads(self) -> torch.Tensor:
        """``[2 * 2^b]`` float32: each refined level's mean absolute residual (:func:`refined_levels`)."""
        return torch.tensor(refined_levels(tuple(self.levels.tolist()), self.head_dim)[2], dtype=torch.float32)

    def refine(self, x: torch.Tensor, state: dict[str, torch.Tensor], parts: Parts) -> Parts:
        """Refinement parts of rows ``x`` whose base parts are ``parts``: one bit per coordinate, the side of its
        cell's split point (:func:`refined_levels`) the unit row's coordinate lies on, and the norm correction."""
        y = self.to_space(x, state)
        u = y / y.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        codes = unpack_codes(parts["q"], self.bits).long()
        children, splits = self.refinement
        bit = (u >= splits.to(x.device)[codes]).long()
        c = children.to(x.device)[2 * codes + bit]
        return {"r": pack_bits(bit, 1),
                "rscale": rscale_code(y, c, norm_of_code(parts["norm"], state["params"]), self.gain)}

    def decode_refined(self, parts: Parts, rparts: Parts, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Refined rows in head space, float32 ``[B, H, T, D]``: ``norm * rscale * children[2 code + bit]``."""
        codes = unpack_codes(parts["q"], self.bits).long()
        bit = unpack_bits(rparts["r"], 1, self.head_dim)
        children, _ = self.refinement
        norm = norm_of_code(parts["norm"], state["params"]) * rscale_of_code(rparts["rscale"])
        return children.to(codes.device)[2 * codes + bit] * norm

    def step2(self, parts: Parts, rparts: Parts, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """The second rung's step per coordinate (:class:`SecondRung`): the refined level's mean absolute
        residual, at the row's refined norm."""
        codes = unpack_codes(parts["q"], self.bits).long()
        bit = unpack_bits(rparts["r"], 1, self.head_dim)
        norm = norm_of_code(parts["norm"], state["params"]) * rscale_of_code(rparts["rscale"])
        return self.child_mads.to(codes.device)[2 * codes + bit] * norm
