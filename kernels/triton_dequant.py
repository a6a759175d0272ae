"""Shared Triton pieces: read one tile of a quantized K or V part and dequantize it in registers.

The kernels (:mod:`triton_decode`, :mod:`triton_chunk`) never see a dequantized copy of the history:
each program loads the stored bytes of ``BLOCK_N`` tokens, turns them into floats in registers and
applies the scales there. Which scale goes where (scale folding)::

    kind        stored part(s)                 per-head scale        per-token / per-group scale
    FLOAT       x  fp16/bf16/fp32              -                     -
    HEAD        q  int8   (int8 shared)        state["scale"][h]     -
    TOKEN       q  int8 + scale fp16[1]        -                     scale[t]: on the score column (K)
                                                                     or on the probability column (V)
    INTN        q  uint8 packed (int4/3/2)     -                     scale/zero[t, group] on load
                   + scale, zero fp16[G]
    CHANNEL     q  uint8 packed (int4/3/2)     -                     scale/zero[t // block, channel] on load
                   + scale, zero fp16[D]
                   per block of tokens
    FP8         q  float8 e4m3 / e5m2          state["scale"][h]     -
    CODEBOOK    q  uint8 packed (tq4/3/2)      -                     norm[t] (8-bit log code): on the score
                   + norm uint8[1]; levels                           column (K) / probability column (V)
                   in params[b, h]                                   (:mod:`triton_codebook`)
    TQC         q  uint8, per-channel widths   sigma[b, h, channel]  norm[t] as CODEBOOK
                   + norm uint8[1]             on load               (:func:`~triton_codebook.tqc_tile`)
    TQV         q  uint8, a 2b-bit code per    -                     norm[t] as CODEBOOK
                   channel pair; codewords                           (:func:`~triton_codebook.tqv_tile`)
                   in a row per [b, h]
    TQT         q  uint8, a circular stream    -                     norm[t] as CODEBOOK
                   of b-bit codes; 2^(b+6)                           (:func:`~triton_codebook.tqt_tile`)
                   table in a row per [b, h]

A per-head K scale is folded into the softmax scale (``scores = (q . k_codes) * scaling * s_k[h]``);
a per-head V scale multiplies the accumulator once, after the history loop; a per-token scale is
one multiply per score (K) or per probability (V) instead of one per element. All are exact in
fp32 up to rounding order. Per-group (INTN) and per-channel-per-block (CHANNEL, ``int*-channel``:
KIVI's keys) scales and zeros vary along head_dim, so they cannot be folded out of the dot: they
are applied to the tile on load (``code * scale + zero`` in fp32, exactly the dequantizer's math).
CHANNEL codes use the same packing as INTN (split layout for 4/2 bits, three byte planes for 3
bits); their scale/zero row is the one row of the token's pool block (the pool's block size is
the token group), their column the channel (``GROUP`` is 1).

FP8: on GPUs with native fp8 conversions (compute capability >= 8.9: Ada, Hopper) the part is loaded
as ``tl.float8e4nv`` / ``tl.float8e5``. Elsewhere (Ampere, and the CPU interpreter tests of this
path) the bytes are loaded as uint8 and decoded with integer ops: an e5m2 byte is the high byte of
an fp16; an e4m3 byte shifted into fp16's exponent/mantissa fields is the value / 256 (normals and
subnormals alike), and the 256 is folded into the per-head scale.

This module also holds the host-side description of a part (:func:`operand`) and its shape checks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvquant.quantizers import (
    ChannelCodebook,
    Codebook,
    Fp8,
    Int8PerToken,
    Int8SharedScale,
    IntNChannel,
    IntNGrouped,
    Passthrough,
    TrellisCodebook,
    VectorCodebook,
)
from kvquant.snapshot import PartSnapshot

from .triton_codebook import (
    codebook_levels,
    codebook_operand,
    tqc_operand,
    tqc_tile,
    tqt_operand,
    tqt_tile,
    tqv_operand,
    tqv_tile,
)
from .unsupported import Unsupported

KIND_FLOAT = 0
KIND_HEAD = 1
KIND_TOKEN = 2
KIND_INTN = 3
KIND_FP8 = 4  # native: loaded as tl.float8e4nv / tl.float8e5
KIND_FP8_E4M3_BITS = 5  # uint8 view, integer decode (value / 256; the 256 folded into the head scale)
KIND_FP8_E5M2_BITS = 6  # uint8 view, integer decode (exact)
KIND_CHANNEL = 7  # int4/3/2 codes as INTN; scale/zero per (pool block, channel): int*-channel

DOT_IEEE = 0  # fp32 operands, exact fp32 products (fp32 queries: the 2e-3 contract vs the fp32 reference)
DOT_FP16 = 1  # fp16 operands, fp32 accumulation (tensor cores)
DOT_BF16 = 2  # bf16 operands, fp32 accumulation (tensor cores)
DOT_BF16_EMULATED = 3  # bf16-rounded operands, fp32 dot: bf16 under the interpreter, whose bf16 tl.dot is wrong


@triton.jit
def load_tile(
    ptr,
    sc_ptr,
    zp_ptr,
    rows,
    sc_rows,
    mask_n,
    offs_d,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    DOT: tl.constexpr = 0,
):
    """Float32 ``[BLOCK_N, D]`` tile of the tokens whose rows start at element offsets ``rows[BLOCK_N]``
    (rows outside ``mask_n`` read as 0); ``sc_rows``: the offsets of their scale/zero rows (CHANNEL:
    their block's one row). See :func:`paged_rows`. With ``DOT`` a half-precision MMA kind, tiles whose
    values are exact in that type (int8 codes, fp8 into fp16, stored values of that very type) come back
    in it, skipping the fp32 round trip.

    Per-group (INTN) and per-channel-per-block (CHANNEL) scale/zero are applied here; per-head and
    per-token scales are not (the kernels fold them, see the module doc). ``ptr``/``sc_ptr``/``zp_ptr``
    point at one head of the part tensors (block 0).
    """
    m2 = mask_n[:, None]
    if KIND == 3 or KIND == 7 or KIND == 8:
        if BITS == 3:
            # 8 codes per 3 bytes: channels j + k*D/8 (k = 0..7) form the 24-bit word
            # lo[j] | mid[j] << 8 | hi[j] << 16 of three byte planes of D/8 bytes; code k at bit 3k
            D8: tl.constexpr = D // 8
            col = offs_d % D8
            row = ptr + rows[:, None] + col[None, :]
            b0 = tl.load(row, mask=m2, other=0).to(tl.int32)
            b1 = tl.load(row + D8, mask=m2, other=0).to(tl.int32)
            b2 = tl.load(row + 2 * D8, mask=m2, other=0).to(tl.int32)
            word = b0 | (b1 << 8) | (b2 << 16)
            code = (word >> ((offs_d // D8) * 3)[None, :]) & 7
        else:
            # split packing: byte j holds channels j, j + D/n, ... (n = 8 / BITS) at bit offsets 0, BITS, ...
            PER_BYTE: tl.constexpr = 8 // BITS
            DP: tl.constexpr = D // PER_BYTE
            col = offs_d % DP
            shift = (offs_d // DP) * BITS
            byte = tl.load(ptr + rows[:, None] + col[None, :], mask=m2, other=0)
            code = (byte.to(tl.int32) >> shift[None, :]) & ((1 << BITS) - 1)
        if KIND == 8:
            # codebook: the level of each code (zp_ptr = the head's params row); the norm is a token scale
            x = codebook_levels(zp_ptr, code)
        else:
            # INTN: one scale per GROUP channels of the token's row; CHANNEL (GROUP 1): one per channel of
            # the block's row
            s_off = sc_rows[:, None] + (offs_d // GROUP)[None, :]
            s = tl.load(sc_ptr + s_off, mask=m2, other=0.0).to(tl.float32)
            z = tl.load(zp_ptr + s_off, mask=m2, other=0.0).to(tl.float32)
            x = code.to(tl.float32) * s + z
    elif KIND == 9:  # tqc: per-channel widths (zp_ptr = the (sequence, head)'s tqc row)
        x = tqc_tile(ptr, zp_ptr, rows, m2, offs_d, D)
    elif KIND == 10:  # tqv: a code per channel pair into a 2-D codeword table (zp_ptr = the tqv row)
        x = tqv_tile(ptr, zp_ptr, rows, m2, offs_d, BITS)
    elif KIND == 11:  # tqt: an L-bit window of the row's circular code stream into a table (zp_ptr = the row)
        x = tqt_tile(ptr, zp_ptr, rows, m2, offs_d, BITS, D)
    elif KIND == 5:
        b = tl.load(ptr + rows[:, None] + offs_d[None, :], mask=m2, other=0).to(tl.uint16)
        bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        x = bits.to(tl.float16, bitcast=True).to(tl.float32)
    elif KIND == 6:
        b = tl.load(ptr + rows[:, None] + offs_d[None, :], mask=m2, other=0).to(tl.uint16)
        x = (b << 8).to(tl.float16, bitcast=True).to(tl.float32)
    elif KIND == 4:
        if DOT == 1:
            # fp8 -> fp16 is exact: the bytes (masked rows: 0 = +0.0) converted by the hardware, no select
            b = tl.load(ptr.to(tl.pointer_type(tl.uint8)) + rows[:, None] + offs_d[None, :], mask=m2, other=0)
            x = b.to(ptr.dtype.element_ty, bitcast=True).to(tl.float16)
        else:
            # native fp8: no `other` (an int/float literal cannot be cast to fp8); masked lanes zeroed after
            x = tl.load(ptr + rows[:, None] + offs_d[None, :], mask=m2).to(tl.float32)
            x = tl.where(m2, x, 0.0)
    else:
        x = tl.load(ptr + rows[:, None] + offs_d[None, :], mask=m2, other=0)
        if DOT == 1 and (KIND == 1 or KIND == 2):
            # int8 code c -> fp16 without a conversion instruction: the bits 0x6400 | (c + 128) are the
            # fp16 1024 + (c + 128), exactly; minus 1152 (exact) leaves c. With b the code's byte,
            # 0x6400 | (b ^ 0x80) = b ^ 0x6480: one logic op with one immediate
            u = x.to(tl.uint8, bitcast=True).to(tl.uint16) ^ 0x6480
            x = u.to(tl.float16, bitcast=True) - 1152.0
        elif DOT == 1 and ptr.dtype.element_ty == tl.float16:
            x = x.to(tl.float16)  # fp16 values are exact MMA operands: no fp32 round trip
        elif DOT == 2 and (KIND == 1 or KIND == 2 or ptr.dtype.element_ty == tl.bfloat16):
            x = x.to(tl.bfloat16)
        else:
            x = x.to(tl.float32)
    return x


@triton.jit
def perm4(i):
    """The channel order of :func:`int8_words_fp16` tiles: position ``i`` holds channel ``perm4(i)`` (channels
    1 and 2 of every 4 swapped; an involution, so it also maps channels to positions)."""
    return (i & ~3) | ((i & 1) << 1) | ((i >> 1) & 1)


@triton.jit
def int8_words_fp16(ptr, words, mask_n, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """fp16 ``[BLOCK_N, D]`` tile of int8 codes (``HEAD`` / ``TOKEN`` kinds) whose rows start at the 32-bit
    word offsets ``words`` from ``ptr`` (rows outside ``mask_n`` read as 0), with the channels in the order
    :func:`perm4`: each 32-bit word of 4 codes is loaded once and turned into two fp16 pairs by one
    and + xor each (``(w & 0x00FF00FF) ^ 0x64806480`` is the fp16 pair ``1024 + (c + 128)`` of its bytes 0
    and 2, the same of ``w >> 8`` of bytes 1 and 3), minus 1152 (exact): no per-byte extraction, two values
    per instruction. The caller permutes the query (K) or the output columns (V) with :func:`perm4`."""
    W: tl.constexpr = D // 4
    wp = ptr.to(tl.pointer_type(tl.int32))
    w = tl.load(wp + words[:, None] + tl.arange(0, W)[None, :], mask=mask_n[:, None], other=0)
    e = (w & 0x00FF00FF) ^ 0x64806480
    o = ((w >> 8) & 0x00FF00FF) ^ 0x64806480
    return (_pairs_fp16(e, o, BLOCK_N, D) - 1152.0).to(tl.float16)  # fp16 (the interpreter promotes to fp32)


@triton.jit
def _pairs_fp16(e, o, BLOCK_N: tl.constexpr, DH: tl.constexpr):
    """fp16 ``[BLOCK_N, DH]`` from the 32-bit words ``e`` (fp16 pairs of channels 4i, 4i + 2) and ``o`` (4i + 1,
    4i + 3), ``[BLOCK_N, DH / 4]``: channels in :func:`perm4` order. No instruction: register views."""
    x = tl.join(e, o)
    h = tl.join(x.to(tl.int16), (x >> 16).to(tl.int16))
    return tl.reshape(h.to(tl.float16, bitcast=True), [BLOCK_N, DH])


@triton.jit
def nibble_tiles(wp, offs, mask_n, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """Split-packed int4 codes (byte j: channel j in the low nibble, channel j + D/2 in the high one) of
    ``BLOCK_N`` tokens, the 32-bit words ``wp + offs`` (``offs [BLOCK_N, D/8]``: row r's words; rows outside
    ``mask_n`` read as 0), as
    two fp16 tiles ``[BLOCK_N, D/2]`` of the codes of channels [0, D/2) (``lo``) and [D/2, D) (``hi``), both in
    :func:`perm4` order, as fp16 *subnormals*: ``lo = c * 2**-24``, ``hi = 16 c * 2**-24`` (exact; the caller
    multiplies the MMA results by :data:`NIBBLE_LO` / :data:`NIBBLE_HI`). Per 32-bit word of 8 codes: one shift
    and four ands (``w & 0x000F000F`` is the fp16 pair of the low nibbles of bytes 0 and 2 as subnormals,
    ``0x00F000F0`` their high nibbles, times 16), two codes per instruction, no constant to add or subtract."""
    w = tl.load(wp + offs, mask=mask_n[:, None], other=0)
    w8 = w >> 8
    lo = _pairs_fp16(w & 0x000F000F, w8 & 0x000F000F, BLOCK_N, D // 2)
    hi = _pairs_fp16(w & 0x00F000F0, w8 & 0x00F000F0, BLOCK_N, D // 2)
    return lo, hi


@triton.jit
def code_tiles(wp, offs, mask_n, BITS: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """Grouped int4 / int3 / int2 codes of ``BLOCK_N`` tokens as one fp16 ``[BLOCK_N, D]`` tile of *subnormals*,
    position ``i`` = channel :func:`perm4` ``(i)`` holding ``c * 2**(code_exp(i) - 24)`` (exact; powers of two the
    caller folds into the query rows / the output rows). ``offs [BLOCK_N, W]``: each row's first 32-bit words from
    ``wp`` (rows outside ``mask_n`` read as 0), ``W = D BITS / 32`` (int3: ``D / 32`` words per byte plane).
    Stored layouts (``quantizers/intn.py``):

    * 4 and 2 bits, split packing: byte j holds channels ``j + k D/n`` (``n = 8 / BITS``) at bit ``BITS k``. Per
      32-bit word (bytes j..j+3) and chunk k: ``w & (m << BITS k)`` (``m`` = 0x000F000F / 0x00030003) is the fp16
      pair of bytes 0 and 2's code k times ``2**(BITS k)`` as subnormals, the same of ``w >> 8`` for bytes 1 and
      3: one and per two codes, one shift per word.
    * 3 bits, three byte planes (low, mid, high of the 24-bit word of channels ``j + k D/8``, code k at bit 3k):
      per three words L, M, H of the planes, ``A = [L | M << 8]`` (bits 0-15: codes 0-2 at bits 0, 3, 6),
      ``B = [M | H << 8]`` (bits 8-23: codes 3-5 at bits 1, 4, 7) per fp16 half (bytes 0 / 2, then 1 / 3), and H
      itself (codes 6, 7 at bits 2, 5): every code inside a half's 10 mantissa bits, one and per two codes.

    Chunk k (code k of every byte / word) fills positions ``[k D/n, (k + 1) D/n)``, so ``perm4`` of the
    position is the channel (``D/n`` is a multiple of 4)."""
    if BITS == 3:
        W: tl.constexpr = D // 32
        lw = tl.load(wp + offs, mask=mask_n[:, None], other=0)
        mw = tl.load(wp + offs + W, mask=mask_n[:, None], other=0)
        hw = tl.load(wp + offs + 2 * W, mask=mask_n[:, None], other=0)
        ae = (lw & 0x00FF00FF) | ((mw & 0x00FF00FF) << 8)
        ao = ((lw >> 8) & 0x00FF00FF) | (mw & -16711936)  # -16711936: 0xFF00FF00 as int32
        be = (mw & 0x00FF00FF) | ((hw & 0x00FF00FF) << 8)
        bo = ((mw >> 8) & 0x00FF00FF) | (hw & -16711936)
        ho = hw >> 8
        DC: tl.constexpr = D // 8
        c0 = _pairs_fp16(ae & 0x00070007, ao & 0x00070007, BLOCK_N, DC)
        c1 = _pairs_fp16(ae & 0x00380038, ao & 0x00380038, BLOCK_N, DC)
        c2 = _pairs_fp16(ae & 0x01C001C0, ao & 0x01C001C0, BLOCK_N, DC)
        c3 = _pairs_fp16(be & 0x000E000E, bo & 0x000E000E, BLOCK_N, DC)
        c4 = _pairs_fp16(be & 0x00700070, bo & 0x00700070, BLOCK_N, DC)
        c5 = _pairs_fp16(be & 0x03800380, bo & 0x03800380, BLOCK_N, DC)
        c6 = _pairs_fp16(hw & 0x001C001C, ho & 0x001C001C, BLOCK_N, DC)
        c7 = _pairs_fp16(hw & 0x00E000E0, ho & 0x00E000E0, BLOCK_N, DC)
        x = _cat_tiles(_cat_tiles(_cat_tiles(c0, c1, BLOCK_N, D // 4), _cat_tiles(c2, c3, BLOCK_N, D // 4), BLOCK_N,
                                  D // 2),
                       _cat_tiles(_cat_tiles(c4, c5, BLOCK_N, D // 4), _cat_tiles(c6, c7, BLOCK_N, D // 4), BLOCK_N,
                                  D // 2), BLOCK_N, D)  # fmt: skip
    elif BITS == 2:
        w = tl.load(wp + offs, mask=mask_n[:, None], other=0)
        w8 = w >> 8
        DC: tl.constexpr = D // 4
        c0 = _pairs_fp16(w & 0x00030003, w8 & 0x00030003, BLOCK_N, DC)
        c1 = _pairs_fp16(w & 0x000C000C, w8 & 0x000C000C, BLOCK_N, DC)
        c2 = _pairs_fp16(w & 0x00300030, w8 & 0x00300030, BLOCK_N, DC)
        c3 = _pairs_fp16(w & 0x00C000C0, w8 & 0x00C000C0, BLOCK_N, DC)
        x = _cat_tiles(_cat_tiles(c0, c1, BLOCK_N, D // 2), _cat_tiles(c2, c3, BLOCK_N, D // 2), BLOCK_N, D)
    else:
        lo, hi = nibble_tiles(wp, offs, mask_n, BLOCK_N, D)
        x = _cat_tiles(lo, hi, BLOCK_N, D)
    return x


@triton.jit
def _halves(v):
    """int32 ``v [...]`` as fp16 ``[..., 2]``: its low and high 16-bit halves (register views)."""
    return tl.join(v.to(tl.int16), (v >> 16).to(tl.int16)).to(tl.float16, bitcast=True)


@triton.jit
def key_tile2(wp, offs, mask_n, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """Grouped int2 *key* codes of ``BLOCK_N`` tokens as an fp16 ``[BLOCK_N, D]`` MMA ``A`` tile of subnormals whose
    register layout is the warpgroup MMA's own: no shared-memory round trip (:func:`code_tiles` orders positions by
    chunk, which puts two positions a lane pair must hold in one thread, so Triton staged every unpacked tile
    through ``STS`` / ``LDSM``). ``offs [BLOCK_N, 4 E]`` (``E = D / 64``): row r's 32-bit words (word ``a E + e``)
    from ``wp`` (rows outside ``mask_n`` read as 0). Position ``p = h + 2 a + 8 (e + E (o + 2 k))`` (``h``: the
    fp16 half, ``a``: the word's lane part, ``e``: its register part, ``o``: bytes 0 / 2 or 1 / 3 (``w >> 8``),
    ``k``: the chunk) holds channel :func:`key_chan2` ``(p)`` as ``c * 2**(2 k - 24)`` (:func:`key_exp2`): the MMA
    operand layout wants the position bits 1 and 2 in the lanes (here: the word), bit 0 in the register pair (the
    half) and the rest in registers (chunk, byte, word part). One shift per word and one and per two codes, as
    :func:`code_tiles`; the stored format is the same (split packing, ``quantizers/intn.py``)."""
    E: tl.constexpr = D // 64
    # loaded as [BLOCK_N, 4 E] rows (16-byte copies), then viewed as [BLOCK_N, a, e]
    w = tl.load(wp + offs, mask=mask_n[:, None], other=0)
    w = tl.permute(tl.reshape(w, [BLOCK_N, 4, E]), (0, 2, 1))  # [BLOCK_N, e, a]
    w8 = w >> 8
    u0 = tl.permute(tl.join(_halves(w & 0x00030003), _halves(w8 & 0x00030003)), (0, 4, 1, 2, 3))  # [N, o, e, a, h]
    u1 = tl.permute(tl.join(_halves(w & 0x000C000C), _halves(w8 & 0x000C000C)), (0, 4, 1, 2, 3))
    u2 = tl.permute(tl.join(_halves(w & 0x00300030), _halves(w8 & 0x00300030)), (0, 4, 1, 2, 3))
    u3 = tl.permute(tl.join(_halves(w & 0x00C000C0), _halves(w8 & 0x00C000C0)), (0, 4, 1, 2, 3))
    v0 = tl.permute(tl.join(u0, u1), (0, 5, 1, 2, 3, 4))  # [N, k0, o, e, a, h] (chunks 0, 1)
    v1 = tl.permute(tl.join(u2, u3), (0, 5, 1, 2, 3, 4))  # chunks 2, 3
    x = tl.permute(tl.join(v0, v1), (0, 6, 1, 2, 3, 4, 5))  # [N, k1, k0, o, e, a, h]
    return tl.reshape(x, [BLOCK_N, D])


@triton.jit
def key_chan2(p, D: tl.constexpr):
    """The channel at position ``p`` of a :func:`key_tile2` tile: byte ``4 (a E + e) + o + 2 h`` of the row, chunk
    ``k`` (split packing: channel ``byte + k D / 4``)."""
    E: tl.constexpr = D // 64
    h = p % 2
    a = (p // 2) % 4
    q = p // 8
    e = q % E
    o = (q // E) % 2
    k = q // (2 * E)
    return 4 * (a * E + e) + o + 2 * h + k * (D // 4)


@triton.jit
def key_exp2(p, D: tl.constexpr):
    """The power of two of position ``p`` of a :func:`key_tile2` tile: ``2 k`` for chunk ``k``."""
    return 2 * (p // (D // 4))


@triton.jit
def _cat_tiles(lo, hi, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """``[BLOCK_N, D]``: the columns of ``lo [BLOCK_N, D/2]`` then those of ``hi`` (register views)."""
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), [BLOCK_N, D])


@triton.jit
def code_exp(i, BITS: tl.constexpr, D: tl.constexpr):
    """The power of two of position ``i`` of a :func:`code_tiles` tile, ``(BITS k) % 8`` for chunk ``k``."""
    if BITS == 3:  # noqa: SIM108 (a constexpr branch)
        e = (3 * (i // (D // 8))) % 8
    else:
        e = BITS * (i // (D * BITS // 8))
    return e


@triton.jit
def pow2(e):
    """``2**e`` in fp32 for integer ``e`` in [-126, 127], exactly (built from its bits)."""
    return ((tl.zeros([], tl.int32) + e + 127) << 23).to(tl.float32, bitcast=True)  # e: a tensor or an int


#: what the MMA results of :func:`nibble_tiles`' ``lo`` / ``hi`` tiles are multiplied by (powers of two: exact)
NIBBLE_LO: tl.constexpr = tl.constexpr(16777216.0)  # 2**24
NIBBLE_HI: tl.constexpr = tl.constexpr(1048576.0)  # 2**20


# ------------------------------------------------------------ int4 grouped, folded (decode inner loop)
# The packed int4 decode path does not dequantize tiles: the codes are exact MMA operands, and the
# per-(token, group) scale and zero are applied to the per-group partial dots (one multiply-add per
# (query head, token, group) instead of per element):
#
#   K:  q . k[t] = sum_g s[t,g] (q_g . c[t,g]) + z[t,g] sum(q_g)
#   V:  sum_t p[t] v[t,d] = sum_t (p[t] s[t,g(d)]) c[t,d] + sum_t p[t] z[t,g(d)]
#
# Each packed byte is loaded once: its low nibbles are the channels [0, D/2) (split packing), its
# high nibbles [D/2, D), dotted against the two halves of the query (or of the output). Groups are
# the leading axis of 3-D (batched) dots. Exact up to fp32 rounding order; more exact than
# dequantizing into a half-precision operand, which the low-half split had to repair.


@triton.jit
def codes_operand(c, DOT: tl.constexpr):
    """Unsigned codes < 128 as an exact MMA operand of kind ``DOT``, without a conversion instruction:
    the fp16 bits ``0x6400 | c`` are 1024 + c (bf16 ``0x4300 | c``: 128 + c), minus the constant."""
    if DOT == 1:
        r = (c.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    elif DOT == 2:
        r = (c.to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True) - 128.0
    else:
        r = c.to(tl.float32)
    return r


@triton.jit
def nibbles_operand(b, DOT: tl.constexpr):
    """The low and high nibbles of the bytes ``b`` as exact MMA operands of kind ``DOT``: the whole byte
    through the ``0x6400`` magic (``1024 + b``), the high nibble likewise, and the low one as
    ``b - 16 * hi`` (exact in fp16: integers below 2048)."""
    if DOT == 1:
        x = b.to(tl.uint16)
        whole = (x | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        hi = ((x >> 4) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        lo = whole - hi * 16.0
    else:
        lo = codes_operand(b & 15, DOT)
        hi = codes_operand(b >> 4, DOT)
    return lo, hi


@triton.jit
def load_q_halves(q_ptr, qh, q_sh, mask_h, D: tl.constexpr, GROUP: tl.constexpr, DOT: tl.constexpr):
    """The query heads ``qh`` as two ``[G2, BLOCK_H, GROUP]`` halves (channels [0, D/2) and [D/2, D),
    grouped) in the MMA operand type, and their per-group sums ``[G2, BLOCK_H, 1]`` in fp32."""
    G2: tl.constexpr = D // 2 // GROUP
    g = tl.arange(0, G2)[:, None, None]
    j = tl.arange(0, GROUP)[None, None, :]
    ptr = q_ptr + qh[None, :, None] * q_sh + g * GROUP + j
    m = mask_h[None, :, None]
    lo = tl.load(ptr, mask=m, other=0.0)
    hi = tl.load(ptr + D // 2, mask=m, other=0.0)
    if DOT == 0 or DOT == 3:
        lo = lo.to(tl.float32)
        hi = hi.to(tl.float32)
    return lo, hi, reduce_sum(lo.to(tl.float32), 2)[:, :, None], reduce_sum(hi.to(tl.float32), 2)[:, :, None]


@triton.jit
def _load_group_scales(sc_ptr, zp_ptr, sc_rows, mask_n, G2: tl.constexpr):
    """Scale and zero of the tokens whose scale rows start at ``sc_rows``, groups of the low half and of the
    high half: ``[G2, 1, BLOCK_N]``."""
    off = sc_rows[None, None, :] + tl.arange(0, G2)[:, None, None]
    m = mask_n[None, None, :]
    s_lo = tl.load(sc_ptr + off, mask=m, other=0.0).to(tl.float32)
    s_hi = tl.load(sc_ptr + off + G2, mask=m, other=0.0).to(tl.float32)
    z_lo = tl.load(zp_ptr + off, mask=m, other=0.0).to(tl.float32)
    z_hi = tl.load(zp_ptr + off + G2, mask=m, other=0.0).to(tl.float32)
    return s_lo, s_hi, z_lo, z_hi


@triton.jit
def qk_fold4(q_lo, q_hi, qs_lo, qs_hi, ptr, sc_ptr, zp_ptr, rows, sc_rows, mask_n,
             D: tl.constexpr, GROUP: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    """Scores ``[BLOCK_H, BLOCK_N]`` of the queries (:func:`load_q_halves`) against grouped int4 keys."""
    G2: tl.constexpr = D // 2 // GROUP
    g = tl.arange(0, G2)[:, None, None]
    j = tl.arange(0, GROUP)[None, :, None]
    b = tl.load(ptr + rows[None, None, :] + g * GROUP + j, mask=mask_n[None, None, :], other=0)
    s_lo, s_hi, z_lo, z_hi = _load_group_scales(sc_ptr, zp_ptr, sc_rows, mask_n, G2)
    t = _mma(q_lo, codes_operand(b & 15, DOT), DOT) * s_lo + qs_lo * z_lo
    t += _mma(q_hi, codes_operand(b >> 4, DOT), DOT) * s_hi + qs_hi * z_hi
    return reduce_sum(t, 0)


@triton.jit
def pv_fold4(p, acc_lo, acc_hi, zacc_lo, zacc_hi, ptr, sc_ptr, zp_ptr, rows, sc_rows, mask_n,
             D: tl.constexpr, GROUP: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    """Add ``p [BLOCK_H, BLOCK_N] @ v`` for grouped int4 values to the output halves ``acc_lo/acc_hi``
    (``[G2, BLOCK_H, GROUP]``: code terms) and ``zacc_lo/zacc_hi`` (``[G2, BLOCK_H, 1]``: zero terms)."""
    G2: tl.constexpr = D // 2 // GROUP
    g = tl.arange(0, G2)[:, None, None]
    j = tl.arange(0, GROUP)[None, None, :]
    b = tl.load(ptr + rows[None, :, None] + g * GROUP + j, mask=mask_n[None, :, None], other=0)
    s_lo, s_hi, z_lo, z_hi = _load_group_scales(sc_ptr, zp_ptr, sc_rows, mask_n, G2)
    p3 = p[None, :, :]
    acc_lo += dot_pv(p3 * s_lo, codes_operand(b & 15, DOT), DOT, False)
    acc_hi += dot_pv(p3 * s_hi, codes_operand(b >> 4, DOT), DOT, False)
    zacc_lo += reduce_sum(p3 * z_lo, 2)[:, :, None]
    zacc_hi += reduce_sum(p3 * z_hi, 2)[:, :, None]
    return acc_lo, acc_hi, zacc_lo, zacc_hi


@triton.jit
def dot_split_a(a, b, DOT: tl.constexpr):
    """``a @ b`` for an fp32 ``a`` and an exact operand ``b``: in half precision ``a`` is split into
    high + low halves (two MMAs), so that its rounding costs ~2^-22 relative, as in :func:`dot_pv`."""
    if DOT == 0:
        r = tl.dot(a, b, input_precision="ieee")
    else:
        ah = _half(a, DOT)
        r = _mma(ah, b, DOT) + _mma(_half(a - ah.to(tl.float32), DOT), b, DOT)
    return r


@triton.jit
def qk_channel4(q_lo, q_hi, ptr, sc_ptr, zp_ptr, rows, sc_row, mask_n, D: tl.constexpr, DOT: tl.constexpr):
    """Scores ``[BLOCK_H, BLOCK_N]`` against per-channel int4 keys (``int4-channel``) when the tile lies in
    one pool block (``sc_row``: the offset of that block's scale row): the block's scale is folded into
    the query and its zero into one
    term per query head (``q . k = (q * s) . c + q . z``), the codes are exact MMA operands, each packed
    byte loaded once (low nibbles: channels [0, D/2) against ``q_lo``, high: [D/2, D) against ``q_hi``)."""
    DH: tl.constexpr = D // 2
    j = tl.arange(0, DH)
    row = sc_row
    s_lo = tl.load(sc_ptr + row + j).to(tl.float32)[None, :]
    s_hi = tl.load(sc_ptr + row + DH + j).to(tl.float32)[None, :]
    z_lo = tl.load(zp_ptr + row + j).to(tl.float32)[None, :]
    z_hi = tl.load(zp_ptr + row + DH + j).to(tl.float32)[None, :]
    b = tl.load(ptr + rows[None, :] + j[:, None], mask=mask_n[None, :], other=0)  # [D/2, BLOCK_N]
    r = dot_split_a(q_lo * s_lo, codes_operand(b & 15, DOT), DOT)
    r += dot_split_a(q_hi * s_hi, codes_operand(b >> 4, DOT), DOT)
    return r + (reduce_sum(q_lo * z_lo, 1) + reduce_sum(q_hi * z_hi, 1))[:, None]


@triton.jit
def load_token_scale(sc_ptr, sc_rows, mask_n):
    """Per-token scales ``[BLOCK_N]`` (int8-token) at row offsets ``sc_rows``, 0 outside ``mask_n``."""
    return tl.load(sc_ptr + sc_rows, mask=mask_n, other=0.0).to(tl.float32)


@triton.jit
def head_ptrs(P, S, Z, sh, ssh, hg):
    """Pointers to head ``hg`` (block 0) of a part, its scale and its zero (head strides ``sh``, ``ssh``)."""
    h = hg.to(tl.int64)  # head strides of a head-major pool can exceed 2^31 elements
    return P + h * sh, S + h * ssh, Z + h * ssh


@triton.jit
def paged_rows(tbl_ptr, offs_n, mask_n, sb, st, ss_b, ss_t, BS: tl.constexpr, KIND: tl.constexpr):
    """Block-table addressing (vLLM's layout): token ``n`` of a row lives in block ``tbl[n // BS]`` at
    offset ``n % BS``. Returns the element offsets of the tokens' part rows and of their scale rows
    (``sb``/``st``, ``ss_b``/``ss_t``: block and token strides of the part and of its scale part;
    CHANNEL scales have one row per block)."""
    blk = tl.load(tbl_ptr + offs_n // BS, mask=mask_n, other=0).to(tl.int64)
    inner = (offs_n % BS).to(tl.int64)
    rows = blk * sb + inner * st
    if KIND == 7:  # noqa: SIM108 (a constexpr branch)
        sc_rows = blk * ss_b
    else:
        sc_rows = blk * ss_b + inner * ss_t
    return rows, sc_rows


@triton.jit
def load_head_scale(hs_ptr, hg, KIND: tl.constexpr):
    """The per-head factor at index ``hg`` (``b * Hg + head``: scales are per sequence and head) of the
    group: the static scale (x256 for e4m3 bit decode), or 1."""
    if KIND == 1 or KIND == 4:
        s = tl.load(hs_ptr + hg).to(tl.float32)
    elif KIND == 5:
        s = tl.load(hs_ptr + hg).to(tl.float32) * 256.0
    elif KIND == 6:
        s = tl.load(hs_ptr + hg).to(tl.float32)
    else:
        s = 1.0
    return s


@triton.jit
def _half(x, DOT: tl.constexpr):
    """``x`` as an MMA operand of the query's precision (DOT 3: bf16-rounded values kept in fp32)."""
    if DOT == 1:
        r = x.to(tl.float16)
    elif DOT == 2:
        r = x.to(tl.bfloat16)
    else:
        r = x.to(tl.bfloat16).to(tl.float32)
    return r


@triton.jit
def _mma(a, b, DOT: tl.constexpr):
    """``a @ b``: fp32 (DOT 0) and bf16-emulated (DOT 3) operands as exact fp32 products (not tf32)."""
    return tl.dot(a, b, input_precision="ieee") if DOT == 0 or DOT == 3 else tl.dot(a, b)


@triton.jit
def dot_qk(q, kt, DOT: tl.constexpr, SPLIT: tl.constexpr):
    """Scores ``q @ kt`` (fp32 accumulation). ``q`` is in the query dtype (exact as an operand); ``kt`` is
    a dequantized fp32 tile: int8 / fp8 codes and stored half values are exact in the half type; with
    ``SPLIT`` (packed ints, INTN / CHANNEL: code * scale + zero) it is split into high + low halves (two MMAs)."""
    if DOT == 0:
        r = tl.dot(q.to(tl.float32), kt, input_precision="ieee")
    else:
        qh = _half(q, DOT)
        kh = _half(kt, DOT)
        r = _mma(qh, kh, DOT)
        if SPLIT:
            r += _mma(qh, _half(kt - kh.to(tl.float32), DOT), DOT)
    return r


@triton.jit
def mma_acc(a, b, acc, DOT: tl.constexpr):
    """``acc + a @ b`` accumulated by the MMA itself (no zero-initialised product, no separate add)."""
    if DOT == 0 or DOT == 3:  # noqa: SIM108 (a constexpr branch)
        r = tl.dot(a, b, acc, input_precision="ieee")
    else:
        r = tl.dot(a, b, acc)
    return r


@triton.jit
def pv_acc(p, v, acc, DOT: tl.constexpr):
    """``acc + p @ v`` for fp32 probabilities ``p`` and an exact operand ``v`` (:func:`dot_pv` without
    ``SPLIT``), accumulated by the MMAs."""
    if DOT == 0:
        r = mma_acc(p, v, acc, DOT)
    else:
        ph = _half(p, DOT)
        r = mma_acc(_half(p - ph.to(tl.float32), DOT), v, mma_acc(ph, v, acc, DOT), DOT)
    return r


@triton.jit
def dot_pv(p, v, DOT: tl.constexpr, SPLIT: tl.constexpr):
    """``p @ v`` for fp32 probabilities ``p``. In half precision ``p`` is split into high + low halves
    (two MMAs: rounding ``p`` then costs ~2^-22 instead of 2^-11 (fp16) / 2^-8 (bf16) relative), and so
    is ``v`` with ``SPLIT`` (packed ints; one more MMA, the low x low term is dropped)."""
    if DOT == 0:
        r = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        ph = _half(p, DOT)
        pl = _half(p - ph.to(tl.float32), DOT)
        vh = _half(v, DOT)
        r = _mma(ph, vh, DOT) + _mma(pl, vh, DOT)
        if SPLIT:
            r += _mma(ph, _half(v - vh.to(tl.float32), DOT), DOT)
    return r


# Reductions. Compiled: the public tl.max / tl.min / tl.sum (no private tl.* helper, so the kernels
# compile on older triton releases too). Interpreted: tl.reduce with triton's own combine functions,
# because tl.max / tl.sum are @triton.jit functions of triton's standard library, built compiled (not
# interpreted) when `triton` was imported before TRITON_INTERPRET=1 was set (transformers imports it),
# and the interpreter cannot call them then; with these combine functions it takes its numpy fast path.
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):

    @triton.jit
    def reduce_max(x, axis: tl.constexpr):
        return tl.reduce(x, axis, tl.standard._elementwise_max)

    @triton.jit
    def reduce_min(x, axis: tl.constexpr):
        return tl.reduce(x, axis, tl.standard._elementwise_min)

    @triton.jit
    def reduce_sum(x, axis: tl.constexpr):
        return tl.reduce(x, axis, tl.standard._sum_combine)

else:

    @triton.jit
    def reduce_max(x, axis: tl.constexpr):
        return tl.max(x, axis)

    @triton.jit
    def reduce_min(x, axis: tl.constexpr):
        return tl.min(x, axis)

    @triton.jit
    def reduce_sum(x, axis: tl.constexpr):
        return tl.sum(x, axis)


@triton.jit
def cap_scores(s, SOFTCAP: tl.constexpr):
    """Attention logit softcapping (Gemma 2) on base-2 scores: ``SOFTCAP * tanh(s / SOFTCAP)`` with
    ``SOFTCAP = softcap * log2(e)`` (the kernels' scores are natural scores times log2(e)); 0 = off.
    tanh as ``1 - 2 / (exp(2y) + 1)``: exact limits at +-inf, no libdevice call (runs interpreted)."""
    if SOFTCAP > 0:
        e = tl.exp(s * (2.0 / SOFTCAP))
        s = SOFTCAP * (1.0 - 2.0 / (e + 1.0))
    return s


@triton.jit
def online_rescale(m_i, m_blk):
    """Online-softmax bookkeeping for one more block of scores whose row max is ``m_blk``: the new
    running max, the exp2 base to subtract (0 while a row has seen no key, so no inf - inf) and
    ``alpha = exp2(m_i - base)``, the factor that rescales what was accumulated so far."""
    m_new = tl.maximum(m_i, m_blk)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, m_safe, tl.exp2(m_i - m_safe)


# ------------------------------------------------------------------------------------------- host side
@dataclass
class Operand:
    """One quantized K or V of a head group, as kernel arguments."""

    data: torch.Tensor  # block tensor [num_blocks, Hg, block_size, D or D*bits/8]
    scale: torch.Tensor  # per-token/per-group scale part, or a dummy
    zero: torch.Tensor  # per-group zero part, or a dummy
    head_scale: torch.Tensor  # state["scale"] as fp32 [B, Hg], or a dummy
    kind: int
    bits: int = 8
    group: int = 1
    block: int = 0  # tokens per pool block (CHANNEL: the scale's token group)

    def args(self) -> tuple:
        """Pointer and stride arguments (block, head, token strides), in the order the kernels declare them."""
        d, s = self.data, self.scale
        return (d, s, self.zero, self.head_scale, d.stride(0), d.stride(1), d.stride(2),
                s.stride(0), s.stride(1), s.stride(2))

    def meta(self) -> tuple:
        return (self.kind, self.bits, self.group)

    def folds_channel4(self) -> bool:
        """True when the decode kernel reads this part with :func:`qk_channel4` (per-channel int4 keys: a
        decode tile lies in one pool block, whose one scale row it folds)."""
        return self.kind == KIND_CHANNEL and self.bits == 4

    def int8_words(self, dot: int) -> bool:
        """True when the decode kernel reads this part with :func:`int8_words_fp16` (int8 codes, fp16 MMAs)."""
        return dot == DOT_FP16 and self.kind in (KIND_HEAD, KIND_TOKEN)

    def offsets32(self) -> bool:
        """True when every element offset of this part's tensors (codes, scale, zero) fits in 31 bits, so that a
        kernel may compute them in 32-bit integers."""
        return all(sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) < 2**31
                   for t in (self.data, self.scale, self.zero))  # fmt: skip

    def code_rows(self, head_dim: int) -> bool:
        """True when the fp16-query decode kernel :func:`~kvquant.kernels.triton_rows._decode_partial_rows_t` can
        read this part with :func:`code_tiles`: grouped int4 / int3 / int2 codes, groups of >= 16 channels, each
        chunk of the packing a multiple of 4 channels, scale / zero rows contiguous per token."""
        chunk = head_dim // 8 if self.bits == 3 else head_dim * self.bits // 8
        return (self.kind == KIND_INTN and self.bits in (2, 3, 4) and self.group >= 16
                and head_dim % self.group == 0 and chunk % 4 == 0
                and self.scale.stride(-1) == 1 and self.scale.stride(-2) == head_dim // self.group)  # fmt: skip

    def folds4(self, head_dim: int) -> bool:
        """True when the decode kernel reads this part on the folded int4 path (:func:`qk_fold4`,
        :func:`pv_fold4`): grouped 4-bit codes, whole groups (of >= 16 channels, an MMA's K) per half of D."""
        return self.kind == KIND_INTN and self.bits == 4 and self.group >= 16 and (head_dim // 2) % self.group == 0


def native_fp8(device: torch.device) -> bool:
    """True when this device converts fp8 in hardware (CUDA compute capability >= 8.9)."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def operand(store: PartSnapshot, head_dim: int, fp8_native: bool) -> Operand:
    """Describe one K or V of a head group (:class:`~kvquant.snapshot.PartSnapshot`) for the kernels (Unsupported
    if unknown)."""
    qz = store.quantizer
    parts = store.parts
    main = parts.get("q", parts.get("x"))
    if main is None or main.dim() != 4 or main.stride(-1) != 1:
        raise Unsupported(f"{qz.describe()}: part layout not [blocks, H, block_size, D] with unit channel stride")
    if isinstance(qz, Passthrough):
        return Operand(main, main, main, main, KIND_FLOAT)
    if isinstance(qz, Int8SharedScale):
        return Operand(main, main, main, _head_scale(store), KIND_HEAD)
    if isinstance(qz, Int8PerToken):
        return Operand(main, parts["scale"], main, main, KIND_TOKEN)
    if isinstance(qz, IntNGrouped):  # int4 / int2 (split packing) and int3 (three byte planes)
        if qz.bits not in (2, 3, 4):
            raise Unsupported(f"{qz.describe()}: {qz.bits}-bit codes have no Triton path")
        if head_dim % qz.group_size or head_dim % 8:
            raise Unsupported(f"{qz.describe()}: head_dim {head_dim} not a multiple of the group / packing")
        sc, zp = parts["scale"], parts["zero"]
        if sc.stride(-1) != 1 or zp.stride() != sc.stride():
            raise Unsupported(f"{qz.describe()}: scale/zero parts not laid out alike")
        return Operand(main, sc, zp, main, KIND_INTN, bits=qz.bits, group=qz.group_size)
    if isinstance(qz, IntNChannel):  # per channel over blocks of tokens (KIVI keys); codes packed as INTN
        if qz.bits not in (2, 3, 4, 8):
            raise Unsupported(f"{qz.describe()}: {qz.bits}-bit codes have no Triton path")
        if head_dim % 8:
            raise Unsupported(f"{qz.describe()}: head_dim {head_dim} not a multiple of the packing")
        if qz.token_group != store.block_size:
            raise Unsupported(f"{qz.describe()}: token group {qz.token_group} != store block {store.block_size}")
        sc, zp = parts["scale"], parts["zero"]
        if sc.dim() != 4 or sc.shape[-1] != head_dim or sc.stride(-1) != 1 or zp.stride() != sc.stride():
            raise Unsupported(f"{qz.describe()}: scale/zero parts not [blocks, H, 1, D] laid out alike")
        # tokens: by block address
        return Operand(main, sc, zp, main, KIND_CHANNEL, bits=qz.bits, group=1, block=qz.token_group)
    if isinstance(qz, Codebook):  # rotated codebook codes (packed as INTN) + an 8-bit log norm per token
        return codebook_operand(store, main, Operand)
    if isinstance(qz, ChannelCodebook):  # tqc: per-channel widths, channel-major bits + an 8-bit log norm
        return tqc_operand(store, main, Operand)
    if isinstance(qz, VectorCodebook):  # tqv: a 2b-bit code per pair of rotated channels + an 8-bit log norm
        return tqv_operand(store, main, Operand)
    if isinstance(qz, TrellisCodebook):  # tqt: a circular b-bit code stream read by L-bit windows + a log norm
        return tqt_operand(store, main, Operand)
    if isinstance(qz, Fp8):
        if fp8_native:
            kind, data = KIND_FP8, main
        else:
            kind = KIND_FP8_E4M3_BITS if qz.dtype == torch.float8_e4m3fn else KIND_FP8_E5M2_BITS
            data = main.view(torch.uint8)
        return Operand(data, main.view(torch.uint8), data, _head_scale(store), kind)
    raise Unsupported(f"{type(qz).__name__}: no Triton path for this quantizer")


def _head_scale(store: PartSnapshot) -> torch.Tensor:
    """The static scales as fp32 ``[B, Hg]`` contiguous (per sequence; a per-head ``[Hg]`` is broadcast)."""
    s = store.state.get("scale")
    if s is None:  # not calibrated yet: nothing is in the pool (tokens are held in full precision)
        s = torch.ones(store.batch, store.heads, device=store.device)
    if s.dim() == 1:
        s = s.expand(store.batch, -1)
    return s.float().contiguous()


def dot_kind(dtype: torch.dtype, interpreted: bool = False) -> int:
    if dtype == torch.float32:
        return DOT_IEEE
    if dtype == torch.float16:
        return DOT_FP16
    if dtype == torch.bfloat16:
        # Triton 3.x's interpreter multiplies bf16 tl.dot operands as raw integers (checked with
        # triton 3.9); the emulation rounds the operands to bf16 exactly as the MMA sees them.
        return DOT_BF16_EMULATED if interpreted else DOT_BF16
    raise Unsupported(f"query dtype {dtype}: expected float32, float16 or bfloat16")
