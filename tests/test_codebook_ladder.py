"""The age ladder (``ladder_tokens``, issue 14): embedded refinement codes of ``tq*`` / ``tqv*`` / ``tqc-*`` / ``tqt*``
rows and the store's ring of young refinement rows (exact attention, crop, beams, bytes); its second rung
(``ladder2_tokens``: ``refine2`` / ``decode_refined2``) likewise."""

from __future__ import annotations

import pytest
import torch

from kvquant.config import KVPrecision, KVQuantConfig
from kvquant.errors import ConfigError
from kvquant.kernels import dispatch
from kvquant.quantizers import ChannelCodebook, Codebook, TrellisCodebook, VectorCodebook
from kvquant.quantizers import trellis as trellis_module
from kvquant.quantizers.codebook import refined_levels, unpack_codes
from tests.test_codebook import DEV, codebook_layer, model_space_reference, triton_matches_torch


def rel_error(q, state, x, refined):
    parts = q.quantize(x, state)
    y = q.to_space(x, state)
    r = q.decode_refined(parts, q.refine(x, state, parts), state) if refined else q.decode_space(parts, state)
    return float(((r - y) ** 2).sum(-1).mean() / (y**2).sum(-1).mean())


def test_channel_refinement_reaches_the_next_widths():
    """tqc: one refinement bit per channel reads about as well as every channel one bit wider."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, 2, 3000, 64, generator=g) * (torch.rand(64, generator=g) * 3 + 0.2) + 1.0
    widths = [4, 3, 3, 0, 5, 2, 3, 4] * 8
    q, q1 = ChannelCodebook(64, widths), ChannelCodebook(64, [b + 1 for b in widths])
    st = q.fit(x)
    base, ref = rel_error(q, st, x, False), rel_error(q, st, x, True)
    assert ref < 0.4 * base
    assert ref < 1.05 * rel_error(q1, q1.fit(x), x, False)


def test_channel_refinement_follows_the_searched_scale():
    """With the row-scale search, the refinement bit splits the cell of the scale the base code was taken at: rows
    coded at a wider scale refine as well as the others (a bit taken at the RMS scale would miss their cells)."""
    torch.manual_seed(8)
    x = torch.distributions.StudentT(2.5).sample((1, 1, 2000, 64)) * (torch.rand(64) * 2 + 0.3)
    q = ChannelCodebook(64, [6, 5, 5, 4, 4, 3, 3, 2] * 8)
    st = q.fit(x)
    _, divisor, _ = q._encode(x, st)
    wide = (divisor / q._row_norm(q._whiten(x, st)) > 1.2).flatten()
    assert 50 < int(wide.sum()) < 1950
    parts = q.quantize(x, st)
    y = q.to_space(x, st)
    base = ((q.decode_space(parts, st) - y) ** 2).sum(-1).flatten()
    ratio = ((q.decode_refined(parts, q.refine(x, st, parts), st) - y) ** 2).sum(-1).flatten() / base
    # median error ratio ~0.25 on either kind of row; a bit taken at the RMS scale reads ~0.5 on the wide ones
    assert float(ratio[wide].median()) < 0.35 and float(ratio[~wide].median()) < 0.35


@pytest.mark.parametrize("cls", [Codebook, VectorCodebook])
def test_refinement_reaches_about_the_next_width(cls):
    """tq3 + its refinement bit has about tq4's error (the embedded code costs little), far below tq3's."""
    x = torch.randn(1, 2, 4000, 64, generator=torch.Generator().manual_seed(5))
    q4 = Codebook(64, 4)
    e4 = rel_error(q4, q4.fit(x), x, False)
    q = cls(64, 3)
    st = q.fit(x)
    base, ref = rel_error(q, st, x, False), rel_error(q, st, x, True)
    assert ref < 0.35 * base
    assert ref < 1.12 * e4


@pytest.mark.parametrize("bits", [3, 4])
def test_trellis_refinement_beats_the_scalar_ladder(bits):
    """tqt: a sign-of-residual bit per coordinate takes ~64% off the trellis code's error, and the refined row reads
    below the scalar code's refined row (tq + its embedded bit) and, at 3 bits, the next scalar width."""
    x = torch.randn(1, 2, 1500, 64, generator=torch.Generator().manual_seed(7)) * 2 + 0.5
    q = TrellisCodebook(64, bits)
    st = q.fit(x)
    base, ref = rel_error(q, st, x, False), rel_error(q, st, x, True)
    assert ref < 0.4 * base
    qs = Codebook(64, bits)
    sts = qs.fit(x)
    assert ref < 0.92 * rel_error(qs, sts, x, True)
    if bits == 3:
        q4 = Codebook(64, 4)
        assert ref < rel_error(q4, q4.fit(x), x, False)


def test_trellis_refinement_step_is_least_squares(monkeypatch):
    """The step ``residual_step`` (mean |residual| on Gaussian rows) reads below a step a fifth smaller or larger on
    other rows; dropping the bits leaves the trellis code (decode_space is what it was)."""
    x = torch.randn(1, 1, 1500, 64, generator=torch.Generator().manual_seed(9))
    q = TrellisCodebook(64, 3)
    st = q.fit(x)
    parts = q.quantize(x, st)
    before = q.decode_space(parts, st)
    delta = trellis_module.residual_step(3, 64)
    errs = {}
    for f in (0.8, 1.0, 1.25):
        monkeypatch.setattr(trellis_module, "residual_step", lambda b, d, f=f: f * delta)
        errs[f] = rel_error(q, st, x, True)
    assert errs[1.0] < min(errs[0.8], errs[1.25])
    assert torch.equal(q.decode_space(parts, st), before)


def test_refined_levels_split_their_parent_cell():
    """Each child level lies in its parent's cell on the parent's side of the split: dropping the bit leaves the
    tq3 code."""
    lv = Codebook(64, 3).levels.tolist()
    children, splits, _ = refined_levels(tuple(lv), 64)
    edges = [-1.0, *((a + b) / 2 for a, b in zip(lv[:-1], lv[1:], strict=True)), 1.0]
    for c in range(len(lv)):
        a, b = children[2 * c], children[2 * c + 1]
        assert edges[c] < a < splits[c] < b < edges[c + 1]


def test_refine_keeps_the_base_code():
    """The refined row's codes under the base levels are the stored base codes (an embedded code)."""
    q = Codebook(64, 3)
    x = torch.randn(1, 1, 300, 64, generator=torch.Generator().manual_seed(2))
    st = q.fit(x)
    parts = q.quantize(x, st)
    r = q.decode_refined(parts, q.refine(x, st, parts), st)
    u = r / r.norm(dim=-1, keepdim=True)
    lv = q.levels
    # the cell of each refined value (scaled by the base norm) is its base code
    n = r.norm(dim=-1, keepdim=True)
    base = q.decode_space(parts, st)
    scale = (base.norm(dim=-1, keepdim=True) / lv[unpack_codes(parts["q"], 3).long()].norm(dim=-1, keepdim=True))
    cell = torch.bucketize(r / scale, (lv[1:] + lv[:-1]) / 2)
    assert torch.equal(cell, unpack_codes(parts["q"], 3).long())
    assert torch.isfinite(u).all() and (n > 0).all()


SECOND_RUNG = {
    "tq3": Codebook(64, 3), "tqt3": TrellisCodebook(64, 3), "tqc": ChannelCodebook(64, [4, 3, 3, 0, 5, 2, 3, 4] * 8),
}


@pytest.mark.parametrize("name", list(SECOND_RUNG))
def test_second_rung_cuts_the_refined_error(name):
    """The second rung's sign bit leaves ~1/3 of the refined row's error (tq3 / tqt3 / tqc, Gaussian rows with
    per-channel spreads and an offset), its step beats one a fifth smaller or larger, and dropping the bit leaves
    the refined row."""
    q = SECOND_RUNG[name]
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, 2, 1500, 64, generator=g) * (torch.rand(64, generator=g) * 3 + 0.2) + 1.0
    st = q.fit(x)
    parts = q.quantize(x, st)
    y = q.to_space(x, st)
    rp = q.refine(x, st, parts)
    r2 = q.refine2(x, st, parts, rp)
    y1, y2 = q.decode_refined(parts, rp, st), q.decode_refined2(parts, rp, r2, st)
    err = lambda r: float(((r - y) ** 2).sum(-1).mean())  # noqa: E731
    assert err(y2) < 0.4 * err(y1)
    assert err(y2) < min(err(y1 + (y2 - y1) * f) for f in (0.8, 1.2))
    assert torch.allclose((y2 - y1).abs(), q.step2(parts, rp, st))  # one step per coordinate, either sign
    assert r2["r2"].dtype == torch.uint8 and r2["r2"].shape[-1] == 64 // 8


def ladder_reference(q, k, v, layer, past, scaling):
    """:func:`model_space_reference` with the ladder's young pool rows ``[q_end - n, q_end)`` decoded with their
    refinement bits (the second rung's ``[q_end - n2, q_end)`` with both), recomputed here from the rows written
    (fp16-rounded, as the residual window holds them)."""
    return _sdpa(q, *ladder_history(k, v, layer), k, v, layer, past, scaling)


def ladder_history(k, v, layer):
    """The history ``k``, ``v`` as :func:`ladder_reference` reads it (its pool rows, the ladder's refined)."""
    kh, vh = k.clone(), v.clone()
    lo, hi = layer.q_end - layer.refine.ladder_n, layer.q_end
    lo2 = layer.q_end - layer.refine.ladder2_n
    for g in layer.groups:
        for s, x, src in ((g.key, kh, k), (g.value, vh, v)):
            full = s.gather(layer.table())
            parts = {n: t[:, :, :hi] for n, t in full.items()}
            x[:, g.head_index, :hi] = s.quantizer.dequantize(parts, s.state, torch.float32)
            if hasattr(s.quantizer, "refine") and hi > lo:
                young = {n: t[:, :, lo:hi] for n, t in full.items()}
                rows = src[:, g.head_index, lo:hi].half().float()
                r = s.quantizer.refine(rows, s.state, young)
                y = s.quantizer.decode_refined(young, r, s.state)
                if hasattr(s.quantizer, "refine2") and hi > lo2:
                    a = lo2 - lo
                    sub = lambda d: {n: t[:, :, a:] for n, t in d.items()}  # noqa: B023, E731
                    r2 = s.quantizer.refine2(rows[:, :, a:], s.state, sub(young), sub(r))
                    y[:, :, a:] = s.quantizer.decode_refined2(sub(young), sub(r), r2, s.state)
                x[:, g.head_index, lo:hi] = s.quantizer.from_space(y, s.state)
    # sinks, residual and the fresh chunk as the plain reference has them
    ref_k, ref_v = k.clone(), v.clone()
    ref_k[:, :, :hi], ref_v[:, :, :hi] = kh[:, :, :hi], vh[:, :, :hi]
    return ref_k, ref_v


def _sdpa(q, kh, vh, k, v, layer, past, scaling):
    n = min(layer.sink_tokens, past)
    kh[:, :, :n], vh[:, :, :n] = k[:, :, :n].half().float(), v[:, :, :n].half().float()
    res = slice(layer.q_end, past)
    kh[:, :, res], vh[:, :, res] = k[:, :, res].half().float(), v[:, :, res].half().float()
    rep = q.shape[1] // layer.num_heads
    Tq = q.shape[2]
    mask = torch.arange(past + Tq, device=q.device)[None, :] <= (torch.arange(Tq, device=q.device)[:, None] + past)
    return torch.nn.functional.scaled_dot_product_attention(
        q, kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1), attn_mask=mask, scale=scaling)


ROW = [KVPrecision("tq3", "tqv3"), KVPrecision("tqv3", "tq2"), KVPrecision("int8-token", "tq3")]
OPTS = {"sink_tokens": 4, "residual_tokens": 5, "residual_step": 1}


TQC = "tqc-" + "43305234" * 8  # 3 bits a channel on average, widths 0..5
ROW_TQC = [KVPrecision(TQC, "tqv3"), KVPrecision("tq3", "tq3"), KVPrecision(TQC, "int8-token")]
ROW_TQT = [KVPrecision("tqt3", "tqt4"), KVPrecision(TQC, "tqt3"), KVPrecision("int8-token", "tqt2")]
ROWS = {"tq-tqv-int8": ROW, "tqc": ROW_TQC, "tqt": ROW_TQT}


def ladder_layer(ladder=24, past=70, Tq=1, row=ROW, **kw):
    return codebook_layer(row, past=past, Tq=Tq, steps=(40, 41, 42), ladder_tokens=ladder, **{**OPTS, **kw})


@pytest.mark.parametrize("rung2", [0, 10], ids=["one rung", "two rungs"])
@pytest.mark.parametrize("row", list(ROWS.values()), ids=list(ROWS))
@pytest.mark.parametrize("Tq", [1, 5])
def test_ladder_attention_is_exact(Tq, row, rung2, monkeypatch):
    """Attention over a store with a ladder equals SDPA over the history with the young rows refined (the
    youngest through the second rung too), and the ladder moves the output towards the exact attention: it is
    read; so does the second rung."""
    monkeypatch.setenv("KVQUANT_ATTENTION", "torch")
    layer, k, v = ladder_layer(Tq=Tq, row=row, ladder2_tokens=rung2)
    rings = layer.refine
    assert rings.ladder_n == 24 and rings.ladder2_n == rung2 and layer.q_end == 70 + Tq - 5  # (fresh chunk too)
    q = torch.randn(2, 3 * layer.num_heads, Tq, 64, device=DEV)
    out = dispatch.attend(q, k[:, :, 70:], v[:, :, 70:], layer, 70, None, 0.125)
    assert (out - ladder_reference(q, k, v, layer, 70, 0.125)).abs().max() <= 2e-4
    plain = model_space_reference(q, k, v, layer, 70, 0.125)  # the same store read without its ladder
    assert (out - plain).abs().max() > 1e-3
    if rung2:  # the same store read with one rung
        layer.refine.ladder2, layer.refine.ladder2_n = [], 0
        assert (out - dispatch.attend(q, k[:, :, 70:], v[:, :, 70:], layer, 70, None, 0.125)).abs().max() > 1e-4


@pytest.mark.parametrize(("past", "plain", "more", "bound"), [
    (70, {"ladder": 0}, {"ladder": 60}, 0.6),  # a 60-row ladder against none
    # a ladder over the whole pool, with a second rung on every row (ROW's tq3 heads take it, its tqv3 heads do not)
    (50, {"ladder": 42}, {"ladder": 42, "ladder2_tokens": 42}, 0.75),
], ids=["one rung", "two rungs"])  # fmt: skip
def test_ladder_lowers_the_error_against_exact_attention(past, plain, more, bound, monkeypatch):
    """The ladder (and its second rung) bring the output closer to the exact attention."""
    monkeypatch.setenv("KVQUANT_ATTENTION", "torch")
    errs = []
    for kw in (plain, more):
        layer, k, v = ladder_layer(past=past, **kw)
        torch.manual_seed(0)
        q = torch.randn(2, 3 * layer.num_heads, 1, 64, device=DEV)
        out = dispatch.attend(q, k[:, :, past:], v[:, :, past:], layer, past, None, 0.125)
        exact = _sdpa(q, k.clone(), v.clone(), k, v, layer, past, 0.125)
        errs.append(float((out - exact).pow(2).mean()))
    assert errs[1] < bound * errs[0]


@pytest.mark.parametrize("rung2", [0, 8], ids=["one rung", "two rungs"])
def test_ladder_decode_steps_crop_reorder_copy(rung2, monkeypatch):
    """One-token steps keep the ring on the newest N pool tokens (the second ring on the newest N2); crop keeps
    their rows below the cut; a beam reorder and a copy carry them; reset drops them. Attention stays exact
    throughout."""
    monkeypatch.setenv("KVQUANT_ATTENTION", "torch")
    layer, k, v = ladder_layer(ladder=10, past=60, Tq=0, ladder2_tokens=rung2)
    g = torch.Generator().manual_seed(9)
    ks, vs = [k[:, :, :60]], [v[:, :, :60]]
    for _ in range(3):
        kk, vv = torch.randn(2, 3, 1, 64, generator=g), torch.randn(2, 3, 1, 64, generator=g)
        layer.append(kk, vv)
        ks.append(kk)
        vs.append(vv)
    k, v = torch.cat(ks, 2), torch.cat(vs, 2)
    past = 63
    assert layer.q_end == past - 5 and layer.refine.ladder_n == 10 and layer.refine.ladder2_n == rung2

    def check(layer, k, v, past):
        torch.manual_seed(1)
        q = torch.randn(layer.batch, 3 * layer.num_heads, 1, 64)
        fk, fv = torch.randn(layer.batch, 3, 1, 64), torch.randn(layer.batch, 3, 1, 64)
        kk, vv = torch.cat([k[:, :, :past], fk], 2), torch.cat([v[:, :, :past], fv], 2)
        out = dispatch.attend(q, fk, fv, layer, past, None, 0.125)
        assert (out - ladder_reference(q, kk, vv, layer, past, 0.125)).abs().max() <= 2e-4

    check(layer, k, v, past)
    twin = layer.copy()
    layer.index_batch(torch.tensor([1, 0]))
    check(layer, k.flip(0), v.flip(0), past)
    check(twin, k, v, past)  # the copy is untouched by the reorder
    layer.crop(52)  # 6 tokens below q_end = 58: 4 ring rows stay
    assert layer.q_end == 52 and layer.refine.ladder_n == 4 and layer.refine.ladder2_n == max(0, rung2 - 6)
    check(layer, k.flip(0), v.flip(0), 52)
    for t in range(52, 60):  # the ring refills with the tokens written after the crop
        layer.append(k.flip(0)[:, :, t:t + 1], v.flip(0)[:, :, t:t + 1])
    rings = layer.refine
    assert layer.q_end == 55 and rings.ladder_n == 7 and rings.ladder2_n == min(rung2, max(0, rung2 - 6) + 3)
    check(layer, k.flip(0), v.flip(0), 60)
    layer.reset()
    assert layer.refine.ladder_n == layer.refine.ladder2_n == 0 and layer.refine.ladder == layer.refine.ladder2 == []


def test_ladder_bytes_are_counted():
    """memory(): the ring's refinement rows (D / 8 bits + 1 scale byte per row and codebook K or V) on top of the
    same store."""
    a, _, _ = ladder_layer(ladder=0, past=100)
    b, _, _ = ladder_layer(ladder=32, past=100)
    ma, mb = a.memory(), b.memory()
    refinable = {"keys": 2, "values": 3}  # codebook heads per side in ROW
    for kind, heads in refinable.items():
        assert mb[kind] - ma[kind] == 2 * heads * 32 * (64 // 8 + 1)  # batch 2, 32 rows, 9 B a row
    assert b.refine.ladder_bytes() == 2 * 5 * 32 * 9
    assert mb["scales"] == ma["scales"] and mb["dense"] == ma["dense"]
    c, _, _ = ladder_layer(ladder=32, past=100, ladder2_tokens=20)  # the second ring: D / 8 bytes a row
    mc = c.memory()
    rung2 = {"keys": 1, "values": 2}  # ROW's tq3 heads (its tqv3 heads keep one rung)
    for kind, heads in rung2.items():
        assert mc[kind] - mb[kind] == 2 * heads * 20 * (64 // 8)
    assert c.refine.ladder_bytes() == b.refine.ladder_bytes() + 2 * 3 * 20 * 8


def test_ladder_config_is_checked():
    cfg = KVQuantConfig.from_dict({"default": "tq3", "residual_tokens": 4, "residual_step": 1, "ladder_tokens": 51})
    assert KVQuantConfig.from_dict(cfg.to_dict()).ladder_tokens == 51
    with pytest.raises(ConfigError, match="ladder_tokens"):
        KVQuantConfig.from_dict({"default": "tq3", "ladder_tokens": -1})
    with pytest.raises(ConfigError, match="ladder_tokens"):
        KVQuantConfig.from_dict({"default": "tq3", "ladder_tokens": 8, "evict": {"policy": "snapkv", "keep": 0.5}})
    tqt = KVQuantConfig.from_dict({"default": {"key": "tqv3", "value": "tqt3"}, "ladder_tokens": 8})  # sign bits
    assert tqt.ladder_tokens == 8
    two = KVQuantConfig.from_dict({"default": "tqt3", "ladder_tokens": 39, "ladder2_tokens": 30})
    assert KVQuantConfig.from_dict(two.to_dict()).ladder2_tokens == 30
    with pytest.raises(ConfigError, match=r"ladder2_tokens: 9 exceeds ladder_tokens \(8\)"):
        KVQuantConfig.from_dict({"default": "tq3", "ladder_tokens": 8, "ladder2_tokens": 9})
    with pytest.raises(ConfigError, match="ladder2_tokens"):
        KVQuantConfig.from_dict({"default": "tq3", "ladder_tokens": 8, "ladder2_tokens": -2})


LADDER_CASES = {  # ladder_layer keywords
    "sinks+residual": {},
    "short": {"past": 26},  # the ring reaches down into the sink rows (they stay the sink buffer's)
    "ladder only": {"sink_tokens": 0, "residual_tokens": 0, "residual_step": 16},  # no other dense segment
    "two rungs": {"ladder2_tokens": 10},
}


@pytest.mark.parametrize("case", list(LADDER_CASES), ids=str)
@pytest.mark.parametrize("row", list(ROWS.values()), ids=list(ROWS))
@pytest.mark.parametrize("Tq", [1, 5], ids=["decode", "chunk"])
def test_triton_reads_the_ladder(Tq, row, case, monkeypatch):
    """The Triton kernels (decode, chunk) read a store with an age ladder as the torch path does: the ring's young
    rows refined on the dense side, the pool below them in-kernel, merged by log-sum-exp."""
    kw = {"ladder": 24, **LADDER_CASES[case]}
    past = kw.pop("past", 70)
    layer, k, v = ladder_layer(past=past, Tq=Tq, row=row, **kw)
    assert layer.refine.ladder_n > 0 and layer.refine.ladder2_n == kw.get("ladder2_tokens", 0)
    if case == "short":
        assert layer.q_end - layer.refine.ladder_n < layer.sink_tokens
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3 * layer.num_heads, Tq, 64, generator=g).to(DEV)
    out = triton_matches_torch(monkeypatch, (q, k[:, :, past:], v[:, :, past:], layer, past, None, 0.125))
    if layer.residual_tokens:  # (ladder_reference refines fp16 rows, as a residual window hands them over)
        assert (out - ladder_reference(q, k, v, layer, past, 0.125)).abs().max() <= 2e-4


def test_ladder_with_left_padding(monkeypatch):
    """A left-padded row reads what the same tokens read unpadded in a batch of one (its sinks, static state and
    ring rows are its own real tokens'); the Triton path reads the padded batch as the torch path does."""
    monkeypatch.setenv("KVQUANT_ATTENTION", "torch")
    g = torch.Generator().manual_seed(4)
    T, pad = 60, 3
    k, v = torch.randn(2, 3, T + 1, 64, generator=g) * 2, torch.randn(2, 3, T + 1, 64, generator=g)
    k[1, :, :pad] = v[1, :, :pad] = 0
    cfg = KVQuantConfig(block_size=16, ladder_tokens=12, **OPTS)
    from kvquant.store import LayerStore

    both = LayerStore(ROW, cfg, 64, 2, DEV)
    both.append(k[:, :, :T], v[:, :, :T], row_start=torch.tensor([0, pad]))
    one = LayerStore(ROW, cfg, 64, 1, DEV)
    one.append(k[1:, :, pad:T], v[1:, :, pad:T])
    assert both.refine.ladder_n == one.refine.ladder_n == 12
    q = torch.randn(2, 9, 1, 64, generator=g)
    mask = torch.ones(2, 1, 1, T + 1, dtype=torch.bool)
    mask[1, :, :, :pad] = False
    out = dispatch.attend(q, k[:, :, T:], v[:, :, T:], both, T, mask, 0.125)
    ref = dispatch.attend(q[1:], k[1:, :, T:], v[1:, :, T:], one, T - pad, None, 0.125)
    assert (out[1:] - ref).abs().max() <= 1e-4
    triton_matches_torch(monkeypatch, (q, k[:, :, T:], v[:, :, T:], both, T, mask, 0.125))  # (the same batch)


def test_ladder_reads_any_range():
    """A read that starts or ends inside the ring reads the same rows as a whole read (tiles may split anywhere)."""
    layer, _, _ = ladder_layer(ladder=20)
    lo, hi = layer.q_end - layer.refine.ladder_n, layer.q_end
    for g in layer.groups:
        k, v = layer.read(g, 0, 70)
        for a, b in ((lo + 3, hi - 2), (lo - 5, lo + 1), (hi - 1, 70), (lo + 7, 70)):
            ka, va = layer.read(g, a, b)
            # the same rows up to one float32 ulp (the CPU's vector and scalar exp2 may differ in the last bit)
            torch.testing.assert_close(ka, k[:, :, a:b], rtol=3e-7, atol=1e-7)
            torch.testing.assert_close(va, v[:, :, a:b], rtol=3e-7, atol=1e-7)
        pieces = layer.read_factored(g, 0, 70)  # the pool walk stops before the young rows
        assert pieces[-2][1] <= lo or pieces[-1][0] <= lo


def test_cache_memory_report_counts_the_ring():
    """Through a QuantizedKVCache: the report's per-precision bytes add up to the total, the ring among them."""
    from kvquant import ModelShape, QuantizedKVCache

    shape = ModelShape(num_layers=2, num_kv_heads=3, head_dim=64)
    cfg = KVQuantConfig.from_dict({"default": {"key": "tqv3", "value": "tq3"}, "sink_tokens": 4, "residual_tokens": 4,
                                   "residual_step": 1, "ladder_tokens": 20, "block_size": 16})
    cache = QuantizedKVCache(shape, cfg)
    g = torch.Generator().manual_seed(0)
    for n in (50, 1, 1, 1):
        for layer in range(2):
            k = torch.randn(1, 3, n, 64, generator=g)
            cache.update(k, torch.randn_like(k), layer)
    rep = cache.memory_report()
    assert rep["per_precision"]["refinement (ladder)"] == 2 * 2 * 3 * 20 * 9  # layers, K and V, heads, rows, bytes
    assert sum(rep["per_precision"].values()) == rep["bytes_total"]
