"""Issue 11, "Why": the bad inputs that lost data, allocated without bound or ended in a traceback, as a table.

Every row runs the real command in-process (``kvquant.cli.main``) and asserts the contract: exit status 2, ONE
line on stderr that names the field, option or file, no traceback, and nothing overwritten or left behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvquant import ConfigError, KVQuantConfig
from kvquant.cli import main

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "tinystories-stories260k.yaml"
CAL = ["--candidates", "int2,int8,fp16", "--calib-window", "32", "--calib-windows", "1", "--samples", "1"]


def run(capsys, *argv: str) -> tuple[int, str]:
    """``kvquant ARGV`` in-process: (exit status, stderr); the contract's shape is asserted for status 2."""
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if rc == 2:
        line = err.strip()
        assert "\n" not in line and ": error: " in line, err
        return rc, line
    return rc, err


@pytest.fixture
def bad_utf8(tmp_path):
    def make(name: str, text: bytes) -> Path:
        p = tmp_path / name
        p.write_bytes(text)
        return p

    return make


# ---------------------------------------------------------------------------------------------- Data loss
def test_calibrate_o_png_is_refused_before_any_work(stories_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("kvquant.calibrate._load_model_and_text", lambda *a: pytest.fail("model loaded"))
    out = tmp_path / "out.png"
    rc, err = run(capsys, "calibrate", "--model", stories_path, "--data", "tinystories", "--budget-bits", "7",
                  *CAL, "-o", out)
    assert rc == 2 and "-o:" in err and "out.png must end in .yaml, .yml or .json" in err
    assert list(tmp_path.iterdir()) == []


def test_calibrate_twice_refuses_then_force_replaces(stories_path, tmp_path, capsys):
    out = tmp_path / "out.yaml"
    argv = ["calibrate", "--model", stories_path, "--data", "tinystories", "--budget-bits", "7", *CAL, "-o", out]
    assert run(capsys, *argv)[0] == 0
    first = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert {"out.yaml", "out.png", "kvquant-sensitivity.json"} <= set(first)
    rc, err = run(capsys, *argv)
    assert rc == 2 and err.endswith(f"-o: {out} exists; pass --force to overwrite it")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == first  # intact, nothing added
    out.unlink()  # the heatmap alone is protected too
    rc, err = run(capsys, *argv)
    assert rc == 2 and "out.png exists" in err and "-o (its heatmap)" in err
    assert run(capsys, *argv, "--force")[0] == 0
    assert KVQuantConfig.from_file(out).description.startswith("calibrated")
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


@pytest.mark.parametrize("name,content", [("notes.txt", "my notes\n"), ("notes.json", '{"mine": 1}\n')])
def test_sens_cache_never_replaces_another_file(stories_path, tmp_path, capsys, name, content):
    notes = tmp_path / name
    notes.write_text(content)
    rc, err = run(capsys, "calibrate", "--model", stories_path, "--data", "tinystories", "--budget-bits", "7", *CAL,
                  "--sens-cache", notes, "-o", tmp_path / "c.yaml")
    assert rc == 2 and err.startswith("kvquant calibrate: error: --sens-cache:") and str(notes) in err
    assert notes.read_text() == content and not (tmp_path / "c.yaml").exists()


def test_calibrate_o_folder_is_refused_without_stray_tmp(stories_path, tmp_path, capsys):
    folder = tmp_path / "some_dir.yaml"
    folder.mkdir()
    rc, err = run(capsys, "calibrate", "--model", stories_path, "--data", "tinystories", "--budget-bits", "7", *CAL,
                  "-o", folder)
    assert rc == 2 and "is a folder, not a file" in err
    assert list(folder.iterdir()) == [] and [p.name for p in tmp_path.iterdir()] == ["some_dir.yaml"]


def _eval_argv(out: Path, *extra: str) -> list[str]:
    return ["eval", str(RECIPE), "--configs", "int8", "--protocol", "decode", "--window", "24", "--prefill", "8",
            "--decode-chunk", "16", "--max-windows", "1", "--no-generation", "--quiet", "--out", str(out), *extra]


def test_eval_out_naming_a_file_is_refused_before_the_run(shared, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("kvquant.eval.runner.run_recipe", lambda *a, **k: pytest.fail("the run started"))
    f = tmp_path / "notes.txt"
    f.write_text("keep me\n")
    rc, err = run(capsys, *_eval_argv(f))
    assert rc == 2 and err.endswith(f"out: {f} exists and is not a folder") and f.read_text() == "keep me\n"


def test_eval_refuses_to_overwrite_a_previous_run(shared, tmp_path, capsys):
    out = tmp_path / "run"
    assert run(capsys, *_eval_argv(out))[0] == 0
    before = (out / "results.json").read_bytes()
    rc, err = run(capsys, *_eval_argv(out))
    assert rc == 2 and "results.json, report.md" in err and "pass --force" in err
    assert (out / "results.json").read_bytes() == before
    assert run(capsys, *_eval_argv(out, "--force"))[0] == 0
    assert json.loads((out / "results.json").read_text())["results"]
    assert not [p for p in out.iterdir() if ".tmp" in p.name]


def test_estimate_plot_is_not_overwritten(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("10\n20\n")
    plot = tmp_path / "cdf.png"
    plot.write_bytes(b"mine")
    argv = ["estimate", "--layers", "2", "--kv-heads", "1", "--head-dim", "8", "--lengths", lengths, "--plot", plot]
    rc, err = run(capsys, *argv)
    assert rc == 2 and "--plot:" in err and plot.read_bytes() == b"mine"
    assert run(capsys, *argv, "--force")[0] == 0 and plot.read_bytes()[:4] == b"\x89PNG"
    rc, err = run(capsys, *argv[:-1], tmp_path / "cdf.yaml")
    assert rc == 2 and "must end in .png" in err


# ---------------------------------------------------------------------------------------------- Unbounded settings
@pytest.mark.parametrize("field,value", [
    ("sink_tokens", 100000), ("sink_tokens", 10**12), ("residual_tokens", 10**9), ("headroom", 1e40),
    ("group_size", 1 << 30),
])  # fmt: skip
def test_unbounded_settings_are_refused_at_load(field, value, stories_path, tmp_path, capsys):
    with pytest.raises(ConfigError, match=f"^{field}: "):
        KVQuantConfig.from_dict({"default": "int8", field: value})
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"default: int8\n{field}: {value}\n")
    for argv in (["show-config", cfg, "--model", stories_path],
                 ["estimate", "--config", cfg, "--layers", "2", "--kv-heads", "1", "--head-dim", "8"]):
        rc, err = run(capsys, *argv)
        assert rc == 2 and f"error: {field}: " in err


# ---------------------------------------------------------------------------------------------- Tracebacks
TRACEBACK_ROWS = [
    # (id, argv builder, message fragment)
    ("estimate --layers 0", lambda p: ["estimate", "--layers", "0", "--kv-heads", "2", "--head-dim", "8"],
     "--layers: 0 must be an integer from 1"),
    ("estimate --budget nonsense", lambda p: ["estimate", "--layers", "2", "--kv-heads", "2", "--head-dim", "8",
                                              "--budget", "1e999GiB"], "--budget: "),
    ("estimate --model /nonexistent", lambda p: ["estimate", "--model", "/nonexistent"],
     "--model: path /nonexistent does not exist"),
    ("show-config --model /nonexistent", lambda p: ["show-config", "int8", "--model", "/nonexistent/model"],
     "--model: path /nonexistent/model does not exist"),
    ("layers: a list", lambda p: ["show-config", p["layers_list"], "--model", p["model"]],
     "layers: expected a mapping"),
    ("layers: a string", lambda p: ["estimate", "--config", p["layers_str"], "--model", p["model"]],
     "layers: expected a mapping"),
    ("config not UTF-8", lambda p: ["show-config", p["cfg_utf8"], "--model", p["model"]],
     "is not UTF-8 text"),
    ("recipe not UTF-8", lambda p: ["eval", p["recipe_utf8"]], "is not UTF-8 text"),
    ("data not UTF-8", lambda p: ["eval", str(RECIPE), "--data", p["data_utf8"], "--out", p["out"]],
     "is not UTF-8 text"),
    ("calibrate data not UTF-8", lambda p: ["calibrate", "--model", p["model"], "--data", p["data_utf8"],
                                            "--budget-bits", "7", *CAL, "-o", p["out"] + ".yaml"],
     "is not UTF-8 text"),
    ("calibrate --samples 0", lambda p: ["calibrate", "--model", p["model"], "--data", "tinystories", "--budget-bits",
                                         "7", *CAL[:-1], "0", "-o", p["out"] + ".yaml"],
     "--samples: 0 must be an integer from 1"),
    ("calibrate --group-size 16 on head_dim 8", lambda p: ["calibrate", "--model", p["model"], "--data", "tinystories",
                                                           "--budget-bits", "7", "--candidates", "int4,int8,fp16",
                                                           "--group-size", "16", "-o", p["out"] + ".yaml"],
     "--group-size: int4: 16 does not divide head_dim 8"),
    ("calibrate --model /nonexistent", lambda p: ["calibrate", "--model", "/nonexistent", "--budget-bits", "7",
                                                  "-o", p["out"] + ".yaml"], "--model: path /nonexistent does not"),
    ("eval --model /nonexistent", lambda p: ["eval", str(RECIPE), "--model", "/nonexistent", "--out", p["out"]],
     "model: path /nonexistent does not exist"),
]


@pytest.mark.parametrize("row", TRACEBACK_ROWS, ids=[r[0] for r in TRACEBACK_ROWS])
def test_user_errors_are_one_line_not_a_traceback(row, stories_path, bad_utf8, tmp_path, capsys):
    _, argv, fragment = row
    paths = {
        "model": str(stories_path),
        "out": str(tmp_path / "out"),
        "layers_list": str(bad_utf8("l.yaml", b"default: int8\nlayers: [1, 2]\n")),
        "layers_str": str(bad_utf8("s.yaml", b"default: int8\nlayers: '0,1'\n")),
        "cfg_utf8": str(bad_utf8("u.yaml", b"default: int8\n# caf\xe9\n")),
        "recipe_utf8": str(bad_utf8("r.yaml", b"name: x # caf\xe9\n")),
        "data_utf8": str(bad_utf8("d.txt", b"Once upon a time \xff\xfe there was\n")),
    }
    rc, err = run(capsys, *argv(paths))
    assert rc == 2 and fragment in err, err
    if "UTF-8" in fragment:  # the message names the file
        assert any(name in err for name in ("u.yaml", "r.yaml", "d.txt"))
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.yaml").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_eval_device_cuda_without_cuda(shared, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("kvquant.eval.runner.run_recipe", lambda *a, **k: pytest.fail("the run started"))
    rc, err = run(capsys, "eval", RECIPE, "--device", "cuda", "--out", tmp_path / "o")
    assert rc == 2 and "device: cuda asked for, but CUDA is not available" in err


def test_argument_errors_are_one_line(capsys):
    for argv in (["estimate", "--layers", "x"], ["nosuchcommand"], ["calibrate"], ["eval"], ["--bogus"]):
        rc, err = run(capsys, *argv)
        assert rc == 2 and "--help" in err


@pytest.mark.parametrize("capacity", [0, -5, 1 << 40, 2.5])
def test_capacity_is_bounded(capacity):
    from kvquant import QuantizedKVCache, wrap

    from conftest import tiny_model

    model = tiny_model(layers=1, head_dim=8, heads=2, kv_heads=1)
    with pytest.raises(ValueError, match="^capacity: "):
        QuantizedKVCache(model, "int8", capacity=capacity)
    with pytest.raises(ValueError, match="^capacity: "):
        wrap(model, "int8", capacity=capacity)


def test_readme_states_the_contract_with_a_real_message(tmp_path, capsys):
    readme = (REPO / "README.md").read_text()
    assert "exit status 2" in readme and "Nothing is overwritten without `--force`" in readme
    readme += (REPO / "docs" / "guide.md").read_text()  # the contract in full, with its example
    cfg = tmp_path / "c.yaml"
    cfg.write_text("default: int8\nsink_tokens: 100000\n")
    rc, err = run(capsys, "estimate", "--config", cfg, "--layers", "2", "--kv-heads", "1", "--head-dim", "8")
    assert rc == 2 and f"`{err}`" in readme  # the example in the README is what the command prints
