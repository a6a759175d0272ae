"""Quantizer math: round-trip error bounds (hypothesis), exact zeros, packing, NaN/Inf rejection."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvquant import KVQuantConfig
from kvquant.quantizers import Int8PerToken, Int8SharedScale, IntNGrouped, make_quantizer, pack_codes, unpack_codes
from kvquant.store import LayerStore

D = 16
floats = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_infinity=False, width=32)
tensors = arrays("float32", (1, 2, 3, D), elements=floats).map(torch.from_numpy)


def fp16_slack(x: torch.Tensor) -> torch.Tensor:
    return x.abs() * 2**-10  # scales/zeros stored in fp16 move the grid by at most this much


@settings(max_examples=60, deadline=None)
@given(tensors)
def test_int8_per_token_error_at_most_half_a_step(x):
    q = Int8PerToken(D)
    parts = q.quantize(x, {})
    err = (q.dequantize(parts, {}, torch.float32) - x).abs()
    assert (err <= parts["scale"].float() / 2 * (1 + 1e-3) + 1e-6).all()


@settings(max_examples=60, deadline=None)
@given(tensors)
def test_int8_shared_scale_error_within_range(x):
    q = Int8SharedScale(D)
    state = q.calibrate(x.abs().amax(dim=(0, 2, 3)))  # calibrated on x itself: nothing clips
    err = (q.dequantize(q.quantize(x, state), state, torch.float32) - x).abs()
    assert (err <= state["scale"].view(1, -1, 1, 1) / 2 * (1 + 1e-4) + 1e-6).all()
    assert int(q.clipped(x, state)) == 0


@settings(max_examples=60, deadline=None)
@given(tensors, st.sampled_from([4, 8, 16]), st.sampled_from([2, 4]))
def test_grouped_int_error_at_most_half_a_step(x, group, bits):
    q = IntNGrouped(D, bits=bits, group_size=group)
    parts = q.quantize(x, {})
    err = (q.dequantize(parts, {}, torch.float32) - x).abs().reshape(1, 2, 3, D // group, group)
    step = parts["scale"].float().unsqueeze(-1)
    bound = step / 2 * (1 + 1e-3) + fp16_slack(x).reshape(err.shape) + 1e-5
    assert (err <= bound).all()


def test_clipping_is_counted_for_static_scales():
    q = Int8SharedScale(D)
    state = q.calibrate(torch.tensor([1.0, 1.0]))
    x = torch.zeros(1, 2, 1, D)
    x[0, 0, 0, 0] = 5.0
    y = q.dequantize(q.quantize(x, state), state, torch.float32)
    assert int(q.clipped(x, state)) == 1 and y[0, 0, 0, 0] == pytest.approx(1.0)


@pytest.mark.parametrize("precision", ["int8", "int8-token", "int4", "int2", "fp8-e4m3", "fp8-e5m2", "fp16"])
def test_zeros_are_exact(precision):
    q = make_quantizer(precision, D, group_size=8)
    x = torch.randn(2, 2, 5, D)
    x[:, :, 1] = 0.0  # a whole zero token
    x[0, 0, 2, :4] = 0.0
    state = q.calibrate(x.abs().amax(dim=(0, 2, 3))) if q.static else {}
    y = q.dequantize(q.quantize(x, state), state, torch.float32)
    assert (y[:, :, 1] == 0).all()
    if precision not in ("int4", "int2"):  # asymmetric grids need not contain 0 inside a mixed group
        assert (y[0, 0, 2, :4] == 0).all()


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(0, 2**bits, (3, 5, D), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape[-1] == D * bits // 8 and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed, bits), codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("side", ["key", "value"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_inf_rejected_when_written(bad, side, dtype):
    store = LayerStore([KVQuantConfig.preset("int8").default] * 2, KVQuantConfig.preset("int8"), D, 1,
                       torch.device("cpu"))
    k, v = torch.randn(2, 1, 2, 3, D, dtype=dtype)
    (k if side == "key" else v)[0, 1, 2, 3] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        store.append(k, v)
    assert store.cache_pos == 0  # nothing half-written


@pytest.mark.parametrize("preset", ["int8", "int8-token", "int4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_inf_rejected_in_a_decode_token(preset, bad):
    """After the prefill, int8's decode writes skip the separate NaN/Inf pass (its quantizer checks while
    quantizing); a bad token is still refused, before any block or table changes."""
    cfg = KVQuantConfig.load({**KVQuantConfig.preset(preset).to_dict(), "block_size": 16})
    store = LayerStore([cfg.default] * 2, cfg, D, 1, torch.device("cpu"))
    clean = LayerStore([cfg.default] * 2, cfg, D, 1, torch.device("cpu"))
    torch.manual_seed(0)
    k, v = torch.randn(2, 1, 2, 32, D)  # 32 tokens: two whole blocks, the next token starts a third
    for s in (store, clean):
        s.append(k, v)
    tables, held = [list(t) for t in store.tables], len(store.blocks.free)
    nk, nv = torch.randn(2, 1, 2, 1, D)
    bad_v = nv.clone()
    bad_v[0, 1, 0, 5] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        store.append(nk, bad_v)
    assert store.cache_pos == 32 and store.tables == tables and len(store.blocks.free) == held
    for s in (store, clean):
        s.append(nk, nv)
    for g, h in zip(store.groups, clean.groups, strict=True):
        assert torch.equal(torch.cat(store.read(g, 0, 33)), torch.cat(clean.read(h, 0, 33)))
    assert store.clipped() == clean.clipped() and store.static_values() == clean.static_values()


def test_int8_static_overflowing_scaled_value_is_clipped_not_refused():
    """x / scale may overflow to inf where x is finite (a tiny scale): that is clipping, counted, not NaN/Inf."""
    q = Int8SharedScale(D)
    state = {"scale": torch.full((2,), torch.finfo(torch.float32).tiny)}
    x = torch.zeros(1, 2, 3, D)
    x[0, 1, 2, 3] = 1e3
    parts, clipped = q.quantize_counted(x, state)
    assert int(clipped) == 1 and parts["q"][0, 1, 2, 3] == 127
    x[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        q.quantize_counted(x, state)
