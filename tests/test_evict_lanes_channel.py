"""AdaKV lanes for layers that quantize whole blocks (per-channel keys: ``int8-kchannel``, ``int4-kchannel``) or
keep a full-precision residual window: each (row, KV head) holds whole lanes of its own tokens plus its own
full-precision tail (kvquant.lanes), read exactly as a per-head reference quantizes the same kept tokens."""

from __future__ import annotations

import math

import pytest
import torch
from test_evict_lanes import BS, Peaked, decode_until_full, held, lane_store, run, snapshot, step

from kvquant import KVCacheFull, KVQuantConfig, PagedKVPool, QuantizedKVCache
from kvquant.blocks import LayerBlocks
from kvquant.cache import QuantizedLayer
from kvquant.kernels.attention_torch import attend_torch, dequantize_history
from kvquant.store import LayerStore, block_specs, make_groups
from kvquant.transformers_compat import cache_kw

from conftest import tiny_model

D = 32
# (name, config extras): per-channel keys without / with a residual window, a per-token residual window, static
CONFIGS = {
    "int8-kchannel": {"default": "int8-kchannel"},
    "int4-kchannel": {"default": "int4-kchannel"},
    "int4-kchannel-r8": {"default": "int4-kchannel", "residual_tokens": 8},
    "int4-r8": {"default": "int4", "residual_tokens": 8},
    "int8-r8": {"default": "int8", "residual_tokens": 8},  # static per-(row, head) scales
    "int4-kchannel-sinks": {"default": "int4-kchannel", "sink_tokens": 4},  # first 4 slots read from fp16 sinks
}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", kv_heads=2, heads=4, head_dim=D, layers=2, vocab=128)


def cfg(name: str, policy="snapkv", keep=0.5, **extra) -> KVQuantConfig:
    base = dict(CONFIGS[name])
    default = base.pop("default")
    precision = {"int8-kchannel": {"key": "int8-channel", "value": "int8-token"},
                 "int4-kchannel": {"key": "int4-channel", "value": "int4"}}.get(default, default)  # fmt: skip
    return KVQuantConfig.from_dict({"default": precision, "block_size": BS, **base, **extra,
                                    "evict": {"policy": policy, "keep": keep, "window": 8, "sinks": 2,
                                              "budget": "adakv"}})  # fmt: skip


def reference(store: LayerStore, seq_k: torch.Tensor, seq_v: torch.Tensor, b: int, h: int) -> tuple[torch.Tensor, ...]:
    """(Row ``b``, head ``h``)'s tokens ``seq[1, 1, n, D]`` as a plain per-head reference stores them (no
    paging): whole blocks of ``block_size`` quantized from slot 0 (each block its own per-channel scales) while
    ``residual_tokens`` + a block are held, the rest in the dense dtype (tokens reach the quantizer through it, as
    in per-row blocks)."""
    n = seq_k.shape[2]
    q = max(0, (n - store.residual_tokens) // BS) * BS
    gi, _ = store.lanes.head_lane[h]
    g = store.groups[gi]
    out = []
    for seq, st in ((seq_k, g.key), (seq_v, g.value)):
        seq = seq.to(store.dense.dtype).float()
        i = g.heads.index(h)  # static scales: this (row, head)'s
        state = {name: t[b:b + 1, i:i + 1] if t.dim() == 2 else t for name, t in st.state.items()}
        sinks = store.sink_tokens if q else 0
        first = seq[:, :, :BS].clone()
        if sinks:  # a sink row is masked in its block (copy of the first non-sink token, or 0) and read dense
            first[:, :, :sinks] = first[:, :, sinks:sinks + 1] if g.per_block else 0.0
        chunks = [first] + [seq[:, :, j:j + BS] for j in range(BS, q, BS)]
        quant = st.quantizer
        parts = [quant.dequantize(quant.quantize(c, state), state, torch.float32) for c in chunks[:q // BS]]
        if sinks:
            parts[0][:, :, :sinks] = seq[:, :, :sinks]
        parts.append(seq[:, :, q:])
        out.append(torch.cat(parts, dim=2))
    return out[0], out[1], q


def check_tails(store: LayerStore, seqs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every (row, head) holds (n - R) // block lanes of its own and its tail; its history equals the reference."""
    assert store.lanes and store.tail_lanes
    k, v = dequantize_history(store, store.cache_pos)
    H, lanes_seen = store.num_heads, set()
    for (b, h), (sk, sv) in seqs.items():
        rk, rv, q = reference(store, sk, sv, b, h)
        n = sk.shape[2]
        assert store.lanes.fill[b][h] == n and store.lanes.qfill[b][h] == q
        assert len(store.tables[b * H + h]) == q // BS
        for e in store.tables[b * H + h]:
            assert store.blocks.lane_where(e)[1] == store.lanes.head_lane[h][0]
            assert (b, e) not in lanes_seen
            lanes_seen.add((b, e))
        torch.testing.assert_close(k[b, h, :n], rk[0, 0], rtol=0, atol=0)
        torch.testing.assert_close(v[b, h, :n], rv[0, 0], rtol=0, atol=0)
    # bytes: the distinct lanes (one head of one block each) + the tails' buffer [B, H, longest tail, D]
    lanes = {e for t in store.tables for e in t}
    mem = store.memory()
    assert mem["lanes"] == len(lanes)
    lane_bytes = sum(store.blocks.lane_bytes(store.blocks.lane_where(e)[1]) for e in lanes)
    assert held(store) == lane_bytes
    width = max(store.lanes.fill[b][h] - store.lanes.qfill[b][h] for b in range(store.batch) for h in range(H))
    assert store.dense.res_k.shape[2] == width
    sinks = 2 * store.dense.sink_k.numel() * store.dense.sink_k.element_size() if store.dense.sink_k is not None else 0
    assert mem["dense"] == 2 * store.batch * H * width * D * store.dense.res_k.element_size() + sinks


def prompt(store: LayerStore, counts: list[list[int]], T: int, gen: torch.Generator):
    """Keep each (row, head)'s first ``counts[b][h]`` of ``T`` tokens: the kept sequences, per (row, head)."""
    B, H = len(counts), len(counts[0])
    keys, values = torch.randn(B, H, T, D, generator=gen), torch.randn(B, H, T, D, generator=gen)
    keys[:, :, :, 3] += 20.0  # an outlier channel: per-channel scales matter
    keep = torch.arange(T).view(1, 1, -1) < torch.tensor(counts).unsqueeze(-1)
    store.append_kept(keys, values, keep)
    return {(b, h): (keys[b:b + 1, h:h + 1, :counts[b][h]], values[b:b + 1, h:h + 1, :counts[b][h]])
            for b in range(B) for h in range(H)}  # fmt: skip


def decode(store: LayerStore, seqs: dict, steps: int, gen: torch.Generator) -> None:
    """``steps`` decode tokens; each (row, head) appends its token to its own sequence."""
    for _ in range(steps):
        x, y = torch.randn(store.batch, store.num_heads, 1, D, generator=gen), torch.randn(
            store.batch, store.num_heads, 1, D, generator=gen)  # fmt: skip
        x[:, :, :, 3] += 20.0
        step(store, x, y)
        for (b, h), (sk, sv) in seqs.items():
            seqs[(b, h)] = (torch.cat([sk, x[b:b + 1, h:h + 1]], dim=2), torch.cat([sv, y[b:b + 1, h:h + 1]], dim=2))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_head_holds_its_lanes_and_tail_exactly(name):
    """Uneven per-head counts (a row's heads far apart), prompt then decode across several block boundaries:
    lanes = (n - R) // block per (row, head), history equal to the per-head reference (exactly)."""
    gen = torch.Generator().manual_seed(0)
    st = lane_store(cfg(name), batch=2)
    assert st.lanes and st.tail_lanes
    seqs = prompt(st, [[5, 70], [37, 16]], 80, gen)
    check_tails(st, seqs)
    decode(st, seqs, 41, gen)
    check_tails(st, seqs)
    assert st.q_end == min(min(r) for r in st.lanes.qfill) and st.q_end < max(max(r) for r in st.lanes.qfill)


def test_static_scales_held_dense_until_calibrated_then_flushed_per_head():
    """Static int8 scales wait for 16 real tokens: a short prompt is held dense (every head's tail from slot 0),
    each head grows at its own slot; at calibration the heads' full blocks go to lanes of their own."""
    gen = torch.Generator().manual_seed(8)
    st = lane_store(cfg("int8-r8"), batch=2)
    seqs = prompt(st, [[4, 9], [7, 2]], 12, gen)
    assert not st.dense.calibrated and st.q_end == 0 and not any(st.tables)
    check_tails(st, seqs)
    decode(st, seqs, 40, gen)
    assert st.dense.calibrated and all(st.tables)
    check_tails(st, seqs)


@pytest.mark.parametrize("name", ["int8-kchannel", "int4-kchannel-r8", "int4-kchannel-sinks", "int8-r8"])
@pytest.mark.parametrize("decode_step", [True, False])
def test_attention_equals_the_reference_over_lanes_and_tails(name, decode_step):
    """The attention (decode: factored pieces, tails folded in as codes with scale 1 -- per-block keys, per-token
    values, or dequantized for per-head static scales; else the tiled walk) over a lane layer with tails equals a
    plain softmax over each head's reference keys / values (empty slots masked)."""
    gen = torch.Generator().manual_seed(1)
    st = lane_store(cfg(name), batch=2)
    seqs = prompt(st, [[5, 70], [37, 16]], 80, gen)
    decode(st, seqs, 23, gen)
    B, H, S = 2, 2, st.cache_pos
    Tq = 1 if decode_step else 3
    q = torch.randn(B, H, Tq, D, generator=gen)
    fk, fv = torch.randn(B, H, Tq, D, generator=gen), torch.randn(B, H, Tq, D, generator=gen)
    counts = torch.tensor(st.lanes.fill)
    keep = torch.arange(S).view(1, 1, -1) < counts.unsqueeze(-1)  # [B, H, S]
    mask = torch.cat([keep.unsqueeze(2).expand(B, H, Tq, S), torch.ones(B, H, Tq, Tq).tril().bool()], dim=-1)
    got = attend_torch(q, fk, fv, st, S, mask, D ** -0.5)
    for (b, h), (sk, sv) in seqs.items():
        rk, rv, _ = reference(st, sk, sv, b, h)
        kk = torch.cat([rk[0, 0], fk[b, h]])
        vv = torch.cat([rv[0, 0], fv[b, h]])
        n = rk.shape[2]
        m = torch.cat([torch.ones(Tq, n, dtype=torch.bool), torch.ones(Tq, Tq).tril().bool()], dim=-1)
        p = torch.softmax((q[b, h] @ kk.T * D ** -0.5).masked_fill(~m, -math.inf), dim=-1)
        torch.testing.assert_close(got[b, h], p @ vv, rtol=1e-5, atol=1e-5)


def test_a_head_reads_only_its_own_tail():
    """Scribbling over one (row, head)'s tail moves that head's history and no other's."""
    gen = torch.Generator().manual_seed(2)
    st = lane_store(cfg("int8-kchannel"), batch=2)
    seqs = prompt(st, [[5, 70], [37, 16]], 80, gen)
    decode(st, seqs, 9, gen)
    k, _ = dequantize_history(st, st.cache_pos)
    filled = (torch.arange(st.cache_pos).view(1, 1, -1) < torch.tensor(st.lanes.fill).unsqueeze(-1)).unsqueeze(-1)
    for b in range(2):
        for h in range(2):
            n = st.lanes.fill[b][h] - st.lanes.qfill[b][h]
            st.dense.res_k[b, h, :n] += 1.0
            k2, _ = dequantize_history(st, st.cache_pos)
            moved = (torch.where(filled, k2, 0) != torch.where(filled, k, 0)).any(dim=-1).any(dim=-1)
            assert moved[b, h] and moved.sum() == 1
            k = k2


def test_bounded_arena_full_changes_nothing_and_release_frees_every_lane():
    """A bounded arena: the step whose tail flush needs a lane that is not free raises KVCacheFull with tables,
    fills, tails and counts unchanged; release returns every block."""
    gen = torch.Generator().manual_seed(3)
    st = lane_store(cfg("int8-kchannel"), num_blocks=2, fixed=True)  # 4 lanes
    seqs = prompt(st, [[20, 40]], 60, gen)  # lanes 1 + 2, tails 4 + 8
    assert [len(t) for t in st.tables] == [1, 2] and st.lanes.tail_lengths() == [[4, 8]]
    decode(st, seqs, 8, gen)  # head 1 flushes at 48: the last free lane
    assert [len(t) for t in st.tables] == [1, 3] and not st.blocks.free and not any(st.blocks.lane_free)
    decode(st, seqs, 3, gen)  # head 0's tail at 15
    before = snapshot(st), st.dense.res_k.clone(), list(map(list, st.lanes.qfill))
    assert st.blocks_needed(1) > 0
    with pytest.raises(KVCacheFull):
        step(st, torch.randn(1, 2, 1, D), torch.randn(1, 2, 1, D))  # head 0's tail fills a block: no lane free
    assert snapshot(st) == before[0] and torch.equal(st.dense.res_k, before[1]) and st.lanes.qfill == before[2]
    check_tails(st, seqs)
    st.release()
    assert st.blocks.used == 0 and not any(st.blocks.lane_refs)


def capture(monkeypatch):
    """Record every chunk of K/V each layer writes: ``{layer: [(keys, values), ...]}``."""
    seen: dict[int, list] = {}
    real = QuantizedLayer._write

    def recording(self, keys, values, *a, **k):
        seen.setdefault(self.layer_idx, []).append((keys.clone(), values.clone()))
        return real(self, keys, values, *a, **k)

    monkeypatch.setattr(QuantizedLayer, "_write", recording)
    return seen


def model_seqs(store: LayerStore, chunks: list) -> dict:
    """Each (row, head)'s kept tokens in slot order, from the layer's written K/V by original position."""
    keys = torch.cat([c[0] for c in chunks], dim=2)
    values = torch.cat([c[1] for c in chunks], dim=2)
    out = {}
    for b in range(store.batch):
        for h in range(store.num_heads):
            pos = store.slots.pos[b, h, :store.lanes.fill[b][h]].long()
            assert (pos >= 0).all()
            out[(b, h)] = (keys[b:b + 1, h:h + 1, pos], values[b:b + 1, h:h + 1, pos])
    return out


@pytest.mark.parametrize("name", ["int8-kchannel", "int4-kchannel", "int4-r8", "int4-r8-h2o"])
def test_model_prefill_and_decode_hold_the_reference(model, monkeypatch, name):
    """A left-padded batch through the model (uneven AdaKV budgets), prompt then 30 decode steps: every layer's
    (row, head) holds its lanes and tail exactly, its history equal to the per-head reference of its kept tokens
    (``-h2o``: a decode-time policy; each head at its budget replaces a token in its lanes or its tail)."""
    torch.manual_seed(4)
    ids = torch.randint(3, 128, (2, 90))
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    seen = capture(monkeypatch)
    tracked = name.endswith("-h2o")
    config = cfg(name.removesuffix("-h2o"), Peaked("accumulate" if tracked else None))
    # (tracked: a bf16 model, so that a victim written in place inside a lane -- quantized from the model's K/V,
    # as per-row blocks do -- and the reference's tokens, through the 16-bit tail, are the same values)
    net = model
    if tracked:
        net = tiny_model("llama", kv_heads=2, heads=4, head_dim=D, layers=2, vocab=128).to(torch.bfloat16)
    cache, logits = run(net, config, ids, torch.randint(3, 128, (2, 30)), mask)
    assert torch.isfinite(logits).all()
    for layer in cache.layers:
        st = layer.store
        check_tails(st, model_seqs(st, seen[layer.layer_idx]))
        qfill = st.lanes.qfill
        assert max(max(r) for r in qfill) > min(min(r) for r in qfill)  # heads hold different lane counts
    report = cache.memory_report()
    assert sum(report["per_precision"].values()) == sum(report[f"bytes_{k}"] for k in ("keys", "values", "scales",
                                                                                       "dense"))  # fmt: skip


@pytest.mark.parametrize("name", ["int8-kchannel", "int4-r8-h2o"])
def test_beams_share_lanes_and_each_row_equals_its_own_run(model, name):
    """Rows repeated (beams) share their lanes (counted once) and keep their own tails; each row then decodes as
    its own single-row run (``-h2o``: victims inside shared lanes are written to copies: copy-on-write)."""
    torch.manual_seed(5)
    ids, cont = torch.randint(3, 128, (1, 100)), torch.randint(3, 128, (2, 24))
    tracked = name.endswith("-h2o")
    config = cfg(name.removesuffix("-h2o"), Peaked("accumulate" if tracked else None))
    cache, _ = run(model, config, ids, cont[:1, :0])
    before = [held(la.store) for la in cache.layers]
    cache.batch_repeat_interleave(2)
    for la, b in zip(cache.layers, before, strict=True):
        assert held(la.store) == b == la.store.memory()["shared"]
    with torch.no_grad():
        got = torch.stack([model(cont[:, i:i + 1], **cache_kw(cache)).logits[:, -1] for i in range(cont.shape[1])],
                          dim=1)
    # (tracked: the batched step's scores differ from a single row's by float noise, which can move a K value of
    # the fp16 tail by one ulp: ~3e-5 on these logits; a head reading another row's lane moves them by far more)
    tol = 1e-4 if tracked else 1e-5
    for row in range(2):
        _, ref = run(model, config, ids, cont[row:row + 1])
        torch.testing.assert_close(got[row:row + 1], ref[:, 1:], rtol=tol, atol=tol)
    for la in cache.layers:
        H = la.store.num_heads
        # lanes flushed (or copied before a victim's write) while decoding are each row's own
        assert la.store.tables[:H] != la.store.tables[H:]
        if tracked:
            assert la.store.bytes_moved > 0
        else:  # the prompt's lanes stay shared
            assert any(la.store.blocks.lane_refs[e] == 2 for t in la.store.tables[:H] for e in t)
    cache.reorder_cache(torch.tensor([1, 1]))
    for la in cache.layers:
        st = la.store
        assert st.tables[0:2] == st.tables[2:4] and st.lanes.qfill[0] == st.lanes.qfill[1]
        assert torch.equal(st.dense.res_k[0], st.dense.res_k[1])
    d = cache.dump()["layers"][0]  # the debug dump lists each (row, head)'s tail
    assert d["lanes"] and d["tail_tokens"] == cache.layers[0].store.lanes.tail_lengths()


@pytest.mark.parametrize("name", ["int8-kchannel", "int4-kchannel"])
def test_generate_greedy_beam_and_left_padded(model, name):
    """generate() with the default preset's per-channel keys + snapkv AdaKV: greedy and beam search on a
    left-padded batch run on lane layers; a padded row generates what it generates alone."""
    torch.manual_seed(6)
    ids = torch.randint(3, 128, (2, 80))
    mask = torch.ones_like(ids)
    mask[0, :10] = 0
    config = cfg(name)
    greedy = model.generate(ids, attention_mask=mask, **cache_kw(QuantizedKVCache(model, config)), max_new_tokens=20,
                            do_sample=False)  # fmt: skip
    beams = model.generate(ids, attention_mask=mask, **cache_kw(QuantizedKVCache(model, config)), max_new_tokens=20,
                           num_beams=3, do_sample=False)  # fmt: skip
    assert greedy.shape == beams.shape == (2, 100)
    alone = model.generate(ids[1:], **cache_kw(QuantizedKVCache(model, config)), max_new_tokens=20, do_sample=False)
    assert torch.equal(greedy[1:, 80:], alone[:, 80:])
    cache = QuantizedKVCache(model, config)
    model.generate(ids, attention_mask=mask, **cache_kw(cache), max_new_tokens=20, do_sample=False)
    assert all(la.store.tail_lanes for la in cache.layers)


def test_reset_and_crop(model):
    """reset() returns every lane and tail, and the cache then runs a new prompt as a fresh one; crop() of an
    evicting layer is refused (one line)."""
    torch.manual_seed(7)
    config = cfg("int8-kchannel", Peaked())
    cache, _ = run(model, config, torch.randint(3, 128, (1, 120)), torch.randint(3, 128, (1, 20)))
    with pytest.raises(ValueError, match="crop"):
        cache.crop(100)
    cache.reset()
    for la in cache.layers:
        assert la.store.blocks.used == 0 and la.store.dense.res_k is None and la.store.q_end == 0
        assert la.store.lanes.qfill == [[0, 0]]
    new = torch.randint(3, 128, (1, 70))
    with torch.no_grad():
        got = model(new, **cache_kw(cache)).logits
        ref = model(new, **cache_kw(QuantizedKVCache(model, config))).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_bounded_pool_refuses_a_step_before_any_layer_writes(model):
    """A bounded pool and int8-kchannel AdaKV: decode until a step's tail flush does not fit; KVCacheFull leaves
    every layer's lanes, fills, tails and the pool's counts as they were; reset() returns every block."""
    torch.manual_seed(9)
    config = cfg("int8-kchannel", Peaked())
    per_block = sum(LayerBlocks(block_specs(make_groups([config.default] * 2, config, D)), BS,
                                torch.device("cpu")).bytes_per_block for _ in range(2))  # fmt: skip
    pool = PagedKVPool(model, config, max_bytes=per_block * 10)  # 10 blocks = 20 lanes per layer
    ids = torch.randint(3, 128, (1, 120))
    cache = QuantizedKVCache.from_pool(pool, ids)

    def state():
        return [(snapshot(la.store), la.store.dense.res_k.clone(), [list(r) for r in la.store.lanes.qfill])
                for la in cache.layers]

    before, after = decode_until_full(model, ids, cache, state, 300)
    for (s0, r0, q0), (s1, r1, q1) in zip(before, after, strict=True):
        assert s0 == s1 and torch.equal(r0, r1) and q0 == q1
    for la in cache.layers:
        assert la.store.memory()["lanes"] > 8
    cache.reset()
    assert pool.stats()["blocks_used"] == 0


@pytest.mark.parametrize("name", ["int8-kchannel", "int8-r8"])
def test_identical_prompt_rows_share_their_lanes_once(model, name):
    """generate()'s beams start from identical prompt rows: each head's flushed lanes are written once and shared
    (its tail stays per row, as any row's)."""
    torch.manual_seed(10)
    ids = torch.randint(3, 128, (1, 100))
    config = cfg(name, Peaked())
    single, _ = run(model, config, ids, ids[:, :0])
    beams, _ = run(model, config, ids.repeat(3, 1), ids[:, :0])
    for one, three in zip(single.layers, beams.layers, strict=True):
        assert three.store.memory()["lanes"] == one.store.memory()["lanes"] > 0
        assert held(three.store) == held(one.store) == three.store.memory()["shared"]
        H = three.store.num_heads
        assert three.store.tables[:H] == three.store.tables[H:2 * H] == three.store.tables[2 * H:]
        res_k = three.store.dense.res_k
        assert res_k.shape[0] == 3 and torch.equal(res_k[0], res_k[2])
