"""examples/decode_loop.py runs: its hand-written greedy loop over a preallocated quantized cache gives the same
tokens as generate() on stories260K, and it reports both speeds."""

from __future__ import annotations

import runpy
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_decode_loop_agrees_with_generate(stories_path, capsys):
    main = runpy.run_path(str(EXAMPLES / "decode_loop.py"), run_name="decode_loop")["main"]
    rc = main(["--model", str(stories_path), "--new-tokens", "12", "--config", "int4"])
    out = capsys.readouterr().out
    assert rc == 0 and "tokens agree: True" in out
    assert out.count("tokens/s") == 2
    assert "cache_pos=" in out  # the cursor after the prompt and the new tokens
