"""Per-channel-width codebook keys ``tqc-<widths>`` (keys of RoPE models): :class:`ChannelCodebook`."""

from __future__ import annotations

import functools
import math

import torch

from ..base import Parts, PartSpec
from .rows import (
    NORM_CODES,
    _per_head,
    check_gain,
    code_of_norm,
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
    GAUSS_MAX_BITS,
    gaussian_levels,
    gaussian_refined,
)

CHANNEL_PREFIX = "tqc-"
SEARCH_SCALES = (1.0, 1.25, 1.5, 2.0, 2.5)  # ChannelCodebook's row scales tried, times the row's RMS norm (search)


def channel_precision(widths: list[int]) -> str:
    """The config precision name of a :class:`ChannelCodebook` with these per-channel widths."""
    return CHANNEL_PREFIX + "".join(str(int(b)) for b in widths)


class ChannelCodebook(Refinable):
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
    @functools.cached_property
    def _bounds(self) -> torch.Tensor:
        """``[D, 2^8 - 1]``: each channel's decision boundaries (midpoints of its width's levels), ascending, padded
        with +inf (:meth:`_code`)."""
        bounds = torch.full((self.head_dim, 2**GAUSS_MAX_BITS - 1), math.inf)
        for j, b in enumerate(self.widths.tolist()):
            if b:
                lv = torch.tensor(gaussian_levels(b))
                bounds[j, : len(lv) - 1] = (lv[1:] + lv[:-1]) / 2
        return bounds

    def _code(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Nearest level of each channel's width for unit-scale rows ``u[..., D]``: ``(codes, levels)``; one
        batched search over every channel's own boundaries (a NaN takes the outermost code)."""
        dev = u.device
        flat = u.reshape(-1, self.head_dim).t().contiguous()  # [D, rows]
        codes = torch.searchsorted(self._bounds.to(dev, u.dtype), flat).t().reshape(u.shape)
        codes = torch.minimum(codes, self._mask.to(dev))
        ch = torch.arange(self.head_dim, device=dev)
        return codes, self.table.to(dev, u.dtype)[ch, codes]

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
