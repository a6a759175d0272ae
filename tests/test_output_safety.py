"""Issue 38, data loss: outputs never replace an input, ``--force`` replaces only what kvquant wrote, a run's files
are replaced together, and temporaries are cleaned after SIGINT / SIGTERM and after a SIGKILL.

Each ``export --force`` case below exited 0 and deleted or replaced the user's files before issue 38; after each,
every input byte is checked unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvquant.cli import main
from kvquant.errors import OutputError
from kvquant.outputs import (
    OWN_MANIFEST,
    check_disjoint,
    check_output,
    check_output_dir,
    input_paths,
    is_own_file,
    staged_files,
    staged_folder,
    sweep_stale,
)

KVQUANT_DIR = Path(__file__).resolve().parent.parent / "kvquant"
CALIB = ["--calib-window", "32", "--calib-windows", "1"]


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (links followed) -> the sha256 of its bytes; a link also records its target."""
    out = {}
    for p in sorted(root.rglob("*")):
        key = str(p.relative_to(root))
        if p.is_symlink():
            out[key + " ->"] = os.readlink(p)
        if p.is_file():
            out[key] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def run(capsys, *argv) -> tuple[int, str]:
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    if rc == 2:
        assert len(err.strip().splitlines()) == 1 and ": error: " in err, err
    return rc, err.strip()


@pytest.fixture
def work(tmp_path, stories_path, shared, monkeypatch):
    """A writable copy of the stories260K checkpoint at ``work/mymodel`` and a data file; cwd is ``work``."""
    model = tmp_path / "mymodel"
    shutil.copytree(stories_path, model)
    for p in model.iterdir():
        p.chmod(0o644)
    data = tmp_path / "data.txt"
    data.write_text((shared / "data" / "tinystories-valid-sample.txt").read_text()[:6000])
    monkeypatch.chdir(tmp_path)
    import kvquant.calibrate

    real, loads = kvquant.calibrate._load_model_and_text, []

    def load(*a):  # the real loader (so a command that does not refuse runs, and its damage shows), counted
        loads.append(a)
        return real(*a)

    monkeypatch.setattr("kvquant.calibrate._load_model_and_text", load)
    yield tmp_path
    assert not loads, "the model loaded before the outputs were checked"


def export(fmt: str, out: str | Path, *extra: str) -> list[str]:
    return ["export", "--model", "mymodel", "--data", "data.txt", "--format", fmt, *CALIB, "-o", str(out), *extra]


@pytest.mark.parametrize("out", ["mymodel", ".", "mymodel/model.safetensors", "mymodel/sub"])
@pytest.mark.parametrize("fmt", ["vllm", "kvquant"])
def test_export_force_never_touches_the_model(work, capsys, fmt, out):
    if fmt == "kvquant" and not out.endswith(".safetensors"):
        out = f"{out}/scales.safetensors" if out != "." else "mymodel/scales.safetensors"
    before = tree(work)
    rc, err = run(capsys, *export(fmt, out, "--force"))
    assert rc == 2 and "-o:" in err and "--model" in err, err
    assert tree(work) == before


def test_export_force_refuses_a_folder_it_did_not_write(work, capsys):
    (work / "results").mkdir()
    (work / "results" / "thesis.tex").write_text("thesis\n")
    before = tree(work)
    rc, err = run(capsys, *export("vllm", "results", "--force"))
    assert rc == 2 and "was not written by kvquant" in err and "kvquant_export.json" in err
    assert tree(work) == before
    (work / "notes.safetensors").write_bytes(b"not mine")
    rc, err = run(capsys, *export("kvquant", "notes.safetensors", "--force"))
    assert rc == 2 and "is not a kvquant scales file" in err
    assert tree(work) == before | {"notes.safetensors": hashlib.sha256(b"not mine").hexdigest()}


def test_export_refuses_outputs_inside_a_linked_source(work, capsys, tmp_path):
    """A model whose weights link elsewhere (an earlier ``--weights link`` export): that folder is an input too."""
    linked = tmp_path / "linked"
    linked.mkdir()
    for p in (work / "mymodel").iterdir():
        (linked / p.name).symlink_to(p)
    before = tree(work)
    argv = ["export", "--model", str(linked), "--data", "data.txt", "--format", "kvquant", *CALIB, "--force"]
    rc, err = run(capsys, *argv, "-o", "mymodel/model.safetensors")
    assert rc == 2 and "-o:" in err
    rc, err = run(capsys, *argv, "-o", str(linked / "model.safetensors"))
    assert rc == 2 and "-o:" in err
    assert tree(work) == before


def test_export_force_replaces_its_own_export(tmp_path, stories_path, shared, capsys, monkeypatch):
    work = tmp_path
    shutil.copytree(stories_path, work / "mymodel")
    (work / "data.txt").write_text((shared / "data" / "tinystories-valid-sample.txt").read_text()[:6000])
    monkeypatch.chdir(work)
    assert run(capsys, *export("vllm", "out"))[0] == 0
    model_before = tree(work / "mymodel")
    (work / "out" / "kv_scales.safetensors").write_bytes(b"stale")  # so the replacement is visible
    assert run(capsys, *export("vllm", "out"))[0] == 2  # no --force
    assert run(capsys, *export("vllm", "out", "--force"))[0] == 0
    assert (work / "out" / "kv_scales.safetensors").read_bytes() != b"stale"
    assert tree(work / "mymodel") == model_before
    assert [p.name for p in work.iterdir() if ".kvq-" in p.name] == []
    assert run(capsys, *export("kvquant", "s.safetensors"))[0] == 0
    assert run(capsys, *export("kvquant", "s.safetensors", "--force"))[0] == 0  # its own kind: replaced


def test_export_o_in_a_missing_folder_is_one_line(work, capsys):
    for fmt, out in (("vllm", "nowhere/out"), ("kvquant", "nowhere/s.safetensors")):
        rc, err = run(capsys, *export(fmt, out))
        assert rc == 2 and "does not exist" in err and "nowhere" in err


def test_calibrate_and_eval_outputs_inside_the_model_are_refused(work, capsys, monkeypatch):
    monkeypatch.setattr("kvquant.eval.runner.run_recipe", lambda *a, **k: pytest.fail("the run started"))
    before = tree(work)
    rc, err = run(capsys, "calibrate", "--model", "mymodel", "--data", "data.txt", "--budget-bits", "7",
                  "--candidates", "int2,int8,fp16", "-o", "mymodel/c.yaml")
    assert rc == 2 and "lies inside --model" in err
    recipe = Path(__file__).resolve().parent.parent / "recipes" / "tinystories-stories260k.yaml"
    rc, err = run(capsys, "eval", recipe, "--model", "mymodel", "--data", "data.txt", "--out", "mymodel", "--quiet")
    assert rc == 2 and "out:" in err and "lies inside model" in err
    assert tree(work) == before

    class Reached(BaseException):
        pass

    def reached(*a, **k):
        raise Reached

    monkeypatch.setattr("kvquant.eval.runner.run_recipe", reached)
    with pytest.raises(Reached):  # beside the data is fine: only the files a run writes are its outputs
        main(["eval", str(recipe), "--model", "mymodel", "--data", "data.txt", "--out", ".", "--quiet"])


def test_check_disjoint_equal_holds_inside(tmp_path):
    m = tmp_path / "m"
    m.mkdir()
    (m / "w.safetensors").write_bytes(b"x")
    inputs = input_paths("--model", m)
    for out, word in ((m, "is"), (tmp_path, "holds"), (m / "w.safetensors", "lies inside"),
                      (m / "new", "lies inside")):
        with pytest.raises(OutputError, match=f"^-o: .* {word} --model"):
            check_disjoint([("-o", out)], inputs)
    check_disjoint([("-o", tmp_path / "elsewhere")], inputs)


# ------------------------------------------------------------------------------------------ sets and temporaries
def _listing(d: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in d.iterdir() if p.name != OWN_MANIFEST}


def test_a_run_s_files_are_replaced_together(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    (d / "mine.txt").write_text("user")
    with staged_files(d, ["results.json", "report.md", "plot.png"]) as stage:  # an earlier run
        for name in ("results.json", "report.md", "plot.png"):
            (stage / name).write_text("old")
    with pytest.raises(KeyboardInterrupt), staged_files(d, ["results.json", "report.md", "plot.png"]) as stage:
        (stage / "results.json").write_text("new")
        raise KeyboardInterrupt  # between two files
    assert _listing(d) == {"results.json": "old", "report.md": "old", "plot.png": "old", "mine.txt": "user"}
    with staged_files(d, ["results.json", "report.md", "plot.png"]) as stage:
        (stage / "results.json").write_text("new")
        (stage / "report.md").write_text("new")
    # the old run's plot is not left beside the new report; the user's file is untouched
    assert _listing(d) == {"results.json": "new", "report.md": "new", "mine.txt": "user"}
    assert is_own_file(d / "results.json") and not is_own_file(d / "mine.txt") and not is_own_file(d / "plot.png")


def test_force_replaces_only_files_kvquant_wrote(tmp_path):
    """``--force`` of a run's set (eval --out, calibrate -o) is decided by the folder's manifest, not by the name:
    a foreign file named like one of ours, or one of ours changed since, is refused, and an earlier run's file that
    this run does not write is removed only when it is ours."""
    d = tmp_path / "out"
    d.mkdir()
    with staged_files(d, ["results.json", "report.md"]) as stage:
        (stage / "results.json").write_text("ours")
        (stage / "report.md").write_text("ours")
    assert check_output_dir(d, ["results.json", "report.md"], "out", force=True) == d
    assert check_output(d / "report.md", (".md",), "-o", force=True, own=True) == d / "report.md"
    (d / "report.md").write_text("the user's edits")  # changed since: no longer ours
    (d / "plot.png").write_text("the user's plot")  # never ours
    for call in (lambda: check_output_dir(d, ["results.json", "report.md"], "out", force=True),
                 lambda: check_output(d / "report.md", (".md",), "-o", force=True, own=True),
                 lambda: check_output_dir(d, ["plot.png"], "out", force=True)):
        with pytest.raises(OutputError, match=r"^(out|-o): .* was not written by kvquant .*never replaced"):
            call()
    check_output(d / "plot.png", (".png",), "--plot", force=True)  # a single file of its own kind: as before
    with staged_files(d, ["results.json", "report.md", "plot.png"]) as stage:
        (stage / "results.json").write_text("new")
    assert _listing(d) == {"results.json": "new", "report.md": "the user's edits", "plot.png": "the user's plot"}
    (d / OWN_MANIFEST).write_text("not json")  # a damaged manifest: nothing is ours
    assert not is_own_file(d / "results.json")


def test_eval_and_calibrate_force_refuse_a_foreign_file_of_their_name(work, capsys, monkeypatch):
    """A results.json / config.yaml / heatmap the user wrote is refused by --force, one line, before any work."""
    monkeypatch.setattr("kvquant.eval.runner.run_recipe", lambda *a, **k: pytest.fail("the run started"))
    out = work / "run"
    out.mkdir()
    (out / "results.json").write_text('{"mine": true}\n')
    (work / "c.png").write_bytes(b"my picture")
    (work / "d.yaml").write_text("default: int8\n")
    before = tree(work)
    recipe = Path(__file__).resolve().parent.parent / "recipes" / "tinystories-stories260k.yaml"
    rc, err = run(capsys, "eval", recipe, "--model", "mymodel", "--data", "data.txt", "--out", out, "--quiet",
                  "--force")
    assert rc == 2 and "results.json exists and was not written by kvquant" in err
    cal = ["calibrate", "--model", "mymodel", "--data", "data.txt", "--budget-bits", "7",
           "--candidates", "int2,int8,fp16", "--force"]
    rc, err = run(capsys, *cal, "-o", "c.yaml")
    assert rc == 2 and "-o (its heatmap):" in err and "c.png exists and was not written by kvquant" in err
    rc, err = run(capsys, *cal, "-o", "d.yaml")
    assert rc == 2 and err.startswith("kvquant calibrate: error: -o:") and "was not written by kvquant" in err
    assert tree(work) == before


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_sweep_after_sigkill_finishes_or_removes(tmp_path):
    pid = _dead_pid()
    (tmp_path / f".r.json.kvq-{pid}-abc_12.tmp.json").write_text("half")  # a partial atomic write
    stage = tmp_path / f".export.kvq-{pid}-stage"  # killed between the two renames of a folder swap
    old = tmp_path / f".export.kvq-{pid}-old"
    stage.mkdir()
    old.mkdir()
    (stage / "new").write_text("n")
    (old / "old").write_text("o")
    (tmp_path / "keep.txt").write_text("user")
    partial = tmp_path / f".other.kvq-{pid}-stage"  # killed while writing a staging folder: its target stays
    partial.mkdir()
    (tmp_path / "other").mkdir()
    sweep_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "keep.txt", "other"]
    assert [p.name for p in (tmp_path / "export").iterdir()] == ["new"]
    d = tmp_path / "set"  # a complete file set whose commit was cut: committed
    d.mkdir()
    (d / "results.json").write_text("old")
    s = d / f".set.kvq-{pid}-set"
    s.mkdir()
    (s / "results.json").write_text("new")
    (s / ".kvq-set.json").write_text(json.dumps({"names": ["results.json"], "remove": []}))
    sweep_stale(d)
    assert sorted(_listing(d).items()) == [("results.json", "new")] and is_own_file(d / "results.json")
    live = tmp_path / f".x.kvq-{os.getpid()}-stage"  # a running process's temporary is left alone
    live.mkdir()
    sweep_stale(tmp_path)
    assert live.exists()


SIGNAL_SCRIPT = textwrap.dedent("""
    import sys, time, types
    pkg = types.ModuleType("kvquant")  # kvquant.outputs alone: not the package (torch), so the test is fast
    pkg.__path__ = [sys.argv[2]]
    sys.modules["kvquant"] = pkg
    from kvquant.outputs import staged_folder, terminate_as_exit
    terminate_as_exit()
    with staged_folder(sys.argv[1]) as tmp:
        (tmp / "part").write_text("x")
        print("ready", flush=True)
        time.sleep(60)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_while_writing_leaves_nothing(tmp_path, sig):
    target = tmp_path / "out"
    target.mkdir()
    (target / "kvquant_export.json").write_text("{}")
    argv = [sys.executable, "-c", SIGNAL_SCRIPT, str(target), str(KVQUANT_DIR)]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(sig)
    rc = p.wait(timeout=30)
    assert rc != 0
    assert sorted(q.name for q in tmp_path.iterdir()) == ["out"]
    assert [q.name for q in target.iterdir()] == ["kvquant_export.json"]


def test_staged_folder_swaps_whole(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "a").write_text("old")
    with staged_folder(target) as tmp:
        (tmp / "b").write_text("new")
    assert [q.name for q in target.iterdir()] == ["b"] and sorted(q.name for q in tmp_path.iterdir()) == ["out"]


EXPORT_SIGTERM_SCRIPT = textwrap.dedent("""
    import shutil, sys, time
    real = shutil.copy2

    def slow_copy(src, dst, **kw):  # the first copied file announces itself, then the copy hangs: a SIGTERM lands
        out = real(src, dst, **kw)
        print("copying", flush=True)
        time.sleep(60)
        return out

    shutil.copy2 = slow_copy
    from kvquant.cli import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_sigterm_during_export_weights_copy_leaves_nothing(tmp_path, stories_path, shared):
    """The issue's case, through the real command in a subprocess: SIGTERM while the weights are copied."""
    data = tmp_path / "data.txt"
    data.write_text((shared / "data" / "tinystories-valid-sample.txt").read_text()[:6000])
    argv = [sys.executable, "-c", EXPORT_SIGTERM_SCRIPT, "export", "--model", str(stories_path), "--data", str(data),
            "--format", "vllm", "--weights", "copy", *CALIB, "-o", str(tmp_path / "out")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        while (line := p.stdout.readline()) and line.strip() != "copying":
            pass
        assert line.strip() == "copying", "the export ended before it copied"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        p.kill()
    assert sorted(q.name for q in tmp_path.iterdir()) == ["data.txt"]  # no partial copy folder, no out
