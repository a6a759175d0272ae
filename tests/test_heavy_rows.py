"""Heavy rows (``heavy_tokens``, :mod:`kvquant.heavy`): the prompt rows each KV head attends to most keep their
first refinement rung; attention reads them refined (torch path), through decode steps, crop, beams, copies; their
bytes are counted and sized; the cache picks them by the prompt's own attention."""

from __future__ import annotations

import pytest
import torch

from kvquant import KVQuantConfig, ModelShape, QuantizedKVCache
from kvquant.config import KVPrecision
from kvquant.errors import ConfigError
from kvquant.heavy import gather_parts, pick_rows, position_dtype, put_rows
from kvquant.kernels import attention_torch, dispatch
from kvquant.memory import sequence_bytes
from kvquant.store import LayerStore
from kvquant.transformers_compat import cache_kw
from tests.test_codebook import DEV, model_space_reference, triton_matches_torch
from tests.test_codebook_ladder import ROWS, _sdpa, ladder_history

OPTS = {"sink_tokens": 4, "residual_tokens": 5, "residual_step": 1, "block_size": 16}


def heavy_layer(row, past=70, heavy=12, B=2, seed=0, **kw):
    """A store of ``row``'s heads that wrote ``past`` tokens (keys with a per-channel offset) in one append with
    random key scores; returns it, ``past + 8`` keys / values (the rest for fresh chunks) and the scores."""
    g = torch.Generator().manual_seed(seed)
    layer = LayerStore(row, KVQuantConfig(**{**OPTS, "heavy_tokens": heavy, **kw}), 64, B, DEV)
    H = len(row)
    off = torch.randn(1, H, 1, 64, generator=g) * 4
    k = torch.randn(B, H, past + 8, 64, generator=g) + off
    v = torch.randn(B, H, past + 8, 64, generator=g) + off / 4
    scores = torch.rand(B, H, past, generator=g)
    layer.append(k[:, :, :past], v[:, :, :past], None, scores)
    return layer, k, v, scores


def heavy_reference(q, k, v, layer, past, scaling):
    """SDPA over the history as the store should read it (:func:`ladder_history`: pool rows dequantized, the
    ladder's young rows refined) with the heavy rows refined too -- their refinement recomputed here from the rows
    written (fp16-rounded, as the residual window passes them on)."""
    kh, vh = ladder_history(k, v, layer)
    end = layer.q_end
    for gi, g in enumerate(layer.groups):
        at = layer.refine.heavy[gi][0] if layer.refine.heavy else None
        for side, (s, x, src) in enumerate(((g.key, kh, k), (g.value, vh, v))):
            if at is None or layer.refine.heavy[gi][1 + side] is None:
                continue
            parts = {n: t[:, :, :end] for n, t in s.gather(layer.table()).items()}
            rows = src[:, g.head_index, :end].half().float()
            refined = s.quantizer.from_space(
                s.quantizer.decode_refined(parts, s.quantizer.refine(rows, s.state, parts), s.state), s.state)
            for b, h, n in (at >= 0).nonzero().tolist():
                p = int(at[b, h, n])
                x[b, g.heads[h], p] = refined[b, h, p]
    return _sdpa(q, kh, vh, k, v, layer, past, scaling)


def test_pick_put_gather():
    scores = torch.tensor([[[0.1, 0.9, 0.5, 0.8, 0.7]]])
    eligible = torch.tensor([[False, True, True, False, True]])
    assert pick_rows(scores, eligible, 2).tolist() == [[[1, 4]]]  # 0.8 is not eligible; ascending order
    assert pick_rows(scores, eligible, 4).tolist() == [[[-1, 1, 2, 4]]]  # three eligible: a placeholder
    x = torch.zeros(1, 1, 4, 2)
    rows = torch.tensor([[[[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]]])
    out = put_rows(x, rows, torch.tensor([[[-1, 11, 12]]]), 10, 13)  # tokens [10, 14), rows at 11 and 12 only
    assert out[0, 0, :, 0].tolist() == [0.0, 2.0, 3.0, 0.0] and x.abs().sum() == 0
    assert put_rows(x, rows, torch.tensor([[[10, 11, 13]]]), 10, 13)[0, 0, :, 0].tolist() == [1.0, 2.0, 0.0, 0.0]
    blocks = torch.arange(3 * 2 * 4).view(3, 2, 4, 1)  # [num_blocks, H, block_size, 1]
    got = gather_parts({"q": blocks}, torch.tensor([[2, 0]]), torch.tensor([[[5, 1], [-1, 2]]]))["q"]
    want = [[[blocks[0, 0, 1, 0], blocks[2, 0, 1, 0]], [blocks[2, 1, 0, 0], blocks[2, 1, 2, 0]]]]  # (-1: row 0)
    assert got[..., 0].tolist() == want
    assert position_dtype(32768) == torch.int16 and position_dtype(32769) == torch.int32


@pytest.mark.parametrize("row", list(ROWS.values()), ids=list(ROWS))
def test_picks_are_the_top_scores_below_the_ladder(row):
    """Per (row, head), the heavy positions are the highest-scoring pool rows, sinks and the ladder's rows out;
    their stored refinement is the quantizer's refinement of those rows."""
    layer, k, _, scores = heavy_layer(row, ladder_tokens=10)
    lo, hi = 4, layer.q_end - 10
    for gi, g in enumerate(layer.groups):
        at = layer.refine.heavy[gi][0]
        if at is None:
            assert not any(hasattr(s.quantizer, "refine") for s in (g.key, g.value))
            continue
        assert at.dtype == torch.int16 and at.shape == (2, len(g.heads), 12)
        for hi_, h in enumerate(g.heads):
            for b in range(2):
                want = scores[b, h, lo:hi].topk(12).indices + lo
                assert sorted(at[b, hi_].tolist()) == sorted(want.tolist())


@pytest.mark.parametrize("Tq", [1, 5])
@pytest.mark.parametrize("row", list(ROWS.values()), ids=list(ROWS))
def test_attention_reads_heavy_rows_refined(row, Tq, monkeypatch):
    """Attention (torch: one decode softmax, the tiled walk, the online softmax over small tiles) equals SDPA over
    the history with the heavy rows refined; and it differs from the same store read without them."""
    monkeypatch.setenv("KVQUANT_ATTENTION", "torch")
    layer, k, v, _ = heavy_layer(row)
    torch.manual_seed(3)
    q = torch.randn(2, 3 * layer.num_heads, Tq, 64)
    fk, fv = k[:, :, 70:70 + Tq], v[:, :, 70:70 + Tq]
    ref = heavy_reference(q, k[:, :, :70 + Tq], v[:, :, :70 + Tq], layer, 70, 0.125)
    out = dispatch.attend(q, fk, fv, layer, 70, None, 0.125)
    assert (out - ref).abs().max() <= 2e-4
    monkeypatch.setattr(attention_torch, "WORKSPACE_BYTES", 4096)  # tiles of a block: the online softmax
    assert (dispatch.attend(q, fk, fv, layer, 70, None, 0.125) - ref).abs().max() <= 2e-4
    heavy, layer.refine.heavy = layer.refine.heavy, []
    assert (dispatch.attend(q, fk, fv, layer, 70, None, 0.125) - out).abs().max() > 1e-3
    plain = model_space_reference(q, k[:, :, :70 + Tq], v[:, :, :70 + Tq], layer, 70, 0.125)
    assert (dispatch.attend(q, fk, fv, layer, 70, None, 0.125) - plain).abs().max() <= 2e-4
    layer.refine.heavy = heavy


def test_heavy_rows_lower_the_error_where_attention_looks(monkeypatch):
    """Rows picked by the queries' own attention, refined, bring the output closer to the exact attention than
    the same bytes of random rows do."""
    monkeypatch.setenv("KVQUANT_ATTENTION", "torch")
    errs = {}
    for pick in ("attention", "random"):
        g = torch.Generator().manual_seed(4)
        layer = LayerStore([KVPrecision("tq2", "tq2")] * 2, KVQuantConfig(**{**OPTS, "heavy_tokens": 16}), 64, 1,
                           DEV)  # fmt: skip
        k, v = torch.randn(1, 2, 200, 64, generator=g), torch.randn(1, 2, 200, 64, generator=g)
        k[:, :, 20:200:10] += torch.randn(1, 2, 1, 64, generator=g) * 2  # a few keys the queries below favour
        q = k[:, :, 20:200:10].mean(2, keepdim=True).repeat_interleave(3, 1) * 0.6
        s = (q.view(1, 2, 3, 64) @ k.transpose(-1, -2) / 8).softmax(-1).sum(2)  # [1, 2, 200]
        layer.append(k[:, :, :199], v[:, :, :199], None, s[..., :199] if pick == "attention" else torch.rand(1, 2, 199))
        out = dispatch.attend(q, k[:, :, 199:], v[:, :, 199:], layer, 199, None, 0.125)
        errs[pick] = float((out - _sdpa(q, k.clone(), v.clone(), k, v, layer, 199, 0.125)).pow(2).mean())
    assert errs["attention"] < 0.7 * errs["random"]


def test_decode_steps_crop_reorder_copy_reset(monkeypatch):
    """Decode steps keep the picks (picked once, from the prompt) beside a moving two-rung ladder; a beam reorder
    and a copy carry them; crop drops the rows cut off; reset forgets them. Attention stays exact throughout."""
    monkeypatch.setenv("KVQUANT_ATTENTION", "torch")
    layer, k, v, _ = heavy_layer(ROWS["tqt"], past=60, heavy=8, ladder_tokens=6, ladder2_tokens=3)
    picks = [h[0].clone() for h in layer.refine.heavy if h[0] is not None]
    for t in range(60, 66):
        layer.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
    held = [h for h in layer.refine.heavy if h[0] is not None]
    assert all(torch.equal(h[0], p) for h, p in zip(held, picks, strict=True))

    def check(layer, k, v, past):
        torch.manual_seed(1)
        q = torch.randn(layer.batch, 3 * layer.num_heads, 1, 64)
        kk, vv = torch.cat([k[:, :, :past], k[:, :, 66:67]], 2), torch.cat([v[:, :, :past], v[:, :, 66:67]], 2)
        out = dispatch.attend(q, kk[:, :, past:], vv[:, :, past:], layer, past, None, 0.125)
        assert (out - heavy_reference(q, kk, vv, layer, past, 0.125)).abs().max() <= 2e-4

    check(layer, k, v, 66)
    twin = layer.copy()
    layer.index_batch(torch.tensor([1, 0]))
    check(layer, k.flip(0), v.flip(0), 66)
    check(twin, k, v, 66)  # the copy is untouched by the reorder
    top = max(int(h[0].max()) for h in layer.refine.heavy if h[0] is not None)
    layer.crop(top)  # the highest pick (and any at or above it) is cut off
    assert all(int(h[0].max()) < top for h in layer.refine.heavy if h[0] is not None)
    check(layer, k.flip(0), v.flip(0), top)
    layer.reset()
    assert layer.refine.heavy == []


def test_bytes_are_counted_and_sized():
    """memory(): per pick and refined side D / 8 bits + a norm byte, per pick and head of a refined group a 2-byte
    position; sequence_bytes gives the same."""
    a, *_ = heavy_layer(ROWS["tq-tqv-int8"], heavy=0)
    b, *_ = heavy_layer(ROWS["tq-tqv-int8"], heavy=12)
    ma, mb = a.memory(), b.memory()
    refinable = {"keys": 2, "values": 3}  # codebook heads per side in the row (every head has one: 3 positions)
    for kind, n in refinable.items():
        assert mb[kind] - ma[kind] == 2 * 12 * n * (64 // 8 + 1)
    assert mb["index"] - ma["index"] == 2 * 12 * 3 * 2
    assert b.refine.heavy_bytes() == 2 * 12 * (5 * 9 + 3 * 2)


@pytest.fixture(scope="module")
def model():
    from tests.test_kernels_e2e import tiny_llama

    return tiny_llama(heads=4, kv_heads=2, layers=2)


CACHE_CONFIG = {"default": "tq3", "heads": {"1.1": {"key": "int8", "value": "tqt3"}}, "heavy_tokens": 10,
                "ladder_tokens": 6, "ladder2_tokens": 2, **OPTS}  # fmt: skip


@pytest.mark.parametrize("batch", [1, 2])
def test_cache_picks_by_the_prompt_and_sizes_them(model, batch, monkeypatch):
    """Through a wrapped model: the prompt's write picks every layer's heavy rows (real rows past the sinks,
    below the ladder), ``generate`` decodes with them, and the cache holds what ``sequence_bytes`` says."""
    import kvquant

    monkeypatch.setenv("KVQUANT_ATTENTION", "torch")
    cfg = KVQuantConfig.from_dict(CACHE_CONFIG)
    kvquant.wrap(model, cfg)
    try:
        g = torch.Generator().manual_seed(5)
        ids = torch.randint(3, 96, (batch, 50), generator=g)
        mask = torch.ones_like(ids)
        mask[1:, :7] = 0  # the second row is left-padded by 7
        cache = QuantizedKVCache(model, cfg)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, **cache_kw(cache), max_new_tokens=5, do_sample=False)
        for layer in cache.layers:
            store = layer.store
            first = store.starts.row_start.view(-1, 1, 1) + 4
            for at, _, _ in store.refine.heavy:
                assert at.shape[-1] == 10 and bool(((at >= first) & (at < 50 - 5 - 6)).all())
        shape = ModelShape.of(model)
        assert cache.memory_report()["bytes_total"] == sequence_bytes(shape, cfg, 54, batch)["total"]
        # layer 0: 4 codebook sides and 2 positions a pick; layer 1 (head 1 has int8 keys): 3 sides, 2 positions
        assert sequence_bytes(shape, cfg, 54, batch)["heavy"] == batch * 10 * ((4 * 9 + 2 * 2) + (3 * 9 + 2 * 2))
    finally:
        kvquant.unwrap(model)


def test_needs_the_models_queries_and_config_checks():
    cfg = KVQuantConfig.from_dict({"default": "tq3", "heavy_tokens": 8})
    assert KVQuantConfig.from_dict(cfg.to_dict()).heavy_tokens == 8
    cache = QuantizedKVCache(ModelShape(num_layers=1, num_kv_heads=2, head_dim=64), cfg)
    k = torch.randn(1, 2, 20, 64)
    with pytest.raises(ValueError, match="heavy_tokens: heavy rows are picked by the model's queries"):
        cache.update(k, k, 0)
    with pytest.raises(ConfigError, match="heavy_tokens"):
        KVQuantConfig.from_dict({"default": "tq3", "heavy_tokens": -1})
    with pytest.raises(ConfigError, match="heavy_tokens"):
        KVQuantConfig.from_dict({"default": "tq3", "heavy_tokens": 8, "evict": {"policy": "snapkv", "keep": 0.5}})
    with pytest.raises(ConfigError, match="heavy_tokens"):
        KVQuantConfig.from_dict({"default": "tq3", "heavy_tokens": 8, "offload": {"device_blocks": 4}})
    # layers without a codebook side hold none
    plain = LayerStore([KVPrecision("int8", "int8")], KVQuantConfig(heavy_tokens=8), 64, 1, DEV)
    assert plain.refine.heavy_tokens == 0


HEAVY_CASES = {  # heavy_layer keywords
    "sinks+residual": {},
    "with a two-rung ladder": {"ladder_tokens": 10, "ladder2_tokens": 4},
    "no dense side": {"sink_tokens": 0, "residual_tokens": 0, "residual_step": 16},  # the kernels' lse alone
}


@pytest.mark.parametrize("case", list(HEAVY_CASES))
@pytest.mark.parametrize("row", list(ROWS.values()), ids=list(ROWS))
@pytest.mark.parametrize("Tq", [1, 5], ids=["decode", "chunk"])
def test_triton_reads_heavy_rows(Tq, row, case, monkeypatch):
    """The Triton kernels (decode, chunk) read a store with heavy rows as the torch path does: the pool in-kernel at
    its base width, each heavy row's base softmax term then traded for its refined one (swap_rows)."""
    layer, k, v, _ = heavy_layer(row, **HEAVY_CASES[case])
    assert layer.refine.heavy
    q = torch.randn(2, 3 * layer.num_heads, Tq, 64, generator=torch.Generator().manual_seed(3))
    args = (q, k[:, :, 70:70 + Tq], v[:, :, 70:70 + Tq], layer, 70, None, 0.125)
    out = triton_matches_torch(monkeypatch, args)
    monkeypatch.undo()  # (triton_matches_torch stubbed the torch path out)
    # the swap is what moves it: without it the kernels read other values
    heavy, layer.refine.heavy = layer.refine.heavy, []
    monkeypatch.setenv("KVQUANT_ATTENTION", "torch")
    assert (out - dispatch.attend(*args)).abs().max() > 1e-3
    layer.refine.heavy = heavy


def test_swap_rows_with_a_mask_and_softcap():
    """swap_rows on its own: attention over keys with some rows at a base value, turned into attention with those
    rows at another value, equals plain softmax attention over the changed keys (per-head rows, key ranges that hide
    some of them, softcapping)."""
    from kvquant.kernels.triton_attention import attend_dense, swap_rows

    g = torch.Generator().manual_seed(8)
    B, Hkv, rep, Tq, T, D = 2, 2, 3, 4, 30, 16
    q = torch.randn(B, Hkv * rep, Tq, D, generator=g)
    k, v = torch.randn(B, Hkv, T, D, generator=g) * 2, torch.randn(B, Hkv, T, D, generator=g)
    pos = torch.tensor([[[3, 17, -1], [9, 3, 25]], [[0, 28, 11], [-1, -1, 5]]])
    kr, vr = k.clone(), v.clone()
    rows = torch.randn(B, Hkv, 3, D, generator=g)
    base = [x.gather(2, pos.clamp_min(0)[..., None].expand(-1, -1, -1, D)) for x in (k, v)]
    for b, h, i in (pos >= 0).nonzero().tolist():
        kr[b, h, pos[b, h, i]] += rows[b, h, i]
        vr[b, h, pos[b, h, i]] -= rows[b, h, i]
    refined = [x.gather(2, pos.clamp_min(0)[..., None].expand(-1, -1, -1, D)) for x in (kr, vr)]
    ranges = (torch.tensor([[0, 2, 4, 10], [1, 0, 0, 12]]), torch.tensor([[30, 20, 26, 30], [29, 30, 9, 30]]))
    at = torch.arange(T).expand(B, T)
    for softcap in (None, 5.0):
        out, lse = attend_dense(q, k, v, at, ranges, 0.3, softcap)
        want, _ = attend_dense(q, kr, vr, at, ranges, 0.3, softcap)
        got = swap_rows(out, lse, q, (*base, *refined, pos), ranges, 0.3, softcap)
        assert (got - want).abs().max() <= 1e-5


def test_picks_do_not_depend_on_the_score_tile(model, monkeypatch):
    """A long prompt scores its keys a few queries at a time (HEAVY_SCORE_ELEMENTS): the same picks."""
    import kvquant
    from kvquant import cache as cache_module

    monkeypatch.setenv("KVQUANT_ATTENTION", "torch")
    cfg = KVQuantConfig.from_dict(CACHE_CONFIG)
    kvquant.wrap(model, cfg)
    try:
        ids = torch.randint(3, 96, (1, 60), generator=torch.Generator().manual_seed(6))
        picks = []
        for elements in (1 << 24, 4 * 60 * 3):  # tiles of 256 queries, then of 3
            monkeypatch.setattr(cache_module, "HEAVY_SCORE_ELEMENTS", elements)
            cache = QuantizedKVCache(model, cfg)
            with torch.no_grad():
                model(ids, **cache_kw(cache))
            picks.append([h[0] for layer in cache.layers for h in layer.store.refine.heavy])
        assert all(torch.equal(a, b) for a, b in zip(*picks, strict=True))
    finally:
        kvquant.unwrap(model)


def test_generate_with_heavy_rows_triton_matches_torch(model, monkeypatch):
    """End to end (a left-padded batch, greedy): the Triton path (interpreter on CPU) reads the heavy rows as the
    torch path does, every decode step in-kernel (no fallback)."""
    import kvquant
    from tests.test_kernels_e2e import E2E_TOL, generate

    kvquant.wrap(model, KVQuantConfig.from_dict(CACHE_CONFIG))
    try:
        ids = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(7))
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
        ref_tokens, ref_logits, _, _ = generate(model, ids, mask, "torch", monkeypatch, new_tokens=4)
        tokens, logits, calls, cache = generate(model, ids, mask, "triton", monkeypatch, new_tokens=4)
        assert all(layer.store.refine.heavy for layer in cache.layers)
        assert calls.count(1) == 3 * 2  # 3 decode steps x 2 layers, none fell back
        assert torch.equal(tokens, ref_tokens) and (logits - ref_logits).abs().max() <= E2E_TOL  # (measured 1.8e-5)
    finally:
        kvquant.unwrap(model)
