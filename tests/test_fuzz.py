"""Fuzzing the error contract: configs load or raise ConfigError; every command exits 0 or 2 with one line.

Config dicts come from hypothesis (every field with values of every type, bounds and nesting); the command
lines are built from each command's own options with good, bad, huge and file-system-hostile values and run
in-process through ``kvquant.cli.main``. The long work (model loads, evaluation runs) is replaced by a stub
that exits 0 once every check has passed, so a loop stays fast and only the checks are fuzzed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvquant import ConfigError, KVQuantConfig, ModelShape
from kvquant.cli import build_parser, main
from kvquant.config import _TOP_LEVEL

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "tinystories-stories260k.yaml"
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

# ------------------------------------------------------------------------------------------------ configs
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**13), 10**13), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(["int8", "int4", "int2", "fp16", "int4-channel", "int8-token", "fp8-e4m3", "none", "keys", "kv",
                     "3.1", "0.0", "-1", "1.2.3"]),
)  # fmt: skip
KEYS = st.one_of(st.text(max_size=4), st.integers(-2, 40), st.sampled_from(["key", "value", "bits", "precision", "0"]))
VALUES = st.recursive(
    SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(KEYS, inner, max_size=3)),
    max_leaves=8,
)
CONFIG_DICTS = st.one_of(
    st.dictionaries(st.sampled_from(sorted(_TOP_LEVEL)), VALUES, max_size=5),  # known fields, any values
    st.dictionaries(st.one_of(st.sampled_from(sorted(_TOP_LEVEL)), st.text(max_size=5)), VALUES, max_size=3),
)
SHAPES = [ModelShape(2, 2, 8), ModelShape(3, 1, 64), ModelShape(40, 8, 128)]


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(CONFIG_DICTS)
def test_config_dicts_load_or_raise_config_error(data):
    try:
        cfg = KVQuantConfig.from_dict(data)
    except ConfigError:
        return
    assert KVQuantConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()  # what loads, round-trips
    for shape in SHAPES:
        try:
            bits = cfg.avg_bits(shape)
        except ConfigError:
            continue
        assert 0 < bits <= 32


@FUZZ
@given(st.binary(max_size=80), st.sampled_from([".yaml", ".json", ".yml", ""]))
def test_config_files_load_or_raise_config_error(tmp_path_factory, raw, suffix):
    p = tmp_path_factory.mktemp("cfg") / f"c{suffix}"
    p.write_bytes(raw)
    with contextlib.suppress(ConfigError):
        KVQuantConfig.from_file(p)


# ------------------------------------------------------------------------------------------------ command lines
class Reached(BaseException):  # not an Exception: main() must not treat it as a bug
    """Raised by the stubbed long work: every check passed."""


@pytest.fixture(scope="module")
def files(tmp_path_factory, stories_path):
    """A pool of paths every option may get: good ones, missing ones, folders, bad UTF-8, wrong kinds."""
    d = tmp_path_factory.mktemp("fuzz")
    (d / "exists.yaml").write_text("default: int8\n")
    (d / "exists.png").write_bytes(b"png")
    (d / "exists.json").write_text('{"x": 1}\n')
    (d / "bad.txt").write_bytes(b"abc \xff\xfe\n")
    (d / "lengths.txt").write_text("10\n200\n3000\n")
    (d / "badlengths.txt").write_text("10\n1e999\n-4\nx\n")
    (d / "folder").mkdir()
    (d / "recipe.yaml").write_text(RECIPE.read_text())
    (d / "badrecipe.yaml").write_text("window: big\nmodel: x\n")
    return {
        "model": str(stories_path), "missing": str(d / "missing" / "x"), "folder": str(d / "folder"),
        "yaml": str(d / "exists.yaml"), "png": str(d / "exists.png"), "json": str(d / "exists.json"),
        "bad": str(d / "bad.txt"), "lengths": str(d / "lengths.txt"), "badlengths": str(d / "badlengths.txt"),
        "recipe": str(d / "recipe.yaml"), "badrecipe": str(d / "badrecipe.yaml"),
        "new_yaml": str(d / "new" / "c.yaml"), "new_png": str(d / "new" / "p.png"), "new_dir": str(d / "outdir"),
        "under_file": str(d / "exists.yaml" / "x.yaml"),
    }


INTS = ["0", "1", "2", "3", "8", "16", "24", "64", "-1", str(2**40), str(2**70)]
FLOATS = ["0", "2.5", "7.5", "8", "16", "-1", "nan", "inf", "1e999"]
WORDS = ["", " ", "x", "int4", "int8", "int4,int8,fp16", "fp16,int2", "int9", "int4,int4", "decode",
         "simulated,decode", "sideways", "cpu", "cuda", "cuda:x", "mps", "float32", "bf16", "float8", "24GiB", "-3MB",
         "1e999GiB", "tinystories", "kjv", "fisher", "kl", "/nonexistent", "hub:", "int8,reference", "--force"]


def _actions(command: str) -> list[argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices[command]._actions if a.option_strings and a.dest not in ("help", "debug")]


def _option_values(action: argparse.Action, files: dict[str, str]) -> st.SearchStrategy[list[str]]:
    """``[option]`` for a flag, else ``[option, value]`` with values mostly of the option's type."""
    opt = st.sampled_from(action.option_strings)
    if action.nargs == 0:
        return opt.map(lambda o: [o])
    typed = {int: INTS, float: FLOATS}.get(action.type, WORDS + sorted(files.values()))
    value = st.one_of(st.sampled_from(typed), st.sampled_from(WORDS + sorted(files.values())), st.text(max_size=4))
    return st.tuples(opt, value).map(list)


def _run(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # --help
            rc = e.code or 0
        except Reached:
            rc = 0
    return rc, err.getvalue()


def _check(argv: list[str]) -> None:
    rc, err = _run(argv)
    assert "Traceback" not in err, (argv, err)
    assert rc in (0, 2), (argv, rc, err)
    if rc == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and ": error: " in lines[0], (argv, err)


def _stub(mp: pytest.MonkeyPatch) -> None:
    def reached(*a, **k):
        raise Reached

    mp.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # fuzzed hub ids must not reach the network
    mp.setattr("kvquant.calibrate._load_model_and_text", reached)
    mp.setattr("kvquant.eval.runner.run_recipe", reached)
    mp.setattr("kvquant.eval.parallel.run_parallel", reached)  # --procs N would start N processes
    mp.setattr("kvquant.eval.suite.run_models", reached)  # --jobs N likewise


def _base(command: str, f: dict[str, str]) -> list[str]:
    """A command line that passes every check (the fuzzed options are appended to it); ``[command]`` for a
    command without one here, which is then fuzzed from its bare name."""
    return {
        "estimate": ["estimate", "--layers", "2", "--kv-heads", "2", "--head-dim", "8"],
        "show-config": ["show-config", f["yaml"], "--model", f["model"]],
        "calibrate": ["calibrate", "--model", f["model"], "--budget-bits", "7", "--candidates", "int2,int8,fp16",
                      "-o", f["new_yaml"]],
        "eval": ["eval", f["recipe"], "--quiet", "--out", f["new_dir"]],
        "presets": ["presets"],
    }.get(command, [command])


def _commands() -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


COMMANDS = _commands()  # every command the parser knows, those added later included


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_line_exits_0_or_2_with_one_line(command, files, tmp_path):
    actions = _actions(command)
    base = _base(command, files)

    @FUZZ
    @given(st.lists(st.one_of(*[_option_values(a, files) for a in actions]), max_size=3) if actions
           else st.just([]))
    def fuzz(options):
        with pytest.MonkeyPatch.context() as mp:
            _stub(mp)
            mp.chdir(tmp_path)  # a fuzzed relative output path lands here
            _check(base + [x for o in options for x in o])

    fuzz()


def test_base_command_lines_reach_the_work(files):
    for command in ("calibrate", "estimate", "eval", "presets", "show-config"):
        with pytest.MonkeyPatch.context() as mp:
            _stub(mp)
            assert _run(_base(command, files))[0] == 0, command
