"""Per-channel-width codebook keys ``tqc-<widths>``: packing, widths from the allocation, the error on
keys whose query energy sits in a few channels (vs ``tq3`` at the same bits), exact head-space attention
through a LayerStore, config parsing and bytes held."""

from __future__ import annotations

import math

import pytest
import torch

from kvquant.config import ConfigError, KVPrecision, KVQuantConfig
from kvquant.kernels import dispatch
from kvquant.quantizers import (
    ChannelCodebook,
    Codebook,
    allocate_widths,
    channel_precision,
    is_precision,
    make_quantizer,
)
from kvquant.quantizers.codebook import SEARCH_SCALES, gaussian_distortion, gaussian_levels
from kvquant.store import make_groups
from tests.test_codebook import DEV, codebook_layer, model_space_reference

WIDTHS = [0, 1, 2, 3, 4, 5, 6, 7, 8, 3, 2, 1] + [4] * 26 + [3] * 26  # 224 bits
assert sum(WIDTHS) % 8 == 0


def test_gaussian_levels_and_distortion():
    # Max (1960): 0.3634 (1 bit), 0.1175, 0.03454, 0.009497 (4 bits)
    for b, d in {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}.items():
        assert abs(gaussian_distortion(b) / d - 1) < 2e-3, (b, gaussian_distortion(b))
    assert gaussian_distortion(0) == 1.0
    assert all(gaussian_distortion(b + 1) < gaussian_distortion(b) for b in range(8))
    lv = gaussian_levels(3)
    assert len(lv) == 8 and abs(lv[0] + lv[-1]) < 1e-6


def test_pack_roundtrip():
    q = ChannelCodebook(64, WIDTHS)
    assert q.parts()["q"].shape == (224 // 8,)
    assert q.bits_per_element() == (224 + 8) / 64
    g = torch.Generator().manual_seed(1)
    hi = torch.tensor([2**b for b in WIDTHS])
    codes = (torch.rand(2, 3, 5, 64, generator=g) * hi).long()
    assert torch.equal(q.unpack(q.pack(codes)), codes)


def test_code_is_the_nearest_level_of_each_channels_width():
    """The encoder's one batched search gives each channel the nearest level of its own width (a brute-force argmin
    over that width's levels), at any row count; far-out values take the outermost level, width 0 its mean (0)."""
    q = ChannelCodebook(64, WIDTHS)
    g = torch.Generator().manual_seed(3)
    for shape in [(1, 3, 1, 64), (2, 1, 37, 64)]:
        u = torch.randn(shape, generator=g) * 2
        u[..., 20] = 50.0
        u[..., 21] = -50.0
        codes, c = q._code(u)
        for j, b in enumerate(WIDTHS):
            lv = torch.tensor(gaussian_levels(b)) if b else torch.zeros(1)
            want = (u[..., j:j + 1] - lv).abs().argmin(-1)
            assert torch.equal(codes[..., j], want), j
            assert torch.equal(c[..., j], lv[want]), j


def test_trailing_zero_width_channels():
    """A row whose last channels have width 0 (their code starts past the row's last byte) unpacks to zeros there,
    and the kernels' channel info points inside the row for every channel."""
    from kvquant.kernels.triton_codebook import tqc_channel_info

    widths = [4] * 48 + [0] * 16  # 192 bits
    q = ChannelCodebook(64, widths)
    hi = torch.tensor([2**b for b in widths])
    codes = (torch.rand(3, 64, generator=torch.Generator().manual_seed(2)) * hi).long()
    assert torch.equal(q.unpack(q.pack(codes)), codes)
    info = tqc_channel_info(torch.tensor(widths))
    assert int((info & 255).max()) < 192 // 8


def test_allocation_follows_weights():
    w = [100.0] * 4 + [1.0] * 60
    widths = allocate_widths(w, 3 * 64)
    assert sum(widths) == 192
    assert min(widths[:4]) > max(widths[4:])
    assert allocate_widths([1.0] * 64, 3 * 64) == [3] * 64  # equal weights: equal widths
    with pytest.raises(ValueError, match="total_bits"):
        allocate_widths([1.0] * 4, 40)


def score_error(qz, k: torch.Tensor, q: torch.Tensor) -> float:
    """Mean squared error of the scores ``q . k`` over all (query, key) pairs, relative to their variance."""
    state = qz.fit(k)
    kh = qz.dequantize(qz.quantize(k, state), state, torch.float32)
    s, sh = q @ k[0, 0].T, q @ kh[0, 0].T
    return float(((s - sh) ** 2).mean() / s.var())


def test_beats_tq3_on_keys_with_concentrated_queries():
    """Keys with per-channel spreads, queries whose energy sits in 8 channels: allocating the same 3 bits per
    channel on average by E[q_j^2] var(k_j) beats the rotated tq3 codebook's score error by far."""
    g = torch.Generator().manual_seed(0)
    D = 64
    spread = torch.rand(D, generator=g) * 2 + 0.2
    k = torch.randn(1, 1, 2048, D, generator=g) * spread + torch.randn(D, generator=g) * 5
    qscale = torch.full((D,), 0.2)
    qscale[8:16] = 3.0
    q = torch.randn(256, D, generator=g) * qscale
    widths = allocate_widths((qscale**2 * spread**2).tolist(), 3 * D)
    tqc = score_error(ChannelCodebook(D, widths), k, q)
    tq3 = score_error(Codebook(D, 3), k, q)
    assert tqc * 3 < tq3, (tqc, tq3)
    # equal widths 3 everywhere: per-channel Gaussian codes are within 25% of Lloyd-Max on Gaussian channels
    flat = ChannelCodebook(D, [3] * D)
    state = flat.fit(k)
    kh = flat.dequantize(flat.quantize(k, state), state, torch.float32)
    rel = float(((k - kh) ** 2 / spread**2).mean())
    assert rel < 1.25 * gaussian_distortion(3), rel


def test_names_and_config():
    name = channel_precision(WIDTHS)
    assert is_precision(name) and is_precision("tq3") and not is_precision("tqc-3x")
    assert isinstance(make_quantizer(name, 64), ChannelCodebook)
    cfg = KVQuantConfig.from_dict({"default": {"key": name, "value": "tq3"}})
    assert cfg.default.key == name
    with pytest.raises(ValueError, match="widths"):
        make_quantizer("tqc-" + "3" * 63, 64)
    with pytest.raises(ValueError, match="multiple of 8"):
        ChannelCodebook(8, [1] * 7 + [2])
    with pytest.raises(ConfigError, match="precision"):
        KVQuantConfig.from_dict({"default": "tqc-abc"})
    from kvquant.shape import ModelShape

    with pytest.raises(ConfigError, match="widths: 63 given, head_dim is 64"):
        KVQuantConfig.from_dict({"default": {"key": "tqc-" + "3" * 63, "value": "tq3"}}).validate(
            ModelShape(num_layers=1, num_kv_heads=1, head_dim=64))


@pytest.mark.parametrize("option", [{}, {"sink_tokens": 3, "residual_tokens": 16}], ids=["plain", "sinks+residual"])
@pytest.mark.parametrize("Tq", [1, 5])
def test_head_space_attention_is_exact(option, Tq, monkeypatch):
    """Through a LayerStore (tqc keys beside tq3 values and an int8 head), attention over the stored rows equals
    SDPA over the model-space dequantized history."""
    monkeypatch.setenv("KVQUANT_ATTENTION", "torch")
    name = channel_precision(WIDTHS)
    row = [KVPrecision(name, "tq3"), KVPrecision("int8-token", "int8-token")]
    layer, k, v = codebook_layer(row, past=70, Tq=Tq, steps=(40, 41), **option)
    q = torch.randn(2, 3 * layer.num_heads, Tq, 64, device=DEV)
    out = dispatch.attend(q, k[:, :, 70:], v[:, :, 70:], layer, 70, None, 0.125)
    ref = model_space_reference(q, k, v, layer, 70, 0.125)
    assert (out - ref).abs().max() <= 2e-4


def test_memory_counts_codes_norms_and_state():
    name = channel_precision(WIDTHS)
    layer, _, _ = codebook_layer([KVPrecision(name, "tq3")], B=1, past=127, block=128)
    mem = layer.memory()
    tokens = 128
    assert mem["keys"] == tokens * 224 // 8
    assert mem["scales"] >= 2 * tokens + 2 * 64 * 4  # norm bytes (K, V) + the key mean and spread (fp32)
    assert math.isfinite(mem["scales"])


def test_row_norm_over_wide_channels_only():
    """A token with one huge narrow channel keeps its other channels' error: the row norm is taken over the
    channels at least as wide as the average (16 channels of 8 bits here), not over every channel."""
    widths = [8] * 16 + [2] * 48  # 224 bits, average 3.5: the norm is over the 16 wide channels
    q = ChannelCodebook(64, widths, search=False)  # the RMS scale alone (the search may widen this row: below)
    assert int(q.norm_mask.sum()) == 16
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 1, 512, 64, generator=g)
    state = q.fit(x)
    y = x.clone()
    y[0, 0, -1, 20] = 30.0  # one narrow channel of the last row far out
    err = (q.dequantize(q.quantize(y, state), state, torch.float32) - y)[0, 0] ** 2
    others = [j for j in range(64) if j != 20]
    typical = float(err[:-1, others].mean())
    assert float(err[-1, others].mean()) < 2 * typical


def test_presets_lists_every_precision_family(capsys):
    """`kvquant presets` names the parameterised families (tqc-...) beside the fixed precisions."""
    from kvquant.cli import main
    from kvquant.quantizers import PRECISION_FAMILIES

    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for prefix in PRECISION_FAMILIES:
        assert f"  {prefix}..." in out


def weighted_error(q, x, state):
    """Per row, ``sum_j 4^{width_j} (w_j - w_hat_j)^2`` of whitened rows: the score error the search minimises."""
    sigma = state["scale"].view(1, -1, 1, q.head_dim)
    e = (q.dequantize(q.quantize(x, state), state, torch.float32) - x) / sigma
    return (e**2 * q.error_weight).sum(-1)


def test_row_scale_search_lowers_the_score_weighted_error():
    """``search``: on heavy-tailed keys the searched row scale lowers the score-weighted error on average and
    on the rows with a value far out on a narrow channel (clipped at the RMS scale), with the same bytes."""
    torch.manual_seed(4)
    x = torch.distributions.StudentT(3.0).sample((1, 2, 1024, 64)) * (torch.rand(64) * 2 + 0.3)
    x[:, :, 700, 56] = 25.0  # channel 56 is 2 bits wide
    widths = allocate_widths(torch.linspace(4.0, 0.05, 64) ** 2, 4 * 64)
    assert widths[56] == 2
    plain, searched = ChannelCodebook(64, widths, search=False), ChannelCodebook(64, widths)
    state = plain.fit(x[:, :, :960])
    e0, e1 = weighted_error(plain, x, state), weighted_error(searched, x, state)
    assert float(e1.mean()) < 0.5 * float(e0.mean())  # ~0.2 over seeds
    assert float(e1[:, :, 700].max()) < 0.9 * float(e0[:, :, 700].max())  # (the grid ends at 2.5x: bounded)
    for part, spec in plain.parts().items():
        assert searched.parts()[part] == spec
    # every row's codes come from one of the scales tried, m = 1 among them
    _, divisor, _ = searched._encode(x, state)
    rms = searched._row_norm(searched._whiten(x, state))
    ratio = (divisor / rms).flatten()
    assert ((ratio[:, None] - torch.tensor(SEARCH_SCALES)).abs().amin(1) < 1e-5).all()
    assert (ratio == 1).any() and (ratio > 1).any()


def test_search_setting_reaches_the_quantizer():
    """``codebook_search`` in a config reaches every ``tqc`` quantizer the store builds and survives a round trip; a
    bad value names the field."""
    name = channel_precision(WIDTHS)
    for on in (True, False):
        cfg = KVQuantConfig.from_dict({"default": {"key": name, "value": "tq3"}, "codebook_search": on})
        ((_, _, kq, _),) = make_groups([cfg.default] * 2, cfg, 64)
        assert kq.search is on
        assert KVQuantConfig.from_dict(cfg.to_dict()).codebook_search is on
    assert KVQuantConfig.from_dict({"default": "tq3"}).codebook_search is True
    with pytest.raises(ConfigError, match="^codebook_search: 'yes'"):
        KVQuantConfig.from_dict({"default": "tq3", "codebook_search": "yes"})
