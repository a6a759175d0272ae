"""Trellis-coded rotated rows: ``tqt{bits}`` (QTIP-style bit-shift trellis on :class:`Codebook`'s head space).

Same rotation, per-channel mean and 8-bit log norm as ``tq{bits}`` / ``tqv{bits}``, and the same bytes
(``bits`` per coordinate, packed, plus one norm byte per row), but the ``D`` coordinates of the unit row are
coded *jointly along the row* by a bit-shift trellis:

* the row's codes form one circular little-endian bit stream of ``k D`` bits (``k = bits``);
* coordinate ``j`` is reconstructed as ``table[s_j]``, where the *state* ``s_j`` is the ``L``-bit window of the
  stream that ends at bit ``k (j + 1)`` (read circularly: the first windows wrap to the end of the row, so
  there are no extra start bits, "tail-biting"); consecutive windows overlap by ``L - k`` bits;
* the encoder picks the whole stream that minimises the squared error ``sum_j (u_j - table[s_j])^2`` with the
  Viterbi algorithm over the ``2^L`` states (each state has ``2^k`` predecessors), run twice for the
  tail-biting constraint: a free pass over the ``2 BOUNDARY`` coordinates around the row's wrap-around picks the
  wrapped bits with context on both sides, the second pass pins them (pinning the free end of a plain pass instead
  costs ~25% more MSE at 3 bits).

The ``2^L``-entry table is data-oblivious (Lloyd's algorithm with Viterbi assignments on a seeded Gaussian
sample, :func:`trellis_table`): one per width for every head, like ``tqv``'s codewords. Granularity: per token
and KV head (one norm), the code shared along the row by the trellis. MSE on unit-Gaussian coordinates
(``benchmarks`` / tests): ~0.022 at 3 bits against 0.0345 for the scalar Lloyd-Max code, 0.030 for ``tqv3``'s
2-D code and the rate-distortion bound 0.0156. Decode is one ``L``-bit window and one table lookup per
coordinate (the kernels: :func:`~kvquant.kernels.triton_codebook.tqt_tile`); encode costs ~``1.5 D 2^L``
operations per row (two Viterbi passes), far more than ``tq``'s: cheap for one decoded token, slow for long
prefills on a CPU (SmolLM2-135M: minutes per 1K-token prefill on 2 loaded cores).

The age ladder (``ladder_tokens``) refines a young row by one bit per coordinate: the sign of the coordinate's
residual against its trellis value, which then moves by ``+-delta`` (:func:`residual_step`). ~0.36x the trellis code's
MSE (``tq``'s cell split: ~0.26x of a larger error), and dropping the bits leaves the trellis code.
"""

from __future__ import annotations

import functools
import math

import torch

from .base import Parts
from .codebook import (
    Codebook,
    Refinable,
    VectorCodebook,
    check_gain,
    code_of_norm,
    norm_of_code,
    pack_bits,
    row_gain,
    rscale_code,
    rscale_of_code,
    unpack_bits,
)

TRELLIS_PREFIX = "tqt"
#: state bits ``L`` per code width ``k``: ``L - k`` = 6 bits carried from one coordinate to the next
STATE_BITS = {2: 8, 3: 9, 4: 10}
TRAIN_ROWS = 2048  # seeded Gaussian rows of TRAIN_LEN coordinates the table is trained on
TRAIN_LEN = 64
TRAIN_ITERS = 8
TRELLIS_SEED = 0x7157
RESIDUAL_ROWS = 1024  # seeded unit rows the refinement step (:func:`residual_step`) is measured on
VITERBI_CHUNK = 512  # rows per Viterbi pass (distances and back pointers: ~D * rows * 2^L * 4 bytes)
BOUNDARY = 16  # coordinates on each side of the row's wrap-around that the first (free) encoder pass looks at


def viterbi(u: torch.Tensor, table: torch.Tensor, k: int, pin: torch.Tensor | None = None) -> torch.Tensor:
    """States ``[N, T]`` (int64) of the trellis path minimising ``sum_t (u[:, t] - table[s_t])^2`` for rows
    ``u[N, T]``. State ``s_t`` holds the stream bits ``[k (t + 1) - L, k (t + 1))``; its top ``k`` bits are code
    ``t``, its low ``L - k`` bits are the top bits of ``s_{t-1}``. ``pin[N]`` (tail-biting): the low ``L - k``
    bits of ``s_0`` and the top ``L - k`` bits of ``s_{T-1}`` both equal ``pin`` (None: free start and end)."""
    N, T = u.shape
    S = table.numel()
    L = S.bit_length() - 1
    c = L - k  # carried bits
    C, K = 1 << c, 1 << k
    dev = u.device
    tab = table.to(device=dev, dtype=u.dtype)
    dist = (u.unsqueeze(-1) - tab) ** 2  # [N, T, S]; state s = new << c | carried
    cost = dist[:, 0]
    if pin is not None:
        carried = torch.arange(S, device=dev) & (C - 1)
        cost = torch.where(carried[None, :] == pin[:, None], cost, torch.full_like(cost, math.inf))
    back = []
    for t in range(1, T):
        # predecessor of s: p = (s's carried bits) << k | j, j in [0, 2^k): p viewed as [carried, j]
        m, j = cost.view(N, C, K).min(dim=2)
        back.append(j)
        cost = (dist[:, t].view(N, K, C) + m.unsqueeze(1)).view(N, S)
    if pin is not None:
        top = torch.arange(S, device=dev) >> k
        cost = torch.where(top[None, :] == pin[:, None], cost, torch.full_like(cost, math.inf))
    s = cost.argmin(dim=1, keepdim=True)
    states = [s]
    for t in range(T - 1, 0, -1):
        cr = s & (C - 1)
        s = (cr << k) | back[t - 1].gather(1, cr)
        states.append(s)
    return torch.cat(states[::-1], dim=1)


def encode(u: torch.Tensor, table: torch.Tensor, k: int) -> torch.Tensor:
    """Tail-biting trellis codes ``[N, T]`` (int64, ``k`` bits each) for rows ``u[N, T]``: a free pass picks the
    wrapped bits, a pinned pass makes the circular stream consistent (two Viterbi passes)."""
    L = table.numel().bit_length() - 1
    T = u.shape[1]
    out = []
    for x in u.split(VITERBI_CHUNK):
        # the wrapped bits, chosen where they sit mid-sequence: a free pass over the BOUNDARY coordinates on either
        # side of the wrap-around (pinning a plain pass's own last state instead costs ~+25% MSE at 3 bits: it was
        # chosen with no context after it; a trellis path forgets its start within a few windows)
        w = min(T // 2, BOUNDARY)
        mid = viterbi(torch.roll(x, w, dims=1)[:, : 2 * w], table, k)[:, w - 1]
        pinned = viterbi(x, table, k, pin=mid >> k)
        out.append(pinned >> (L - k))
    return torch.cat(out) if out else torch.zeros(0, u.shape[1], dtype=torch.long, device=u.device)


def states_of(codes: torch.Tensor, k: int, L: int) -> torch.Tensor:
    """The states ``[..., T]`` a circular stream of ``k``-bit codes ``[..., T]`` gives (inverse of the encoder's
    choice): ``s_t = sum_i code_{t - i} << (L - k - i k)`` over the codes inside the window, wrapping around."""
    s = torch.zeros_like(codes)
    for i in range(-(-L // k)):  # codes t, t-1, ... (circularly) inside the window, at bit L - k - i k
        shift = L - k - i * k
        part = torch.roll(codes, i, dims=-1)
        s = s | ((part << shift) if shift >= 0 else (part >> -shift))
    return s & ((1 << L) - 1)


@functools.cache
def trellis_table(bits: int) -> torch.Tensor:
    """The ``2^L`` reconstruction values (float32, unit-Gaussian scale; ``L = STATE_BITS[bits]``) of the
    ``bits``-bit trellis: Lloyd's algorithm with Viterbi assignments (free start) on ``TRAIN_ROWS`` seeded
    Gaussian rows, started from the Gaussian quantiles in a seeded order. Deterministic; cached per process."""
    if bits not in STATE_BITS:
        raise ValueError(f"bits: {bits} is not supported by the trellis quantizer ({', '.join(map(str, STATE_BITS))})")
    L = STATE_BITS[bits]
    S = 1 << L
    gen = torch.Generator().manual_seed(TRELLIS_SEED * 17 + bits)
    q = (torch.arange(S, dtype=torch.float64) + 0.5) / S
    table = (torch.special.ndtri(q)[torch.randperm(S, generator=gen)]).float()
    x = torch.randn(TRAIN_ROWS, TRAIN_LEN, generator=gen)
    for _ in range(TRAIN_ITERS):
        st = viterbi(x, table, bits).flatten()
        n = torch.bincount(st, minlength=S).float()
        s = torch.zeros(S).index_add_(0, st, x.flatten())
        table = torch.where(n > 0, s / n.clamp_min(1), table)
    return table


class TrellisCodebook(Refinable):
    """``tqt{bits}``: :class:`Codebook`'s rotation, mean and 8-bit log norm; the unit row coded by a tail-biting
    bit-shift trellis of ``2^L`` states (see the module doc). Same bytes as ``tq{bits}`` / ``tqv{bits}``.
    Read by the torch path and in-kernel by the Triton decode / chunk kernels
    (:func:`~kvquant.kernels.triton_codebook.tqt_tile`: three bytes, a shift and a mask per channel, one lookup)."""

    static = True
    space = True
    center = True

    def __init__(self, head_dim: int, bits: int = 3, gain: str = "unbiased") -> None:
        super().__init__(head_dim)
        self.gain = check_gain(gain)
        if bits not in STATE_BITS:
            raise ValueError(f"bits: {bits} is not supported by the trellis quantizer (2, 3 or 4)")
        if head_dim & (head_dim - 1) or head_dim < 8:
            raise ValueError(f"head_dim: {head_dim} is not a power of two >= 8; tqt{bits} rotates by Hadamard")
        self.bits = bits
        self.state_bits = STATE_BITS[bits]
        if head_dim * bits < self.state_bits:
            raise ValueError(f"head_dim: {head_dim} too short for a {self.state_bits}-bit trellis window")
        self.table = trellis_table(bits) / math.sqrt(head_dim)
        self.name = f"{TRELLIS_PREFIX}{bits}"
        self.granularity = (
            f"per token and KV head: randomized Hadamard rotation, 8-bit log norm, tail-biting {2**self.state_bits}"
            f"-state bit-shift trellis, {bits} bits per coordinate"
        )

    to_space = Codebook.to_space
    query_to_space = Codebook.query_to_space
    from_space = Codebook.from_space
    per_sequence = Codebook.per_sequence
    fit = VectorCodebook.fit
    parts = VectorCodebook.parts  # b D / 8 bytes of codes and one norm byte per row, like tq{b} / tqv{b}

    def quantize(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Parts:
        y = self.to_space(x, state)
        u = y / y.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        codes = encode(u.reshape(-1, self.head_dim), self.table, self.bits).view(y.shape)
        c = self.table.to(x.device)[states_of(codes, self.bits, self.state_bits)]
        ncode = code_of_norm(row_gain(y, c, self.gain), state["params"], x)
        return {"q": pack_bits(codes, self.bits), "norm": ncode}

    def clipped(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Rows of ``x`` whose norm falls outside the 8-bit norm code's range (stored at its nearest end)."""
        return Codebook.clipped(self, x, state)

    def decode_space(self, parts: Parts, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Stored rows in head space: ``norm * table[s_j]``, float32 ``[B, H, T, D]``."""
        return self._unit(parts) * norm_of_code(parts["norm"], state["params"])

    def dequantize(self, parts: Parts, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return self.from_space(self.decode_space(parts, state), state).to(dtype)

    def _unit(self, parts: Parts) -> torch.Tensor:
        """The stored rows' unit-scale values ``table[s_j]``, float32 ``[B, H, T, D]``."""
        codes = unpack_bits(parts["q"], self.bits, self.head_dim)
        return self.table.to(codes.device)[states_of(codes, self.bits, self.state_bits)]

    # -- embedded refinement (the store's age ladder, ``ladder_tokens``; see the module doc) --------
    def refine(self, x: torch.Tensor, state: dict[str, torch.Tensor], parts: Parts) -> Parts:
        """Refinement parts of rows ``x`` whose base parts are ``parts``: one bit per coordinate, the sign of the
        row's residual against its decoded trellis code, and the norm correction (as ``tq``'s)."""
        y = self.to_space(x, state)
        n = norm_of_code(parts["norm"], state["params"])
        c = self._unit(parts)
        bit = (y >= n * c).long()
        cr = c + (2 * bit - 1) * residual_step(self.bits, self.head_dim)
        return {"r": pack_bits(bit, 1), "rscale": rscale_code(y, cr, n, self.gain)}

    def decode_refined(self, parts: Parts, rparts: Parts, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Refined rows in head space, float32 ``[B, H, T, D]``: ``norm * rscale * (table[s_j] +- delta)``."""
        c = self._unit(parts)
        sign = 2 * unpack_bits(rparts["r"], 1, self.head_dim) - 1
        norm = norm_of_code(parts["norm"], state["params"]) * rscale_of_code(rparts["rscale"])
        return (c + sign * residual_step(self.bits, self.head_dim)) * norm

    def step2(self, parts: Parts, rparts: Parts, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """The second rung's step (:class:`~kvquant.quantizers.codebook.SecondRung`): :func:`residual_step2` at the
        row's refined norm, the same for every coordinate."""
        norm = norm_of_code(parts["norm"], state["params"]) * rscale_of_code(rparts["rscale"])
        return norm * residual_step2(self.bits, self.head_dim)


def _coded_unit_rows(bits: int, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``RESIDUAL_ROWS`` seeded random unit rows ``u`` of ``head_dim``, their trellis values ``c`` and the
    least-squares row gains ``g`` (what :func:`residual_step` and :func:`residual_step2` are measured on)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(RESIDUAL_ROWS, head_dim, generator=gen)
    u = u / u.norm(dim=1, keepdim=True)
    table = trellis_table(bits) / math.sqrt(head_dim)
    c = table[states_of(encode(u, table, bits), bits, STATE_BITS[bits])]
    return u, c, _ls_gain(u, c)


def _ls_gain(u: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return (u * c).sum(1, keepdim=True) / (c * c).sum(1, keepdim=True).clamp_min(1e-30)


@functools.cache
def residual_step(bits: int, head_dim: int) -> float:
    """The refinement step ``delta`` of :class:`TrellisCodebook` ``(bits)`` rows of ``head_dim``: the mean absolute
    residual ``|u_j - g c_j|`` of seeded random unit rows ``u`` against their codes ``c`` (``g``: the least-squares
    row gain), the step that minimises the squared error of a sign-of-residual bit. Deterministic; cached."""
    u, c, g = _coded_unit_rows(bits, head_dim, TRELLIS_SEED * 23 + bits * 5 + head_dim)
    return float((u - g * c).abs().mean())


@functools.cache
def residual_step2(bits: int, head_dim: int) -> float:
    """The second rung's step of :class:`TrellisCodebook` ``(bits)`` rows of ``head_dim``: the mean absolute residual
    of seeded random unit rows against their refined decode (first-rung sign bit at :func:`residual_step`, then the
    least-squares row gain), in units of that gain. Deterministic; cached."""
    u, c, g = _coded_unit_rows(bits, head_dim, TRELLIS_SEED * 29 + bits * 7 + head_dim)
    c1 = c + torch.where(u >= g * c, 1.0, -1.0) * residual_step(bits, head_dim)
    g1 = _ls_gain(u, c1)
    return float(((u - g1 * c1) / g1).abs().mean())


__all__ = [
    "TRELLIS_PREFIX", "TrellisCodebook", "encode", "residual_step", "residual_step2", "states_of", "trellis_table",
    "viterbi",
]
