"""Codebook quantizers ``tq2/tq3/tq4``: the MSE theory check, exact head-space attention (torch path), and
the Triton decode / chunk kernels reading codebook codes in-kernel (interpreter on CPU) against the torch path."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kvquant.config import ConfigError, KVPrecision, KVQuantConfig  # noqa: E402
from kvquant.kernels import dispatch  # noqa: E402
from kvquant.quantizers import GAINS, Codebook, IntNGrouped, make_quantizer, uniform_levels  # noqa: E402
from kvquant.store import LayerStore, make_groups  # noqa: E402
from kvquant.transformers_compat import cache_kw

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# MSE of the Lloyd-Max quantizer of a unit Gaussian (Max 1960; Lloyd 1982), per coordinate
LLOYD_MAX_GAUSSIAN = {2: 0.1175, 3: 0.03454, 4: 0.009497}


def gaussian_like(n: int, D: int, seed: int = 0) -> torch.Tensor:
    """Rows with per-channel scales and a large per-channel offset (what q/k/v-bias keys look like)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.rand(1, 1, 1, D, generator=g) * 1.5 + 0.5
    off = torch.randn(1, 1, 1, D, generator=g) * 8
    return torch.randn(1, 2, n, D, generator=g) * mag + off


def rel_mse(q, x: torch.Tensor) -> float:
    state = q.fit(x) if q.space else q.calibrate(x.abs().amax(dim=(0, 2, 3)))
    xh = q.dequantize(q.quantize(x, state), state, torch.float32)
    centered = x - x.mean(dim=(0, 2), keepdim=True)
    return float(((x - xh) ** 2).sum() / (centered**2).sum())


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("D", [64, 128])
def test_mse_near_lloyd_max_and_below_uniform(bits, D):
    """Build 4: on rotated Gaussian-like rows the codebook's relative MSE is within 10% of the Lloyd-Max
    optimum for its width, and below a uniform grid of as many levels with the same norm side information."""
    x = gaussian_like(2048, D)
    tq = rel_mse(Codebook(D, bits, gain="mse"), x)
    assert abs(tq / LLOYD_MAX_GAUSSIAN[bits] - 1) <= 0.10, (tq, LLOYD_MAX_GAUSSIAN[bits])
    uniform = rel_mse(Codebook(D, bits, levels=uniform_levels(bits, D), gain="mse"), x)
    assert tq < uniform
    # the default unbiased row gain pays 1 / cos^2 ~ 1 / (1 - D) in MSE for unshrunk scores and outputs
    unbiased = rel_mse(Codebook(D, bits), x)
    assert tq < unbiased <= 1.02 * tq / (1 - LLOYD_MAX_GAUSSIAN[bits]), (unbiased, tq)
    if bits < 4:  # also below kvquant's min/max grid over the whole row, which stores 3/8 bit more per value
        grid = IntNGrouped(D, bits=bits, group_size=D) if bits != 3 else make_quantizer("int3", D, group_size=D)
        assert tq < rel_mse(grid, x)


TQC_MIXED, TQC_DROPPED = "tqc-" + "4" * 16 + "3" * 32 + "2" * 16, "tqc-" + "0" * 8 + "4" * 56
UNBIASED_KINDS = ["tq2", "tq3", "tq4", "tqv3", "tqt3", TQC_MIXED, TQC_DROPPED]


@pytest.mark.parametrize("precision", UNBIASED_KINDS)
def test_unbiased_gain_keeps_each_rows_projection(precision):
    """``gain: unbiased`` (default): a stored row's projection on its own (centered) row is the row's squared norm,
    up to the 8-bit norm code (mean over rows within 0.5%; ``tqc``: over the wide channels of its row norm).
    ``gain: mse`` shrinks it by about the code's relative MSE (the Lloyd-Max centroid condition)."""
    x = gaussian_like(512, 64, seed=5)
    ratios = {}
    for gain in GAINS:
        q = make_quantizer(precision, 64, gain=gain)
        state = q.fit(x)
        d = q.to_space(x, state)
        dh = q.to_space(q.dequantize(q.quantize(x, state), state, torch.float32), state)
        if hasattr(q, "norm_mask"):  # tqc: the channels its row norm is taken over
            d, dh = (t * q.norm_mask for t in (d, dh))
        ratios[gain] = float(((d * dh).sum(-1) / (d * d).sum(-1)).mean())
    assert abs(ratios["unbiased"] - 1) < 0.005, ratios
    assert ratios["mse"] < ratios["unbiased"] - 0.005, ratios


def test_codebook_gain_reaches_the_store():
    """``codebook_gain`` in a config reaches every codebook quantizer the store builds; a bad value names the field."""
    for gain in GAINS:
        cfg = KVQuantConfig.from_dict({"default": {"key": "tqv3", "value": "tq3"}, "codebook_gain": gain})
        ((_, _, kq, vq),) = make_groups([cfg.default] * 2, cfg, 64)
        assert kq.gain == vq.gain == gain
        assert KVQuantConfig.from_dict(cfg.to_dict()).codebook_gain == gain
    with pytest.raises(ConfigError, match="^codebook_gain: 'lsq'"):
        KVQuantConfig.from_dict({"default": "tq3", "codebook_gain": "lsq"})
    with pytest.raises(ValueError, match="gain"):
        make_quantizer("tq3", 64, gain="lsq")


def test_mean_removal_handles_offsets():
    """A large per-channel offset spread over every channel by the rotation costs a lot without centering."""
    x = gaussian_like(512, 64, seed=3)
    assert rel_mse(Codebook(64, 4), x) * 5 < rel_mse(Codebook(64, 4, center=False), x)


def test_layout_and_bits():
    q = make_quantizer("tq3", 64)
    assert q.bits_per_element() == 3 + 8 / 64
    assert {n: s.shape for n, s in q.parts().items()} == {"q": (24,), "norm": (1,)}
    with pytest.raises(ValueError, match="head_dim"):
        Codebook(48, 4)
    cfg = KVQuantConfig(default=KVPrecision("tq4", "tq3"))
    assert cfg.bits("tq4", 64) == 4.125
    with pytest.raises(ConfigError, match="precision"):
        KVQuantConfig.from_dict({"default": "tq5"})
    from kvquant.shape import ModelShape

    shape = ModelShape(num_layers=2, num_kv_heads=2, head_dim=48)
    with pytest.raises(ConfigError, match="tq3 rotates by Hadamard .*power-of-two head_dim"):
        cfg.validate(shape)


# ------------------------------------------------------------------------------ attention (exact maths)
def codebook_layer(row, B=2, D=64, past=70, Tq=1, steps=(), seed=0, block=16, **options):
    """A LayerStore of codebook (and other) heads with keys carrying a large per-channel offset."""
    g = torch.Generator().manual_seed(seed)
    row = [r if isinstance(r, KVPrecision) else KVPrecision(r, r) for r in row]
    layer = LayerStore(row, KVQuantConfig(block_size=block, **options), D, B, DEV)
    H = len(row)
    off = torch.randn(1, H, 1, D, generator=g) * 4
    k = (torch.randn(B, H, past + Tq, D, generator=g) + off).to(DEV)
    v = (torch.randn(B, H, past + Tq, D, generator=g) + off / 4).to(DEV)
    cuts = [0, *[c for c in steps if 0 < c < past], past, past + Tq]
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        layer.append(k[:, :, a:b], v[:, :, a:b])
    return layer, k, v


def model_space_reference(q, k, v, layer, past, scaling):
    """SDPA over the model-space history (each quantized row dequantized by its quantizer), the fresh chunk exact."""
    kh, vh = k.clone(), v.clone()
    for g in layer.groups:
        for s, x in ((g.key, kh), (g.value, vh)):
            parts = {n: t[:, :, : layer.q_end] for n, t in s.gather(layer.table()).items()}  # via the block tables
            x[:, g.head_index, : layer.q_end] = s.quantizer.dequantize(parts, s.state, torch.float32)
    n = min(layer.sink_tokens, past)
    kh[:, :, :n], vh[:, :, :n] = k[:, :, :n].half().float(), v[:, :, :n].half().float()
    res = slice(layer.q_end, past)  # residual rows: fp16 copies
    kh[:, :, res], vh[:, :, res] = k[:, :, res].half().float(), v[:, :, res].half().float()
    kh[:, :, past:], vh[:, :, past:] = k[:, :, past:], v[:, :, past:]
    rep = q.shape[1] // layer.num_heads
    Tq = q.shape[2]
    L = past + Tq
    mask = torch.arange(L, device=q.device)[None, :] <= (torch.arange(Tq, device=q.device)[:, None] + past)
    return F.scaled_dot_product_attention(
        q, kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1), attn_mask=mask, scale=scaling
    )


ROWS = {
    "tq4": ["tq4", "tq4"],
    "k4v3+int8": [KVPrecision("tq4", "tq3"), "int8-token"],
    "k2+fp16v": [KVPrecision("tq2", "fp16"), KVPrecision("int4", "tq2")],
}
OPTIONS = {"plain": {}, "sinks+residual": {"sink_tokens": 3, "residual_tokens": 16},
           "residual-step1": {"sink_tokens": 4, "residual_tokens": 13, "residual_step": 1},
           "rotate": {"rotate": "kv", "center_keys": False}}  # key centering: tests/test_stress_presets.py


@pytest.mark.parametrize("row", list(ROWS), ids=str)
@pytest.mark.parametrize("option", list(OPTIONS), ids=str)
@pytest.mark.parametrize("Tq", [1, 5])
def test_head_space_attention_is_exact(row, option, Tq, monkeypatch):
    """Queries rotated once and the output mapped back once give exactly the attention over the model-space
    dequantized history (the key mean shifts every score of a query alike), with GQA (3 query heads per KV)."""
    monkeypatch.setenv("KVQUANT_ATTENTION", "torch")
    layer, k, v = codebook_layer(ROWS[row], past=70, Tq=Tq, steps=(40, 41), **OPTIONS[option])
    q = torch.randn(2, 3 * layer.num_heads, Tq, 64, device=DEV)
    out = dispatch.attend(q, k[:, :, 70:], v[:, :, 70:], layer, 70, None, 0.125)
    ref = model_space_reference(q, k, v, layer, 70, 0.125)
    if layer.space.rotate_keys:  # the reference is in storage space; dispatch's input and output are in model space
        from kvquant.rotation import fwht

        ref = fwht(model_space_reference(fwht(q), fwht(k), fwht(v), layer, 70, 0.125))
    assert (out - ref).abs().max() <= 2e-4


def test_residual_step_one_holds_exactly_r_tokens():
    """``residual_step: 1``: after every append the window holds exactly R tokens (not R .. R + block - 1), the
    pool grows token by token (not at block boundaries), and a row already in the pool is never re-quantized."""
    R = 13
    layer, k, v = codebook_layer(["tq4", KVPrecision("tq4", "tq3")], past=40, Tq=1, steps=(20, 21, 30),
                                 sink_tokens=4, residual_tokens=R, residual_step=1)  # fmt: skip
    assert layer.cache_pos == 41 and layer.q_end == 41 - R
    s = layer.groups[0].key
    first = s.gather(layer.table())["q"][:, :, : layer.q_end].clone()
    g = torch.Generator().manual_seed(3)
    for _ in range(5):  # one-token decode steps: one more token to the pool each
        kk, vv = torch.randn(2, 2, 1, 64, generator=g).to(DEV), torch.randn(2, 2, 1, 64, generator=g).to(DEV)
        layer.append(kk, vv)
        assert layer.cache_pos - layer.q_end == R
    assert torch.equal(s.gather(layer.table())["q"][:, :, : first.shape[2]], first)
    default, _, _ = codebook_layer(["tq4"], past=40, Tq=1, sink_tokens=4, residual_tokens=R)
    assert default.cache_pos - default.q_end == R + (41 - R) % 16  # the default flushes whole blocks


def test_residual_step_is_checked():
    with pytest.raises(ConfigError, match="residual_step"):
        KVQuantConfig.from_dict({"block_size": 16, "residual_tokens": 8, "residual_step": 0})
    with pytest.raises(ConfigError, match="residual_step"):
        KVQuantConfig.from_dict({"block_size": 16, "residual_tokens": 8, "residual_step": 32})
    cfg = KVQuantConfig.from_dict({"default": "tq4", "residual_tokens": 8, "residual_step": 1})
    assert KVQuantConfig.from_dict(cfg.to_dict()).residual_step == 1
    with pytest.raises(ConfigError, match="residual_step"):  # per-channel blocks share one scale per block
        LayerStore([KVPrecision("int4-channel", "int4")],
                   KVQuantConfig(block_size=16, residual_tokens=8, residual_step=1), 64, 1, DEV)


def test_memory_counts_norms_and_state():
    layer, _, _ = codebook_layer(["tq4", "tq3"], B=1, past=127, block=128)
    mem = layer.memory()
    tokens = 128  # one block
    assert mem["keys"] == 2 * tokens * 32 - tokens * 8  # packed codes: 32 B (tq4) + 24 B (tq3) per token
    assert mem["scales"] >= 2 * 2 * tokens  # one norm byte per token, head, K and V (+ the static state)


def test_calibrate_chooses_among_codebook_candidates(stories, tinystories_text, tmp_path):
    """``kvquant calibrate --candidates tq2,tq4,int8-token``: K and V allocated separately under the budget;
    the config it writes runs in a real cache (stories260K, head_dim 8)."""
    from kvquant import QuantizedKVCache
    from kvquant.calibrate import calibrate
    from kvquant.shape import ModelShape

    model, tok = stories
    res = calibrate(model, tok, tinystories_text, 5.0, candidates="tq2,tq4,int8-token", kv_separate=True,
                    calib_window=64, calib_windows=1, samples=2, output=tmp_path / "tq.yaml", heatmap=False,
                    use_cache=False)  # fmt: skip
    assert res.bits == {"tq2": 3.0, "tq4": 5.0, "int8-token": 10.0}  # + one 8-bit norm / fp16 scale per 8
    cfg = KVQuantConfig.from_file(tmp_path / "tq.yaml")
    assert cfg.avg_bits(ModelShape.of(model)) <= 5.0
    assert cfg.precisions() & {"tq2", "tq4"}
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    out = model.generate(ids, **cache_kw(QuantizedKVCache(model, cfg)), max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8


TRITON_ROWS = {
    "tq4": ["tq4", "tq4"],
    "tq3": ["tq3", "tq3"],
    "tq2": ["tq2", "tq2"],
    "k4v3+int8": [KVPrecision("tq4", "tq3"), "int8-token"],
    "k2+fp16v,int4+v2": [KVPrecision("tq2", "fp16"), KVPrecision("int4", "tq2")],
}


@pytest.mark.parametrize("row", list(TRITON_ROWS), ids=str)
@pytest.mark.parametrize("option", ["plain", "sinks+residual", "residual-step1"], ids=str)
@pytest.mark.parametrize("Tq", [1, 3], ids=["decode", "chunk"])
def test_triton_reads_codebook_codes(row, option, Tq, monkeypatch):
    """The Triton kernels (decode: Tq = 1, chunk: Tq > 1) read the codes, norms and levels through the block
    tables and match the torch block walk: every width, K/V asymmetric, mixed with int8 / int4 / fp16 heads."""
    layer, k, v = codebook_layer(TRITON_ROWS[row], D=32, past=45, Tq=Tq, steps=(20,), **OPTIONS[option])
    assert layer.has_head_space
    q = torch.randn(2, 2 * layer.num_heads, Tq, 32, device=DEV)
    triton_matches_torch(monkeypatch, (q, k[:, :, 45:], v[:, :, 45:], layer, 45, None, 0.17))


def triton_matches_torch(monkeypatch, args: tuple) -> torch.Tensor:
    """``dispatch.attend(*args)`` through the Triton path (interpreter on CPU; a fallback to torch fails the test)
    equals the torch path's result within 2e-4; returns the Triton result."""
    pytest.importorskip("triton")
    monkeypatch.setenv("KVQUANT_ATTENTION", "torch")
    ref = dispatch.attend(*args)
    monkeypatch.setenv("KVQUANT_ATTENTION", "triton")

    def no_fallback(*a, **kw):
        raise AssertionError("the Triton path fell back to torch")

    monkeypatch.setattr(dispatch, "attend_torch", no_fallback)
    out = dispatch.attend(*args)
    assert (out - ref).abs().max() <= 2e-4
    return out
