"""Memory accounting: bytes held at 4096 tokens vs the seed formula, ratios vs FP16, estimate CLI."""

from __future__ import annotations

import json

import pytest
import torch

from kvquant import KVPrecision, KVQuantConfig, ModelShape, QuantizedKVCache
from kvquant.cli import main
from kvquant.memory import estimate, kv_bytes, parse_bytes, percentile, sequence_bytes

SHAPE = ModelShape(num_layers=2, num_kv_heads=4, head_dim=64)


def fill(config: str, tokens: int = 4096, batch: int = 1, chunk: int = 1024) -> QuantizedKVCache:
    cache = QuantizedKVCache(SHAPE, config)
    g = torch.Generator().manual_seed(0)
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        for layer in range(SHAPE.num_layers):
            k = torch.randn(batch, SHAPE.num_kv_heads, n, SHAPE.head_dim, generator=g)
            cache.update(k, torch.randn_like(k), layer)
    return cache


@pytest.mark.parametrize("config,max_ratio", [("fp16", 1.0), ("int8", 0.53), ("int8-token", 0.53),
                                              ("fp8-e4m3", 0.53), ("int4", 0.3125), ("int2", 0.1875)])
def test_bytes_at_4096_tokens_match_formula(config, max_ratio):
    cache = fill(config)
    rep = cache.memory_report()
    formula = kv_bytes(1, 4096, SHAPE, KVQuantConfig.load(config).avg_bits(SHAPE) / 8)
    assert rep["tokens"] == 4096
    assert abs(rep["bytes_total"] - formula) / formula <= 0.03
    assert rep["bytes_total"] == rep["bytes_keys"] + rep["bytes_values"] + rep["bytes_scales"]
    assert rep["fp16_bytes_per_token"] == 2 * 2 * 4 * 64 * 2
    assert rep["ratio_vs_fp16"] <= max_ratio
    assert sum(rep["per_precision"].values()) == rep["bytes_total"]


def test_memory_follows_length_not_a_maximum():
    short, long = fill("int8", tokens=300), fill("int8", tokens=3000)
    r_short, r_long = short.memory_report(), long.memory_report()
    block = KVQuantConfig.load("int8").block_size
    assert r_short["bytes_total"] == kv_bytes(1, -(-300 // block) * block, SHAPE, 1.0) + r_short["bytes_scales"]
    assert r_long["bytes_total"] == kv_bytes(1, 3072, SHAPE, 1.0) + r_long["bytes_scales"]
    # growth reserves at most a quarter more than is used (plus a block), and capacity= preallocates
    assert r_long["bytes_reserved"] <= 1.25 * r_long["bytes_total"] + kv_bytes(1, block, SHAPE, 1.0)
    pre = QuantizedKVCache(SHAPE, "int8", capacity=4096)
    pre.update(torch.randn(1, 4, 10, 64), torch.randn(1, 4, 10, 64), 0)
    assert pre.layers[0].store.capacity == 4096


def test_batch_and_mixed_precision_accounting():
    cfg = KVQuantConfig.from_dict({"default": "int4", "layers": {0: {"key": "int8-token"}}, "heads": {"1.2": "fp16"}})
    cache = QuantizedKVCache(SHAPE, cfg)
    for layer in range(2):
        cache.update(torch.randn(3, 4, 256, 64), torch.randn(3, 4, 256, 64), layer)
    rep = cache.memory_report()
    assert rep["batch"] == 3
    assert rep["bytes_total"] == pytest.approx(kv_bytes(3, 256, SHAPE, cfg.avg_bits(SHAPE) / 8), rel=0.01)
    assert {"int4 (keys)", "int4 (values)", "int8-token (keys)", "fp16 (keys)", "fp16 (values)"} <= set(
        rep["per_precision"])


def test_estimate_formula_budget_and_percentiles():
    shape = ModelShape(30, 3, 64)
    res = estimate(shape, KVQuantConfig.load("int8"), context=8192, batch=4, budget=parse_bytes("1GiB"),
                   lengths=list(range(1, 101)))
    assert res["fp16_bytes"] == 4 * 8192 * 2 * 30 * 3 * 64 * 2
    assert 0.5 < res["ratio_vs_fp16"] < 0.5 + 1e-5  # + one fp32 scale per (layer, KV head) and K / V
    held = [sequence_bytes(shape, KVQuantConfig.load("int8"), t, 4)["total"] for t in (23296, 23297)]
    assert res["config_max_context"] == 23296 and held[0] <= 2**30 < held[1]  # whole blocks of 128 tokens
    assert 23296 < 2**30 // (4 * 2 * 30 * 3 * 64)  # (the seed formula, which counts no block and no scale)
    assert res["lengths"]["p95"] == 95 and res["lengths"]["p99"] == 99
    assert percentile([5], 99) == 5
    with pytest.raises(ValueError, match="budget"):
        parse_bytes("lots")


def test_estimate_cli(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [100, 200, 300, 4000, 120, 90]) + "\n")
    plot = tmp_path / "cdf.png"
    rc = main(["estimate", "--layers", "30", "--kv-heads", "3", "--head-dim", "64", "--config", "int4",
               "--context", "4096", "--batch", "2", "--budget", "2GiB", "--lengths", str(lengths),
               "--plot", str(plot)])
    out = capsys.readouterr().out
    assert rc == 0 and "p95" in out and "longest context" in out and plot.stat().st_size > 1000
    rc = main(["estimate", "--layers", "30", "--kv-heads", "3", "--head-dim", "64", "--json"])
    assert json.loads(capsys.readouterr().out)["ratio_vs_fp16"] == pytest.approx(0.5, abs=1e-4)


def test_cli_errors_are_one_line(capsys):
    assert main(["estimate", "--layers", "30"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing: --kv-heads, --head-dim" in err
    rc = main(["estimate", "--layers", "2", "--kv-heads", "1", "--head-dim", "64", "--config", "int5"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "config" in err


def test_help_teaches(capsys):
    with pytest.raises(SystemExit):
        main(["estimate", "--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and "P95" in out


# ------------------------------------------------------------------ sequence_bytes: what a cache of a config holds
LAYOUT_CONFIGS = {
    "int8": {"default": "int8"},
    "int4 + sinks + residual": {"default": "int4", "sink_tokens": 4, "residual_tokens": 8, "block_size": 16},
    "kivi": {"default": {"key": "int4-channel", "value": "int4"}, "block_size": 16, "sink_tokens": 4},
    "rotated int4": {"default": "int4", "rotate": "kv", "block_size": 16},
    "tq3 + two-rung ladder": {"default": "tq3", "sink_tokens": 4, "residual_tokens": 3, "residual_step": 1,
                              "ladder_tokens": 20, "ladder2_tokens": 12, "block_size": 16},
    "mixed": {"default": "tqt3", "heads": {"0.1": {"key": "int8", "value": "tqv3"}, "1.0": "fp16",
                                           "1.3": {"key": "tqc-" + "43" * 32, "value": "tq4"}},
              "sink_tokens": 2, "residual_tokens": 5, "residual_step": 2, "ladder_tokens": 9, "ladder2_tokens": 4,
              "block_size": 16},
}


@pytest.mark.parametrize("name", list(LAYOUT_CONFIGS))
def test_sequence_bytes_is_what_a_cache_holds(name):
    """The layout arithmetic against the store's own count, through a prefill and then one-token steps (the
    residual window, the ladder's rings and whole blocks all move), for 1 and 2 sequences."""
    cfg = KVQuantConfig.from_dict(LAYOUT_CONFIGS[name])
    g = torch.Generator().manual_seed(1)
    for batch, prefill in ((1, 3), (1, 37), (2, 21)):
        cache = QuantizedKVCache(SHAPE, cfg)
        for step in range(12):
            n = prefill if step == 0 else 1
            for layer in range(SHAPE.num_layers):
                k = torch.randn(batch, SHAPE.num_kv_heads, n, SHAPE.head_dim, generator=g)
                cache.update(k, torch.randn_like(k), layer)
            tokens = cache.get_seq_length()
            assert cache.memory_report()["bytes_total"] == sequence_bytes(SHAPE, cfg, tokens, batch)["total"], (
                name, batch, tokens)


def test_sequence_bytes_parts():
    cfg = KVQuantConfig.from_dict(LAYOUT_CONFIGS["tq3 + two-rung ladder"])
    b = sequence_bytes(SHAPE, cfg, 100)
    heads = SHAPE.num_layers * SHAPE.num_kv_heads
    assert b["dense"] == (4 + 3) * heads * 2 * 64 * 2  # sinks and exactly 3 residual tokens, fp16
    assert b["ladder"] == heads * 2 * (20 * (8 + 1) + 12 * 8)  # D bits + a norm byte; D bits more on rung 2
    assert b["pool"] == heads * 2 * 112 * 25  # 97 pooled tokens in 7 blocks of 16; 3 x 64 bits + a norm byte
    assert b["total"] == sum(v for k, v in b.items() if k != "total")
    assert sequence_bytes(SHAPE, cfg, 0)["total"] == 0


@pytest.mark.parametrize("precision", ["tq2", "tq3", "tq4", "tqv3", "tqt3", "tqc-" + "3" * 64, "int4"])
def test_rung_parts_are_what_the_store_keeps(precision):
    """Quantizer.rung_parts (what sizing counts) against the ladder's ring tensors a store actually holds."""
    # built directly: from a file or mapping, ladder_tokens with int4 alone is refused as an option that does nothing
    cfg = KVQuantConfig(default=KVPrecision(precision, precision), ladder_tokens=8, ladder2_tokens=4,
                        residual_tokens=1, residual_step=1, block_size=16)
    cache = QuantizedKVCache(SHAPE, cfg)
    k = torch.randn(1, SHAPE.num_kv_heads, 40, SHAPE.head_dim, generator=torch.Generator().manual_seed(2))
    cache.update(k, torch.randn_like(k), 0)
    store = cache.layers[0].store
    q = store.groups[0].key.quantizer
    for rung, ring in ((1, store.refine.ladder), (2, store.refine.ladder2)):
        held = {n: (tuple(t.shape[3:]), t.dtype) for pair in ring for r in pair if r is not None for n, t in r.items()}
        assert held == {n: (s.shape, s.dtype) for n, s in q.rung_parts(rung).items()}, rung
