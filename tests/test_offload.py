"""CPU offload of cold blocks (kvquant/offload.py): exact attention over offloaded blocks, device bytes bounded
while the context grows, reference counts over both tiers, config errors (tiny random models, CPU: both tiers
are CPU tensors there, the moves and the accounting are the same code)."""

from __future__ import annotations

import pytest
import torch

import kvquant
from kvquant import KVQuantConfig, QuantizedKVCache
from kvquant.blocks import GROWTH
from kvquant.errors import ConfigError
from kvquant.kernels.attention_torch import attend_torch
from kvquant.store import LayerStore
from kvquant.transformers_compat import cache_kw

from conftest import tiny_model


def cfg(preset: str, offload: dict | None = None, **extra) -> KVQuantConfig:
    base = KVQuantConfig.load(preset).to_dict()
    base.pop("name", None)
    return KVQuantConfig.load({**base, "block_size": 16, **extra, **({"offload": offload} if offload else {})})


def fill(store: LayerStore, tokens: int, seed: int = 0, chunk: int = 37) -> None:
    g = torch.Generator().manual_seed(seed)
    done = 0
    while done < tokens:
        n = min(chunk, tokens - done)
        k = torch.randn(store.batch, store.num_heads, n, store.head_dim, generator=g)
        v = torch.randn(store.batch, store.num_heads, n, store.head_dim, generator=g)
        store.append(k, v)
        done += n


@pytest.mark.parametrize("preset", ["fp32", "int8-token", "int4", "int4-kchannel"])
def test_attention_over_offloaded_blocks_equals_resident(preset):
    """keep_recent_blocks 2: most blocks live in the host tier, attention (decode step and a prefill chunk, through
    the torch tile walk with prefetch, and through staging as the Triton path does) equals the resident store's."""
    sinks = {"sink_tokens": 4} if preset == "int8-token" else {}
    plain = LayerStore([KVQuantConfig.load(preset).default] * 2, cfg(preset, **sinks), 32, batch=2,
                       device=torch.device("cpu"))  # fmt: skip
    off = LayerStore([KVQuantConfig.load(preset).default] * 2, cfg(preset, {"keep_recent_blocks": 2}, **sinks), 32,
                     batch=2, device=torch.device("cpu"))  # fmt: skip
    fill(plain, 300)
    fill(off, 300)
    assert off.has_host_blocks() and len(off.host_block_ids()) >= 300 // 16 - 3 - (1 if sinks else 0)
    resident = sum(1 for t in off.tables for b in t if b >= 0)
    assert resident <= 2 * (2 + 1 + (1 if sinks else 0))  # per row: 2 recent + the sink block (+1 partial)
    g = torch.Generator().manual_seed(5)
    for tq in (1, 20):
        q = torch.randn(2, 4, tq, 32, generator=g)
        fk, fv = torch.randn(2, 2, tq, 32, generator=g), torch.randn(2, 2, tq, 32, generator=g)
        ref = attend_torch(q, fk, fv, plain, plain.cache_pos, None, 0.2)
        out = attend_torch(q, fk, fv, off, off.cache_pos, None, 0.2)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        with off.staged():  # what the Triton path reads: every block in the device arena for the call
            assert not off.has_host_blocks()
            staged = attend_torch(q, fk, fv, off, off.cache_pos, None, 0.2)
        torch.testing.assert_close(staged, ref, atol=1e-5, rtol=1e-5)
        assert off.has_host_blocks()  # back in the host tier, the staging blocks free again


def test_small_workspace_walks_many_tiles_with_prefetch(monkeypatch):
    from kvquant.kernels import attention_torch

    monkeypatch.setattr(attention_torch, "WORKSPACE_BYTES", 4096)  # one block per tile: many tiles
    plain = LayerStore([KVQuantConfig.load("int4").default] * 2, cfg("int4"), 32, batch=1, device=torch.device("cpu"))
    off = LayerStore([KVQuantConfig.load("int4").default] * 2, cfg("int4", {"keep_recent_blocks": 1}), 32, batch=1,
                     device=torch.device("cpu"))  # fmt: skip
    fill(plain, 200)
    fill(off, 200)
    q = torch.randn(1, 4, 1, 32)
    fk, fv = torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32)
    ref = attend_torch(q, fk, fv, plain, 200, None, 0.2)
    torch.testing.assert_close(attend_torch(q, fk, fv, off, 200, None, 0.2), ref, atol=1e-5, rtol=1e-5)
    assert off.host.prefetcher.prefetched >= 8


def test_model_logits_match_and_device_bytes_stay_bounded_to_4k():
    """A small random Llama run to 4K tokens: logits equal the non-offloaded cache's (fp32, 1e-5) at every chunk;
    device bytes stay flat while host bytes grow; device + host = the bytes the resident cache holds."""
    model = tiny_model("llama", heads=4, kv_heads=2, head_dim=32, layers=2, vocab=96)
    ids = torch.randint(3, 96, (1, 4096), generator=torch.Generator().manual_seed(0))
    plain = QuantizedKVCache(model, cfg("int4"))
    off = QuantizedKVCache(model, cfg("int4", {"device": "cpu", "keep_recent_blocks": 2}))
    device_bytes, host_bytes, reserved = [], [], []
    chunk = 512
    with torch.no_grad():
        for s in range(0, 4096, chunk):
            a = model(ids[:, s:s + chunk], **cache_kw(plain), use_cache=True).logits
            b = model(ids[:, s:s + chunk], **cache_kw(off), use_cache=True).logits
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
            r, rp = off.memory_report(), plain.memory_report()
            assert r["bytes_device"] + r["bytes_host"] == r["bytes_total"] == rp["bytes_total"]
            device_bytes.append(r["bytes_device"])
            host_bytes.append(r["bytes_host"])
            reserved.append(r["bytes_reserved"])
        step = model(ids[:, -1:], **cache_kw(off), use_cache=True).logits
        ref = model(ids[:, -1:], **cache_kw(plain), use_cache=True).logits
        torch.testing.assert_close(step, ref, atol=1e-5, rtol=1e-5)
    per_block = sum(layer.store.blocks.bytes_per_block for layer in off.layers)
    assert max(device_bytes) <= 3 * per_block  # 2 recent blocks + the partial one, every layer
    assert device_bytes[-1] == device_bytes[1] and host_bytes == sorted(host_bytes) and host_bytes[-1] > 20 * per_block
    # the device arena does not grow with the context (freed blocks are reused): what one chunk needs
    assert reserved[-1] == reserved[3] <= GROWTH * (chunk // 16 + 3) * per_block < rp["bytes_reserved"] / 4
    assert r["bytes_moved_to_host"] == r["bytes_host"]


def test_generate_beams_and_release_over_both_tiers():
    model = tiny_model("llama", heads=4, kv_heads=2, head_dim=32, layers=2, vocab=96)
    ids = torch.randint(3, 96, (1, 90), generator=torch.Generator().manual_seed(1))
    outs = {}
    caches = {}
    for name, off in (("plain", None), ("offload", {"keep_recent_blocks": 1})):
        caches[name] = QuantizedKVCache(model, cfg("int8-token", off))
        with torch.no_grad():
            outs[name] = model.generate(ids, **cache_kw(caches[name]), max_new_tokens=20, do_sample=False, num_beams=3,
                                        pad_token_id=0)  # fmt: skip
    assert torch.equal(outs["offload"], outs["plain"])
    store = caches["offload"].layers[0].store
    assert store.blocks.host is not None and store.blocks.host.used > 0
    caches["offload"].release()
    for layer in caches["offload"].layers:
        assert layer.store.blocks.used == 0 and layer.store.blocks.host.used == 0  # no reference leaked


def test_crop_and_wrap_generate_with_offload():
    model = tiny_model("llama", heads=4, kv_heads=2, head_dim=32, layers=2, vocab=96)
    ids = torch.randint(3, 96, (1, 120), generator=torch.Generator().manual_seed(2))
    c = cfg("int4", {"keep_recent_blocks": 1})
    cache = QuantizedKVCache(model, c)
    with torch.no_grad():
        model(ids, **cache_kw(cache), use_cache=True)
    store = cache.layers[0].store
    host_before = store.blocks.host.used
    cache.crop(-70)  # back to 50 tokens: host blocks past them are freed
    assert cache.get_seq_length() == 50 and store.blocks.host.used < host_before
    plain = QuantizedKVCache(model, cfg("int4"))
    with torch.no_grad():
        model(ids[:, :50], **cache_kw(plain), use_cache=True)
        a = model(ids[:, 50:60], **cache_kw(plain), use_cache=True).logits
        b = model(ids[:, 50:60], **cache_kw(cache), use_cache=True).logits
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    with kvquant.wrapped(model, c), torch.no_grad():
        out = model.generate(ids[:, :40], max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 45)


@pytest.mark.parametrize("value, field", [
    ({"device": "gpu"}, "offload.device"),
    ({"keep_recent_blocks": -1}, "offload.keep_recent_blocks"),
    ({"keep_recent_blocks": True}, "offload.keep_recent_blocks"),
    ({"keep": 2}, "offload.keep"),
    ("cpu", "offload"),
])  # fmt: skip
def test_offload_config_errors_name_the_field(value, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        KVQuantConfig.load({"default": "int8", "offload": value})


def test_offload_config_round_trips():
    c = KVQuantConfig.load({"default": "int4", "offload": {"keep_recent_blocks": 3}})
    assert c.offload == {"device": "cpu", "keep_recent_blocks": 3}
    assert KVQuantConfig.load(c.to_dict()).offload == c.offload
    assert KVQuantConfig.load({"default": "int4", "offload": None}).offload is None


def test_pool_caches_offload_and_give_every_block_back():
    model = tiny_model("llama", heads=4, kv_heads=2, head_dim=32, layers=2, vocab=96)
    pool = kvquant.PagedKVPool(model, cfg("int8-token", {"keep_recent_blocks": 1}))
    ids = torch.randint(3, 96, (2, 100), generator=torch.Generator().manual_seed(3))
    caches = [QuantizedKVCache.from_pool(pool, ids[i:i + 1]) for i in range(2)]
    with torch.no_grad():
        for i, c in enumerate(caches):
            model(ids[i:i + 1], **cache_kw(c), use_cache=True)
    st = pool.stats()
    per_layer = 2 * (100 // 16 - 1)  # two caches, every full block but the newest
    assert st["blocks_host"] == 2 * per_layer and st["bytes_host"] > 0
    assert sum(c.memory_report()["bytes_host"] for c in caches) == st["bytes_host"]
    for c in caches:
        c.release()
    pool.clear_prefixes()
    st = pool.stats()
    assert st["blocks_host"] == 0 and st["blocks_used"] == 0


@pytest.mark.parametrize("tq", [1, 8])
def test_triton_reads_staged_offloaded_blocks(tq):
    """The Triton kernels read the arena through the block tables: with offload the host blocks are staged into
    device blocks for the call (kernels/dispatch.py); the output equals the resident store's (interpreter on CPU)."""
    pytest.importorskip("triton")
    from kvquant.kernels.triton_attention import attend_triton

    stores = []
    for off in (None, {"keep_recent_blocks": 1}):
        s = LayerStore([KVQuantConfig.load("int4").default] * 2, cfg("int4", off), 64, batch=1,
                       device=torch.device("cpu"))  # fmt: skip
        fill(s, 70 + tq, seed=3)
        stores.append(s)
    plain, off = stores
    assert off.has_host_blocks()
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, tq, 64, generator=g)
    fk, fv = (torch.randn(1, 2, tq, 64, generator=g) for _ in range(2))
    ref = attend_triton(q, fk, fv, plain, 70, None, 0.125)
    with off.snapshot().staged() as staged:  # as kernels/dispatch.py stages them
        assert not off.has_host_blocks()
        out = attend_triton(q, fk, fv, staged, 70, None, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert off.has_host_blocks() and off.blocks.used == sum(1 for b in off.tables[0] if b >= 0)
