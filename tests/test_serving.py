"""Serving arithmetic (kvquant/serving.py): each formula checked against a direct count."""

from __future__ import annotations

import json

import pytest

from kvquant import KVQuantConfig, ModelShape
from kvquant.memory import kv_bytes, sequence_bytes
from kvquant.serving import ModelCost, decode_bound, params_from_config, prefill_flops, serving_estimate

from conftest import tiny_model


@pytest.mark.parametrize("tied", [False, True])
def test_params_from_config_counts_the_model(tied):
    model = tiny_model("llama", kv_heads=2, heads=4, head_dim=16, layers=3, tie_word_embeddings=tied)
    counted = sum(p.numel() for n, p in model.named_parameters() if "norm" not in n)
    assert params_from_config(model.config) == counted


def test_prefill_flops_split_at_a_shared_prefix_adds_up():
    shape = ModelShape(4, 2, 64)
    cost = ModelCost(params=1e6, q_heads=8)
    whole = prefill_flops(1000, 0, shape, cost)
    assert prefill_flops(300, 0, shape, cost) + prefill_flops(700, 300, shape, cost) == pytest.approx(whole)
    # attention term by brute force
    att = sum(4 * 4 * 8 * 64 * (p + 1) for p in range(1000))
    assert whole == pytest.approx(2e6 * 1000 + att)


def test_decode_bound_and_batch_at_p99():
    shape = ModelShape(30, 3, 64)
    cost = ModelCost(params=135e6)
    cfg = KVQuantConfig.load("int4")
    est = serving_estimate(shape, cfg, cost, context=8192, batch=16, bandwidth=4.8e12, memory=16e9, p99=4096,
                           prompt_tokens=2048, shared_prefix=1536)
    fp16, q = est["fp16_decode"], est["config_decode"]
    assert q["kv_bytes_per_step"] == sequence_bytes(shape, cfg, 8192, 16)["total"]  # what 16 caches would hold
    assert q["kv_bytes_per_step"] == kv_bytes(16, 8192, shape, cfg.avg_bits(shape) / 8)  # int4: whole blocks, no state
    assert fp16["bytes_per_step"] == cost.weight_bytes + kv_bytes(16, 8192, shape, 2.0)
    assert fp16["tokens_per_s_bound"] == pytest.approx(16 * 4.8e12 / fp16["bytes_per_step"])
    ratio = cfg.avg_bits(shape) / 16
    assert 1.0 < est["decode_speedup_bound"] < 1 / ratio  # weights are read either way
    assert est["fp16_batch_at_p99"] == int((16e9 - cost.weight_bytes) // kv_bytes(1, 4096, shape, 2.0))
    assert est["config_batch_at_p99"] > 3 * est["fp16_batch_at_p99"]
    assert est["prefix"]["hit_rate"] == 0.75
    assert est["prefix"]["prefill_flops_saved"] == pytest.approx(prefill_flops(1536, 0, shape, cost))
    assert 0.7 < est["prefix"]["saved_fraction"] < 0.75  # later tokens attend further: saved is under 75%
    long_ctx = decode_bound(cost, kv_bytes(16, 10**6, shape, 2.0), 16, 4.8e12)
    assert long_ctx["kv_share_of_step"] > 0.99


def test_budget_below_weights_is_a_one_line_error():
    with pytest.raises(ValueError, match="^budget:"):
        serving_estimate(ModelShape(2, 2, 64), KVQuantConfig.load("int8"), ModelCost(params=1e9), 1024, 1,
                         memory=1e9, p99=100)


# ------------------------------------------------------------------------------ kvquant estimate (serving options)
def _estimate(capsys, *extra):
    import json

    from kvquant.cli import main

    rc = main(["estimate", "--layers", "30", "--kv-heads", "3", "--head-dim", "64", "--config", "int4",
               "--context", "8192", "--batch", "16", "--json", *extra])  # fmt: skip
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if rc == 0 else out.err)


def test_estimate_cli_serving_figures_are_serving_estimate(capsys, tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in range(1, 201)) + "\n")  # p99 = 198
    rc, res = _estimate(capsys, "--params", "1.35e8", "--bandwidth", "4.8TB/s", "--memory", "16GB",
                        "--lengths", str(lengths), "--prompt-tokens", "2048", "--shared-prefix", "1536")  # fmt: skip
    assert rc == 0
    want = serving_estimate(ModelShape(30, 3, 64), KVQuantConfig.load("int4"), ModelCost(params=1.35e8), 8192, 16,
                            bandwidth=4.8e12, memory=16e9, p99=198, prompt_tokens=2048, shared_prefix=1536)
    assert res["serving"] == json.loads(json.dumps(want))  # the same numbers, through JSON
    assert res["serving"]["prefix"]["hit_rate"] == 0.75 and res["serving"]["p99"] == 198


def test_estimate_cli_serving_text_and_q_heads_from_the_model(capsys, tmp_path):
    from kvquant.cli import main

    model = tiny_model("llama", kv_heads=2, heads=4, head_dim=16, layers=3)
    model.save_pretrained(tmp_path / "m")
    rc = main(["estimate", "--model", str(tmp_path / "m"), "--config", "int8", "--context", "1024",
               "--bandwidth", "1TB/s", "--prompt-tokens", "512", "--shared-prefix", "256"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "tok/s" in out and "hit rate 50.0%" in out
    shape = ModelShape(3, 2, 16)
    cost = ModelCost(params=params_from_config(model.config), q_heads=4)
    saved = prefill_flops(256, 0, shape, cost)
    assert f"{saved:.3g} saved" in out


@pytest.mark.parametrize("extra, field", [
    (["--memory", "1GiB"], "--memory"),  # needs a P99 length
    (["--bandwidth", "fast"], "--bandwidth"),
    (["--shared-prefix", "10"], "--shared-prefix"),  # without --prompt-tokens
    (["--prompt-tokens", "10", "--shared-prefix", "20"], "--shared-prefix"),
    (["--bandwidth", "1TB/s"], "--params"),  # no model, no parameter count
    (["--params", "-5"], "--params"),
    (["--params", "1e8", "--bandwidth", "1TB/s", "--weight-bytes", "0"], "--weight-bytes"),
])  # fmt: skip
def test_estimate_cli_serving_errors_are_one_line(capsys, extra, field):
    rc, err = _estimate(capsys, *extra)
    assert rc == 2 and err.count("\n") == 1 and f"error: {field}:" in err


def test_estimate_help_teaches_the_serving_formulas(capsys):
    from kvquant.cli import main

    with pytest.raises(SystemExit):
        main(["estimate", "--help"])
    out = capsys.readouterr().out
    for word in ("--bandwidth", "--shared-prefix", "hit rate", "2 x params", "P99", "weight bytes", "examples:"):
        assert word in out
