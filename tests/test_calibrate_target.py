"""``kvquant calibrate --target-bytes`` on the real stories260K model: the config it writes, its bytes, refusals."""

from __future__ import annotations

import pytest
import torch
import yaml

from kvquant import KVQuantConfig, ModelShape
from kvquant.calibrate_target import (
    FAST_KEY_CANDIDATES,
    FAST_VALUE_CANDIDATES,
    TIERS,
    allocate_bytes,
    calibrate_target,
    calibration_template,
    check_reachable,
    check_template,
    default_candidates,
    expectation,
    fp16_bytes,
    parse_kind_candidates,
    parse_target,
    split_calibration,
)
from kvquant.errors import ArgumentError
from kvquant.memory import sequence_bytes
from kvquant.quantizers import CHANNEL
from kvquant.text import token_windows, tokenize
from kvquant.transformers_compat import cache_kw

# head_dim 8: the per-token scale of int4 and the 8-bit norm of tq* weigh heavily, so 0.27x is out of reach here
KEYS, VALUES = "fp16,int8-token,int4,tq4,tq3", "fp16,int8-token,int4,tq4,tq3"
SMALL = dict(window=64, windows=2, heldout=2, samples=2, key_candidates=KEYS, value_candidates=VALUES,
             expect_tokens=16)
CONTEXT, TARGET = 256, 0.45


def _cli(argv: list[str]) -> int:
    from kvquant.cli import main

    return main(argv)


def _args(stories_path, data, out, target: str = str(TARGET)) -> list[str]:
    return ["calibrate", "--model", str(stories_path), "--data", str(data), "--target-bytes", target,
            "--context", str(CONTEXT), "--calib-window", "64", "--calib-windows", "2", "--heldout-windows", "2",
            "--samples", "2", "--expect-tokens", "16", "--key-candidates", KEYS, "--value-candidates", VALUES,
            "-o", str(out)]


# ------------------------------------------------------------------ no model
def test_targets_and_tiers_parse_and_refuse():
    assert parse_target(None, "auto-4bit") == TIERS["auto-4bit"] == 0.27
    assert parse_target(0.21, None) == 0.21
    for bad in [(None, None), (0.3, "auto-4bit"), (0.0, None), (1.5, None), (None, "auto-2bit")]:
        with pytest.raises(ArgumentError):
            parse_target(*bad)
    with pytest.raises(ArgumentError, match="keys only"):
        parse_kind_candidates("tq4,tqc4", 1)
    with pytest.raises(ArgumentError, match="unknown precision"):
        parse_kind_candidates("int4,int5", 0)


def test_byte_knapsack_takes_the_best_decrease_per_byte():
    sens = {"a": torch.tensor([[[4.0, 1.0]], [[2.0, 0.5]]], dtype=torch.float64),
            "b": torch.zeros(2, 1, 2, dtype=torch.float64)}
    labels = {0: ["a", "b"], 1: ["a", "b"]}
    costs = {("a", 0): 1.0, ("b", 0): 3.0, ("a", 1): 1.0, ("b", 1): 3.0}
    # room for two upgrades (4 units at 1 byte + 2 x 2 extra): the two most sensitive units, the keys
    choice, predicted = allocate_bytes(sens, labels, costs, 8.0)
    assert [choice[li][0] for li in range(2)] == [["b", "a"], ["b", "a"]]
    assert predicted == pytest.approx(1.5)


def test_calibration_reads_only_the_end_of_the_text():
    ids = torch.arange(1000)
    split = split_calibration(ids, 64, 2, 3, bos_id=None)
    assert split.start == 1000 - 5 * 64 and split.end == 1000
    assert int(split.fit.min()) >= 1000 - 2 * 64 and int(split.heldout.max()) < 1000 - 2 * 64
    with pytest.raises(ArgumentError, match="--data: 200 tokens"):
        split_calibration(ids[:200], 64, 2, 3)


# ------------------------------------------------------------------ on stories260K
@pytest.fixture(scope="module")
def target_run(stories, tinystories_text):
    model, tok = stories
    seen: list[torch.Tensor] = []
    hook = model.get_input_embeddings().register_forward_hook(lambda _m, args, _out: seen.append(args[0].clone()))
    try:
        res = calibrate_target(model, tok, tinystories_text, TARGET, context=CONTEXT, **SMALL)
    finally:
        hook.remove()
    return res, seen


def test_calibration_never_reads_the_scoring_windows(stories, tinystories_text, target_run):
    """Every window the model saw while calibrating lies in the text's last tokens, past every window an
    evaluation of 16 windows of 256 tokens cut from its start scores."""
    _, tok = stories
    res, seen = target_run
    ids = tokenize(tinystories_text, tok)
    scoring = token_windows(ids, 256, max_windows=16)
    scored_end = scoring[-1].start + scoring[-1].ids.numel()
    assert scored_end <= res.split.start
    assert seen
    rows: list[torch.Tensor] = []
    for x in seen:  # a one-token forward continues the window before it (the expectation's exact decode)
        if x.shape == (1, 1) and rows:
            rows[-1] = torch.cat([rows[-1], x[0]])
        else:
            rows.extend(x.reshape(-1, x.shape[-1]))
    # each held-out window: its prefill and the 16 tokens decoded after it, one window less its last token
    assert sum(r.numel() == 63 for r in rows) >= 2, "the decoded windows were not seen"
    for row in rows:
        if row.numel() >= 8:
            at = (ids.unfold(0, row.numel(), 1) == row).all(dim=1).nonzero().flatten()
            assert at.numel() and int(at.min()) >= res.split.start, "calibration read text outside its range"


def test_the_result_holds_its_bytes_and_states_its_expectation(stories, target_run):
    model, _ = stories
    res, _ = target_run
    shape = ModelShape.of(model)
    held = sequence_bytes(shape, res.config, CONTEXT)["total"]
    assert held == res.allocation.bytes <= TARGET * fp16_bytes(shape, CONTEXT)
    assert len(res.expect.kl) == 2 and all(k >= 0 for k in res.expect.kl)
    assert "held-out" in res.expect.line() and "+-" in res.expect.line()
    # more than the cheapest uniform config: the allocation spent the target
    cheapest = sequence_bytes(shape, KVQuantConfig.from_dict({"default": {"key": "tq3", "value": "tq3"},
                                                              "sink_tokens": 4, "residual_tokens": 16,
                                                              "residual_step": 16, "ladder_tokens": 64}),
                              CONTEXT)["total"]
    assert held > cheapest
    assert (res.config.sink_tokens, res.config.residual_tokens, res.config.residual_step,
            res.config.ladder_tokens) == (4, 16, 16, 64)


def test_the_command_writes_a_config_whose_cache_holds_the_promised_bytes(stories, stories_path, tmp_path,
                                                                          tinystories_text, capsys, monkeypatch):
    import kvquant
    from kvquant.cache import QuantizedKVCache

    data = tmp_path / "text.txt"
    data.write_text(tinystories_text)
    out = tmp_path / "cal.yaml"
    assert _cli(_args(stories_path, data, out)) == 0
    text = out.read_text()
    for needle in ("kvquant version", "target: 0.45x", "bytes held at context 256", "expected (held-out",
                   "kvquant calibrate --model"):
        assert needle in text
    cfg = KVQuantConfig.load(out)
    model, _ = stories
    shape = ModelShape.of(model)
    assert yaml.safe_load(text)["model_shape"] == shape.as_dict()
    monkeypatch.setenv("KVQUANT_ATTENTION", "torch")
    kvquant.wrap(model, cfg)
    try:
        cache = QuantizedKVCache(model, cfg)
        ids = torch.randint(3, 500, (1, CONTEXT - 8), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            model.generate(ids, **cache_kw(cache), max_new_tokens=9, do_sample=False, min_new_tokens=9)
        held = cache.memory_report()["bytes_total"]
    finally:
        kvquant.unwrap(model)
    assert held == sequence_bytes(shape, cfg, CONTEXT)["total"] <= TARGET * fp16_bytes(shape, CONTEXT)
    # show-config summarises the provenance and the bytes
    capsys.readouterr()
    assert _cli(["show-config", str(out), "--context", str(CONTEXT)]) == 0
    shown = capsys.readouterr().out
    assert "expected (held-out" in shown and "bytes at 256 tokens" in shown


def test_refusals_write_nothing(stories_path, tmp_path, tinystories_text, capsys):
    data = tmp_path / "text.txt"
    data.write_text(tinystories_text)
    out = tmp_path / "cal.yaml"
    assert _cli(_args(stories_path, data, out, target="0.05")) == 2
    assert "--target-bytes: 0.05 is below the cheapest config" in capsys.readouterr().err
    short = tmp_path / "short.txt"
    short.write_text(tinystories_text[:300])
    assert _cli(_args(stories_path, short, out)) == 2
    assert "--data:" in capsys.readouterr().err
    assert _cli(_args(stories_path, data, out) + ["--fast"]) == 2
    assert "--fast:" in capsys.readouterr().err
    argv = _args(stories_path, data, out)
    argv[argv.index("--key-candidates") + 1] = "int4-channel,tq4"
    assert _cli(argv) == 2
    assert "--key-candidates: int4-channel: a per-channel block cannot take" in capsys.readouterr().err
    assert _cli(_args(stories_path, data, out) + ["--expect-tokens", "63"]) == 2
    assert "--expect-tokens: 63" in capsys.readouterr().err
    assert not out.exists()


def test_fast_leaves_out_the_slow_codebooks(stories_path, tmp_path, tinystories_text):
    """``--fast`` sets the candidates (no ``tqv*`` / ``tqc*``) and the written config and its header hold only them."""
    data = tmp_path / "text.txt"
    data.write_text(tinystories_text)
    out = tmp_path / "fast.yaml"
    argv = _args(stories_path, data, out, target="0.45")
    k = argv.index("--key-candidates")
    del argv[k : k + 4]  # the explicit --key-candidates / --value-candidates
    assert _cli(argv + ["--fast"]) == 0
    text = out.read_text()
    assert f"--key-candidates {FAST_KEY_CANDIDATES} --value-candidates {FAST_VALUE_CANDIDATES}" in text
    body = yaml.safe_load(text)
    assert "tqv" not in str(body) and "tqc" not in str(body)
    assert "tqv" not in FAST_KEY_CANDIDATES + FAST_VALUE_CANDIDATES and "tqc" not in FAST_KEY_CANDIDATES


def test_softcapped_models_get_no_codebook_keys(stories):
    model, _ = stories
    shape = ModelShape.of(model)
    tpl = KVQuantConfig(sink_tokens=4)
    codebook_only = {0: ["tq3", "fp16"], 1: ["tq3", "fp16"]}
    with pytest.raises(ArgumentError, match="softcapping"):
        check_reachable(shape, tpl, codebook_only, 0.45, CONTEXT, softcap=50.0)
    labels = check_reachable(shape, tpl, {0: ["tq3", "int8-token", "fp16"], 1: ["tq3"]}, 0.6, CONTEXT, softcap=50.0)
    assert labels[0] == ["int8-token", "fp16"]
    assert check_reachable(shape, tpl, codebook_only, 0.45, CONTEXT, softcap=None) == codebook_only


def test_block_keys_need_residual_0(stories):
    """An exact residual window quantized less than a block at a time and per-channel block keys cannot share a
    layer: refused, naming the candidate and the ways out; with ``--residual 0`` or whole-block steps they are
    candidates again."""
    model, _ = stories
    shape = ModelShape.of(model)
    labels = {0: ["int4-channel", "tq4"], 1: ["int4"]}
    with pytest.raises(ArgumentError, match="--key-candidates: int4-channel: .*--residual 0"):
        check_template(calibration_template(4, 16), shape, labels)
    check_template(calibration_template(4, 0), shape, labels)
    check_template(calibration_template(4, 16, step=128), shape, labels)
    assert "int4-channel" in default_candidates(16, False, 128)[0]
    assert "tqc2" in default_candidates(16, False, target=0.21)[0] and "tqv2" in default_candidates(16, False,
                                                                                                   target=0.21)[1]
    assert "tqc2" not in default_candidates(16, False, target=0.27)[0]
    assert "int4-channel" in default_candidates(0, False)[0] and "int4-channel" in default_candidates(0, True)[0]
    assert not any(c in CHANNEL for c in (default_candidates(16, False)[0] + "," + default_candidates(16, True)[0])
                   .split(","))


def test_the_expectation_is_exact_decode_and_sees_the_residual_window(stories, tinystories_text):
    """The expectation decodes through a real cache: a window kept whole in the fp16 residual scores ~0, the same
    precisions without it do not (the simulated protocol would quantize both)."""
    model, tok = stories
    windows = split_calibration(tokenize(tinystories_text, tok), 64, 1, 2).heldout
    base = {"default": {"key": "int4", "value": "int4"}, "sink_tokens": 0}
    whole = expectation(model, windows, KVQuantConfig.from_dict({**base, "residual_tokens": 64, "residual_step": 1}),
                        decoded=16)
    none = expectation(model, windows, KVQuantConfig.from_dict(base), decoded=16)
    assert whole.decoded == 16 and len(whole.kl) == 2 and "exact one-token decode" in whole.line()
    assert max(whole.kl) < 1e-5 < min(none.kl)
