"""``kvquant export``: calibrated static K/V scales, written where kvquant configs or serving engines read them.

``--format kvquant``: the scales file a config's ``scales_file`` names (:mod:`kvquant.scales`).

``--format vllm`` (SGLang reads the same): a checkpoint directory a serving engine loads as is --

* ``config.json``: the model's config plus a compressed-tensors ``quantization_config`` holding only a
  ``kv_cache_scheme`` (FP8 e4m3, static, symmetric; strategy ``tensor``: one scale per layer's K and V, every
  engine backend; or ``attn_head``: one per KV head, vLLM's FlashAttention backend only -- others take the
  max over heads). No ``config_groups``: the weights are not quantized;
* ``kv_scales.safetensors``: ``model.layers.N.self_attn.k_scale`` / ``v_scale`` (float32, ``[1]`` or
  ``[H, 1, 1]``), ``scale = statistic / 448`` (compressed-tensors' convention: stored = fp8(sat(x / scale)));
* ``model.safetensors.index.json``: the weights' names plus the scales (vLLM loads only indexed files; a
  lone ``model.safetensors`` is exported as ``model-00001-of-00001.safetensors``, since transformers and
  compressed-tensors would read it alone and miss the scales);
* the weights, symlinked (``--weights link``, default) or copied (``--weights copy``), unchanged; tokenizer
  and other files copied;
* ``kvquant_export.json``: what was measured (statistic, calibration tokens, model, data, command).

The directory is built beside the target and renamed into place; an existing target is refused without
``--force``, and with it unless it is an export (it holds ``kvquant_export.json``); an output that is, holds or
lies inside an input (the model folder, the files its links point to, the data, the config's scales) is refused
before anything loads. :func:`engine_config` turns such a directory back into a kvquant config that reproduces the
engine's FP8 cache (per-tensor scale, saturating cast), for ``kvquant eval --configs vllm:DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from .config import KVQuantConfig
from .errors import ArgumentError, InputError, OutputError
from .inputs import looks_like_path, user_path
from .outputs import atomic_path, check_disjoint, check_output, check_output_folder, input_paths, staged_folder
from .quantizers import Fp8
from .scales import (
    EXPORT_INFO,
    FP8_E4M3_MAX,
    SCALES_FORMAT,
    KVScales,
    collect_amax,
    engine_scale_name,
    parse_statistic,
    read_engine_scales,
    save_scales,
)
from .shape import ModelShape

ENGINE_PREFIX = "vllm:"
SCALES_NAME = "kv_scales.safetensors"
INDEX_NAME = "model.safetensors.index.json"

EXPORT_EPILOG = """\
examples:
  kvquant export --model smollm2-135m --config fp8-e4m3 --data wikitext-2 --format vllm -o out/
      vllm serve out/ --kv-cache-dtype fp8        (SGLang: --kv-cache-dtype fp8_e4m3)
  kvquant export --model smollm2-135m --config fp8-e4m3 --data wikitext-2 --format vllm --granularity head -o out-h/
  kvquant export --model smollm2-135m --config int8 --data wikitext-2 --format kvquant -o scales.safetensors
      then in a config:  scales_file: scales.safetensors
  kvquant eval recipes/wikitext2-smollm2.yaml --configs fp16,fp8-e4m3,vllm:out/
      predicts the engine's FP8 cache here (its scales, per-tensor, saturating cast)

The statistic is measured on the LAST calib-windows x calib-window tokens of --data (evaluation windows are
cut from the start of a corpus): max (nothing clipped on that text) or percentile:P (P-th percentile of |x|).
"""


def engine_config(directory: str | Path) -> KVQuantConfig:
    """A kvquant config reproducing a serving engine's FP8 KV cache from an export directory.

    Every K and V is ``fp8-e4m3`` with the engine's scales (read from the directory as the engine loads them),
    headroom 1 (stored = fp8(clamp(x / scale, -448, 448)), the engine's saturating cast), no sinks, no residual.
    """
    d = Path(directory)
    scales = read_engine_scales(d)  # checks the scheme and the tensors now, not at the first forward
    return KVQuantConfig.from_dict({
        "name": f"{ENGINE_PREFIX}{directory}",
        "description": f"serving engine FP8 e4m3 cache, {scales.granularity} scales from {d} "
                       f"({scales.statistic}), saturating cast",
        "default": "fp8-e4m3",
        "headroom": 1.0,
        "scales_file": str(d),
    })


# ------------------------------------------------------------------------------------------ writers
def _is_scales_file(p: Path) -> bool:
    """True when ``p`` is a kvquant scales file (its recorded format; the values are not checked here)."""
    try:
        if p.suffix == ".json":
            doc = json.loads(p.read_text(encoding="utf-8"))
            return isinstance(doc, dict) and doc.get("format") == SCALES_FORMAT
        with open(p, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= 1 << 24:
                return False
            header = json.loads(f.read(n))
        return isinstance(header, dict) and (header.get("__metadata__") or {}).get("format") == SCALES_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def check_export_output(out: str | Path, fmt: str, force: bool) -> Path:
    """Check ``-o`` before any work: ``--force`` replaces only what ``kvquant export`` wrote.

    ``--format vllm``: a new folder, an empty one, or (with ``force``) an export folder (it holds
    ``kvquant_export.json``); ``--format kvquant``: a new ``.safetensors`` / ``.json`` file or (with ``force``)
    a kvquant scales file. Anything else raises :class:`OutputError`; its parent folder must exist.
    """
    if fmt == "vllm":
        return check_output_folder(out, EXPORT_INFO, "-o", force=force)
    p = user_path(out, "-o", OutputError)
    if not p.parent.is_dir():
        raise OutputError(f"-o: the folder {p.parent} does not exist (create it first)")
    p = check_output(p, (".safetensors", ".json"), "-o", force=force)
    if p.exists() and not _is_scales_file(p):
        raise OutputError(f"-o: {p} exists and is not a kvquant scales file; it is never replaced: remove it "
                          "yourself or choose another name")
    return p


def export_inputs(model_dir: str | Path | None, data: str | None, config: str | None,
                  cfg: KVQuantConfig | None) -> list[tuple[str, Path]]:
    """What an export reads, for :func:`kvquant.outputs.check_disjoint`: the model folder (and the files its
    links point to), a local data file, a config file and its ``scales_file``."""
    from kvquant.models import model_input_paths

    found = model_input_paths(model_dir) if model_dir is not None else []
    if data is not None and looks_like_path(data):
        found += input_paths("--data", data)
    if config is not None and Path(config).is_file():
        found += input_paths("--config", config)
    if cfg is not None and cfg.scales_file:
        found += input_paths("--config's scales_file", cfg.scales_file)
    return found


def fp8_scales(amax: torch.Tensor, headroom: float = 1.0) -> torch.Tensor:
    """The engine's FP8 e4m3 scale for each amax: kvquant's own FP8 scale computation (``amax * headroom / 448``)."""
    return Fp8(1, "fp8-e4m3", headroom=headroom).calibrate(amax.reshape(-1))["scale"].reshape(amax.shape)


def kv_cache_scheme(granularity: str) -> dict[str, Any]:
    """The compressed-tensors ``kv_cache_scheme`` (QuantizationArgs fields) of a static FP8 e4m3 KV cache."""
    return {
        "num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
        "strategy": "tensor" if granularity == "tensor" else "attn_head",
        "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax", "observer_kwargs": {},
    }


def write_vllm_export(model_dir: str | Path, scales: KVScales, out: str | Path, weights: str = "link",
                      force: bool = False, headroom: float = 1.0, info: dict[str, Any] | None = None) -> Path:
    """Write an engine checkpoint directory at ``out`` (see the module doc); returns its path."""
    from safetensors import safe_open
    from safetensors.torch import save

    src, out = Path(model_dir), Path(out)
    if weights not in ("link", "copy"):
        raise ArgumentError(f"--weights: {weights!r} must be link or copy")
    check_disjoint([("-o", out)], export_inputs(src, None, None, None))
    check_export_output(out, "vllm", force)
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise InputError(f"--model: {src} is already quantized ({config['quantization_config'].get('quant_method')}); "
                         "export from the unquantized checkpoint")
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    if not shards:
        raise InputError(f"--model: {src} has no *.safetensors weights (save it with safe_serialization=True)")
    index_path = src / INDEX_NAME
    renamed: dict[str, str] = {}  # source name -> name in the export
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:
        # transformers and compressed-tensors read a lone model.safetensors and ignore an index beside it: the
        # export is always indexed, so every loader finds the scales file too
        renamed = {name: f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i, name in enumerate(shards)}
        weight_map: dict[str, str] = {}
        for name in shards:
            with safe_open(str(src / name), framework="pt") as f:
                weight_map.update(dict.fromkeys(f.keys(), renamed[name]))
        index = {"metadata": {}, "weight_map": weight_map}
    layers, heads = scales.key_amax.shape
    tensors: dict[str, torch.Tensor] = {}
    shape = (1,) if heads == 1 else (heads, 1, 1)
    for i in range(layers):
        tensors[engine_scale_name(i, "k")] = fp8_scales(scales.key_amax[i], headroom).reshape(shape).contiguous()
        tensors[engine_scale_name(i, "v")] = fp8_scales(scales.value_amax[i], headroom).reshape(shape).contiguous()
    index["weight_map"].update(dict.fromkeys(tensors, SCALES_NAME))
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "dense", "quantization_status": "compressed",
        "config_groups": {}, "ignore": ["lm_head"], "kv_cache_scheme": kv_cache_scheme(scales.granularity),
    }
    record = {"format": "vllm", "statistic": scales.statistic, "granularity": scales.granularity,
              "headroom": headroom, "fp8_max": FP8_E4M3_MAX, "scale": "statistic * headroom / fp8_max",
              "scales_meta": scales.meta, **(info or {})}
    with staged_folder(out, "-o") as tmp:
        for p in sorted(src.iterdir()):
            if p.name in ("config.json", INDEX_NAME) or p.is_dir():
                continue
            name = renamed.get(p.name, p.name)
            if p.suffix == ".safetensors" and weights == "link":
                os.symlink(p.resolve(), tmp / name)
            else:
                shutil.copy2(p, tmp / name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / SCALES_NAME).write_bytes(save(tensors, metadata={"format": "compressed-tensors kv scales",
                                                                "statistic": scales.statistic}))
        (tmp / EXPORT_INFO).write_text(json.dumps(record, indent=2) + "\n")  # last: marks the folder as ours
    return out


# ------------------------------------------------------------------------------------------ command
def _check_vllm_config(cfg: KVQuantConfig, shape: ModelShape) -> None:
    """vLLM's FP8 cache is one precision everywhere, no rotation, sinks or residual: refuse what it cannot serve."""
    precisions = {p for row in cfg.resolve(shape) for pair in row for p in (pair.key, pair.value)}
    if precisions != {"fp8-e4m3"}:
        raise ArgumentError(f"--config: --format vllm exports an FP8 e4m3 cache for every layer; the config stores "
                         f"{', '.join(sorted(precisions))} (use --config fp8-e4m3)")
    for name, default in (("rotate", "none"), ("sink_tokens", 0), ("residual_tokens", 0)):
        if getattr(cfg, name) != default:
            raise ArgumentError(
                f"--config: {name} is {getattr(cfg, name)!r}; a serving engine's FP8 cache has no {name}"
            )


def _command_line(argv: list[str] | None) -> str:
    args = list(sys.argv[1:] if argv is None else argv)
    return "kvquant " + " ".join(shlex.quote(a) for a in args)


def _model_dir(spec: str) -> str:
    """Where a model's files are: the converted cache of a named model (``smollm2-135m``), else ``spec`` itself."""
    from kvquant.models import NAMED_MODELS, resolve_named
    from kvquant.stress import split_spec

    base = split_spec(spec)[0]
    return str(resolve_named(base, progress=False)[0]) if base in NAMED_MODELS else base


def cmd_export(args: argparse.Namespace) -> int:
    from .calibrate import _load_model_and_text, _tokenize
    from .sensitivity import calibration_windows

    parse_statistic(args.statistic)  # cheap checks before the model loads
    if not (1.0 <= args.headroom < float("inf")):
        raise ArgumentError(f"--headroom: {args.headroom} must be a number >= 1.0")
    cfg = KVQuantConfig.load(args.config)
    model_dir = _model_dir(args.model)
    # first: an output that is an input is refused as such, whatever else is wrong with it
    check_disjoint([("-o", args.output)], export_inputs(model_dir, args.data, args.config, cfg))
    out = check_export_output(args.output, args.format, args.force)
    granularity = args.granularity or ("tensor" if args.format == "vllm" else "head")
    from .calibrate import _model_shape

    shape = _model_shape(args.model)  # from the config alone: the checks below run before the weights load
    cfg.check_model(shape)
    if args.format == "vllm":
        _check_vllm_config(cfg, shape)
    model, tok, text, model_label, data_label = _load_model_and_text(args.model, args.data, args.dtype)
    tokens = calibration_windows(_tokenize(text, tok), args.calib_window, args.calib_windows)
    scales = collect_amax(model, tokens.ids, args.statistic, granularity,
                          rotate="none" if args.format == "vllm" else cfg.rotate,
                          sink_tokens=0 if args.format == "vllm" else cfg.sink_tokens)
    info = {"model": model_label, "data": data_label, "calibration_tokens": tokens.describe(),
            "config": cfg.name or str(args.config), "command": _command_line(getattr(args, "argv", None))}
    if args.format == "kvquant":
        scales.meta.update({k: str(v) for k, v in info.items()})
        with atomic_path(out, what="-o") as tmp:
            save_scales(scales, tmp)
        print(f"wrote {out}  ({scales.granularity} amax, {scales.statistic}, {tokens.describe()})")
    else:
        write_vllm_export(model_dir, scales, out, weights=args.weights, force=args.force,
                          headroom=args.headroom, info=info)
        print(f"wrote {out}/  (compressed-tensors kv_cache_scheme FP8 e4m3, {scales.granularity} scales, "
              f"{scales.statistic}; weights {'linked' if args.weights == 'link' else 'copied'})")
        print(f"serve: vllm serve {out} --kv-cache-dtype fp8   |   predict here: kvquant eval RECIPE "
              f"--configs fp16,{ENGINE_PREFIX}{out}")
    return 0


def register(subparsers: Any) -> None:
    """Add the ``export`` subcommand to the ``kvquant`` CLI."""
    p = subparsers.add_parser(
        "export",
        help="write calibrated K/V scales for kvquant configs or a serving engine (vLLM / SGLang)",
        description="Measure static K/V scales on calibration text and write them as a kvquant scales file or as "
        "a compressed-tensors checkpoint directory that vLLM and SGLang load.",
        epilog=EXPORT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="smollm2-135m or a local checkpoint directory (safetensors)")
    p.add_argument("--config", default="fp8-e4m3", help="the kvquant config the scales serve (default: fp8-e4m3)")
    p.add_argument("--data", default="wikitext-2", help="calibration corpus (its LAST tokens are used)")
    p.add_argument("--format", required=True, choices=["vllm", "kvquant"],
                   help="vllm: compressed-tensors checkpoint directory (SGLang reads it too); kvquant: scales file")
    p.add_argument("--statistic", default="max", help="max (default) or percentile:P, e.g. percentile:99.9")
    p.add_argument("--granularity", choices=["tensor", "head"],
                   help="one scale per layer tensor (vllm default: every engine backend) or per KV head "
                   "(kvquant default; vLLM: FlashAttention backend only)")
    p.add_argument("--headroom", type=float, default=1.0,
                   help="vllm: scale = statistic x headroom / 448 (default 1.0, llm-compressor's convention)")
    p.add_argument("--weights", default="link", choices=["link", "copy"],
                   help="vllm: symlink the weights (default) or copy them; unchanged either way")
    p.add_argument("--calib-window", dest="calib_window", type=int, default=512, help="tokens per window (512)")
    p.add_argument("--calib-windows", dest="calib_windows", type=int, default=4, help="windows, from the end (4)")
    p.add_argument("--dtype", default="float32", help="model dtype while measuring (float32)")
    p.add_argument("--force", action="store_true", help="replace an existing output")
    p.add_argument("-o", "--output", required=True, help="vllm: the directory to write; kvquant: the .safetensors "
                   "(or .json) file")
    p.set_defaults(func=cmd_export)
