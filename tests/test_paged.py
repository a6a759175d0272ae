"""The paged pool: block tables, sharing (beams, prefixes), sliding windows, a bounded pool, the
cache -> attention contract, reversible wrap, session ids and the debug dump (tiny models, CPU)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

import kvquant
from kvquant import KVCacheFull, ModelShape, PagedKVPool, QuantizedKVCache
from kvquant.blocks import LayerBlocks
from kvquant.quantizers.base import PartSpec
from kvquant.transformers_compat import cache_kw

from conftest import tiny_model


def greedy(model, ids, cache, n=12, **kw):
    with torch.no_grad():
        return model.generate(ids, **cache_kw(cache), max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)


# ------------------------------------------------------------------------------------------ blocks
def test_layer_blocks_free_list_refcounts_and_growth():
    spec = {"q": PartSpec((8,), torch.int8)}
    blocks = LayerBlocks([(2, spec, spec)], 16, torch.device("cpu"))
    ids = [blocks.allocate() for _ in range(5)]
    assert len(set(ids)) == 5 and blocks.used == 5 and blocks.num_blocks >= 5
    blocks.incref(ids[:2])
    blocks.decref(ids)  # the first two are still referenced once
    assert blocks.used == 2 and sorted(b for b in range(blocks.num_blocks) if blocks.refs[b]) == sorted(ids[:2])
    blocks.parts[0]["key"]["q"][ids[0]] = 7
    c = blocks.copy(ids[0])
    assert c not in ids[:2] and torch.equal(blocks.parts[0]["key"]["q"][c], blocks.parts[0]["key"]["q"][ids[0]])
    with pytest.raises(AssertionError):
        blocks.decref([ids[2]])  # already free


# ------------------------------------------------------------------------------------------ beams
@pytest.mark.parametrize("preset", ["fp32", "int8-token", "int4"])
def test_beams_share_blocks_and_match(preset):
    model = tiny_model("llama", heads=4, kv_heads=2, head_dim=64)
    ids = torch.randint(3, 128, (1, 70), generator=torch.Generator().manual_seed(2))
    cfg = kvquant.KVQuantConfig.load(preset)
    cfg = kvquant.KVQuantConfig.load({**cfg.to_dict(), "block_size": 16})
    one = QuantizedKVCache(model, cfg)
    greedy(model, ids, one, n=6)
    four = QuantizedKVCache(model, cfg)
    out = greedy(model, ids, four, n=6, num_beams=4)
    r1, r4 = one.memory_report(), four.memory_report()
    # the prompt's blocks are written once (identical rows deduplicated) and shared by the 4 beams
    assert r4["bytes_shared"] > 0 and r4["blocks"] < 4 * r1["blocks"]
    prompt_blocks = 70 // 16
    per_layer = r4["blocks"] / len(model.model.layers)
    assert per_layer <= prompt_blocks + 4 * math.ceil((70 % 16 + 6) / 16)
    # copy-on-write moved at most one partial block per row per step (all layers)
    block_bytes = four.layers[0].store.blocks.bytes_per_block * len(four.layers)
    assert r4["bytes_moved"] <= 6 * 4 * block_bytes
    if preset == "fp32":
        assert torch.equal(out, greedy(model, ids, DynamicCache(config=model.config), n=6, num_beams=4))


def test_reorder_moves_no_bytes_and_cow_copies_a_shared_partial_block():
    shape = ModelShape(1, 2, 32)
    cache = QuantizedKVCache(shape, kvquant.KVQuantConfig.load({"default": "int8-token", "block_size": 16}))
    k = torch.randn(2, 2, 20, 32)
    cache.update(k, k.clone(), 0)
    st = cache.layers[0].store
    before = [list(t) for t in st.tables]
    cache.reorder_cache(torch.tensor([1, 1]))
    assert st.tables == [before[1], before[1]] and st.bytes_moved == 0
    assert all(st.blocks.refs[b] == 2 for b in before[1]) and all(st.blocks.refs[b] == 0 for b in before[0])
    x = torch.randn(2, 2, 1, 32)
    cache.update(x, x.clone(), 0)  # rows differ: the shared partial block (tokens 16..19) is copied once
    assert st.tables[0][0] == st.tables[1][0] == before[1][0]  # the full block stays shared
    assert st.tables[0][1] != st.tables[1][1] and st.bytes_moved == st.blocks.bytes_per_block
    y = x[:1].expand(2, -1, -1, -1).contiguous()
    cache.update(y, y.clone(), 0)  # rows now write into their own partial blocks: nothing moves
    assert st.bytes_moved == st.blocks.bytes_per_block


# ------------------------------------------------------------------------------------------ prefix reuse
def test_prefix_reuse_tiny():
    model = tiny_model("qwen2", heads=4, kv_heads=2, head_dim=64)
    pool = PagedKVPool(model, {"default": "int8-token", "block_size": 16})
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 128, (1, 64), generator=g)
    a = torch.cat([shared, torch.randint(3, 128, (1, 5), generator=g)], 1)
    b = torch.cat([shared, torch.randint(3, 128, (1, 9), generator=g)], 1)
    ca = QuantizedKVCache.from_pool(pool, a)
    assert ca.get_seq_length() == 0
    with torch.no_grad():
        model(a, **cache_kw(ca), use_cache=True)
    cb = QuantizedKVCache.from_pool(pool, b)
    assert cb.get_seq_length() == 64
    assert pool.stats()["prefix_hit_tokens"] == 64
    seen = []
    hook = model.model.register_forward_pre_hook(lambda m, args, kw: seen.append(kw["input_ids"].shape[1]),
                                                 with_kwargs=True)
    with torch.no_grad():
        logits = model(b[:, 64:], **cache_kw(cb), use_cache=True).logits
    hook.remove()
    assert seen == [9]
    fresh = QuantizedKVCache(model, pool.config)  # same config, private blocks
    with torch.no_grad():
        model(b[:, :64], **cache_kw(fresh), use_cache=True)
        ref = model(b[:, 64:], **cache_kw(fresh), use_cache=True).logits
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
    # the shared blocks are counted once by the pool and held by both caches
    assert pool.stats()["blocks_shared"] >= 4 * 2
    cache = QuantizedKVCache.from_pool(pool, b)
    out = model.generate(b, **cache_kw(cache), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 77)


def test_prefix_not_reused_for_static_scales_without_file():
    model = tiny_model("llama")
    pool = PagedKVPool(model, {"default": "int8", "block_size": 16})
    ids = torch.randint(3, 128, (1, 40))
    with torch.no_grad():
        model(ids, **cache_kw(QuantizedKVCache.from_pool(pool, ids)), use_cache=True)
    fresh = QuantizedKVCache.from_pool(pool, ids)
    assert not pool.reusable and fresh.get_seq_length() == 0 and pool.stats()["indexed_blocks"] == 0


# ------------------------------------------------------------------------------------------ sliding windows
class BlockWatch(LogitsProcessor):
    """Records, at every generation step, the most blocks any sliding layer's rows hold."""

    def __init__(self, cache):
        self.cache, self.most = cache, 0

    def __call__(self, input_ids, scores):
        for layer in self.cache.layers:
            if layer.window is not None and layer.store is not None:
                st = layer.store
                live = max(sum(b >= 0 for b in t) for t in st.tables)
                self.most = max(self.most, live)
        return scores


@pytest.mark.slow  # 2 x 1000 decode steps (ours and DynamicCache's): ~10 s each on an idle core
@pytest.mark.parametrize("arch", ["mistral", "qwen2-alternating"])
def test_sliding_window_layers_stay_bounded_and_match_dynamic_cache(arch):
    if arch == "mistral":
        model = tiny_model("mistral", heads=2, kv_heads=1, head_dim=32, sliding_window=64)
    else:  # Gemma-2 style: sliding and full layers alternate
        model = tiny_model("qwen2", heads=2, kv_heads=1, head_dim=32, layers=2, use_sliding_window=True,
                           sliding_window=64, layer_types=["sliding_attention", "full_attention"])
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    cfg = kvquant.KVQuantConfig.load({"default": "fp32", "block_size": 16})
    cache = QuantizedKVCache(model, cfg)
    assert [la.window for la in cache.layers] == ([64, 64] if arch == "mistral" else [64, None])
    watch = BlockWatch(cache)
    n = 1000
    out = greedy(model, ids, cache, n=n, logits_processor=LogitsProcessorList([watch]))
    assert watch.most <= math.ceil(64 / 16) + 1
    ref = greedy(model, ids, DynamicCache(config=model.config), n=n)
    assert torch.equal(out, ref)
    if arch != "mistral":  # the full-attention layer keeps everything
        assert len(cache.layers[1].store.tables[0]) == math.ceil((40 + n - 1) / 16)


# ------------------------------------------------------------------------------------------ bounded pool
def test_bounded_pool_full_then_recovers():
    model = tiny_model("llama", heads=4, kv_heads=2, head_dim=64)
    cfg = {"default": "int8-token", "block_size": 16}
    pool = PagedKVPool(model, cfg, max_bytes=10 * _bytes_per_block_all_layers(model, cfg))
    g = torch.Generator().manual_seed(9)
    first = torch.randint(3, 128, (1, 100), generator=g)  # 7 blocks per layer
    second = torch.randint(3, 128, (1, 60), generator=g)  # 4 blocks per layer: does not fit beside the first
    c1 = QuantizedKVCache.from_pool(pool, first)
    with torch.no_grad():
        ref = model(first, **cache_kw(c1), use_cache=True).logits
    held = [list(t) for t in c1.layers[0].store.tables]
    c2 = QuantizedKVCache.from_pool(pool, second)
    with pytest.raises(KVCacheFull) as e, torch.no_grad():
        model(second, **cache_kw(c2), use_cache=True)
    assert e.value.needed == 4 and e.value.free == 3 and "needs 4 blocks" in str(e.value)
    # nothing stored was damaged: the first sequence continues exactly as a fresh one would
    assert c1.layers[0].store.tables == held and c2.get_seq_length() == 0
    nxt = torch.randint(3, 128, (1, 1), generator=g)
    with torch.no_grad():
        cont = model(nxt, **cache_kw(c1), use_cache=True).logits
        alone = QuantizedKVCache(model, pool.config)
        model(first, **cache_kw(alone), use_cache=True)
        torch.testing.assert_close(cont, model(nxt, **cache_kw(alone), use_cache=True).logits, atol=1e-5, rtol=0)
    assert ref.shape[1] == 100
    c1.release()  # its 6 full blocks stay in the prefix index; the partial one is free again
    c2 = QuantizedKVCache.from_pool(pool, second)
    with torch.no_grad():
        model(second, **cache_kw(c2), use_cache=True)
    assert c2.get_seq_length() == 60 and pool.stats()["blocks_free"] == 0
    c2.release()
    c3 = QuantizedKVCache.from_pool(pool, first)  # the index-only blocks are evicted when a new request needs room
    assert c3.get_seq_length() == 96  # ... but first the first request's prefix is found again
    with torch.no_grad():
        fresh = QuantizedKVCache(model, pool.config)
        model(first[:, :96], **cache_kw(fresh), use_cache=True)
        torch.testing.assert_close(model(first[:, 96:], **cache_kw(c3), use_cache=True).logits,
                                   model(first[:, 96:], **cache_kw(fresh), use_cache=True).logits, atol=1e-5, rtol=0)


def _bytes_per_block_all_layers(model, cfg) -> int:
    from kvquant.blocks import block_bytes

    pool = PagedKVPool(model, cfg)
    return sum(block_bytes(s, pool.block_size) for s in pool._specs)


# ------------------------------------------------------------------------------------------ contract, wrap, ids
def test_wrap_is_reversible_and_cache_does_not_touch_the_model():
    model = tiny_model("llama", kvquant_attention=False)
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="kvquant.wrap"):
        QuantizedKVCache(model, "int8")
    assert model.config._attn_implementation == "eager"
    ids = torch.randint(3, 128, (1, 6))
    with kvquant.wrapped(model, "int8-token"):
        assert model.config._attn_implementation == "kvquant"
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert out.shape == (1, 9)
    assert model.config._attn_implementation == "eager" and not hasattr(model, "kvquant_config")


def test_no_attribute_on_key_tensor_and_no_import_cycles():
    import ast
    import pathlib

    import kvquant.view as view

    shape = ModelShape(1, 2, 16)
    cache = QuantizedKVCache(shape, "fp32")
    k = torch.randn(1, 2, 3, 16)
    key, _ = cache.update(k, k.clone(), 0)
    assert not [a for a in vars(key) if "kvquant" in a]
    assert view.take(key).past_len == 0 and view.take(key) is None
    # module-level imports: attention and cache meet only in kvquant.view; the core never imports eval
    root = pathlib.Path(kvquant.__file__).parent

    def imports(path):
        tree = ast.parse(path.read_text())
        out = set()
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                out.add(("." * node.level) + (node.module or ""))
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
        return out

    assert ".cache" not in imports(root / "attention.py") and ".attention" not in imports(root / "cache.py")
    for f in (root / "kernels").glob("*.py"):
        if f.name != "dispatch.py":
            assert ".dispatch" not in imports(f), f.name
    for f in root.glob("*.py"):
        assert not any("eval" in m.split(".") for m in imports(f)), f.name


def test_session_ids_deepcopy_and_dump():
    model = tiny_model("llama")
    pool = PagedKVPool(model, {"default": "int8-token", "block_size": 16})
    cache = QuantizedKVCache(model, None, pool=pool)
    ids = torch.randint(3, 128, (1, 40))
    with torch.no_grad():
        model(ids, **cache_kw(cache), use_cache=True)
    sid = cache.session_id
    assert sid != QuantizedKVCache(model, None, pool=pool).session_id
    twin = copy.deepcopy(cache)
    assert twin.session_id != sid and twin.layers[0].store.tables == cache.layers[0].store.tables
    assert pool.stats()["blocks_shared"] == 3 * 2  # the copy shares every block (2 layers x 3 blocks)
    nxt = torch.randint(3, 128, (1, 2))
    with torch.no_grad():
        a = model(nxt, **cache_kw(cache), use_cache=True).logits
        b = model(nxt, **cache_kw(twin), use_cache=True).logits
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    d = json.loads(json.dumps(cache.dump()))
    assert d["session_id"] == sid and d["layers"][0]["cache_pos"] == 42 and d["pool"]["blocks_used"] > 0
    assert len(d["layers"][0]["block_tables"][0]) == 3
    cache.reset()
    assert cache.session_id != sid and cache.get_seq_length() == 0


def test_inspect_command_prints_the_dump(stories_path, capsys):
    from kvquant.cli import main

    rc = main(["inspect", "--model", str(stories_path), "--config", "int8-token", "--text", "Once upon a time",
               "--new-tokens", "3", "--beams", "2", "--block-size", "16", "--summary"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert d["session_id"].startswith("kvq-") and d["block_size"] == 16 and d["memory"]["bytes_total"] > 0
    assert d["layers"][0]["cache_pos"] == d["cache_pos"] > 3 and d["layers"][0]["block_tables"] == [1, 1]
