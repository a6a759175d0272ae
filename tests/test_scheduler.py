"""kvquant.Scheduler: continuous batching over one quantized pool.

Requests of different lengths arrive at different steps into a pool too small for all of them (so some wait
and some are preempted); each one's greedy tokens must equal its solo run, the pool must be empty afterwards,
a mixed prefill + decode step must give the logits of separate steps, and a shared prefix is held once.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvquant
from kvquant.errors import ConfigError, RequestError
from kvquant.packed import PackedCache, Segment

BS = 16  # block size of these tests: small pools of few blocks


def config(preset: str) -> kvquant.KVQuantConfig:
    return kvquant.KVQuantConfig.load({**kvquant.KVQuantConfig.load(preset).to_dict(), "block_size": BS})


def prompts(lengths, seed=0, vocab=500):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def solo(model, cfg, prompt, n):
    cache = kvquant.QuantizedKVCache(model, cfg)
    out = model.generate(torch.tensor([prompt]), cache=cache, max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow  # 10 solo runs and one staggered run of 20 tokens each: ~6 s on a shared core
@pytest.mark.parametrize("preset", ["fp32", kvquant.DEFAULT_PRESET])
def test_staggered_requests_match_solo_runs_with_waiting_and_preemption(stories, preset):
    model, _ = stories
    cfg = config(preset)
    n_new = 20
    ps = prompts([5, 40, 17, 60, 9, 33, 3, 24, 50, 12])
    want = [solo(model, cfg, p, n_new) for p in ps]
    block = kvquant.PagedKVPool(model, cfg).block_bytes
    sched = kvquant.Scheduler(model, cfg, max_bytes=10 * block, max_step_tokens=96, prefill_chunk=64)
    ids = [sched.submit(p, max_new_tokens=n_new) for p in ps[:4]]
    waited = False
    events: dict[int, list[int]] = {}
    arrivals = iter(ps[4:])
    while sched.busy or len(ids) < len(ps):
        if len(ids) < len(ps):  # one more request arrives at every step
            ids.append(sched.submit(next(arrivals), max_new_tokens=n_new))
        for ev in sched.step():
            events.setdefault(ev.request_id, []).append(ev.token)
        waited |= bool(sched.waiting) and bool(sched.running)
    st = sched.stats()
    assert waited and st["preemptions"] > 0 and st["running_max"] > 1
    assert [sched.output(i) for i in ids] == want
    assert [events[i] for i in ids] == want  # the stream carried every token once, in order
    assert st["pool"]["blocks_used"] == st["pool"]["indexed_blocks"] * model.config.num_hidden_layers
    sched.pool.clear_prefixes()
    assert sched.pool.stats()["blocks_used"] == 0  # no block leaked


def test_long_prompts_chunked_and_sampling_independent_of_batch_mates(stories):
    model, _ = stories
    cfg = config(kvquant.DEFAULT_PRESET)
    ps = prompts([90, 7, 130, 45], seed=1)
    kw = {"max_new_tokens": 10, "temperature": 0.8, "top_k": 50, "top_p": 0.9}
    alone = []
    for i, p in enumerate(ps):
        s = kvquant.Scheduler(model, cfg, max_step_tokens=64, prefill_chunk=32)
        alone.append(s.generate_batch([p], seed=i, **kw)[0])
    block = kvquant.PagedKVPool(model, cfg).block_bytes
    s = kvquant.Scheduler(model, cfg, max_bytes=11 * block, max_step_tokens=64, prefill_chunk=32)
    ids = [s.submit(p, seed=i, **kw) for i, p in enumerate(ps)]
    for _ in s.stream():
        pass
    assert s.stats()["preemptions"] > 0
    assert [s.output(i) for i in ids] == alone


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


def test_mixed_prefill_and_decode_step_gives_the_logits_of_separate_steps(stories):
    model, _ = stories
    a, b = prompts([21, 37], seed=2)
    pool = kvquant.PagedKVPool(model, config("fp32"))

    def new():  # a cache on the pool, not bound to ids (no prefix index: each starts empty)
        return kvquant.QuantizedKVCache(model, pool=pool)

    mixed_a, sep_a = new(), new()
    for c in (mixed_a, sep_a):
        packed_logits(model, [(c, a, 0)])
    nxt = [7]
    mixed = packed_logits(model, [(mixed_a, nxt, len(a)), (new(), b, 0)])
    alone_a = packed_logits(model, [(sep_a, nxt, len(a))])
    alone_b = packed_logits(model, [(new(), b, 0)])
    torch.testing.assert_close(mixed[:1], alone_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mixed[1:], alone_b, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # and both are the model's own logits (fp32 passthrough is exact)
        ref_a = model(torch.tensor([a + nxt]), cache=DynamicCache(config=model.config)).logits[0, -1:]
        ref_b = model(torch.tensor([b]), cache=DynamicCache(config=model.config)).logits[0]
    torch.testing.assert_close(mixed[:1], ref_a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mixed[1:], ref_b, rtol=1e-4, atol=1e-4)


def test_prefix_sharing_holds_shared_blocks_once(stories):
    model, _ = stories
    cfg = config(kvquant.DEFAULT_PRESET)
    system = prompts([64], seed=3)[0]
    q1, q2, q3 = prompts([5, 9, 13], seed=4)
    layers = model.config.num_hidden_layers
    sched = kvquant.Scheduler(model, cfg, max_step_tokens=128, prefill_chunk=32)
    sched.generate_batch([system + q1], max_new_tokens=4)  # indexes the system prompt's blocks
    first = sched.pool.stats()
    r2 = sched.submit(system + q2, max_new_tokens=6)
    r3 = sched.submit(system + q3, max_new_tokens=6)
    sched.step()
    tables = [sched.requests[r].cache.layers[0].store.tables[0][:4] for r in (r2, r3)]
    assert tables[0] == tables[1]  # the same four blocks, referenced twice, not copied
    st = sched.pool.stats()
    assert st["prefix_hit_tokens"] - first["prefix_hit_tokens"] == 2 * 64
    assert st["blocks_shared"] >= 4 * layers
    for _ in sched.stream():
        pass
    fresh = kvquant.Scheduler(model, cfg, max_step_tokens=128, prefill_chunk=32)
    assert sched.output(r2) == fresh.generate_batch([system + q2], max_new_tokens=6)[0]  # a chunk-aligned hit
    sched.pool.clear_prefixes()
    assert sched.pool.stats()["blocks_used"] == 0


def test_cancel_frees_blocks_at_once_and_user_errors_are_one_line(stories):
    model, _ = stories
    cfg = config("int8-token")
    block = kvquant.PagedKVPool(model, cfg).block_bytes
    sched = kvquant.Scheduler(model, cfg, max_bytes=8 * block, max_step_tokens=64, prefill_chunk=32)
    a, b = prompts([30, 20], seed=5)
    ra, rb = sched.submit(a, max_new_tokens=20), sched.submit(b, max_new_tokens=20)
    sched.step()
    used = sched.pool.stats()["blocks_used"]
    assert sched.cancel(ra) and not sched.cancel(ra)
    assert sched.pool.stats()["blocks_used"] < used and sched.status(ra) == "cancelled"
    evs = list(sched.stream())
    assert evs[0].request_id == ra and evs[0].reason == "cancelled"
    assert sched.status(rb) in ("stop", "length")
    base = {"default": "int8-token", "block_size": BS}
    for bad, err in [
        (lambda: sched.submit(a, max_new_tokens=200), RequestError),  # never fits the pool
        (lambda: sched.submit([], max_new_tokens=2), RequestError),
        (lambda: sched.submit(a, max_new_tokens=0), RequestError),
        (lambda: sched.submit(a, top_p=0.0), RequestError),
        (lambda: sched.cancel(99), RequestError),
        (lambda: kvquant.Scheduler(model, cfg, prefill_chunk=20), RequestError),
        (lambda: kvquant.Scheduler(model, {**base, "offload": {"device": "cpu"}}), ConfigError),
        (lambda: kvquant.Scheduler(model, {**base, "evict": {"policy": "snapkv", "keep": 0.5}}), ConfigError),
    ]:
        with pytest.raises(err) as e:
            bad()
        assert "\n" not in str(e.value)


@pytest.mark.slow  # 6 solo runs and one bounded run of 12 tokens each: ~10 s on a shared core
def test_dense_buffers_bounded_by_what_they_hold(stories):
    model, _ = stories
    cfg = config("int4-kchannel-sinks")  # fp16 sinks and the unfilled tail of per-channel key blocks
    ps = prompts([5, 40, 17, 30, 9, 23], seed=6)
    want = [solo(model, cfg, p, 12) for p in ps]
    one = kvquant.Scheduler(model, cfg).dense_per_request  # 4 sinks and a 15-token tail
    bound = int(2.5 * one)  # a worst-case reserve per request would hold two requests
    sched = kvquant.Scheduler(model, cfg, max_step_tokens=64, prefill_chunk=32, max_dense_bytes=bound)
    ids = [sched.submit(p, max_new_tokens=12) for p in ps]
    held = []
    while sched.busy:
        sched.step()
        held.append(sched.dense_bytes())
        assert held[-1] <= bound
        assert sched.dense_bytes() == sum(
            sum(t.numel() * t.element_size() for pair in layer.store.dense_buffers().values() for t in pair)
            for r in sched.running for layer in r.cache.layers)  # fmt: skip
    st = sched.stats()
    assert max(held) > one and st["running_max"] >= 3  # the bound is shared by use, not reserved per request
    assert st["running_max"] < len(ps)  # and it binds: some requests waited
    assert [sched.output(i) for i in ids] == want
    with pytest.raises(RequestError):
        kvquant.Scheduler(model, cfg, max_dense_bytes=-1)
    with pytest.raises(RequestError):
        kvquant.Scheduler(model, cfg, max_dense_bytes=one - 1)


@pytest.mark.slow  # 6 solo runs and three scheduler runs of 16 tokens each
def test_reserve_tokens_holds_more_and_refused_admissions_are_not_retried_in_vain(stories, monkeypatch):
    model, _ = stories
    cfg = config("int8-kchannel")  # per-channel keys: a request needs a new block only when its tail fills
    ps = prompts([5, 40, 17, 30, 9, 23], seed=3)
    want = [solo(model, cfg, p, 16) for p in ps]
    block = kvquant.PagedKVPool(model, cfg).block_bytes
    built = []
    from_pool = kvquant.QuantizedKVCache.from_pool
    monkeypatch.setattr(kvquant.QuantizedKVCache, "from_pool",
                        staticmethod(lambda *a, **k: built.append(1) or from_pool(*a, **k)))  # fmt: skip
    runs = {}
    for name, reserve, retry_all in (("memo", None, False), ("retry", None, True), ("reserve0", 0, False)):
        if retry_all:
            monkeypatch.setattr(kvquant.Scheduler, "_still_refused", lambda *a: False)
        else:
            monkeypatch.undo()
            monkeypatch.setattr(kvquant.QuantizedKVCache, "from_pool",
                                staticmethod(lambda *a, **k: built.append(1) or from_pool(*a, **k)))  # fmt: skip
        built.clear()
        sched = kvquant.Scheduler(model, cfg, max_bytes=9 * block, max_step_tokens=64, prefill_chunk=32,
                                  reserve_tokens=reserve)  # fmt: skip
        ids = [sched.submit(p, max_new_tokens=16) for p in ps]
        while sched.busy:
            sched.step()
        assert [sched.output(i) for i in ids] == want
        sched.pool.clear_prefixes()
        assert sched.pool.stats()["blocks_used"] == 0
        runs[name] = (sched.stats(), len(built))
    memo, retry, reserve0 = runs["memo"], runs["retry"], runs["reserve0"]
    assert memo[0]["steps"] == retry[0]["steps"] and memo[0]["running_max"] == retry[0]["running_max"]
    assert memo[1] < retry[1]  # the same schedule with fewer caches built and dropped
    assert reserve0[0]["running_max"] > memo[0]["running_max"]  # less growth room: more requests held
    with pytest.raises(RequestError):
        kvquant.Scheduler(model, cfg, reserve_tokens=-1)
