"""kvquant.outputs (no overwrite without force, atomic writes, path kinds) and the CLI's --debug / bug paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvquant import KVQuantConfig
from kvquant.cli import main
from kvquant.errors import KVQuantError, OutputError
from kvquant.outputs import atomic_path, check_output, check_output_dir


def test_debug_shows_the_traceback_and_bugs_keep_theirs(capsys, monkeypatch):
    with pytest.raises(KVQuantError, match="--layers"):
        main(["estimate", "--layers", "0", "--kv-heads", "1", "--head-dim", "8", "--debug"])
    monkeypatch.setattr("kvquant.cli.estimate", lambda *a, **k: 1 / 0)  # a genuine bug
    rc = main(["estimate", "--layers", "2", "--kv-heads", "1", "--head-dim", "8"])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" in err and "ZeroDivisionError" in err and "a bug in kvquant" in err


def test_check_output_kinds_and_writability(tmp_path):
    f = tmp_path / "a.yaml"
    assert check_output(f, (".yaml",), "-o") == f
    f.write_text("x")
    with pytest.raises(OutputError, match="^-o: .* exists; pass --force"):
        check_output(f, (".yaml",), "-o")
    assert check_output(f, (".yaml",), "-o", force=True) == f
    with pytest.raises(OutputError, match="is not a folder"):  # a parent that is a file
        check_output(f / "b.yaml", (".yaml",), "-o")
    with pytest.raises(OutputError, match="exists and is not a folder"):
        check_output_dir(f, ["r.json"], "out")
    assert check_output_dir(tmp_path / "new" / "deeper", ["r.json"], "out") == tmp_path / "new" / "deeper"
    assert not (tmp_path / "new").exists()  # checked, not created


def test_atomic_path_leaves_old_file_or_nothing(tmp_path):
    f = tmp_path / "r.json"
    f.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(f) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash while writing")
    assert f.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["r.json"]
    with atomic_path(f) as tmp:
        tmp.write_text("new")
    assert f.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["r.json"]
    assert oct(f.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    with pytest.raises(OutputError, match="exists"), atomic_path(f, force=False):
        pass


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_config_save_refuses_a_png(tmp_path):
    with pytest.raises(OutputError, match="must end in .yaml, .yml or .json"):
        KVQuantConfig.preset("int8").save(tmp_path / "c.png")
    assert list(tmp_path.iterdir()) == []


def test_relative_scales_file_is_resolved_against_the_config_folder(tmp_path, monkeypatch):
    sub = tmp_path / "cfgs"
    sub.mkdir()
    (sub / "c.yaml").write_text("default: int8\nscales_file: scales/s.json\n")
    monkeypatch.chdir(tmp_path)
    cfg = KVQuantConfig.from_file("cfgs/c.yaml")
    assert Path(cfg.scales_file) == (tmp_path / "cfgs" / "scales" / "s.json").resolve()

