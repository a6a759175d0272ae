"""Row helpers shared by the codebook quantizers: the rotation's signs, the 8-bit log norm code and its range,
the row gain, bit packing and the refined row's norm correction byte."""

from __future__ import annotations

import math

import torch

NORM_CODES = 256  # 8-bit log-scaled norm; code 0 = a zero row
GAINS = ("unbiased", "mse")  # how a codebook row's norm is chosen (:func:`row_gain`)
NORM_MARGIN = 2.0  # log2 margin on both sides of the first chunk's norm range (x4 / x0.25)
SHORT_CHUNK = 64  # first chunks with fewer rows per head get NORM_MARGIN + 4
SIGN_SEED = 0x7155


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


def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Codes ``[..., n]`` of ``width`` bits each -> ``[..., n * width / 8]`` uint8, little-endian bit stream."""
    bit = torch.arange(width, device=codes.device)
    bits = ((codes.long().unsqueeze(-1) >> bit) & 1).flatten(-2)
    return (bits.view(*codes.shape[:-1], -1, 8) << torch.arange(8, device=codes.device)).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits` (``width`` <= 16): ``[..., n * width / 8]`` uint8 -> codes ``[..., n]``
    (int64). A code spans at most three bytes: one gather of a 24-bit word per code, a shift, a mask."""
    dev = packed.device
    if 8 % width == 0:  # whole codes per byte: one shift per code slot of a byte
        shift = torch.arange(0, 8, width, device=dev)
        return ((packed.long().unsqueeze(-1) >> shift) & ((1 << width) - 1)).flatten(-2)[..., :n]
    start = torch.arange(n, device=dev) * width
    byte, shift = start // 8, start % 8
    p = torch.nn.functional.pad(packed, (0, 2)).long()
    word = p.index_select(-1, byte) | (p.index_select(-1, byte + 1) << 8) | (p.index_select(-1, byte + 2) << 16)
    return (word >> shift) & ((1 << width) - 1)


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
