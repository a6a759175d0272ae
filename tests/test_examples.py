"""examples/decode_loop.py runs: its hand-written greedy loop over a preallocated quantized cache gives the same
tokens as generate() on stories260K, and it reports both speeds."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_decode_loop_agrees_with_generate(stories_path, capsys):
    rc = _example("decode_loop").main(["--model", str(stories_path), "--new-tokens", "12", "--config", "int4"])
    out = capsys.readouterr().out
    assert rc == 0 and "tokens agree: True" in out
    assert out.count("tokens/s") == 2
    assert "cache_pos=" in out  # the cursor after the prompt and the new tokens
