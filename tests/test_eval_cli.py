"""``kvquant eval`` end to end on stories260K + TinyStories (tiny settings), and its help text."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvquant.eval import cli

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "tinystories-stories260k.yaml"


def test_help_teaches():
    parser = argparse.ArgumentParser(prog="kvquant")
    sub = parser.add_subparsers(dest="command")
    cli.register(sub)
    text = sub.choices["eval"].format_help()
    for word in ("decode", "simulated", "--configs", "--max-windows", "--out", "examples:", "hf-hqq-int4", "KL"):
        assert word in text
    args = parser.parse_args(["eval", "r.yaml", "--configs", "int8,int4", "--window", "64"])
    assert args.func is cli.run and args.window == 64


def test_main_cli_has_eval():
    kcli = pytest.importorskip("kvquant.cli")
    parser = kcli.build_parser()
    args = parser.parse_args(["eval", "r.yaml"])
    assert args.func is cli.run


def test_bad_override_is_one_line_error(capsys):
    rc = cli.main([str(RECIPE), "--protocol", "sideways"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("kvquant eval: error: protocol:") and "\n" not in err


def _small_recipe(tmp_path):
    import yaml

    data = yaml.safe_load(RECIPE.read_text())
    data["generation"] = {"prompts": 2, "prompt_tokens": 8, "new_tokens": 6}
    p = tmp_path / "small.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_eval_end_to_end(shared, tmp_path, capsys):
    out = tmp_path / "out"
    argv = [
        str(_small_recipe(tmp_path)), "--configs", "fp16,int8,int4,hf-hqq-int4,hf-quanto-int8",
        "--protocol", "simulated,decode",
        "--window", "48", "--prefill", "16", "--decode-chunk", "16", "--max-windows", "1", "--out", str(out),
        "--quiet",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "protocol simulated" in printed and "protocol decode" in printed
    data = json.loads((out / "results.json").read_text())
    rows = data["results"]
    ok = [r for r in rows if r["status"] == "ok"]
    assert {(r["config"], r["protocol"]) for r in ok} == {
        (c, p) for c in ("reference", "fp16", "int8", "int4", "hf-hqq-int4") for p in ("simulated", "decode")
    }
    for r in ok:
        for key in ("config", "avg_bits", "ppl", "delta_ppl", "kl_mean", "kl_p99", "top1", "kv_vs_fp16", "tok_per_s"):
            assert r[key] is not None, key
    ref = [r for r in ok if r["config"] == "reference"]
    assert all(r["kl_mean"] == 0 and r["top1"] == 1 and r["delta_ppl"] == 0 for r in ref)
    skipped = [r for r in rows if r["status"] == "skipped"]
    assert skipped and all(r["config"] == "hf-quanto-int8" and "2, 4" in r["reason"] for r in skipped)
    assert "gen" in ok[0]
    md = (out / "report.md").read_text()
    assert "kvquant eval" in md and "--configs fp16,int8,int4" in md
    assert "## simulated" in md and "## decode" in md and "hf-quanto-int8: skipped" in md
    assert (out / "kv_vs_quality.png").stat().st_size > 1000
    header = next(line for line in md.splitlines() if line.startswith("| config"))
    assert header.count(" | ") == 12  # 13 columns: the "|" of "mean |Δp|" is escaped
    assert " ± " in md and "KV held vs FP16" in md and "long ctx" in md
    assert all(r["kv_bytes_held"] > 0 and r["asymptotic_bytes_per_token"] > 0 for r in ok)

    from kvquant.eval.report import rerender

    rerender(out)
    md2 = (out / "report.md").read_text()
    assert md2.startswith(md.rstrip("\n")) and "Re-rendered from results.json" in md2


def test_runs_are_deterministic(shared, tmp_path):
    from kvquant.eval.recipe import load_recipe
    from kvquant.eval.runner import run_recipe

    over = {"configs": ["int4"], "protocol": "decode", "window": 40, "prefill": 8, "decode_chunk": 8,
            "max_windows": 1, "generation": {"prompts": 2, "prompt_tokens": 8, "new_tokens": 6}}  # fmt: skip
    a = run_recipe(load_recipe(RECIPE, over), quiet=True, progress=False)
    b = run_recipe(load_recipe(RECIPE, over), quiet=True, progress=False)
    assert a.meta["generation"]["prompt_offsets"] == b.meta["generation"]["prompt_offsets"]
    keys = ("ppl", "kl_mean", "kl_p99", "top1", "mean_abs_dp", "gen")
    assert [{k: r.get(k) for k in keys} for r in a.rows] == [{k: r.get(k) for k in keys} for r in b.rows]


def _sliding_window_checkpoint(path: Path, text: str) -> Path:
    """A random tiny Qwen2 whose second layer is a sliding-window layer, with a byte-level BPE tokenizer trained
    on ``text``, saved to ``path`` (transformers loads any Qwen2 checkpoint's tokenizer as Qwen2Tokenizer)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, show_progress=False))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    cfg = transformers.Qwen2Config(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, use_sliding_window=True, sliding_window=16,
        max_window_layers=1, layer_types=["full_attention", "sliding_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


def test_baseline_refused_by_the_model_is_not_run_and_exit_0(tmp_path, capsys):
    """transformers' QuantizedCache refuses sliding-window layers: the baseline is listed under "not run" with
    transformers' reason, the kvquant config runs, and the eval exits 0 (1 is reserved for bugs)."""
    pytest.importorskip("hqq")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{(i * 7) % 60}" for i in range(400)) + "\n")
    model = _sliding_window_checkpoint(tmp_path / "model", text.read_text())
    out = tmp_path / "out"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"name: sliding\nmodel: {model}\ndtype: float32\ndata: {text}\nprotocol: [decode]\nwindow: 48\n"
        "max_windows: 1\nprefill: 16\ndecode_chunk: 16\nbos: false\nconfigs: [int8, hf-hqq-int4]\n"
    )
    assert cli.main([str(recipe), "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    rows = json.loads((out / "results.json").read_text())["results"]
    status = {r["config"]: r["status"] for r in rows}
    assert status == {"reference": "ok", "int8": "ok", "hf-hqq-int4": "skipped"}
    reason = next(r["reason"] for r in rows if r["config"] == "hf-hqq-int4")
    assert "only full attention layers" in reason and "\n" not in reason
    assert "not run: hf-hqq-int4: skipped (transformers' QuantizedCache refuses this model" in printed
    assert "hf-hqq-int4: skipped" in (out / "report.md").read_text()
