"""Property tests (hypothesis): int3/int2/int4 packing round trips, error bounds of the int3 grouped
and per-channel (KIVI) quantizers, per-sequence static scales."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvquant.quantizers import Fp8, Int3Grouped, Int8SharedScale, IntNChannel, pack_codes, unpack_codes

FP16_EPS = 2**-10  # fp16 rounding of a scale or zero moves the grid by at most |value| * 2^-11 (x2 slack)
floats = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([2, 3, 4]), st.integers(1, 4), st.sampled_from([8, 16, 64]), st.data())
def test_pack_unpack_round_trip(bits, rows, d, data):
    codes = data.draw(arrays("uint8", (rows, 3, d), elements=st.integers(0, 2**bits - 1)))
    codes = torch.from_numpy(codes)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, 3, d * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)


def _bound(x: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Half a grid step, plus the fp16 rounding of zero (= lo) and of scale x levels (~ hi - lo)."""
    return scale / 2 * (1 + 1e-3) + (lo.abs() + (hi - lo).abs()) * FP16_EPS + 1e-5


@settings(max_examples=60, deadline=None)
@given(arrays("float32", (2, 2, 3, 16), elements=floats).map(torch.from_numpy), st.sampled_from([8, 16]))
def test_int3_grouped_error_at_most_half_a_step(x, group):
    q = Int3Grouped(16, group_size=group)
    parts = q.quantize(x, {})
    y = q.dequantize(parts, {}, torch.float32)
    g = x.reshape(2, 2, 3, 16 // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    bound = _bound(g, parts["scale"].float().unsqueeze(-1), lo, hi)
    assert ((y - x).abs().reshape(g.shape) <= bound).all()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([2, 3, 4]), st.sampled_from([4, 8]), st.integers(1, 20), st.data())
def test_per_channel_error_at_most_half_a_step(bits, block, tokens, data):
    """int*-channel: one (scale, zero) per channel and block of tokens; also a ragged last block."""
    x = torch.from_numpy(data.draw(arrays("float32", (1, 2, tokens, 16), elements=floats)))
    q = IntNChannel(16, bits=bits, token_group=block)
    parts = q.quantize(x, {})
    y = q.dequantize(parts, {}, torch.float32)
    assert y.shape == x.shape
    for b0 in range(0, tokens, block):
        xb = x[:, :, b0:b0 + block]
        lo, hi = xb.amin(2, keepdim=True), xb.amax(2, keepdim=True)
        scale = parts["scale"][:, :, b0 // block].float().unsqueeze(2)
        assert ((y[:, :, b0:b0 + block] - xb).abs() <= _bound(xb, scale, lo, hi)).all()


@settings(max_examples=40, deadline=None)
@given(arrays("float32", (3, 2, 4, 16), elements=floats).map(torch.from_numpy))
def test_per_sequence_static_scales(x):
    """Static scales per (sequence, head), ``amax[B, H]``: each row quantized on its own range."""
    amax = x.abs().amax(dim=(2, 3))
    for q in (Int8SharedScale(16), Fp8(16, "fp8-e4m3")):
        state = q.calibrate(amax)
        assert state["scale"].shape == (3, 2)
        y = q.dequantize(q.quantize(x, state), state, torch.float32)
        assert int(q.clipped(x, state)) == 0
        step = state["scale"][..., None, None]
        rel = 1 / 127 if isinstance(q, Int8SharedScale) else 2**-4  # int8 half-step / e4m3 relative
        bound = (step * 127 * rel if isinstance(q, Int8SharedScale) else x.abs() * rel) + step * 1e-2 + 1e-6
        assert ((y - x).abs() <= bound).all()
