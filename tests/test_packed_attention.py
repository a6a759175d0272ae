"""The batched attention of a packed step (kvquant.packed_attention): decode tokens of many sequences and prefill
chunks of equal length read the shared pool in one walk each, and give the logits of separate steps."""

from __future__ import annotations

import pytest
import torch

import kvquant
import kvquant.packed_attention as pa
from kvquant.packed import PackedCache, Segment

BS = 16


def packed_logits(model, pieces):
    """One packed forward over ``pieces`` = [(cache, token ids, first position)]: logits ``[T, V]``."""
    ids, pos, segs = [], [], []
    for cache, toks, start in pieces:
        segs.append(Segment(cache, len(ids), len(toks)))
        ids += toks
        pos += range(start, start + len(toks))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]),
                    cache=PackedCache(model.config.num_hidden_layers, segs), use_cache=True)
    return out.logits[0]


@pytest.mark.parametrize("preset", ["fp32", "int8-kchannel", "int4-kchannel-sinks", "int4"])
def test_batched_step_gives_the_logits_of_separate_steps(stories, preset, monkeypatch):
    model, _ = stories
    cfg = kvquant.KVQuantConfig.load({**kvquant.KVQuantConfig.load(preset).to_dict(), "block_size": BS})
    pool = kvquant.PagedKVPool(model, cfg)
    g = torch.Generator().manual_seed(0)
    # histories whose tails hold 3, 5, 8 and 15 tokens (the last one's decode token fills its block)
    hist = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 21, 40, 47)]
    fresh = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (16, 16, 9)]
    twins = []
    for h in hist:
        pair = [kvquant.QuantizedKVCache(model, pool=pool) for _ in range(2)]
        for c in pair:
            packed_logits(model, [(c, h, 0)])
        twins.append(pair)
    calls = []
    real = pa.attend_batched
    monkeypatch.setattr(pa, "attend_batched", lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
    nxt = [[7], [8], [9], [10]]
    new = [kvquant.QuantizedKVCache(model, pool=pool) for _ in fresh]
    mixed = packed_logits(model, [(twins[i][0], nxt[i], len(h)) for i, h in enumerate(hist)]
                          + [(c, f, 0) for c, f in zip(new, fresh, strict=True)])
    layers = model.config.num_hidden_layers
    assert sorted(calls) == sorted([2, 4] * layers)  # four decode tokens in one walk, two 16-token chunks in another
    alone = [packed_logits(model, [(twins[i][1], nxt[i], len(h))]) for i, h in enumerate(hist)]
    alone += [packed_logits(model, [(kvquant.QuantizedKVCache(model, pool=pool), f, 0)]) for f in fresh]
    torch.testing.assert_close(mixed, torch.cat(alone), rtol=1e-4, atol=1e-4)
    # and the next decode step of every sequence, batched, still matches
    calls.clear()
    both = [packed_logits(model, [(twins[i][k], [11], len(h) + 1) for i, h in enumerate(hist)]) for k in (0, 1)]
    torch.testing.assert_close(both[0], both[1], rtol=1e-4, atol=1e-4)


def test_stores_the_walk_does_not_cover_take_the_per_sequence_path(stories):
    model, _ = stories
    cfg = kvquant.KVQuantConfig.load({"default": "int8", "block_size": BS})  # static scales: per sequence
    cache = kvquant.QuantizedKVCache(model, cfg)
    packed_logits(model, [(cache, [5, 6, 7], 0)])
    assert not pa.batchable(cache.layers[0].store)
    plain = kvquant.QuantizedKVCache(model, {"default": "int8-token", "block_size": BS})
    packed_logits(model, [(plain, [5, 6, 7], 0)])
    assert pa.batchable(plain.layers[0].store)
