"""Values beyond fp16's range: stored finite (fp16 scales widened to fp32) or refused with a clear error;
NaN in the history propagates through attention instead of turning into a plausible output."""

from __future__ import annotations

import pytest
import torch

import kvquant
from kvquant import KVPrecision, KVQuantConfig
from kvquant.kernels.attention_torch import attend_naive, attend_torch, dequantize_history
from kvquant.quantizers import PRECISIONS
from kvquant.store import LayerStore
from kvquant.tensor_store import StoredOverflow
from kvquant.transformers_compat import cache_kw

from conftest import tiny_model

BIG = 6e5  # > 65504 = fp16 max
OPTIONS = {"plain": {}, "sinks+residual": {"sink_tokens": 2, "residual_tokens": 16}}


def _outlier_kv(dtype=torch.bfloat16, B=2, H=2, T=40, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, T, D, generator=g)
    k[..., 5] = BIG * (1 + torch.rand(B, H, T, generator=g))  # one key channel at 6e5 .. 1.2e6
    return k.to(dtype), torch.randn(B, H, T, D, generator=g).to(dtype)


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_every_precision_stores_finite_or_refuses(precision, option):
    k, v = _outlier_kv()
    cfg = KVQuantConfig.from_dict({"default": precision, "block_size": 16, **OPTIONS[option]})
    store = LayerStore([KVPrecision(precision, precision)] * 2, cfg, 64, 2, torch.device("cpu"))
    try:
        store.append(k[:, :, :33], v[:, :, :33])
        for t in range(33, 40):
            store.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
    except StoredOverflow as e:
        assert precision == "fp16" and str(e).startswith("precision: fp16 cannot store")
        return
    hk, hv = dequantize_history(store, 40)
    assert torch.isfinite(hk).all() and torch.isfinite(hv).all()
    # the outlier channel is read back at its magnitude (not 0, not inf): within its quantization step
    if precision not in ("int8", "fp8-e4m3", "fp8-e5m2"):  # static scales clip (counted), checked below
        rel = ((hk[..., 5] - k[..., 5].float()).abs() / k[..., 5].float().abs()).max().item()
        assert rel < 0.35, f"{precision}: outlier channel read back with relative error {rel:.2f}"


def test_widened_scales_are_counted_and_exact():
    """int4 scales/zeros widen to fp32 in the store that overflowed, memory() counts 4 bytes each."""
    k, v = _outlier_kv(torch.float32)
    cfg = KVQuantConfig.from_dict({"default": "int4", "block_size": 16})
    store = LayerStore([KVPrecision("int4", "int4")] * 2, cfg, 64, 2, torch.device("cpu"))
    store.append(k, v)
    g = store.groups[0]
    assert g.key.parts["scale"].dtype == torch.float32 and g.key.parts["zero"].dtype == torch.float32
    assert g.value.parts["scale"].dtype == torch.float16  # values did not overflow: still fp16
    mem = store.memory()
    used = mem["blocks"] * store.block_size // store.batch  # tokens per row held in whole blocks
    # B x H x tokens x 2 groups x (key scale + zero in fp32, value scale + zero in fp16)
    assert mem["scales"] == 2 * 2 * used * 2 * (2 * 4 + 2 * 2)
    assert g.key.quantizer.bits_per_element() == 4 + 2 * 32 * 2 / 64


def test_int8_token_widens_beyond_fp16_scale():
    x = torch.full((1, 1, 3, 64), 1e7)
    cfg = KVQuantConfig.from_dict({"default": "int8-token", "block_size": 16})
    store = LayerStore([KVPrecision("int8-token", "int8-token")], cfg, 64, 1, torch.device("cpu"))
    store.append(x, x)
    hk, _ = dequantize_history(store, 3)
    assert torch.allclose(hk, x, rtol=1e-2)


def test_fp32_model_dense_buffers_widen():
    """fp32 model: sink / residual buffers are fp16 unless a value would overflow it, then fp32."""
    k, v = _outlier_kv(torch.float32)
    cfg = KVQuantConfig.from_dict({"default": "int8-token", "block_size": 16, "sink_tokens": 2, "residual_tokens": 8})
    store = LayerStore([KVPrecision("int8-token", "int8-token")] * 2, cfg, 64, 2, torch.device("cpu"))
    store.append(k[:, :, :4] / BIG, v[:, :, :4])  # small values first: fp16 buffers
    assert store.dense.res_k.dtype == torch.float16
    store.append(k[:, :, 4:], v[:, :, 4:])
    assert store.dense.res_k.dtype == torch.float32 and store.dense.sink_k.dtype == torch.float32
    hk, _ = dequantize_history(store, 40)
    assert torch.isfinite(hk).all()


@pytest.mark.parametrize("rotate", ["keys", "kv"])
def test_fp32_model_dense_buffers_widen_for_the_rotated_magnitudes(rotate):
    """The widening test looks at what is stored: a rotation adds up equal channels (20000 in each of 64
    channels -> 160000 in one), so fp16 buffers must widen although no raw value exceeds 65504."""
    cfg = KVQuantConfig.from_dict({"default": "int8-token", "block_size": 16, "residual_tokens": 8, "rotate": rotate})
    store = LayerStore([KVPrecision("int8-token", "int8-token")] * 2, cfg, 64, 1, torch.device("cpu"))
    store.append(torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 64))
    assert store.dense.res_k.dtype == torch.float16
    k = torch.full((1, 2, 1, 64), 2e4)
    store.append(k, k.clone())
    assert store.dense.res_k.dtype == torch.float32
    hk, hv = dequantize_history(store, 5)
    assert torch.isfinite(hk).all() and torch.isfinite(hv).all()


def test_headroom_overflow_is_refused():
    with pytest.raises(ValueError, match="^headroom: "):  # refused at load (bounded) ...
        KVQuantConfig.from_dict({"default": "int8", "block_size": 16, "headroom": 1e40})
    # ... and when built directly or changed after construction: no config that holds it reaches a store
    with pytest.raises(ValueError, match="^headroom: "):
        KVQuantConfig(default=KVPrecision("int8", "int8"), block_size=16, headroom=1e40)
    cfg = KVQuantConfig(default=KVPrecision("int8", "int8"), block_size=16)
    with pytest.raises(ValueError, match="^headroom: "):
        cfg.headroom = 1e40
    assert cfg.headroom != 1e40


@pytest.mark.parametrize("past,tq", [(30, 1), (30, 5), (300, 1)])
def test_nan_history_propagates(past, tq):
    """A NaN in the stored history makes the output NaN (it used to give exactly 0)."""
    cfg = KVQuantConfig.from_dict({"default": "fp16", "block_size": 16, "check_finite": False})
    store = LayerStore([KVPrecision("fp16", "fp16")], cfg, 64, 2, torch.device("cpu"))
    k, v = torch.randn(2, 1, past, 64), torch.randn(2, 1, past, 64)
    k[0, 0, 3, :] = float("nan")
    store.append(k, v)
    fk, fv = torch.randn(2, 1, tq, 64), torch.randn(2, 1, tq, 64)
    store.append(fk, fv)
    q = torch.randn(2, 1, tq, 64)
    out = attend_torch(q, fk, fv, store, past, None, 0.125)
    assert torch.isnan(out[0]).all()
    assert torch.isfinite(out[1]).all()
    assert torch.isnan(attend_naive(q, fk, fv, store, past, None, 0.125)[0]).all()


def test_nan_history_propagates_triton():
    pytest.importorskip("triton")
    from kvquant.kernels.triton_attention import attend_triton

    cfg = KVQuantConfig.from_dict({"default": "int8-token", "block_size": 16, "check_finite": False,
                                   "residual_tokens": 16})
    store = LayerStore([KVPrecision("fp16", "fp16")], cfg, 64, 2, torch.device("cpu"))
    k, v = torch.randn(2, 1, 40, 64), torch.randn(2, 1, 40, 64)
    k[0, 0, 3, :] = float("nan")  # in the pool
    v[1, 0, 38, :] = float("nan")  # in the residual
    store.append(k, v)
    fk, fv = torch.randn(2, 1, 1, 64), torch.randn(2, 1, 1, 64)
    store.append(fk, fv)
    out = attend_triton(torch.randn(2, 2, 1, 64), fk, fv, store, 40, None, 0.125)
    assert torch.isnan(out).all()


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_bf16_model_key_channel_at_6e5(precision):
    """Acceptance: a bf16 model with a key channel at 6e5 stores finite values or raises a clear error."""
    model = tiny_model(layers=1, attention_bias=True).to(torch.bfloat16)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.bias[5] = BIG
    cache = kvquant.QuantizedKVCache(model, KVQuantConfig.from_dict({"default": precision, "block_size": 16}))
    try:
        model.generate(torch.tensor([[1, 5, 9, 17, 33, 4, 70, 12]]), max_new_tokens=4, do_sample=False,
                       **cache_kw(cache))
    except StoredOverflow as e:
        assert precision == "fp16", e
        return
    store = cache.layers[0].store
    hk, hv = dequantize_history(store, store.cache_pos)
    assert hk.abs().amax() > 1e5 and torch.isfinite(hk).all() and torch.isfinite(hv).all()
