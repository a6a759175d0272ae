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
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvquant import ConfigError, KVQuantConfig, ModelShape
from kvquant.cli import build_parser, main
from kvquant.config import TOP_LEVEL

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
    st.dictionaries(st.sampled_from(sorted(TOP_LEVEL)), VALUES, max_size=5),  # known fields, any values
    st.dictionaries(st.one_of(st.sampled_from(sorted(TOP_LEVEL)), st.text(max_size=5)), VALUES, max_size=3),
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
    mp.setattr("kvquant.models.load_model", reached)  # inspect loads through it


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
        "export": ["export", "--model", f["model"], "--format", "kvquant", "--data", "tinystories",
                   "-o", f["new_dir"] + ".safetensors"],
        "inspect": ["inspect", "--model", f["model"], "--tokens", "8"],
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
    for command in ("calibrate", "estimate", "eval", "presets", "show-config", "export", "inspect"):
        with pytest.MonkeyPatch.context() as mp:
            _stub(mp)
            assert _run(_base(command, files))[0] == 0, command


# ------------------------------------------------------------------------------------------------ damaged inputs
# Issue 38: damaged files and hostile file systems. Every case is a command line over a scratch folder holding a
# good copy of the model, data and a finished run, then damaged as named; it must end with one line and exit 2
# (the long work stubbed as above), and no input byte may change.
def _damaged_world(root: Path, model_src: Path, data_src: Path) -> dict[str, Path]:
    import os
    import shutil

    m = root / "model"
    shutil.copytree(model_src, m)
    for p in m.iterdir():
        p.chmod(0o644)
    w = {"model": m, "data": root / "data.txt", "root": root}
    w["data"].write_text(data_src.read_text()[:4000])
    trunc = root / "trunc"
    shutil.copytree(m, trunc)
    raw = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    w["trunc"] = trunc
    junk = root / "junkhead"
    shutil.copytree(m, junk)
    (junk / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"\x00" * 64)
    w["junkhead"] = junk
    dangling = root / "dangling"
    dangling.mkdir()
    for p in m.iterdir():
        (dangling / p.name).symlink_to(root / "moved-away" / p.name if p.suffix == ".safetensors" else p)
    w["dangling"] = dangling
    fifo = root / "fifo"
    shutil.copytree(m, fifo)
    os.mkfifo(fifo / "tokenizer.model")
    w["fifo"] = fifo
    (root / "bad.gguf").write_bytes(b"GGML" + b"\x00" * 100)
    (root / "short.gguf").write_bytes(b"GGUF\x03")
    w["bad_gguf"], w["short_gguf"] = root / "bad.gguf", root / "short.gguf"
    (root / "lengths.png").write_text("10\n20\n")
    w["lengths_png"] = root / "lengths.png"
    (root / "binary.json").write_bytes(bytes(range(256)))
    (root / "rows.json").write_text('{"results": [{"config": "int8"}, 3]}')
    (root / "windows.json").write_text('{"results": [{"config": "a", "protocol": "decode", "status": "ok", '
                                       '"windows": [{"window": 0, "ppl": "x", "kl_mean": 1, "top1": 1}]}]}')
    (root / "truncated.json").write_text('{"results": [{"config": "a", "protocol": "de')
    for n in ("binary", "rows", "windows", "truncated"):
        w[f"{n}_json"] = root / f"{n}.json"
    vdir = root / "vllm-damaged"
    vdir.mkdir()
    (vdir / "config.json").write_text(json.dumps({"quantization_config": {"kv_cache_scheme": {
        "type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False, "symmetric": True}}}))
    (vdir / "kv_scales.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    (vdir / "other.safetensors").write_bytes(b"\xff" * 5)
    w["vllm_damaged"] = vdir
    (root / "huge.json").write_text(json.dumps({"format": "kvquant-scales", "layers": [
        {"key_amax": [1e38] * 4, "value_amax": [1.0] * 4}] * 5}))
    (root / "huge.yaml").write_text(f"default: int8\nscales_file: {root / 'huge.json'}\n")
    (root / "missing-scales.yaml").write_text(f"default: int8\nscales_file: {root / 'nope.safetensors'}\n")
    (root / "layer99.yaml").write_text("default: int8\nlayers: {99: int4}\n")
    (root / "head-float.yaml").write_text("default: int8\nheads: {2.10: int2}\n")
    (root / "ladder-int8.yaml").write_text("default: int8\nladder_tokens: 16\n")
    for n in ("huge", "missing-scales", "layer99", "head-float", "ladder-int8"):
        w[f"{n}_yaml"] = root / f"{n}.yaml"
    foreign = root / "foreign-run"  # files named like a run's, written by the user: --force never replaces them
    foreign.mkdir()
    (foreign / "results.json").write_text('{"results": []}\n')
    (foreign / "report.md").write_text("my notes\n")
    (root / "mine.yaml").write_text("default: int8\n")
    (root / "theirs.png").write_bytes(b"\x89PNG my figure")
    w["foreign_run"], w["mine_yaml"], w["theirs_yaml"] = foreign, root / "mine.yaml", root / "theirs.yaml"
    return w


def _damaged_cases(w: dict[str, Path]) -> list[tuple[str, list[str]]]:
    m, d, r = str(w["model"]), str(w["data"]), w["root"]
    recipe = ["eval", str(RECIPE), "--quiet", "--data", d, "--out", str(r / "out")]
    cal = ["calibrate", "--data", d, "--budget-bits", "7", "--candidates", "int2,int8,fp16"]
    exp = ["export", "--data", d, "--calib-window", "32", "--calib-windows", "1"]
    cases = []
    for bad in ("trunc", "junkhead", "dangling", "fifo", "bad_gguf", "short_gguf"):
        b = str(w[bad])
        cases += [
            (f"eval --model {bad}", [*recipe, "--model", b]),
            (f"export vllm --model {bad}", [*exp, "--model", b, "--format", "vllm", "-o", str(r / f"e-{bad}"),
                                            "--weights", "copy"]),
            (f"calibrate --model {bad}", [*cal, "--model", b, "-o", str(r / f"c-{bad}.yaml")]),
            (f"estimate --model {bad}", ["estimate", "--model", b]),
            (f"inspect --model {bad}", ["inspect", "--model", b]),
            (f"show-config --model {bad}", ["show-config", "int8", "--model", b]),
        ]
    for bad in ("binary_json", "rows_json", "windows_json", "truncated_json"):
        cases.append((f"eval --compare {bad}", ["eval", str(w[bad]), "--compare", "a,b"]))
    cases += [
        ("eval vllm:damaged", [*recipe, "--model", m, "--configs", f"vllm:{w['vllm_damaged']}"]),
        ("export -o in a missing folder (vllm)", [*exp, "--model", m, "--format", "vllm", "-o", str(r / "no/out")]),
        ("export -o in a missing folder (kvquant)", [*exp, "--model", m, "--format", "kvquant",
                                                      "-o", str(r / "no/s.safetensors")]),
        ("calibrate -o in a file", [*cal, "--model", m, "-o", str(w["data"] / "c.yaml")]),
        ("inspect --tokens 0", ["inspect", "--model", m, "--tokens", "0"]),
        ("inspect --tokens -3", ["inspect", "--model", m, "--tokens", "-3"]),
        ("inspect --tokens 100000", ["inspect", "--model", m, "--tokens", "100000"]),
        ("inspect --new-tokens 0", ["inspect", "--model", m, "--new-tokens", "0"]),
        ("inspect --beams 0", ["inspect", "--model", m, "--beams", "0"]),
        ("export --force -o model", [*exp, "--model", m, "--format", "vllm", "-o", m, "--force"]),
        ("export --force -o above model", [*exp, "--model", m, "--format", "vllm", "-o", str(r), "--force"]),
        ("export --force -o the weights", [*exp, "--model", m, "--format", "kvquant", "--force",
                                           "-o", str(w["model"] / "model.safetensors")]),
        ("export --force -o the data", [*exp, "--model", m, "--format", "kvquant", "--force", "-o", d]),
        ("calibrate -o inside the model", [*cal, "--model", m, "-o", str(w["model"] / "c.yaml")]),
        ("eval --out the model", [*recipe[:-2], "--model", m, "--out", m, "--force"]),
        ("eval --force over a foreign results.json", [*recipe[:-2], "--model", m, "--out", str(w["foreign_run"]),
                                                      "--force"]),
        ("calibrate --force over a foreign config", [*cal, "--model", m, "-o", str(w["mine_yaml"]), "--force"]),
        ("calibrate --force over a foreign heatmap", [*cal, "--model", m, "-o", str(w["theirs_yaml"]), "--force"]),
        ("estimate --plot over the lengths", ["estimate", "--layers", "2", "--kv-heads", "2", "--head-dim", "8",
                                              "--lengths", str(w["lengths_png"]), "--plot", str(w["lengths_png"]),
                                              "--force"]),
    ]
    for cfg in ("huge", "missing-scales", "layer99", "head-float", "ladder-int8"):
        c = str(w[f"{cfg}_yaml"])
        cases += [
            (f"eval config {cfg}", [*recipe, "--model", m, "--configs", c]),
            (f"estimate config {cfg}", ["estimate", "--model", m, "--config", c]),
            (f"show-config {cfg}", ["show-config", c, "--model", m]),
            (f"inspect config {cfg}", ["inspect", "--model", m, "--config", c]),
        ]
        if cfg != "ladder-int8":
            cases.append((f"export config {cfg}", [*exp, "--model", m, "--format", "kvquant", "--config", c,
                                                    "-o", str(r / f"s-{cfg}.safetensors")]))
    return cases


def _snapshot(root: Path) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[str(p)] = "-> " + str(p.readlink())
        elif p.is_file():
            out[str(p)] = p.read_bytes()
    return out


def test_damaged_inputs_and_hostile_outputs_are_one_line(tmp_path, stories_path, shared):
    w = _damaged_world(tmp_path, stories_path, shared / "data" / "tinystories-valid-sample.txt")
    before = _snapshot(tmp_path)
    failures, tried = [], 0
    for label, argv in _damaged_cases(w):
        tried += 1
        with pytest.MonkeyPatch.context() as mp:
            _stub(mp)
            try:
                rc, err = _run(argv)
            except Exception as e:  # noqa: BLE001 - an exception main() let out is a case not handled
                rc, err = -1, f"{type(e).__name__}: {e}"
        lines = err.strip().splitlines()
        if rc != 2 or "Traceback" in err or len(lines) != 1 or ": error: " not in lines[0]:
            failures.append(f"{label}: rc {rc}: {err.strip()[-300:]}")
    after = _snapshot(tmp_path)
    changed = sorted(k for k in before if before[k] != after.get(k))
    assert not failures, f"{len(failures)} of {tried} not handled:\n" + "\n".join(failures)
    assert not changed, changed


# ------------------------------------------------------------------------------------------------ loaders and allocator
NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 1.0, -1e-7]))


@FUZZ
@given(st.integers(1, 2), st.integers(1, 3), st.lists(NUMBERS, min_size=36, max_size=36),
       st.floats(0, 40), st.booleans())
def test_allocator_ends_or_refuses(layers, heads, values, budget, kv_separate):
    """Any table (NaN, Inf, negative, ties, zeros) and budget: a KVQuantError, or a plan within the budget."""
    import torch

    from kvquant.allocate import allocate
    from kvquant.errors import KVQuantError

    n = layers * heads * 2
    sens = {c: torch.tensor(values[i * n:(i + 1) * n], dtype=torch.float64).reshape(layers, heads, 2)
            for i, c in enumerate(("int2", "int8", "fp16"))}
    try:
        a = allocate(sens, {"int2": 6.0, "int8": 8.0, "fp16": 16.0}, budget, kv_separate=kv_separate)
    except KVQuantError:
        return
    assert a.avg_bits <= budget + 1e-9 and len(a.plan) == layers


JSONISH = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(), st.text(max_size=3)),
                       lambda inner: st.one_of(st.lists(inner, max_size=3),
                                               st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                       max_leaves=10)


@FUZZ
@given(st.one_of(JSONISH, st.fixed_dictionaries({"entries": st.dictionaries(st.just("k"), JSONISH, max_size=1)}),
                 st.fixed_dictionaries({"entries": st.just({"k": {"values": {"int2": [[[1.0, float("nan")]]]},
                                                                  "base": "int2", "candidates": ["int2"],
                                                                  "method": "kl"}})})))
def test_sensitivity_cache_entries_load_or_raise_input_error(tmp_path_factory, doc):
    from kvquant.errors import InputError
    from kvquant.sensitivity import load_cached

    p = tmp_path_factory.mktemp("sens") / "kvquant-sensitivity.json"
    p.write_text(json.dumps(doc))
    with contextlib.suppress(InputError):
        load_cached(p, "k")


@FUZZ
@given(st.one_of(st.binary(max_size=120), JSONISH.map(lambda d: json.dumps({"results": d}).encode())),
       st.sampled_from([".json", ".safetensors"]))
def test_results_and_scales_files_load_or_raise_input_error(tmp_path_factory, raw, suffix):
    from kvquant.errors import InputError, KVQuantError
    from kvquant.eval.compare import compare_text, load_rows
    from kvquant.scales import load_scales

    p = tmp_path_factory.mktemp("files") / f"f{suffix}"
    p.write_bytes(raw)
    with contextlib.suppress(InputError):
        load_scales(p)
    if suffix == ".json":
        with contextlib.suppress(KVQuantError):  # a damaged file: InputError; configs not in it: ArgumentError
            compare_text(load_rows(p), "a", "b")


# ------------------------------------------------------------------------------------------------ batch independence
# Issue 38: a seeded random mix of configs x batch shapes x precisions. Each case batches prompts of random, very
# different lengths (left-padded to the longest) and checks every row against itself alone, teacher-forced: the
# same greedy token at every position, and (precisions without discontinuous codes) logits within 1e-2 (a row
# held in fp16 while it waits for its calibration tokens moves by ~1e-4; a batch-dependence bug by 1-10).
# Left out, as documented in docs/batch-independence.md: per-channel key blocks and residual_tokens (the block
# grid is the same for every row).
MIX_PRECISIONS = ["int8", "int8-token", "int4", "int2", "fp8-e4m3", "fp8-e5m2", "fp16", "tq3", "tq4"]
MIX_OPTIONS = [{}, {"sink_tokens": 3}, {"rotate": "kv"}, {"heavy_tokens": 4},
               {"evict": {"policy": "snapkv", "keep": 0.5, "window": 8, "sinks": 2, "budget": "adakv"}}]


def _mix_cases(n: int, seed: int = 38) -> list[tuple[dict, list[int]]]:
    import random

    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        cfg = {"default": rng.choice(MIX_PRECISIONS), "block_size": rng.choice([16, 32])}
        cfg.update(rng.choice(MIX_OPTIONS))
        if "heavy_tokens" in cfg and not cfg["default"].startswith("tq"):
            cfg["default"] = "tq3"  # (heavy rows refine codebook codes only)
        lengths = [rng.randint(40, 200), rng.randint(1, 15)] + ([rng.randint(1, 60)] if rng.random() < 0.5 else [])
        cases.append((cfg, lengths))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("cfg, lengths", _mix_cases(12), ids=lambda x: str(x))
def test_seeded_mix_of_batches_is_independent(stories, tinystories_text, cfg, lengths):
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "batch_independence.py"
    spec = importlib.util.spec_from_file_location("batch_independence", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model, tok = stories
    prompts, follow = bench.story_ids(tok, tinystories_text, tuple(lengths), 12)
    config = KVQuantConfig.from_dict(cfg)
    discontinuous = config.default.key.startswith("tq")
    for b, (d, same) in enumerate(bench.row_drift(model, prompts, follow, config)):
        assert same, f"{cfg} {lengths}: row {b} greedy tokens differ ({d:.2e})"
        assert discontinuous or d < 1e-2, f"{cfg} {lengths}: row {b} logits differ by {d:.2e}"
