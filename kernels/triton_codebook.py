"""Codebook (``tq*``) reads for the Triton decode and chunk kernels.

A codebook-stored head (:mod:`kvquant.quantizers.codebook`) keeps its rows in its own *head space*
``y = H (s * (x - mu))``: the dispatcher rotates the queries once per step and maps the output of a
V head back once, so the kernels never un-rotate a key. Each stored row is ``b``-bit codes packed
exactly like int4/3/2 (:func:`~kernels.triton_dequant.load_tile` unpacks them) plus one 8-bit log
norm code; the row is ``norm * level[code]``.

Per-channel-width keys ``tqc-<widths>`` (:class:`~kvquant.quantizers.codebook.ChannelCodebook`, kind
:data:`KIND_TQC`) live in the head space ``x - mu`` (queries unchanged, the dispatcher maps the fresh and
dense rows there): a stored row is ``g * sigma_j * level_{w_j}[code_j]``, its codes packed channel-major
(channel ``j`` at bit ``start_j = w_0 + .. + w_{j-1}`` of the row, LSB first). Each channel's code is one or
two bytes of the row (``start_j // 8``, the next one only when the code crosses a byte), shifted by
``start_j % 8`` and masked to ``w_j`` bits, then looked up in the Gaussian Lloyd-Max levels of width
``w_j`` (widths 1..8 back to back, 510 values: level ``c`` of width ``w`` at ``2^w - 2 + c``; width 0
reads a zero). All of it comes from one fp32 row per (sequence, head), :func:`tqc_rows`::

    [lo, step, sigma_0 .. sigma_{D-1}, info_0 .. info_{D-1}, levels (512)]

``lo, step`` are the 8-bit log norm's range (read by :func:`codebook_norms`, as for ``tq*``), ``sigma``
the channel spreads, ``info_j`` (int32 bits) = ``byte | shift << 8 | width << 12 | base << 16`` the
channel's byte, shift, width and level base. :func:`tqc_tile` dequantizes a tile in registers.

2-D vector codebooks ``tqv{b}`` (:class:`~kvquant.quantizers.codebook.VectorCodebook`, kind :data:`KIND_TQV`) live
in ``tq{b}``'s head space (rotated, queries rotated once per step): a stored row is ``norm * c[code_p][j % 2]``,
pair ``p = j // 2`` of channels ``2p, 2p + 1`` coded jointly by one ``W = 2b``-bit code, packed as a little-endian
bit stream (pair ``p`` at bit ``p * W``: one byte, or two for ``tqv3``'s 6-bit codes that cross a byte), into a
table of ``2^W`` codewords of two coordinates. One fp32 row per (sequence, head), :func:`tqv_rows`::

    [lo, step, c_0[0], c_0[1], c_1[0], .. , c_{2^W - 1}[1]]      (2 + 2^(W + 1) values: 34 / 130 / 514)

:func:`tqv_tile` dequantizes a tile in registers (each channel reads its pair's code, then one coordinate).

Trellis codes ``tqt{b}`` (:class:`~kvquant.quantizers.trellis.TrellisCodebook`, kind :data:`KIND_TQT`) live in the same
head space: a row's ``b D`` bits are one circular little-endian stream, channel ``j`` reads the ``L = b + 6``-bit
window ending at bit ``b (j + 1)`` (the first windows wrap to the row's end) and looks it up in a table of ``2^L``
values; one fp32 row per (sequence, head), :func:`table_rows`: ``[lo, step, table_0 .. table_{2^L - 1}]``.
:func:`tqt_tile` reads three bytes per channel (the window never spans more), shifts and masks.

What the kernels read per (sequence, head), from the quantizer's ``params`` row
``[lo, step, level_0 .. level_{2^b - 1}]`` (fp32, ``2 + 2^b`` values, a few hundred bytes in L1):

* :func:`codebook_row` -- the row's address (``pid = b * Hg + head``);
* :func:`codebook_levels` -- ``level[code]`` for a tile of codes (a gather from that tiny table);
* :func:`codebook_norms` -- the per-token norms ``2^(lo + step * (c - 1))`` (code 0: a zero row),
  folded like int8-token's per-token scale: on the score column (K) or the probability column (V).

:func:`codebook_operand` describes one codebook store as kernel arguments.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kvquant.snapshot import PartSnapshot

from .unsupported import Unsupported

KIND_CODEBOOK = 8  # tq4/3/2: codes packed as INTN, value = level[code] * norm[token], in the head's space
KIND_TQC = 9  # tqc-<widths>: per-channel widths, value = level_w[code] * sigma[channel] * norm[token]
TQC_LEVELS = 512  # the level table of a tqc row: widths 1..8 back to back (510 values), then zeros (width 0)
TQC_ZERO = 510  # level base of a width-0 channel (its code is 0: it reads a zero, the channel's mean)
KIND_TQV = 10  # tqv{b}: a 2b-bit code per pair of channels, value = codeword[code][j % 2] * norm[token]
KIND_TQT = 11  # tqt{b}: a circular b-bit code stream, value = table[L-bit window ending at code j] * norm[token]
TQT_CARRIED = 6  # tqt's window is b + 6 bits (kvquant.quantizers.trellis.STATE_BITS)


@triton.jit
def codebook_row(params, pid, BITS: tl.constexpr):
    """Address of the ``params`` row of (sequence, head) ``pid = b * Hg + hg`` (rows of ``2 + 2^BITS``)."""
    return params + pid.to(tl.int64) * (2 + (1 << BITS))


@triton.jit
def codebook_levels(row, code):
    """``level[code]`` (float32) for an integer tile of codes, from the params row ``row``."""
    return tl.load(row + 2 + code).to(tl.float32)


@triton.jit
def codebook_norms(n_ptr, n_rows, mask_n, row):
    """Row norms ``[BLOCK_N]`` from their 8-bit log codes at offsets ``n_rows`` (0 outside ``mask_n``)."""
    c = tl.load(n_ptr + n_rows, mask=mask_n, other=0).to(tl.float32)
    lo = tl.load(row).to(tl.float32)
    step = tl.load(row + 1).to(tl.float32)
    return tl.where(c > 0, tl.exp2(lo + step * (c - 1.0)), 0.0)


def codebook_operand(store: PartSnapshot, main: torch.Tensor, operand_cls: type):
    """``operand_cls`` (:class:`~kernels.triton_dequant.Operand`) for a codebook store: the codes, the
    norm codes as the per-token part, and the fp32 ``params`` rows ``[B, Hg, 2 + 2^b]`` as the head part."""
    qz = store.quantizer
    norm = norm_part(store, main)
    if qz.head_dim % 8:
        raise Unsupported(f"{qz.describe()}: head_dim {qz.head_dim} not a multiple of the packing")
    params = store.state.get("params")
    width = 2 + 2**qz.bits
    if params is None:  # not fitted yet: nothing is in the pool, nothing is read
        params = torch.zeros(store.batch, store.heads, width, device=main.device)
    params = params.float().contiguous()
    if params.shape != (store.batch, store.heads, width):
        raise Unsupported(f"{qz.describe()}: codebook state {tuple(params.shape)} not per (sequence, head)")
    return operand_cls(main, norm, main, params, KIND_CODEBOOK, bits=qz.bits)


def norm_part(store: PartSnapshot, main: torch.Tensor) -> torch.Tensor:
    """A codebook store's 8-bit log norm codes ``[blocks, H, block_size, 1]``, checked against the codes ``main``."""
    norm = store.parts["norm"]
    if norm.dim() != 4 or norm.shape[:3] != main.shape[:3]:
        raise Unsupported(f"{store.quantizer.describe()}: norm part not [blocks, H, block_size, 1]")
    return norm


def cached_head_rows(
    store: PartSnapshot, names: tuple[str, ...], device: torch.device, build: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """``build()``'s rows for ``store`` (kept in its :class:`~kvquant.snapshot.RowsMemo`, which stays with the K or V
    store across snapshots), built again only when its state entries ``names`` (compared by identity: state tensors
    are replaced, never modified in place), its batch or ``device`` change."""
    return store.memo.get(tuple(store.state.get(n) for n in names), (store.batch, device), build)


@triton.jit
def part_bases(P, S, Z, PH, sh, ssh, hg, pid, KIND: tl.constexpr, BITS: tl.constexpr, D: tl.constexpr = 0):
    """Head ``hg``'s pointers to a part, its scale and its zero (block 0); for a codebook part (``KIND`` 8)
    the third is the (sequence, head)'s params row instead (norm code range, levels); for ``tqc`` (``KIND``
    9, head_dim ``D``) its :func:`tqc_rows` row; for ``tqv`` / ``tqt`` (``KIND`` 10 / 11) its :func:`table_rows` row."""
    h = hg.to(tl.int64)  # head strides of a head-major pool can exceed 2^31 elements
    # one return: compiled, a return under a constexpr branch still meets the later one ("return type mismatch")
    if KIND == 8:  # noqa: SIM108  (a statement, not a ternary: constexpr branches are compiled apart)
        third = codebook_row(PH, pid, BITS)
    elif KIND == 9:
        third = PH + pid.to(tl.int64) * (2 + 2 * D + 512)
    elif KIND == 10:
        third = PH + pid.to(tl.int64) * (2 + (2 << (2 * BITS)))
    elif KIND == 11:
        third = PH + pid.to(tl.int64) * (2 + (1 << (BITS + 6)))
    else:
        third = Z + h * ssh
    return P + h * sh, S + h * ssh, third


# ------------------------------------------------------------------------------- tqc: per-channel widths
@functools.cache
def tqc_level_table() -> torch.Tensor:
    """The Gaussian Lloyd-Max levels of widths 1..8 back to back (level ``c`` of width ``w`` at ``2^w - 2 + c``),
    then zeros: fp32 ``[TQC_LEVELS]`` on the CPU."""
    from kvquant.quantizers.codebook import GAUSS_MAX_BITS, gaussian_levels

    table = torch.zeros(TQC_LEVELS)
    for w in range(1, GAUSS_MAX_BITS + 1):
        table[2**w - 2 : 2**w - 2 + 2**w] = torch.tensor(gaussian_levels(w))
    return table


def tqc_channel_info(widths: torch.Tensor) -> torch.Tensor:
    """Per channel of a ``tqc`` row with these widths ``[D]``: int32 ``byte | shift << 8 | width << 12 |
    base << 16`` (the byte holding the code's first bit, the bit in it, the width, the level base). A width-0
    channel reads byte 0 (its code is masked to nothing): a trailing one would otherwise point past the row."""
    w = widths.long().cpu()
    start = torch.where(w > 0, torch.cumsum(w, 0) - w, torch.zeros_like(w))
    base = torch.where(w > 0, (1 << w) - 2, torch.full_like(w, TQC_ZERO))
    return ((start // 8) | (start % 8) << 8 | w << 12 | base << 16).to(torch.int32)


def tqc_rows(qz, state: dict[str, torch.Tensor], batch: int, heads: int, device: torch.device) -> torch.Tensor:
    """The fp32 rows ``[batch, heads, 2 + 2D + TQC_LEVELS]`` the kernels read for a ``tqc`` store (see the module
    doc) from the quantizer ``qz`` and its state (``params [B, H, 2]``, ``scale [B, H, D]``; not fitted yet:
    zeros, nothing is in the pool)."""
    D = qz.head_dim
    bits = torch.zeros(batch, heads, 2 + 2 * D + TQC_LEVELS, dtype=torch.int32, device=device)
    rows = bits.view(torch.float32)  # the info words are written as int32 (bit patterns, never float-copied)
    params, scale = state.get("params"), state.get("scale")
    if params is not None and scale is not None:
        if params.shape != (batch, heads, 2) or scale.shape != (batch, heads, D):
            raise Unsupported(f"{qz.describe()}: tqc state {tuple(params.shape)} / {tuple(scale.shape)} not per "
                              f"(sequence, head)")  # fmt: skip
        rows[..., :2] = params.float()
        rows[..., 2 : 2 + D] = scale.float()
    bits[..., 2 + D : 2 + 2 * D] = tqc_channel_info(qz.widths).to(device)
    rows[..., 2 + 2 * D :] = tqc_level_table().to(device)
    return rows


def tqc_operand(store: PartSnapshot, main: torch.Tensor, operand_cls: type):
    """``operand_cls`` (:class:`~kvquant.kernels.triton_dequant.Operand`) for a ``tqc`` store: the codes, the norm
    codes as the per-token part, and the :func:`tqc_rows` rows as the head part. The rows are built once per
    state (the state is static: fitted on the first chunk): :func:`cached_head_rows`."""
    qz = store.quantizer
    norm = norm_part(store, main)
    rows = cached_head_rows(store, ("params", "scale"), main.device,
                            lambda: tqc_rows(qz, store.state, store.batch, store.heads, main.device))  # fmt: skip
    return operand_cls(main, norm, main, rows, KIND_TQC, bits=8)


@triton.jit
def tqc_tile(ptr, row, rows, m2, offs_d, D: tl.constexpr):
    """Float32 ``[BLOCK_N, D]`` head-space tile ``sigma_j * level_{w_j}[code_j]`` (no row norm: a token scale,
    see :func:`codebook_norms`) of the ``tqc`` rows at element offsets ``rows`` from ``ptr`` (rows outside
    ``m2 [BLOCK_N, 1]`` read code 0); ``row``: the (sequence, head)'s :func:`tqc_rows` row."""
    info = tl.load(row.to(tl.pointer_type(tl.int32)) + 2 + D + offs_d)
    sigma = tl.load(row + 2 + offs_d).to(tl.float32)
    byte = info & 255
    shift = (info >> 8) & 7
    width = (info >> 12) & 15
    base = info >> 16
    addr = ptr + rows[:, None] + byte[None, :]
    b0 = tl.load(addr, mask=m2, other=0).to(tl.int32)
    # the next byte only where the code crosses into it (then it is inside the row)
    b1 = tl.load(addr + 1, mask=m2 & ((shift + width) > 8)[None, :], other=0).to(tl.int32)
    code = ((b0 | (b1 << 8)) >> shift[None, :]) & ((1 << width) - 1)[None, :]
    lv = tl.load(row + 2 + 2 * D + base[None, :] + code).to(tl.float32)
    return lv * sigma[None, :]


# ------------------------------------------------------------------------------- tqv: 2-D vector codebooks
def table_rows(qz, state: dict[str, torch.Tensor], batch: int, heads: int, device: torch.device,
               table: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The fp32 rows ``[batch, heads, 2 + table.numel()]`` the kernels read for a ``tqv`` / ``tqt`` store: the norm code
    range ``params [B, H, 2]`` of the state (not fitted yet: zeros, nothing is in the pool), then the quantizer's
    constant ``table`` flattened (row-major)."""
    rows = torch.zeros(batch, heads, 2 + table.numel(), device=device)
    params = state.get("params")
    if params is not None:
        if params.shape != (batch, heads, 2):
            raise Unsupported(f"{qz.describe()}: {qz.name} state {tuple(params.shape)} not per (sequence, head)")
        rows[..., :2] = params.float()
    rows[..., 2:] = table.float().to(device).flatten()
    return rows


def tqv_rows(qz, state: dict[str, torch.Tensor], batch: int, heads: int, device: torch.device) -> torch.Tensor:
    """The fp32 rows ``[batch, heads, 2 + 2^(2b + 1)]`` the kernels read for a ``tqv{b}`` store (see the module doc):
    the norm code range, then the quantizer's codewords ``[2^(2b), 2]`` row-major (:func:`table_rows`)."""
    cw = qz.codewords
    if cw.shape != (2 ** (2 * qz.bits), 2):
        raise Unsupported(f"{qz.describe()}: codewords {tuple(cw.shape)} are not 2-D codes of {2 * qz.bits} bits")
    return table_rows(qz, state, batch, heads, device, cw)


def table_operand(
    store: PartSnapshot, main: torch.Tensor, operand_cls: type, kind: int, build: Callable[[], torch.Tensor]
):
    """``operand_cls`` (:class:`~kvquant.kernels.triton_dequant.Operand`) for a ``tqv`` / ``tqt`` store: the codes, the
    norm codes as the per-token part, and ``build()``'s rows as the head part (built once per state:
    :func:`cached_head_rows`, as for ``tqc``)."""
    qz = store.quantizer
    norm = norm_part(store, main)
    if qz.head_dim % 8:
        raise Unsupported(f"{qz.describe()}: head_dim {qz.head_dim} not a multiple of 8 (whole bytes per row)")
    rows = cached_head_rows(store, ("params",), main.device, build)
    return operand_cls(main, norm, main, rows, kind, bits=qz.bits)


def tqv_operand(store: PartSnapshot, main: torch.Tensor, operand_cls: type):
    """:func:`table_operand` for a ``tqv`` store (:func:`tqv_rows`)."""
    qz = store.quantizer
    if qz.dim != 2:
        raise Unsupported(f"{qz.describe()}: {qz.dim}-D codes: only pairs")
    return table_operand(store, main, operand_cls, KIND_TQV,
                         lambda: tqv_rows(qz, store.state, store.batch, store.heads, main.device))  # fmt: skip


@triton.jit
def tqv_tile(ptr, row, rows, m2, offs_d, BITS: tl.constexpr):
    """Float32 ``[BLOCK_N, D]`` head-space tile ``c[code_{j // 2}][j % 2]`` (no row norm: a token scale, see
    :func:`codebook_norms`) of the ``tqv{BITS}`` rows at element offsets ``rows`` from ``ptr`` (rows outside
    ``m2 [BLOCK_N, 1]`` read code 0); ``row``: the (sequence, head)'s :func:`tqv_rows` row."""
    W: tl.constexpr = 2 * BITS  # bits of one pair's code
    start = (offs_d // 2) * W  # the pair's first bit in the row
    addr = ptr + rows[:, None] + (start // 8)[None, :]
    word = tl.load(addr, mask=m2, other=0).to(tl.int32)
    if 8 % W != 0:  # 6-bit codes (tqv3) may cross into the next byte (then it is inside the row)
        word = word | (tl.load(addr + 1, mask=m2 & ((start % 8) + W > 8)[None, :], other=0).to(tl.int32) << 8)
    code = (word >> (start % 8)[None, :]) & ((1 << W) - 1)
    return tl.load(row + 2 + 2 * code + (offs_d % 2)[None, :]).to(tl.float32)


# ------------------------------------------------------------------------------- tqt: bit-shift trellis codes
def tqt_operand(store: PartSnapshot, main: torch.Tensor, operand_cls: type):
    """:func:`table_operand` for a ``tqt`` store: rows ``[lo, step, table (2^L values)]``."""
    qz = store.quantizer
    if qz.state_bits != qz.bits + TQT_CARRIED or qz.state_bits > 16:
        raise Unsupported(f"{qz.describe()}: a {qz.state_bits}-bit trellis window; the kernels read {qz.bits + 6}")
    def build() -> torch.Tensor:
        return table_rows(qz, store.state, store.batch, store.heads, main.device, qz.table)

    return table_operand(store, main, operand_cls, KIND_TQT, build)


@triton.jit
def tqt_tile(ptr, row, rows, m2, offs_d, BITS: tl.constexpr, D: tl.constexpr):
    """Float32 ``[BLOCK_N, D]`` head-space tile ``table[s_j]`` (no row norm: a token scale, see
    :func:`codebook_norms`) of the ``tqt{BITS}`` rows at element offsets ``rows`` from ``ptr`` (rows outside
    ``m2 [BLOCK_N, 1]`` read code 0); ``row``: the (sequence, head)'s :func:`table_rows` row. The state ``s_j`` of
    channel ``j`` is the ``L``-bit window of the row's circular bit stream that ends at bit ``BITS (j + 1)``: three
    bytes from its first byte on (wrapping to the row start), shifted, masked."""
    L: tl.constexpr = BITS + 6
    RB: tl.constexpr = BITS * D // 8  # bytes per row
    start = (BITS * (offs_d + 1) - L + BITS * D) % (BITS * D)  # the window's first bit, circularly
    b = start // 8
    base = ptr + rows[:, None]
    w0 = tl.load(base + b[None, :], mask=m2, other=0).to(tl.int32)
    w1 = tl.load(base + ((b + 1) % RB)[None, :], mask=m2, other=0).to(tl.int32)
    w2 = tl.load(base + ((b + 2) % RB)[None, :], mask=m2, other=0).to(tl.int32)
    state = ((w0 | (w1 << 8) | (w2 << 16)) >> (start % 8)[None, :]) & ((1 << L) - 1)
    return tl.load(row + 2 + state).to(tl.float32)
