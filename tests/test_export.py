"""Static scales files, ``kvquant export`` (kvquant and vLLM / compressed-tensors formats) and the engine config.

The vLLM export is checked with the real ``compressed-tensors`` package (a dev extra): its config parser, its
checkpoint-parameter mapping, its qparam shapes, its scale computation and its FP8 quantize op.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvquant import KVQuantConfig, QuantizedKVCache
from kvquant.cli import main
from kvquant.export import engine_config, fp8_scales
from kvquant.scales import (
    KVScales,
    ScalesError,
    collect_amax,
    engine_scale_name,
    load_scales,
    parse_statistic,
    read_engine_scales,
    save_scales,
)
from kvquant.shape import ModelShape
from kvquant.transformers_compat import cache_kw

CALIB = ["--calib-window", "96", "--calib-windows", "2"]


# ------------------------------------------------------------------------------------------ the file format
def _scales(layers: int = 3, heads: int = 2) -> KVScales:
    g = torch.Generator().manual_seed(0)
    return KVScales(torch.rand(layers, heads, generator=g) + 0.5, torch.rand(layers, heads, generator=g) + 0.5,
                    "percentile:99.9", {"model": "m"})


@pytest.mark.parametrize("suffix", [".safetensors", ".json"])
def test_scales_file_round_trip(tmp_path, suffix):
    s = _scales()
    p = save_scales(s, tmp_path / f"s{suffix}")
    back = load_scales(p, ModelShape(3, 2, 8))
    assert torch.equal(back.key_amax, s.key_amax) and torch.equal(back.value_amax, s.value_amax)
    assert back.statistic == "percentile:99.9" and back.meta["model"] == "m" and back.granularity == "head"
    assert not list(tmp_path.glob(".*tmp*"))  # written through a temporary file, nothing left over


def test_per_tensor_scales_broadcast_over_heads(tmp_path):
    s = KVScales(torch.tensor([[2.0], [3.0]]), torch.tensor([[4.0], [5.0]]))
    p = save_scales(s, tmp_path / "t.safetensors")
    rows = load_scales(p).per_layer(ModelShape(2, 3, 8))
    assert rows[1]["key"].tolist() == [3.0, 3.0, 3.0] and rows[0]["value"].tolist() == [4.0, 4.0, 4.0]


@pytest.mark.parametrize("bad, needle", [
    (torch.tensor([[1.0, float("nan")]]), "NaN or Inf"),
    (torch.tensor([[1.0, 0.0]]), "key_amax[0][1] = 0.0 is not positive"),
    (torch.tensor([[1.0, -2.0]]), "is not positive"),
])
def test_scales_file_rejects_bad_values(tmp_path, bad, needle):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"format": "kvquant-scales", "layers": [{"key_amax": bad[0].tolist(),
                                                                     "value_amax": [1.0, 1.0]}]}))
    with pytest.raises(ScalesError) as e:
        load_scales(p)
    msg = str(e.value)
    assert needle in msg and str(p) in msg and "\n" not in msg


def test_scales_file_errors_name_the_file(tmp_path):
    with pytest.raises(ScalesError, match="does not exist"):
        load_scales(tmp_path / "nope.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(ScalesError, match="junk.safetensors.*is not a kvquant scales file"):
        load_scales(junk)
    p = save_scales(_scales(3, 2), tmp_path / "s.safetensors")
    with pytest.raises(ScalesError, match=r"holds 3 layers x 2 heads; the model has 4 layers x 2 KV heads"):
        load_scales(p, ModelShape(4, 2, 8))
    with pytest.raises(ScalesError, match="NaN or Inf"):
        save_scales(KVScales(torch.tensor([[float("inf")]]), torch.tensor([[1.0]])), tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


def test_parse_statistic():
    assert parse_statistic("max") == ("max", None)
    assert parse_statistic("percentile:99.5") == ("percentile", 99.5)
    for bad in ("mean", "percentile:0", "percentile:101", "percentile:x"):
        with pytest.raises(ValueError, match="--statistic"):
            parse_statistic(bad)


# ------------------------------------------------------------------------------------------ measuring
def test_collect_amax_is_the_stores_own_prefill_statistic(stories):
    """The collector's max equals the amax a kvquant FP8 store measures itself on the same tokens (another path)."""
    model, _ = stories
    ids = torch.randint(3, 500, (1, 50), generator=torch.Generator().manual_seed(1))
    s = collect_amax(model, ids, "max", "head")
    cache = QuantizedKVCache(model, KVQuantConfig.from_dict({"default": "fp8-e4m3", "headroom": 1.0}))
    with torch.no_grad():
        model(input_ids=ids, **cache_kw(cache))
    g = cache.layers[0].store.groups[0]  # deeper layers see FP8-quantized attention there: other K/V
    assert torch.equal(g.key.state["scale"].reshape(-1), fp8_scales(s.key_amax[0]))
    assert torch.equal(g.value.state["scale"].reshape(-1), fp8_scales(s.value_amax[0]))
    t = collect_amax(model, ids, "max", "tensor")
    assert torch.equal(t.key_amax[:, 0], s.key_amax.amax(dim=1))
    p100, p90 = collect_amax(model, ids, "percentile:100", "head"), collect_amax(model, ids, "percentile:90", "head")
    assert torch.equal(p100.key_amax, s.key_amax) and bool((p90.key_amax < s.key_amax).all())


# ------------------------------------------------------------------------------------------ export (CLI)
@pytest.fixture(scope="module")
def exports(stories_path, shared, tmp_path_factory):
    """A vLLM export (per tensor), one per head, and the kvquant scales file of the same calibration."""
    d = tmp_path_factory.mktemp("export")
    text = str(shared / "data" / "tinystories-valid-sample.txt")
    common = ["--model", str(stories_path), "--config", "fp8-e4m3", "--data", text, *CALIB]
    assert main(["export", *common, "--format", "vllm", "-o", str(d / "vllm")]) == 0
    assert main(["export", *common, "--format", "vllm", "--granularity", "head", "-o", str(d / "vllm-head")]) == 0
    assert main(["export", *common, "--format", "kvquant", "--granularity", "tensor",
                 "-o", str(d / "scales.safetensors")]) == 0
    return d


def test_export_vllm_directory_layout(exports, stories_path):
    out = exports / "vllm"
    cfg = json.loads((out / "config.json").read_text())
    scheme = cfg["quantization_config"]["kv_cache_scheme"]
    assert (scheme["type"], scheme["num_bits"], scheme["strategy"], scheme["dynamic"], scheme["symmetric"]) == (
        "float", 8, "tensor", False, True)
    weights = out / "model-00001-of-00001.safetensors"
    assert weights.is_symlink() and weights.resolve() == (stories_path / "model.safetensors").resolve()
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert index[engine_scale_name(4, "v")] == "kv_scales.safetensors"
    assert index["model.embed_tokens.weight"] == weights.name
    info = json.loads((out / "kvquant_export.json").read_text())
    assert info["statistic"] == "max" and "last 192 tokens" in info["calibration_tokens"]


def test_export_refuses_to_overwrite(exports, stories_path, shared, capsys):
    out = exports / "vllm"
    before = (out / "config.json").read_text()
    args = ["export", "--model", str(stories_path), "--data", str(shared / "data" / "tinystories-valid-sample.txt"),
            "--format", "vllm", "-o", str(out)]
    assert main(args) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert (out / "config.json").read_text() == before
    assert main([*args[:-2], "--config", "int8", "-o", str(exports / "other")]) == 2
    assert "--config: --format vllm exports an FP8 e4m3 cache" in capsys.readouterr().err
    assert not (exports / "other").exists()


def test_export_parsed_by_compressed_tensors(exports):
    """compressed-tensors parses the scheme, maps the scale names, shapes them as it would, computes the same scales."""
    ct = pytest.importorskip("compressed_tensors")  # a dev extra: installed wherever the suite runs
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.initialize import initialize_qparams
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from compressed_tensors.utils.safetensors_load import get_quantization_parameter_to_path_mapping
    from safetensors import safe_open

    assert ct.__version__
    stat = load_scales(exports / "scales.safetensors")  # the calibration statistic, per tensor
    for name, heads in (("vllm", 1), ("vllm-head", 4)):
        out = exports / name
        qc = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
        args = qc.kv_cache_scheme
        assert str(getattr(args.strategy, "value", args.strategy)) == ("tensor" if heads == 1 else "attn_head")
        assert args.dynamic is False
        mapping = get_quantization_parameter_to_path_mapping(str(out))
        assert sorted(mapping) == sorted(engine_scale_name(i, k) for i in range(5) for k in "kv")
        probe = torch.nn.Module()
        initialize_qparams(probe, "k", args, observed_shape=(4, None, 8), observed_dtype=torch.float32,
                           force_zero_point=False)
        for i in range(5):
            with safe_open(mapping[engine_scale_name(i, "k")], framework="pt") as f:
                k = f.get_tensor(engine_scale_name(i, "k"))
            assert k.shape == probe.k_scale.shape and bool(torch.isfinite(k).all() & (k > 0).all())
            if heads == 1:  # equal to the calibration statistic under compressed-tensors' own scale formula
                amax = stat.key_amax[i].reshape(1)
                ct_scale, _ = calculate_qparams(-amax, amax, args)
                assert torch.equal(k, ct_scale.float()), (k, ct_scale)
    per_head = read_engine_scales(exports / "vllm-head")
    assert torch.equal(per_head.key_amax.amax(dim=1).float(), stat.key_amax[:, 0])


def test_engine_config_reproduces_in_process_fp8(exports, stories):
    """vllm:DIR stores the same FP8 bytes as the in-process config with the same scales, and as compressed-tensors."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from safetensors import safe_open
    from transformers.cache_utils import DynamicCache

    model, _ = stories
    out = exports / "vllm"
    in_process = KVQuantConfig.from_dict({"default": "fp8-e4m3", "headroom": 1.0,
                                          "scales_file": str(exports / "scales.safetensors")})
    ids = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(2))
    logits, caches = [], []
    for cfg in (engine_config(out), in_process):
        caches.append(QuantizedKVCache(model, cfg))
        with torch.no_grad():
            logits.append(model(input_ids=ids, **cache_kw(caches[-1])).logits)
    assert torch.equal(logits[0], logits[1])

    def codes(cache, layer, part):
        return getattr(cache.layers[layer].store.groups[0], part).parts["q"][:, :, :40].view(torch.uint8)

    for i in range(5):
        for part in ("key", "value"):
            assert torch.equal(codes(caches[0], i, part), codes(caches[1], i, part))
    # layer 0 sees the unquantized model's K: compressed-tensors' own FP8 quantize op gives the same codes
    dense = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, **cache_kw(dense))
    args = QuantizationConfig.model_validate(
        json.loads((out / "config.json").read_text())["quantization_config"]).kv_cache_scheme
    with safe_open(str(out / "kv_scales.safetensors"), framework="pt") as f:
        scale = f.get_tensor(engine_scale_name(0, "k"))
    ct_codes = quantize(dense.layers[0].keys, scale, torch.zeros_like(scale), args, dtype=torch.float8_e4m3fn)
    assert torch.equal(ct_codes.view(torch.uint8), codes(caches[0], 0, "key"))
    assert ct_codes.float().abs().max() > 64  # the scale fits these values: codes span much of FP8's range


def test_eval_rows_of_engine_and_in_process_configs_are_equal(exports, stories_path, tmp_path):
    from kvquant.eval.recipe import parse_recipe
    from kvquant.eval.runner import run_recipe

    cfg = tmp_path / "fp8-calibrated.yaml"
    cfg.write_text(f"default: fp8-e4m3\nheadroom: 1.0\nscales_file: {exports / 'scales.safetensors'}\n")
    recipe = parse_recipe({"model": str(stories_path), "data": "tinystories", "window": 40, "max_windows": 2,
                           "prefill": 12, "protocol": ["decode", "simulated"], "bos": True, "generation": False,
                           "configs": [f"vllm:{exports / 'vllm'}", str(cfg)], "out": str(tmp_path / "o")})
    rows = run_recipe(recipe, quiet=True, progress=False).rows
    metrics = ("ppl", "delta_ppl", "kl_mean", "top1", "bytes_per_token")
    for protocol in ("decode", "simulated"):
        a, b = (r for r in rows if r["protocol"] == protocol and r["kind"] == "kvquant")
        assert a["status"] == b["status"] == "ok"
        assert {m: a[m] for m in metrics} == {m: b[m] for m in metrics}
        assert a["kl_mean"] > 0  # FP8 moved something: the equality is not between two no-ops


def test_engine_fp8_cast_saturates():
    """Values beyond the scale's range store as +-448 (the engine's saturating cast), never NaN."""
    from kvquant.quantizers import Fp8

    q = Fp8(8, "fp8-e4m3", headroom=1.0)
    state = q.calibrate(torch.tensor([1.0]))
    x = torch.tensor([0.5, -3.0, 1e4, -1e4, 1.0, 0.0, 2.0, -0.25]).view(1, 1, 1, 8)
    codes = q.quantize(x, state)["q"].float()
    assert codes.flatten().tolist()[2:4] == [448.0, -448.0] and bool(torch.isfinite(codes).all())
    assert int(q.clipped(x, state)) == 4  # -3, 1e4, -1e4 and 2 lie outside +-1
