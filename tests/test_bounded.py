"""Issue 38, hangs and misreads: every loop ends, numbers read from files are checked, bounds hold however a config
is built. The allocator with NaN / ties / degenerate gains, a NaN sensitivity cache, ``inspect`` bounds."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from kvquant import ConfigError, KVQuantConfig, ModelShape
from kvquant.allocate import allocate, check_sensitivity
from kvquant.cli import main
from kvquant.errors import InputError, KVQuantError
from kvquant.scales import KVScales, ScalesError

BITS = {"int2": 6.0, "int8": 8.0, "fp16": 16.0}


def run(capsys, *argv) -> tuple[int, str]:
    """``kvquant ARGV``: (status, the error line); progress bars of a model load may come before it."""
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [x for x in err.replace("\r", "\n").splitlines() if x.strip() and not x.startswith("Loading weights")]
    if rc == 2:
        assert len(lines) == 1 and ": error: " in lines[0], err
    return rc, lines[-1] if lines else ""


def table(fill: float | None = None, seed: int = 0, shape=(3, 2, 2)) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sens = {"int2": torch.rand(*shape, generator=g, dtype=torch.float64) + 0.5,
            "int8": torch.rand(*shape, generator=g, dtype=torch.float64) * 0.1,
            "fp16": torch.zeros(*shape, dtype=torch.float64)}
    if fill is not None:
        sens["int8"][1, 0, 1] = fill
    return sens


# ------------------------------------------------------------------------------------------ the allocator
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -0.5])
def test_allocator_refuses_nan_inf_and_negative_gains(bad):
    t0 = time.perf_counter()
    with pytest.raises(InputError, match=r"values\['int8'\]\[1, 0, 1\]"):
        allocate(table(bad), BITS, 9.0, kv_separate=True)
    assert time.perf_counter() - t0 < 2


@pytest.mark.parametrize("kv_separate", [False, True])
@pytest.mark.parametrize("kind", ["ties", "all-zero", "equal-to-base", "tiny"])
def test_allocator_ends_on_ties_and_degenerate_gains(kind, kv_separate):
    shape = (4, 3, 2)
    if kind == "ties":  # every unit the same: any order is right, the budget still bounds it
        sens = {"int2": torch.ones(shape, dtype=torch.float64), "int8": torch.full(shape, 0.5, dtype=torch.float64),
                "fp16": torch.zeros(shape, dtype=torch.float64)}
    elif kind == "all-zero":  # nothing gains: everything stays at the cheapest
        sens = {c: torch.zeros(shape, dtype=torch.float64) for c in BITS}
    elif kind == "equal-to-base":
        sens = {c: torch.full(shape, 0.25, dtype=torch.float64) for c in BITS}
    else:  # gains at rounding level
        sens = {"int2": torch.full(shape, 1e-300, dtype=torch.float64), "int8": torch.full(shape, 5e-301,
                dtype=torch.float64), "fp16": torch.zeros(shape, dtype=torch.float64)}
    for budget in (6.0, 7.3, 16.0, 100.0):
        a = allocate(sens, BITS, budget, kv_separate=kv_separate)
        assert a.avg_bits <= budget + 1e-9
        if kind in ("all-zero", "equal-to-base"):
            assert {p.key for row in a.plan for p in row} == {"int2"}


def test_check_sensitivity_shape_and_candidates():
    with pytest.raises(InputError, match="no values for candidate 'fp16'"):
        check_sensitivity({"int2": torch.zeros(2, 2, 2)}, ["int2", "fp16"])
    with pytest.raises(InputError, match=r"shape \[2, 2\], expected \[layers, kv_heads, 2\]"):
        check_sensitivity({"int2": torch.zeros(2, 2)}, ["int2"])
    with pytest.raises(InputError, match="the model has 5 x 2"):
        check_sensitivity({"int2": torch.zeros(2, 2, 2)}, ["int2"], shape=(5, 2))


# ------------------------------------------------------------------------------------------ the sensitivity cache
CAL = ["--candidates", "int2,int8,fp16", "--calib-window", "32", "--calib-windows", "1", "--samples", "1",
       "--data", "tinystories", "--budget-bits", "7"]


@pytest.fixture(scope="module")
def calibrated(stories_path, tmp_path_factory):
    """A calibration's folder (config, heatmap, sensitivity cache), made once."""
    d = tmp_path_factory.mktemp("cal")
    assert main(["calibrate", "--model", str(stories_path), *CAL, "-o", str(d / "c.yaml")]) == 0
    return d


@pytest.mark.parametrize("damage", ["nan", "negative", "shape", "malformed", "no-values"])
def test_a_damaged_sensitivity_cache_is_one_line(stories_path, calibrated, tmp_path, capsys, damage):
    import shutil

    for p in calibrated.iterdir():
        shutil.copy(p, tmp_path / p.name)
    capsys.readouterr()
    argv = ["calibrate", "--model", stories_path, *CAL, "-o", tmp_path / "c.yaml"]
    cache = tmp_path / "kvquant-sensitivity.json"
    data = json.loads(cache.read_text())
    (key, entry), = data["entries"].items()
    if damage == "nan":
        entry["values"]["int8"][2][1][0] = float("nan")  # json writes NaN, as a careless edit or a NaN run would
    elif damage == "negative":
        entry["values"]["int8"][0][0][1] = -3.0
    elif damage == "shape":
        entry["values"]["int8"] = entry["values"]["int8"][:2]
    elif damage == "malformed":
        entry["values"]["int8"] = "oops"
    else:
        del entry["values"]
    cache.write_text(json.dumps(data))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    t0 = time.perf_counter()
    rc, err = run(capsys, *argv, "--force")
    assert rc == 2 and "--sens-cache" in err and key in err, err
    assert time.perf_counter() - t0 < 20
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


# ------------------------------------------------------------------------------------------ inspect
@pytest.mark.parametrize("opts, needle", [
    (["--tokens", "100000"], "--tokens: 100000 must be an integer from 1 to 512"),
    (["--tokens", "0"], "--tokens: 0"), (["--tokens", "-3"], "--tokens: -3"),
    (["--new-tokens", "0"], "--new-tokens: 0"), (["--beams", "0"], "--beams: 0"),
    (["--beams", "-2"], "--beams: -2"), (["--tokens", "500", "--new-tokens", "20"], "exceed the model's context"),
    (["--block-size", "0"], "--block-size: 0"), (["--text", "  "], "--text: empty"),
])
def test_inspect_numbers_are_bounded(stories_path, capsys, monkeypatch, opts, needle):
    monkeypatch.setattr("kvquant.models.load_model", lambda *a, **k: pytest.fail("model loaded"))
    t0 = time.perf_counter()
    rc, err = run(capsys, "inspect", "--model", stories_path, *opts)
    assert rc == 2 and needle in err, err
    assert time.perf_counter() - t0 < 10


# ------------------------------------------------------------------------------------------ misreads
def test_float_head_keys_are_refused(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("default: int8\nheads: {2.10: int2}\n")
    with pytest.raises(ConfigError, match=r'heads\.2\.1: .*quote.*"2\.10"'):
        KVQuantConfig.from_file(p)
    p.write_text("default: int8\nheads: {\"2.10\": int2}\n")
    assert (2, 10) in KVQuantConfig.from_file(p).heads
    p.write_text("default: int8\nheads: {2: {1.5: int2}}\n")
    with pytest.raises(ConfigError, match="quote"):
        KVQuantConfig.from_file(p)
    p.write_text("default: int8\nlayers: {1.0: int2}\n")
    with pytest.raises(ConfigError, match="layers"):
        KVQuantConfig.from_file(p)


@pytest.mark.parametrize("amax", [1e38, 1e6, float("inf")])
def test_implausible_amax_is_refused(amax):
    s = KVScales(torch.tensor([[1.0, amax]]), torch.tensor([[1.0, 1.0]]))
    with pytest.raises(ScalesError, match="key_amax"):
        s.check("s.safetensors", ModelShape(1, 2, 8))


@pytest.mark.parametrize("dtype, limit", [(None, 65504.0), (torch.float32, 65504.0), (torch.float16, 65504.0),
                                          (torch.bfloat16, float(torch.finfo(torch.bfloat16).max))])
def test_amax_range_is_that_of_the_dtype_the_cache_holds(dtype, limit):
    """An amax is checked against the range of the dtype the cache holds the model's K/V in (float16 for a
    float32 model, as its sink / residual buffers; a bfloat16 model's own range): 1e5 is refused for a float32
    model and accepted for a bfloat16 one, whose K/V can reach it."""
    from kvquant.shape import held_dtype

    assert float(torch.finfo(held_dtype(dtype)).max) == limit
    ok = KVScales(torch.tensor([[1.0, limit]]), torch.tensor([[1.0, 1.0]]))
    ok.check("s.safetensors", ModelShape(1, 2, 8), dtype)
    big = KVScales(torch.tensor([[1.0, 1e5]]), torch.tensor([[1.0, 1.0]]))
    if limit < 1e5:
        name = str(held_dtype(dtype)).removeprefix("torch.")
        with pytest.raises(ScalesError, match=rf"^scales_file: s\.safetensors: key_amax\[0\]\[1\] = 100000 .*{name}"):
            big.check("s.safetensors", ModelShape(1, 2, 8), dtype)
    else:
        big.check("s.safetensors", ModelShape(1, 2, 8), dtype)


@pytest.mark.parametrize("opt", ["ladder_tokens", "heavy_tokens"])
@pytest.mark.parametrize("precision", ["int8", "int4", "fp8-e4m3", "int4-channel"])
def test_options_that_do_nothing_are_refused(opt, precision):
    with pytest.raises(ConfigError, match=f"^{opt}: .*codebook"):
        KVQuantConfig.from_dict({"default": precision, opt: 8})
    KVQuantConfig.from_dict({"default": precision, "heads": {"0.0": "tq3"}, opt: 8})  # one codebook head: used


@pytest.mark.parametrize("field, value", [("sink_tokens", 200000), ("sink_tokens", -1), ("residual_tokens", 10**9),
                                          ("block_size", 3), ("headroom", 0.5), ("group_size", 3),
                                          ("rotate", "sideways"), ("ladder_tokens", -4)])
def test_bounds_hold_for_a_config_built_directly_or_changed(field, value):
    with pytest.raises(ConfigError, match=f"^{field}"):
        KVQuantConfig(**{field: value})
    cfg = KVQuantConfig.from_dict({"default": "tq3"}) if field == "ladder_tokens" else KVQuantConfig()
    with pytest.raises(ConfigError, match=f"^{field}"):
        setattr(cfg, field, value)
    assert getattr(cfg, field) != value  # a refused assignment leaves the old value


def test_api_misuse_raises_kvquant_errors():
    with pytest.raises(KVQuantError, match="default"):
        KVQuantConfig(default="int8")  # not a KVPrecision
    with pytest.raises(KVQuantError, match="heads"):
        KVQuantConfig(heads={"0.0": "int8"})


def test_api_misuse_names_the_argument():
    from kvquant.attention import check_supported
    from kvquant.rotation import hadamard

    for bad in (object(), torch.nn.Linear(2, 2)):
        with pytest.raises(KVQuantError, match="^model: ") as e:
            check_supported(bad)
        assert isinstance(e.value, TypeError)  # still a TypeError for callers that caught that
    with pytest.raises(ConfigError, match="^head_dim: 12"):
        hadamard(12)


def test_pool_max_bytes_and_device_are_kvquant_errors(stories):
    from kvquant import PagedKVPool

    with pytest.raises(KVQuantError, match="^max_bytes: 1 holds no block"):
        PagedKVPool(stories[0], KVQuantConfig.from_dict({"default": "int8-token"}), max_bytes=1)


@pytest.mark.parametrize("extra, named", [({"default": "int4", "headroom": 2.0}, "headroom"),
                                          ({"default": "int8", "codebook_gain": "mse"}, "codebook_gain"),
                                          ({"default": "int8-token", "share_kv_scale": False}, "share_kv_scale"),
                                          ({"default": "int8", "group_size": 16}, "group_size"),
                                          ({"default": "tqv3", "ladder_tokens": 8, "ladder2_tokens": 4},
                                           "ladder2_tokens")])
def test_options_without_effect_are_reported(extra, named):
    with pytest.warns(UserWarning, match=f"^{named}: does nothing"):
        KVQuantConfig.from_dict(extra)


def test_used_options_are_not_reported(recwarn):
    KVQuantConfig.from_dict({"default": "int8", "headroom": 2.0, "share_kv_scale": False})
    KVQuantConfig.from_dict({"default": "tq3", "codebook_gain": "mse", "ladder_tokens": 8, "ladder2_tokens": 4})
    assert not [w for w in recwarn if "does nothing" in str(w.message)]
