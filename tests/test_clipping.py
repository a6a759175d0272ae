"""Static scales: clipping is counted, reported (memory_report()['clipped']) and warned about once per
cache; a degenerate prefill (1 token, all zeros) does not fix a useless scale."""

from __future__ import annotations

import warnings

import pytest
import torch

from kvquant import KVPrecision, KVQuantConfig, ModelShape, QuantizedKVCache
from kvquant.dense import CALIB_MAX_TOKENS, CALIB_MIN_TOKENS
from kvquant.kernels.attention_torch import dequantize_history
from kvquant.store import LayerStore

SHAPE = ModelShape(num_layers=2, num_kv_heads=2, head_dim=32)


def _store(precision="int8", **options):
    cfg = KVQuantConfig.from_dict({"default": precision, "block_size": 16, **options})
    return LayerStore([KVPrecision(precision, precision)] * 2, cfg, 32, 1, torch.device("cpu"))


@pytest.mark.parametrize("precision", ["int8", "fp8-e4m3"])
def test_one_token_prompt_does_not_fix_the_scale(precision):
    """A 1-token prompt used to set the static scale from one token: later tokens clipped (205 values
    on stories260K). Calibration now waits for CALIB_MIN_TOKENS real tokens (held in full precision)."""
    store = _store(precision)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 40, 32, generator=g)
    x[:, :, 0] *= 0.1  # a small first token (e.g. BOS)
    for t in range(40):
        store.append(x[:, :, t:t + 1], x[:, :, t:t + 1])
    assert store.dense.calibrated and store.q_end == 40
    assert store.clipped() == 0
    k, _ = dequantize_history(store, 40)
    assert (k - x).abs().max() < 0.2  # within a quantization step (a 1-token scale: errors > 2)


def test_all_zero_prefill_waits_for_a_nonzero_value():
    """An all-zero prefill used to give a ~1e-38 scale: every later key read back as ~0."""
    store = _store("int8")
    store.append(torch.zeros(1, 2, 20, 32), torch.zeros(1, 2, 20, 32))
    assert not store.dense.calibrated and store.q_end == 0  # held in full precision
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 20, 32, generator=g)
    store.append(x, x)
    assert store.dense.calibrated
    k, v = dequantize_history(store, 40)
    assert torch.equal(k[:, :, :20], torch.zeros(1, 2, 20, 32))
    assert ((k[:, :, 20:] - x).abs().max() / x.abs().max()) < 0.02


def test_zeros_for_too_long_fall_back_to_a_safe_scale():
    store = _store("int8", headroom=1.0)
    store.append(torch.zeros(1, 2, CALIB_MAX_TOKENS, 32), torch.zeros(1, 2, CALIB_MAX_TOKENS, 32))
    assert store.dense.calibrated
    scale = store.groups[0].key.state["scale"]
    torch.testing.assert_close(scale, torch.full_like(scale, 1 / 127))  # amax 1.0: values up to 1 kept
    assert CALIB_MIN_TOKENS < CALIB_MAX_TOKENS


def test_clipping_is_reported_and_warned_once():
    cache = QuantizedKVCache(SHAPE, KVQuantConfig.from_dict({"default": "int8", "headroom": 1.0}))
    g = torch.Generator().manual_seed(2)
    prefill = torch.randn(1, 2, 32, 32, generator=g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for layer in range(2):
            cache.update(prefill, prefill, layer)
        for _ in range(3):  # later tokens 4x larger than the prefill: most of them clip
            x = torch.randn(1, 2, 16, 32, generator=g) * 4
            for layer in range(2):
                cache.update(x, x, layer)
        report = cache.memory_report()
        report2 = cache.memory_report()
    ours = [w for w in caught if "clipped" in str(w.message)]
    assert len(ours) == 1
    assert "static K/V scales clipped" in str(ours[0].message) and cache.session_id in str(ours[0].message)
    total = 2 * 2 * (32 + 48) * 32 * 2  # layers x heads x tokens x head_dim x (K and V)
    assert report["clipped_values"] == cache.clipped_values() > 0
    assert report["clipped"] == pytest.approx(report["clipped_values"] / total)
    assert report["clipped"] > 0.1 and report2["clipped"] == report["clipped"]


def test_no_clipping_no_warning():
    cache = QuantizedKVCache(SHAPE, "int4")
    x = torch.randn(1, 2, 40, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for layer in range(2):
            cache.update(x, x, layer)
        assert cache.memory_report()["clipped"] == 0.0


def test_pad_positions_do_not_count_as_clipped():
    """Left padding is quantized with its row's scale but is never read: it is not counted as clipped."""
    cfg = KVQuantConfig.from_dict({"default": "int8", "headroom": 1.0})
    store = LayerStore([KVPrecision("int8", "int8")] * 2, cfg, 32, 2, torch.device("cpu"))
    x = torch.randn(2, 2, 24, 32)
    x[1, :, :4] = 100.0  # row 1's pads: far beyond its real tokens' scale
    store.append(x, x, row_start=torch.tensor([0, 4]))
    assert store.clipped() == 0
    assert store.static_values() == 2 * (24 + 20) * 2 * 32  # K and V x real tokens x heads x head_dim


@pytest.mark.parametrize("rows", [
    [KVPrecision("int8", "int8")] * 2,  # one paired group
    [KVPrecision("fp8-e4m3", "fp8-e4m3"), KVPrecision("int8", "int4")],  # a paired and an unpaired group
])
def test_paired_kv_write_stores_and_counts_as_separate_writes(monkeypatch, rows):
    """K and V of a pairable group (int8, fp8) are quantized in one pass (store.write_pair): the stored
    parts, the clipping count and the values counted must equal two separate writes, for a prompt with
    left padding and for decode tokens that clip."""
    import kvquant.tensor_store as store_mod

    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 2, 2, 60, 32, generator=g)
    k[:, :, 50:] *= 4.0  # decode tokens beyond the prompt's range: clipped by the static scales
    v[:, :, 55:] *= 6.0

    def run(pair: bool) -> LayerStore:
        if not pair:
            monkeypatch.setattr(store_mod.QuantizedTensorStore, "paired_state", lambda self, other: None)
        cfg = KVQuantConfig(block_size=16)
        s = LayerStore(rows, cfg, 32, 2, torch.device("cpu"))
        s.append(k[:, :, :40], v[:, :, :40], row_start=torch.tensor([0, 7]))
        for t in range(40, 60):
            s.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        monkeypatch.undo()
        return s

    paired, separate = run(True), run(False)
    assert any(gr.key.paired_state(gr.value) is not None for gr in paired.groups)
    assert paired.clipped() == separate.clipped() > 0
    assert paired.static_values() == separate.static_values()
    for a, b in zip(paired.groups, separate.groups, strict=True):
        for kind in ("key", "value"):
            pa, pb = getattr(a, kind).parts, getattr(b, kind).parts
            for name in pa:
                assert torch.equal(pa[name].view(torch.uint8), pb[name].view(torch.uint8)), (kind, name)
