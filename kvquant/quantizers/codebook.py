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
"""

from __future__ import annotations

import functools
import math

import torch

from ..rotation import fwht
from .base import Parts, PartSpec, Quantizer
from .intn import pack_codes, unpack_codes

NORM_CODES = 256  # 8-bit log-scaled norm; code 0 = a zero row
GAINS = ("unbiased", "mse")  # how a codebook row's norm is chosen (:func:`row_gain`)
NORM_MARGIN = 2.0  # log2 margin on both sides of the first chunk's norm range (x4 / x0.25)
SHORT_CHUNK = 64  # first chunks with fewer rows per head get NORM_MARGIN + 4
SIGN_SEED = 0x7155


def _lloyd_max(density: torch.Tensor, grid: torch.Tensor, levels: int, iters: int = 300) -> torch.Tensor:
    """MSE-optimal ``levels`` scalar quantizer for a density sampled on ``grid`` (Lloyd's algorithm)."""
    w = density / density.sum()
    cdf = torch.cumsum(w, 0)
    # start from the quantiles of the density (midpoints of equal-mass cells)
    c = grid[torch.searchsorted(cdf, (torch.arange(levels, dtype=grid.dtype) + 0.5) / levels).clamp_max(len(grid) - 1)]
    for _ in range(iters):
        edges = (c[1:] + c[:-1]) / 2
        cell = torch.bucketize(grid, edges)
        mass = torch.zeros(levels, dtype=grid.dtype).index_add_(0, cell, w)
        mom = torch.zeros(levels, dtype=grid.dtype).index_add_(0, cell, w * grid)
        c = torch.where(mass > 0, mom / mass.clamp_min(1e-300), c)
    return c


@functools.cache
def lloyd_max_levels(bits: int, head_dim: int) -> tuple[float, ...]:
    """The ``2^bits`` Lloyd-Max levels for one coordinate of a uniformly random unit vector in
    ``head_dim`` dims (density ``(1 - x^2)^((D - 3) / 2)`` on ``[-1, 1]``, ~N(0, 1/D)), ascending."""
    d = head_dim
    grid = torch.linspace(-1.0, 1.0, 20_001, dtype=torch.float64)[1:-1]
    dens = torch.exp((d - 3) / 2 * torch.log1p(-grid * grid)) if d > 3 else torch.ones_like(grid)
    return tuple(_lloyd_max(dens, grid, 2**bits).tolist())


def uniform_levels(bits: int, head_dim: int) -> tuple[float, ...]:
    """The MSE-optimal *uniform* grid of ``2^bits`` levels for the same density (step chosen by a scan):
    the same-bits baseline that :func:`lloyd_max_levels` is compared against."""
    d, n = head_dim, 2**bits
    grid = torch.linspace(-1.0, 1.0, 20_001, dtype=torch.float64)[1:-1]
    w = torch.exp((d - 3) / 2 * torch.log1p(-grid * grid)) if d > 3 else torch.ones_like(grid)
    w = w / w.sum()
    best, best_mse = None, math.inf
    for step in torch.linspace(0.05, 4.0, 400, dtype=torch.float64) / math.sqrt(d):
        lv = (torch.arange(n, dtype=torch.float64) - (n - 1) / 2) * step
        q = lv[torch.bucketize(grid, (lv[1:] + lv[:-1]) / 2)]
        mse = float((w * (grid - q) ** 2).sum())
        if mse < best_mse:
            best, best_mse = lv, mse
    return tuple(best.tolist())


def head_signs(heads: int, head_dim: int, seed: int = SIGN_SEED) -> torch.Tensor:
    """Seeded random +-1 signs ``[heads, head_dim]`` of the randomized Hadamard rotation (one row per head)."""
    g = torch.Generator().manual_seed(seed * 1009 + head_dim)
    return torch.randint(0, 2, (heads, head_dim), generator=g).float() * 2 - 1


def _per_head(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """State ``t[H, D]`` (per head) or ``t[B, H, D]`` (per sequence and head) shaped to broadcast against
    ``x[B, H, ..., D]``."""
    t = t.to(x.device)
    lead = (1, t.shape[0]) if t.dim() == 2 else (t.shape[0], t.shape[1])
    return t.view(*lead, *([1] * (x.dim() - 3)), t.shape[-1])


def norm_of_code(ncode: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Row norms ``[B, H, T, 1]`` from their 8-bit codes: 0 -> 0, c -> 2^(lo + step * (c - 1)) per sequence
    and head (``params[B, H, 2 + levels]``)."""
    lo = params[..., 0].unsqueeze(-1).unsqueeze(-1)
    step = params[..., 1].unsqueeze(-1).unsqueeze(-1)
    c = ncode.float()
    return torch.where(c > 0, torch.exp2(lo + step * (c - 1)), torch.zeros_like(c))


def code_of_norm(norm: torch.Tensor, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """8-bit log codes (uint8, ``[B, H, T, 1]``) of row norms ``norm[B, H, T, 1]`` of rows ``x`` in the per (sequence,
    head) code range ``params[..., :2]`` (the inverse of :func:`norm_of_code`; a zero norm: code 0; clamped)."""
    lo, step = _per_head(params[..., :1], x), _per_head(params[..., 1:2], x)
    code = torch.round((torch.log2(norm.clamp_min(1e-30)) - lo) / step) + 1
    return torch.where(norm > 0, code.clamp(1, NORM_CODES - 1), torch.zeros_like(code)).to(torch.uint8)


def token_weights(use: torch.Tensor | None, B: int, T: int, device: torch.device) -> torch.Tensor:
    """``[B, 1, T, 1]`` weights of the tokens a fit uses (``use[B, T]``; None: all); a row that uses no token
    uses them all."""
    w = torch.ones(B, T, device=device) if use is None else use.float()
    return torch.where(w.sum(1, keepdim=True) > 0, w, torch.ones_like(w)).view(B, 1, T, 1)


def check_gain(gain: str) -> str:
    """``gain`` when it is one of :data:`GAINS` (else a one-line ValueError naming it)."""
    if gain not in GAINS:
        raise ValueError(f"gain: unknown {gain!r} (known: {', '.join(GAINS)})")
    return gain


def row_gain(y: torch.Tensor, c: torch.Tensor, gain: str = "unbiased") -> torch.Tensor:
    """The factor ``g`` (``[..., 1]``) a row ``y[..., D]`` (head space) is stored with as ``g * c`` (``c``: its
    code's values): ``mse``: ``<y, c> / |c|^2``, the least ``|y - g c|^2`` (shrunk by the code's relative MSE);
    ``unbiased``: ``|y|^2 / <y, c>``, so that ``<g c, y> = |y|^2`` (see the module doc). The cosine is taken as at
    least 1/2, so a code far off its row (never seen for these codebooks) cannot blow the gain up."""
    yc = (y * c).sum(-1, keepdim=True)
    cc = (c * c).sum(-1, keepdim=True)
    if check_gain(gain) == "mse":
        return yc / cc.clamp_min(1e-30)
    yy = (y * y).sum(-1, keepdim=True)
    return yy / torch.maximum(yc, 0.5 * (yy * cc).sqrt()).clamp_min(1e-30)


def norm_code_range(norms: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log2 of norm code 1 and the log2 step of the 8-bit norm code, per (sequence, head), from the first
    chunk's row norms ``norms[B, H, T]`` over the tokens weighted by ``w`` (:func:`token_weights`), with
    NORM_MARGIN on both sides (4 more for a sequence with fewer than SHORT_CHUNK such tokens: they say little
    about later norms; counted per sequence, so that a row's left padding or batch-mates do not change it)."""
    B, _, T = norms.shape
    ok = (norms > 0) & (w.view(B, 1, T) > 0)
    logn = torch.log2(norms.clamp_min(1e-30))
    lo = torch.where(ok, logn, torch.full_like(logn, math.inf)).amin(dim=2)
    hi = torch.where(ok, logn, torch.full_like(logn, -math.inf)).amax(dim=2)
    used = (w.view(B, T) > 0).sum(dim=1, keepdim=True)  # [B, 1]
    margin = torch.where(used >= SHORT_CHUNK, NORM_MARGIN, NORM_MARGIN + 4.0)
    lo = torch.where(torch.isfinite(lo), lo, torch.zeros_like(lo)) - margin
    hi = torch.where(torch.isfinite(hi), hi, torch.zeros_like(hi)) + margin
    return lo, (hi - lo) / (NORM_CODES - 2)


def refinement_parts(head_dim: int) -> dict[str, PartSpec]:
    """The first rung's parts of every codebook precision: ``head_dim`` bits (``r``: one per coordinate, or
    ``tqv``'s one per coordinate of a pair's child) and the row's norm correction (``rscale``, :func:`rscale_code`)."""
    return {"r": PartSpec((head_dim // 8,), torch.uint8), "rscale": PartSpec((1,), torch.uint8)}


class SecondRung:
    """The age ladder's second rung (``ladder2_tokens``), for a quantizer with an embedded refinement
    (``refine`` / ``decode_refined``) and a per-coordinate ``step2``: one more bit per coordinate of a refined
    row, the sign of the coordinate's residual against its refined value (in head space), which then moves by
    ``+- step2``, the mean absolute residual of the refined cell: the step that minimises the squared error of a
    sign bit. Embedded like the first rung: dropping the bit leaves the refined row. The row keeps its refined
    norm (no byte of its own): ``D / 8`` bytes a row."""

    def rung_parts(self, rung: int) -> dict[str, PartSpec]:
        """Both rungs: :func:`refinement_parts`, then one bit per coordinate (``r2``)."""
        if rung == 2:
            return {"r2": PartSpec((self.head_dim // 8,), torch.uint8)}  # type: ignore[attr-defined]
        return refinement_parts(self.head_dim) if rung == 1 else {}  # type: ignore[attr-defined]

    def refine2(self, x: torch.Tensor, state: dict[str, torch.Tensor], parts: Parts, rparts: Parts) -> Parts:
        """Second-rung parts of rows ``x`` whose base parts are ``parts`` and first-rung parts ``rparts``."""
        y = self.to_space(x, state)  # type: ignore[attr-defined]
        return {"r2": pack_bits((y >= self.decode_refined(parts, rparts, state)).long(), 1)}  # type: ignore[attr-defined]

    def decode_refined2(
        self, parts: Parts, rparts: Parts, r2parts: Parts, state: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Rows refined by both rungs, float32 head space ``[B, H, T, D]``: the refined row ``+- step2``."""
        return self.add_rung2(self.decode_refined(parts, rparts, state), parts, rparts, r2parts, state)  # type: ignore[attr-defined]

    def add_rung2(
        self, y1: torch.Tensor, parts: Parts, rparts: Parts, r2parts: Parts, state: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """:meth:`decode_refined2` from the rows' refined decode ``y1`` (already at hand: not decoded again)."""
        sign = 2 * unpack_bits(r2parts["r2"], 1, self.head_dim) - 1  # type: ignore[attr-defined]
        return y1 + sign * self.step2(parts, rparts, state)  # type: ignore[attr-defined]


class Codebook(SecondRung, Quantizer):
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


# ---------------------------------------------------------------------------------------------------------
# Per-channel widths: ``tqc-<widths>`` (keys of RoPE models)

GAUSS_MAX_BITS = 8


@functools.cache
def gaussian_levels(bits: int) -> tuple[float, ...]:
    """The ``2^bits`` Lloyd-Max levels of a unit Gaussian, ascending (``bits`` 1..8)."""
    if not 1 <= bits <= GAUSS_MAX_BITS:
        raise ValueError(f"bits: {bits} outside 1..{GAUSS_MAX_BITS}")
    grid = torch.linspace(-9.0, 9.0, 72_001, dtype=torch.float64)
    c = _lloyd_max(torch.exp(-grid * grid / 2), grid, 2**bits)
    return tuple(((c - c.flip(0)) / 2).tolist())  # the density is symmetric: so are its levels


@functools.cache
def gaussian_distortion(bits: int) -> float:
    """MSE of :func:`gaussian_levels` on a unit Gaussian (1.0 for 0 bits: the channel is dropped)."""
    if bits == 0:
        return 1.0
    grid = torch.linspace(-9.0, 9.0, 72_001, dtype=torch.float64)
    w = torch.exp(-grid * grid / 2)
    lv = torch.tensor(gaussian_levels(bits))
    q = lv[torch.bucketize(grid, (lv[1:] + lv[:-1]) / 2)]
    return float((w * (grid - q) ** 2).sum() / w.sum())


def allocate_widths(weights: torch.Tensor | list[float], total_bits: int, max_bits: int = GAUSS_MAX_BITS) -> list[int]:
    """Per-channel code widths summing to ``total_bits`` that minimise ``sum_j weights[j] * D(width_j)``
    (``D``: :func:`gaussian_distortion`), greedily (optimal: ``D`` is convex and decreasing in the width).

    For keys, ``weights[j] = E[q_j^2] * var(k_j)`` makes the objective the expected squared score error
    of a query against a key whose channel ``j`` is quantized at its own scale (channels independent)."""
    w = [float(x) for x in weights]
    if total_bits < 0 or total_bits > max_bits * len(w):
        raise ValueError(f"total_bits: {total_bits} outside 0..{max_bits * len(w)} for {len(w)} channels")
    widths = [0] * len(w)
    for _ in range(total_bits):
        gain = [w[j] * (gaussian_distortion(b) - gaussian_distortion(b + 1)) if b < max_bits else -math.inf
                for j, b in enumerate(widths)]  # fmt: skip
        widths[max(range(len(w)), key=gain.__getitem__)] += 1
    return widths


CHANNEL_PREFIX = "tqc-"
SEARCH_SCALES = (1.0, 1.25, 1.5, 2.0, 2.5)  # ChannelCodebook's row scales tried, times the row's RMS norm (search)


def channel_precision(widths: list[int]) -> str:
    """The config precision name of a :class:`ChannelCodebook` with these per-channel widths."""
    return CHANNEL_PREFIX + "".join(str(int(b)) for b in widths)


class ChannelCodebook(SecondRung, Quantizer):
    """``tqc-<widths>``: per-channel Gaussian Lloyd-Max codes of different widths, one 8-bit log norm per row.

    No rotation: each channel ``j`` of a row is centered and scaled by its own mean ``mu_j`` and spread
    ``sigma_j`` (fitted per sequence and head on the first chunk, like :class:`Codebook`'s mean), the
    whitened row ``w = (x - mu) / sigma`` is divided by one norm ``g``, the RMS of ``w`` over the channels
    whose width is at least the average width (8-bit log code), and channel ``j`` is coded on the
    ``2^{width_j}``-level Lloyd-Max grid of a unit Gaussian (width 0: the channel is stored as its mean).
    (A norm over every channel couples them: a token with one large channel then codes all its narrow
    channels coarsely; neither norm wins on every head: outlier tokens, the ones attention picks, are what a
    per-channel code handles worst.) The widths
    are part of the precision name (``tqc-`` and one digit 0-8 per channel, summing to a multiple of 8),
    chosen offline per (layer, KV head) by :func:`allocate_widths` from calibration text: after RoPE a few
    channel pairs carry most of
    the query energy, so spending the bits there lowers the score error of keys against ``tq3``/``tq4`` at
    the same bits. Read in its head space
    ``x - mu`` (queries unchanged; the mean shifts every score of a query alike). The Triton kernels read
    the codes in-kernel (``kernels/triton_codebook.py``, ``KIND_TQC``). ``gain``: ``unbiased`` (default) stores
    the :func:`row_gain` over the wide channels of the row norm (narrow channels keep some shrinkage); ``mse``
    stores the whitened row's RMS over them, as recorded before the unbiased gain (not a least-squares fit).

    ``search`` (default True): each row's code scale is searched, not fixed. The RMS norm codes a typical row well,
    but a row with a value far out on a narrow channel (often a rare token's key: the ones a copying head must
    find again) is clipped at that channel's outermost level. The encoder codes the row at the norm times each
    of :data:`SEARCH_SCALES` and keeps the codes with the least *score-weighted* error
    ``sum_j 4^{width_j} (w_j - g c_j)^2`` (``g``: the row's stored gain for those codes). ``4^{width_j}`` is the
    channel's weight ``E[q_j^2] var(k_j)`` up to a constant: what :func:`allocate_widths` equalises. Encoder
    only: the stored format, the decoders and the kernels are unchanged. False: the RMS scale alone.
    """

    static = True
    space = True
    center = True

    def __init__(
        self, head_dim: int, widths: list[int] | tuple[int, ...], gain: str = "unbiased", search: bool = True,
    ) -> None:
        super().__init__(head_dim)
        self.gain = check_gain(gain)
        self.search = bool(search)
        widths = [int(b) for b in widths]
        if len(widths) != head_dim:
            raise ValueError(f"widths: {len(widths)} given, head_dim is {head_dim}")
        if any(not 0 <= b <= GAUSS_MAX_BITS for b in widths):
            raise ValueError(f"widths: each must be 0..{GAUSS_MAX_BITS}, got {widths}")
        total = sum(widths)
        if total == 0 or total % 8:
            raise ValueError(f"widths: they sum to {total} bits, not a positive multiple of 8 (whole bytes per row)")
        self.widths = torch.tensor(widths, dtype=torch.long)
        self.total_bits = total
        self.bits = total / head_dim
        self.name = channel_precision(widths)
        self.granularity = (
            f"per token and KV head: per-channel mean/spread, 8-bit log norm, {self.bits:g}-bit average "
            f"per-channel Lloyd-Max widths {min(widths)}..{max(widths)}"
        )
        table = torch.zeros(head_dim, 2**GAUSS_MAX_BITS)
        for j, b in enumerate(widths):
            if b:
                table[j, : 2**b] = torch.tensor(gaussian_levels(b))
        self.table = table
        self.norm_mask = self.widths >= int(self.bits)  # the channels the row norm is taken over
        self.error_weight = torch.where(self.widths > 0, 4.0 ** self.widths.double(), 0.0).float()  # see search
        self.by_width = {b: torch.tensor([j for j, w in enumerate(widths) if w == b]) for b in sorted(set(widths)) if b}
        bit = torch.arange(GAUSS_MAX_BITS)
        self._bit = bit
        self._select = (bit[None, :] < self.widths[:, None]).flatten().nonzero().squeeze(1)  # channel-major bits
        start = torch.cumsum(self.widths, 0) - self.widths  # first bit of each channel's code in the row
        self._byte, self._shift, self._mask = start // 8, start % 8, (1 << self.widths) - 1

    @classmethod
    def from_name(cls, precision: str, head_dim: int, gain: str = "unbiased", search: bool = True) -> ChannelCodebook:
        digits = precision[len(CHANNEL_PREFIX):]
        if not precision.startswith(CHANNEL_PREFIX) or not digits.isdigit():
            raise ValueError(f"precision: {precision!r} is not tqc-<one width digit per channel>")
        return cls(head_dim, [int(c) for c in digits], gain, search)

    def parts(self) -> dict[str, PartSpec]:
        return {"q": PartSpec((self.total_bits // 8,), torch.uint8), "norm": PartSpec((1,), torch.uint8)}

    # -- packing ----------------------------------------------------------------------------
    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes ``[..., D]`` (channel ``j`` below ``2^width_j``) -> ``[..., total_bits / 8]`` uint8, channel-major."""
        bit = self._bit.to(codes.device)
        bits = ((codes.long().unsqueeze(-1) >> bit) & 1).flatten(-2)[..., self._select.to(codes.device)]
        return (bits.view(*codes.shape[:-1], -1, 8) << bit).sum(-1).to(torch.uint8)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`pack`: ``[..., total_bits / 8]`` uint8 -> codes ``[..., D]`` (int64). A code of at
        most 8 bits spans at most two bytes: one gather of a 16-bit little-endian word per channel, a shift, a mask."""
        dev = packed.device
        p = torch.nn.functional.pad(packed, (0, 2)).long()  # zero bytes past the end: a last 0-bit channel starts there
        word = p.index_select(-1, self._byte.to(dev)) | (p.index_select(-1, self._byte.to(dev) + 1) << 8)
        return (word >> self._shift.to(dev)) & self._mask.to(dev)

    # -- static state -----------------------------------------------------------------------
    def fit(self, x: torch.Tensor, use: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Per sequence and head, over the tokens where ``use[B, T]``: channel means and spreads, norm code range."""
        B, H, T, D = x.shape
        xf = x.detach().float()
        w = token_weights(use, B, T, x.device)
        mean = (xf * w).sum(2) / w.sum(2)
        var = (((xf - mean.unsqueeze(2)) ** 2) * w).sum(2) / w.sum(2)
        sd = var.sqrt()
        floor = (sd.amax(-1, keepdim=True) * 1e-4).clamp_min(1e-12)
        state = {"mean": mean, "scale": torch.maximum(sd, floor)}
        lo, step = norm_code_range(self._row_norm(self._whiten(xf, state)).squeeze(-1), w)
        state["params"] = torch.stack([lo, step], dim=2).contiguous()
        return state

    def per_sequence(self, name: str, t: torch.Tensor) -> bool:
        """Everything :meth:`fit` returns (means, spreads, norm code ranges) is per sequence and head."""
        return True

    def _row_norm(self, w: torch.Tensor) -> torch.Tensor:
        """RMS of whitened rows ``w[..., D]`` over the channels of :attr:`norm_mask` -> ``[..., 1]``."""
        sel = w[..., self.norm_mask.to(w.device)]
        return sel.norm(dim=-1, keepdim=True) / math.sqrt(sel.shape[-1])

    def _whiten(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        return (x.float() - _per_head(state["mean"].float(), x)) / _per_head(state["scale"].float(), x)

    # -- head space ---------------------------------------------------------------------------
    def to_space(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Model-space rows -> head space ``x - mu`` (float32)."""
        return x.float() - _per_head(state["mean"].float(), x)

    def query_to_space(self, q: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Queries are unchanged (the head space is only shifted)."""
        return q

    def from_space(self, y: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Head space -> model space ``mu + y`` (float32)."""
        return y.float() + _per_head(state["mean"].float(), y)

    # -- math -------------------------------------------------------------------------------
    def _code(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Nearest level of each channel's width for unit-scale rows ``u[..., D]``: ``(codes, levels)``."""
        codes = torch.zeros(u.shape, dtype=torch.long, device=u.device)
        c = torch.zeros_like(u)
        for b, idx in self.by_width.items():
            idx = idx.to(u.device)
            lv = torch.tensor(gaussian_levels(b), device=u.device, dtype=u.dtype)
            k = torch.bucketize(u.index_select(-1, idx).contiguous(), (lv[1:] + lv[:-1]) / 2)
            codes[..., idx] = k
            c[..., idx] = lv[k]
        return codes, c

    def _encode(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Rows ``x`` -> ``(codes, divisor, norm)``: the codes, the scale the whitened row was divided by before
        coding (what :meth:`refine` must divide by too) and the row's stored gain (before its 8-bit code)."""
        w = self._whiten(x, state)
        rms = self._row_norm(w)  # 0 for a zero row: its norm code is 0 (under mse too)
        mask = self.norm_mask.to(x.device)
        y = self.to_space(x, state) * mask
        sigma = _per_head(state["scale"].float(), x) * mask  # row_gain's cosine guard over the same channels
        weight = self.error_weight.to(x.device)
        best = None
        for m in SEARCH_SCALES if self.search else (1.0,):
            codes, c = self._code(w / (rms * m).clamp_min(1e-30))
            # unbiased: over the channels of the row norm (a narrow one far out must not scale the rest)
            norm = row_gain(y, c * sigma, "unbiased") if self.gain == "unbiased" else rms * m
            err = ((w - norm * c) ** 2 * weight).sum(-1, keepdim=True)
            if best is None:
                best = (codes, rms * m, norm, err)
            else:
                better = err < best[3]
                best = (torch.where(better, codes, best[0]), torch.where(better, rms * m, best[1]),
                        torch.where(better, norm, best[2]), torch.minimum(err, best[3]))  # fmt: skip
        return best[:3]

    def quantize(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Parts:
        codes, _, norm = self._encode(x, state)
        return {"q": self.pack(codes), "norm": code_of_norm(norm, state["params"], x)}

    def clipped(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Rows whose norm falls outside the 8-bit norm code's range (stored at its nearest end)."""
        logn = torch.log2(self._row_norm(self._whiten(x, state)).squeeze(-1).clamp_min(1e-30))
        lo, step = state["params"][..., 0].unsqueeze(-1), state["params"][..., 1].unsqueeze(-1)
        hi = lo + step * (NORM_CODES - 2)
        real = x.abs().amax(dim=-1) > 0
        return (real & ((logn < lo - step / 2) | (logn > hi + step / 2))).sum()

    def decode_space(self, parts: Parts, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Stored rows in head space: ``sigma * g * c[code]``, float32 ``[B, H, T, D]``."""
        codes = self.unpack(parts["q"])
        ch = torch.arange(self.head_dim, device=codes.device)
        c = self.table.to(codes.device)[ch, codes]
        g = norm_of_code(parts["norm"], state["params"])
        return c * g * _per_head(state["scale"].float(), c)

    def dequantize(self, parts: Parts, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return self.from_space(self.decode_space(parts, state), state).to(dtype)

    # -- embedded refinement (the store's age ladder, ``ladder_tokens``) ----------------------
    @functools.cached_property
    def refinement(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per channel, ``(children [D, 2 * 2^8], splits [D, 2^8])`` of its width's Gaussian levels
        (:func:`gaussian_refined`; a width-0 channel gains one bit: +-0.798). Built on first use, kept."""
        ch = torch.zeros(self.head_dim, 2 ** (GAUSS_MAX_BITS + 1))
        sp = torch.zeros(self.head_dim, 2**GAUSS_MAX_BITS)
        for j, b in enumerate(self.widths.tolist()):
            c, s, _ = gaussian_refined(b)
            ch[j, : len(c)], sp[j, : len(s)] = torch.tensor(c), torch.tensor(s)
        return ch, sp

    @functools.cached_property
    def child_mads(self) -> torch.Tensor:
        """``[D, 2 * 2^8]``: per channel, each refined level's mean absolute residual (:func:`gaussian_refined`)."""
        m = torch.zeros(self.head_dim, 2 ** (GAUSS_MAX_BITS + 1))
        for j, b in enumerate(self.widths.tolist()):
            a = gaussian_refined(b)[2]
            m[j, : len(a)] = torch.tensor(a)
        return m

    def refine(self, x: torch.Tensor, state: dict[str, torch.Tensor], parts: Parts) -> Parts:
        """Refinement parts of rows ``x`` (base parts ``parts``): per channel, the side of its cell's split point
        the whitened, normalised value lies on, and the norm correction (in head space)."""
        _, divisor, _ = self._encode(x, state)  # the scale the base codes were taken at (deterministic)
        u = self._whiten(x, state) / divisor.clamp_min(1e-30)
        codes = self.unpack(parts["q"])
        children, splits = (t.to(x.device) for t in self.refinement)
        ch = torch.arange(self.head_dim, device=x.device)
        bit = (u >= splits[ch, codes]).long()
        c = children[ch, 2 * codes + bit] * _per_head(state["scale"].float(), u)
        y = self.to_space(x, state)
        return {"r": pack_bits(bit, 1),
                "rscale": rscale_code(y, c, norm_of_code(parts["norm"], state["params"]), self.gain)}

    def decode_refined(self, parts: Parts, rparts: Parts, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Refined rows in head space: ``sigma * g * rscale * children[code, bit]``, float32 ``[B, H, T, D]``."""
        codes = self.unpack(parts["q"])
        bit = unpack_bits(rparts["r"], 1, self.head_dim)
        children, _ = self.refinement
        ch = torch.arange(self.head_dim, device=codes.device)
        c = children.to(codes.device)[ch, 2 * codes + bit]
        g = norm_of_code(parts["norm"], state["params"]) * rscale_of_code(rparts["rscale"])
        return c * g * _per_head(state["scale"].float(), c)

    def step2(self, parts: Parts, rparts: Parts, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """The second rung's step per channel (:class:`SecondRung`): the refined level's mean absolute residual
        (Gaussian cells), at the row's refined gain and the channel's spread."""
        codes = self.unpack(parts["q"])
        bit = unpack_bits(rparts["r"], 1, self.head_dim)
        ch = torch.arange(self.head_dim, device=codes.device)
        m = self.child_mads.to(codes.device)[ch, 2 * codes + bit]
        g = norm_of_code(parts["norm"], state["params"]) * rscale_of_code(rparts["rscale"])
        return m * g * _per_head(state["scale"].float(), m)


# ---------------------------------------------------------------------------------------------------------
# Vector codebooks: ``tqv{bits}`` (rotated rows, 2-D blocks of coordinates coded jointly)

VQ_DIM = 2  # coordinates per codeword
VQ_SAMPLES = 1024  # training points per codeword (seeded Gaussian sample)
VQ_SEED = 0x7156


@functools.cache
def gaussian_vq(bits: int, dim: int = VQ_DIM, iters: int = 30) -> torch.Tensor:
    """``2^(bits * dim)`` codewords ``[K, dim]`` (float32) for a standard Gaussian in ``dim`` dims: Lloyd's
    algorithm (k-means) on a seeded sample of ``VQ_SAMPLES * K`` points, started from the product of the scalar
    Lloyd-Max levels (:func:`gaussian_levels`), so it is never worse than the scalar code on that sample.
    Data-oblivious and deterministic (same seed, same codewords); cached per process.

    At 3 bits per coordinate, 2-D, 64 codewords: MSE ~0.0299 per coordinate on a unit Gaussian, against
    0.0345 for the scalar Lloyd-Max code and the rate-distortion bound 2^-6 = 0.0156."""
    if not 1 <= bits <= 4 or dim not in (1, 2, 4) or bits * dim > 12:
        raise ValueError(f"bits: {bits} x dim {dim}: a vector codebook needs 1..4 bits, dim 1/2/4, <= 12 bits a code")
    lv = torch.tensor(gaussian_levels(bits))
    grids = torch.meshgrid(*([lv] * dim), indexing="ij")
    c = torch.stack([g.flatten() for g in grids], dim=1)  # the scalar product code, K x dim
    k = c.shape[0]
    gen = torch.Generator().manual_seed(VQ_SEED * 31 + bits * 7 + dim)
    x = torch.randn(VQ_SAMPLES * k, dim, generator=gen)
    for _ in range(iters):
        a = vq_nearest(x, c)
        n = torch.bincount(a, minlength=k).to(x.dtype)
        s = torch.zeros_like(c).index_add_(0, a, x)
        c = torch.where(n[:, None] > 0, s / n.clamp_min(1)[:, None], c)
    return c.float()


def vq_nearest(x: torch.Tensor, c: torch.Tensor, chunk: int = 1 << 16) -> torch.Tensor:
    """Index ``[N]`` (int64) of the nearest codeword ``c[K, dim]`` to each row of ``x[N, dim]`` (squared
    Euclidean distance, by matmul, ``chunk`` rows at a time)."""
    cc = (c * c).sum(1)
    out = [(cc - 2 * xs @ c.T).argmin(1) for xs in x.split(chunk)]
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device=x.device)


def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Codes ``[..., n]`` of ``width`` bits each -> ``[..., n * width / 8]`` uint8, little-endian bit stream."""
    bit = torch.arange(width, device=codes.device)
    bits = ((codes.long().unsqueeze(-1) >> bit) & 1).flatten(-2)
    return (bits.view(*codes.shape[:-1], -1, 8) << torch.arange(8, device=codes.device)).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits` (``width`` <= 16): ``[..., n * width / 8]`` uint8 -> codes ``[..., n]``
    (int64). A code spans at most three bytes: one gather of a 24-bit word per code, a shift, a mask."""
    dev = packed.device
    start = torch.arange(n, device=dev) * width
    byte, shift = start // 8, start % 8
    p = torch.nn.functional.pad(packed, (0, 2)).long()
    word = p.index_select(-1, byte) | (p.index_select(-1, byte + 1) << 8) | (p.index_select(-1, byte + 2) << 16)
    return (word >> shift) & ((1 << width) - 1)


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


# ---------------------------------------------------------------------------------------------------------
# Embedded refinement (the age ladder's young rows): one more bit per coordinate on top of a stored code

REFINE_ITERS = 200


@functools.cache
def refined_levels(
    levels: tuple[float, ...], head_dim: int
) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """An embedded refinement of the scalar codebook ``levels`` (ascending) for one coordinate of a random unit
    vector in ``head_dim`` dims (the density :func:`lloyd_max_levels` is fitted to): each cell of ``levels``
    (between the midpoints of its neighbours) is split in two by its own 2-level Lloyd-Max quantizer, so that
    ``(children[2 c + bit], splits[c], mads[2 c + bit])``: the two child levels (conditional centroids of the
    density on either side of the split), the split point of cell ``c`` and each child's mean absolute residual.
    Dropping the refinement bit leaves exactly the ``levels`` code (an embedded code: a row ages by dropping a bit
    plane, not by re-coding)."""
    d = head_dim
    grid = torch.linspace(-1.0, 1.0, 40_001, dtype=torch.float64)[1:-1]
    w = torch.exp((d - 3) / 2 * torch.log1p(-grid * grid)) if d > 3 else torch.ones_like(grid)
    return _split_cells(levels, grid, w)


@functools.cache
def gaussian_refined(bits: int) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """:func:`refined_levels` for :func:`gaussian_levels` ``(bits)`` on a unit Gaussian (``tqc`` channels); ``bits``
    0 (a channel stored as its mean): one cell, the whole line, split at 0 into +-0.798."""
    grid = torch.linspace(-9.0, 9.0, 72_001, dtype=torch.float64)
    return _split_cells(gaussian_levels(bits) if bits else (0.0,), grid, torch.exp(-grid * grid / 2))


def _split_cells(
    levels: tuple[float, ...], grid: torch.Tensor, w: torch.Tensor
) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """Each cell of ``levels`` split by its own 2-level Lloyd-Max quantizer for the density ``w`` on ``grid``:
    ``(children, splits, mads)``, ``mads[2 c + bit]`` the mean absolute residual ``E|u - child|`` inside the
    child's half-cell (the step of a second rung's sign bit, :class:`SecondRung`)."""
    lv = torch.tensor(levels, dtype=torch.float64)
    edges = torch.cat([grid[:1] - 1, (lv[1:] + lv[:-1]) / 2, grid[-1:] + 1])
    children, splits, mads = [], [], []
    for c in range(len(levels)):
        inside = (grid >= edges[c]) & (grid < edges[c + 1])
        g, p = grid[inside], w[inside]
        t = float(lv[c])  # start the split at the parent level
        for _ in range(REFINE_ITERS):
            lo, hi = g < t, g >= t
            a = float((g[lo] * p[lo]).sum() / p[lo].sum()) if lo.any() else float(g[0])
            b = float((g[hi] * p[hi]).sum() / p[hi].sum()) if hi.any() else float(g[-1])
            t = (a + b) / 2
        lo, hi = g < t, g >= t
        children += [a, b]
        splits.append(t)
        mads += [float(((g[lo] - a).abs() * p[lo]).sum() / p[lo].sum()) if lo.any() else 0.0,
                 float(((g[hi] - b).abs() * p[hi]).sum() / p[hi].sum()) if hi.any() else 0.0]
    return tuple(children), tuple(splits), tuple(mads)


@functools.cache
def refined_vq(bits: int, dim: int = VQ_DIM, iters: int = 30) -> torch.Tensor:
    """An embedded (tree-structured) refinement of :func:`gaussian_vq` ``(bits, dim)``: ``[K, 2^dim, dim]``, the
    ``2^dim`` children of each codeword (k-means within its Voronoi cell on a seeded unit-Gaussian sample,
    started from the parent +- a quarter of the cell's spread on each axis): one more bit per coordinate, and
    dropping it leaves exactly the ``gaussian_vq`` code. Deterministic; cached per process."""
    c = gaussian_vq(bits, dim)
    k, m = c.shape[0], 2**dim
    gen = torch.Generator().manual_seed(VQ_SEED * 37 + bits * 11 + dim)
    x = torch.randn(VQ_SAMPLES * k, dim, generator=gen)
    parent = vq_nearest(x, c)
    n = torch.bincount(parent, minlength=k).clamp_min(1).to(x.dtype)
    spread = torch.zeros(k, dim).index_add_(0, parent, (x - c[parent]) ** 2) / n[:, None]
    corners = torch.tensor([[1.0 if (j >> i) & 1 else -1.0 for i in range(dim)] for j in range(m)])
    ch = c[:, None, :] + corners[None] * spread.sqrt()[:, None, :] * 0.5  # [K, m, dim]
    for _ in range(iters):
        sub = ((x[:, None, :] - ch[parent]) ** 2).sum(-1).argmin(1)  # [N]
        idx = parent * m + sub
        cnt = torch.bincount(idx, minlength=k * m).to(x.dtype)
        s = torch.zeros(k * m, dim).index_add_(0, idx, x)
        ch = torch.where(cnt[:, None] > 0, s / cnt.clamp_min(1)[:, None], ch.reshape(k * m, dim)).view(k, m, dim)
    return ch.float()


RSCALE_STEP = 1 / 1024  # the refined row's norm correction: a linear byte, 1 + (code - 128) * step (+-12.5%)


def rscale_code(y: torch.Tensor, c: torch.Tensor, n: torch.Tensor, gain: str) -> torch.Tensor:
    """The byte of the factor ``s`` of :func:`row_gain` for ``y`` and ``n * c`` (``n``: the base row's decoded norm).

    A refinement row is ``D`` bits plus this byte. Without it the refined row would reuse the norm fitted to the
    base code: the same mean, but a per-row scale error of ~2.6% (sd, Gaussian rows), which moves a young key's
    largest scores far more than its ~1% error in the other directions."""
    s = torch.where(n > 0, row_gain(y, n * c, gain), torch.ones_like(n))
    return (torch.round((s - 1) / RSCALE_STEP) + 128).clamp(0, 255).to(torch.uint8)


def rscale_of_code(code: torch.Tensor) -> torch.Tensor:
    """The factor a refinement row's byte (:func:`rscale_code`) stands for: ``1 + (code - 128) RSCALE_STEP``."""
    return 1 + (code.float() - 128) * RSCALE_STEP
