"""Evaluation recipes: one YAML file naming the model, the data, the protocol and the configs to compare.

Example (every field but ``model``, ``data`` and ``configs`` has a default)::

    name: wikitext2-smollm2
    model: smollm2-135m          # named model, local dir, .gguf file or hub id, optionally +stress variants;
                                 # a list runs the recipe on each model (results in out/<model>/, summary in out/)
    dtype: float32               # float32 | float16 | bfloat16 | auto
    device: cpu                  # cpu | cuda | cuda:N | auto (device_map="auto")
    data: wikitext-2             # kjv | wikitext-2 | tinystories | hub:NAME[/CONFIG][:SPLIT] | path/to/file.txt
    protocol: decode             # decode | simulated | [decode, simulated]
    window: 1024                 # tokens per window (BOS included when bos: true)
    stride: null                 # tokens between window starts (default: the window, no overlap)
    max_windows: 4               # windows to score (null: all)
    first_window: 0              # windows skipped before those (e.g. 8: score windows 9.. as held-out text)
    prefill: 256                 # tokens before scoring (decode: prefilled; simulated: static scales taken there)
    decode_chunk: 1              # decode: tokens per forward step (1 = exact token-by-token generation)
    bos: false                   # prepend the tokenizer's BOS token to every window (true | false | auto:
                                 # when the tokenizer puts it before text by default, as Gemma's does)
    seed: 0
    threads: null                # torch CPU threads (null: torch's default)
    configs: [fp16, int8, int4, hf-hqq-int4]   # presets, config files, baselines (see kvquant.eval.baselines)
    recommend:                   # optional: config -> what to use it for; the report opens with these lines
      int8: the safe default      # (and the measured numbers of each), the plot stars them
    generation:                  # free-generation drift (false to skip)
      prompts: 4
      prompt_tokens: 64
      new_tokens: 32
    tasks: [ppl]                 # ppl (the protocols above) | passkey | needle: long-context retrieval
    retrieval:                   # passkey / needle cases (haystack cut from ``data``)
      lengths: [1024, 2048, 4096, 8192]   # prompt tokens (at most the model's max_position_embeddings)
      depths: [0.0, 0.25, 0.5, 0.75, 1.0]  # needle position as a fraction of the haystack
      trials: 1                  # cases per (length, depth), each with its own needle and haystack cut
    out: results/wikitext2-smollm2

A bad field gives a :class:`RecipeError` (a ``ValueError``) whose one-line message starts with the field name,
e.g. ``window: must be an integer from 2 to 1099511627776, got 'big' (recipes/x.yaml)``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvquant.errors import RecipeError
from kvquant.inputs import read_text

from .protocols import PROTOCOLS

__all__ = ["FIELDS", "TASKS", "Generation", "Recipe", "RecipeError", "Retrieval", "load_recipe", "parse_recipe"]




@dataclass
class Generation:
    prompts: int = 4
    prompt_tokens: int = 64
    new_tokens: int = 32


TASKS = ("ppl", "passkey", "needle")


@dataclass
class Retrieval:
    """The grid of the long-context retrieval tasks (``passkey``, ``needle``): see :mod:`kvquant.eval.longcontext`."""

    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    trials: int = 1


@dataclass
class Recipe:
    model: str
    data: str
    configs: list[str]
    name: str = "eval"
    description: str = ""
    dtype: str = "float32"
    device: str = "cpu"
    protocol: list[str] = field(default_factory=lambda: ["decode"])
    window: int = 1024
    stride: int | None = None
    max_windows: int | None = 4
    first_window: int = 0
    prefill: int = 256
    decode_chunk: int = 1
    bos: bool | str = False  # True, False or "auto" (see :func:`kvquant.text.window_bos`)
    seed: int = 0
    threads: int | None = None
    generation: Generation | None = field(default_factory=Generation)
    tasks: list[str] = field(default_factory=lambda: ["ppl"])
    retrieval: Retrieval = field(default_factory=Retrieval)
    recommend: dict[str, str] = field(default_factory=dict)
    out: str = ""
    source: str = ""  # the file it was read from (not a YAML field)
    resolved_configs: dict[str, str] = field(default_factory=dict)  # entry -> file path for config files
    models: list[str] = field(default_factory=list)  # every model when ``model:`` lists several

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("resolved_configs")
        return d


FIELDS = [
    "name",
    "description",
    "model",
    "dtype",
    "device",
    "data",
    "protocol",
    "window",
    "stride",
    "max_windows",
    "first_window",
    "prefill",
    "decode_chunk",
    "bos",
    "seed",
    "threads",
    "configs",
    "recommend",
    "generation",
    "tasks",
    "retrieval",
    "out",
]
REQUIRED = ["model", "data", "configs"]
DTYPES = ["auto", "float32", "float16", "bfloat16", "fp32", "fp16", "bf16"]


def expand(value: str) -> str:
    """``${KVQUANT_SHARED}`` (the shared data folder, default ``../shared`` beside the repo), other
    environment variables and ``~`` in path-like fields."""
    from kvquant.paths import shared_dir

    value = value.replace("${KVQUANT_SHARED}", str(shared_dir())).replace("$KVQUANT_SHARED", str(shared_dir()))
    value = os.path.expandvars(value)
    return os.path.expanduser(value) if value.startswith("~") else value


def _where(source: str) -> str:
    return f" ({source})" if source else ""


MAX_INT = 1 << 40  # far above any real window, count or chunk; keeps torch and memory sizes sane


def _int(
    data: Mapping[str, Any], key: str, lo: int, source: str, default: Any, nullable: bool = False, hi: int = MAX_INT
) -> Any:
    v = data.get(key, default)
    if v is None and nullable:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        null = " or null" if nullable else ""
        raise RecipeError(f"{key}: must be an integer from {lo} to {hi}{null}, got {v!r}{_where(source)}")
    return v


def _str(data: Mapping[str, Any], key: str, source: str, default: Any = None) -> Any:
    v = data.get(key, default)
    if not isinstance(v, str) or not v.strip():
        raise RecipeError(f"{key}: must be a non-empty string, got {v!r}{_where(source)}")
    return v


def _resolve_config_file(entry: str, base: Path | None) -> Path | None:
    for root in [Path.cwd()] + ([base] if base else []):
        p = (root / entry).expanduser()
        if p.is_file():
            return p
    return None


def validate_config_entry(entry: Any, i: int, base: Path | None, source: str) -> tuple[str, str | None]:
    """Check one ``configs`` entry; returns (entry, resolved file path or None)."""
    from .baselines import BASELINES, ENGINE_PREFIX, REFERENCE, make_method

    where = f"configs[{i}]"
    if not isinstance(entry, str) or not entry.strip():
        raise RecipeError(f"{where}: must be a preset, a config file or a baseline name, got {entry!r}{_where(source)}")
    if entry == REFERENCE or entry.startswith(("hf-", "bnb-")):
        try:
            make_method(entry)
        except ValueError as e:
            raise RecipeError(f"{where}: {e}{_where(source)}") from None
        return entry, None
    from kvquant import PRESETS, KVQuantConfig

    if entry in PRESETS:
        return entry, None
    if entry.startswith(ENGINE_PREFIX):
        from kvquant.scales import read_engine_scales

        d = entry[len(ENGINE_PREFIX):]
        path = next((r / d for r in [Path.cwd()] + ([base] if base else []) if (r / d).is_dir()), None)
        if path is None:
            raise RecipeError(f"{where}: {d!r} is not a directory (vllm:DIR names a `kvquant export --format vllm` "
                              f"output){_where(source)}")
        try:
            read_engine_scales(path)
        except ValueError as e:
            raise RecipeError(f"{where}: {e}{_where(source)}") from None
        return entry, ENGINE_PREFIX + str(path)
    path = _resolve_config_file(entry, base)
    if path is None:
        raise RecipeError(
            f"{where}: {entry!r} is not a preset, a config file or a baseline (presets: {', '.join(PRESETS)}; "
            f"baselines: {', '.join(BASELINES)}){_where(source)}"
        )
    try:
        KVQuantConfig.load(str(path))
    except ValueError as e:
        msg = " ".join(str(e).split())
        raise RecipeError(f"{where}: {path}: {msg}{_where(source)}") from None
    return entry, str(path)


def parse_recommend(raw: Any, configs: list[str], source: str) -> dict[str, str]:
    """``recommend:``: a mapping of listed configs to a non-empty line saying what each is for."""
    if raw in (None, {}):
        return {}
    if not isinstance(raw, Mapping):
        raise RecipeError(f"recommend: must be a mapping of config -> what to use it for, got {raw!r}{_where(source)}")
    out: dict[str, str] = {}
    for k, v in raw.items():
        if k not in configs:
            raise RecipeError(f"recommend.{k}: not in configs ({', '.join(configs)}){_where(source)}")
        if not isinstance(v, str) or not v.strip():
            raise RecipeError(f"recommend.{k}: must be a non-empty line, got {v!r}{_where(source)}")
        out[k] = " ".join(v.split())
    return out


def parse_recipe(data: Any, source: str = "", base: Path | None = None) -> Recipe:
    """Validate a recipe mapping (already parsed from YAML, overrides applied)."""
    if not isinstance(data, Mapping):
        raise RecipeError(f"recipe: must be a mapping of fields, got {type(data).__name__}{_where(source)}")
    unknown = [k for k in data if k not in FIELDS]
    if unknown:
        raise RecipeError(f"{unknown[0]}: unknown field (known: {', '.join(FIELDS)}){_where(source)}")
    for k in REQUIRED:
        if data.get(k) in (None, "", []):
            raise RecipeError(f"{k}: required{_where(source)}")
    models = data["model"] if isinstance(data["model"], list) else [data["model"]]
    for i, m in enumerate(models):
        if not isinstance(m, str) or not m.strip():
            raise RecipeError(f"model[{i}]: must be a non-empty string, got {m!r}{_where(source)}")
        if "+" in m:
            from kvquant.stress import split_spec

            try:
                split_spec(m)
            except ValueError as e:
                raise RecipeError(f"{e}{_where(source)}") from None
    models = [expand(m) for m in models]
    name = data.get("name") or (Path(source).stem if source else "eval")
    if not isinstance(name, str):
        raise RecipeError(f"name: must be a string, got {name!r}{_where(source)}")
    dtype = data.get("dtype", "float32")
    if dtype not in DTYPES:
        raise RecipeError(f"dtype: must be one of {', '.join(DTYPES)}, got {dtype!r}{_where(source)}")
    device = _str(data, "device", source, "cpu")
    if not (device in ("cpu", "auto", "cuda", "mps") or re.fullmatch(r"cuda:\d+", device)):
        raise RecipeError(f"device: must be cpu, cuda, cuda:N, mps or auto, got {device!r}{_where(source)}")
    protocol = data.get("protocol", "decode")
    protocols = [protocol] if isinstance(protocol, str) else protocol
    if not isinstance(protocols, list) or not protocols or any(p not in PROTOCOLS for p in protocols):
        raise RecipeError(
            f"protocol: must be one of {', '.join(PROTOCOLS)} or a list of them, got {protocol!r}{_where(source)}"
        )
    window = _int(data, "window", 2, source, 1024)
    stride = _int(data, "stride", 1, source, None, nullable=True)
    if stride is not None and stride > window:
        raise RecipeError(
            f"stride: {stride} is larger than the window ({window}): tokens would be skipped{_where(source)}"
        )
    max_windows = _int(data, "max_windows", 1, source, 4, nullable=True)
    first_window = _int(data, "first_window", 0, source, 0)
    prefill = _int(data, "prefill", 1, source, min(256, window // 4) or 1)
    if prefill >= window - 1:
        raise RecipeError(f"prefill: {prefill} must be smaller than window - 1 ({window - 1}){_where(source)}")
    decode_chunk = _int(data, "decode_chunk", 1, source, 1)
    bos = data.get("bos", False)
    if not isinstance(bos, bool) and bos != "auto":
        raise RecipeError(f"bos: must be true, false or auto, got {bos!r}{_where(source)}")
    seed = _int(data, "seed", 0, source, 0, hi=2**32 - 1)
    threads = _int(data, "threads", 1, source, None, nullable=True, hi=1024)
    configs = data["configs"]
    if isinstance(configs, str):
        configs = [c.strip() for c in configs.split(",") if c.strip()]
    if not isinstance(configs, list) or not configs:
        raise RecipeError(f"configs: must be a non-empty list, got {configs!r}{_where(source)}")
    resolved: dict[str, str] = {}
    for i, entry in enumerate(configs):
        e, path = validate_config_entry(entry, i, base, source)
        if path:
            resolved[e] = path
    dupes = sorted({c for c in configs if configs.count(c) > 1})
    if dupes:
        raise RecipeError(f"configs: listed twice: {', '.join(dupes)}{_where(source)}")
    recommend = parse_recommend(data.get("recommend"), configs, source)
    gen_raw = data.get("generation", {})
    generation: Generation | None
    if gen_raw in (None, False):
        generation = None
    elif isinstance(gen_raw, Mapping):
        bad = [k for k in gen_raw if k not in ("prompts", "prompt_tokens", "new_tokens")]
        if bad:
            raise RecipeError(
                f"generation.{bad[0]}: unknown field (known: prompts, prompt_tokens, new_tokens){_where(source)}"
            )
        g = Generation()
        for k, lo in (("prompts", 0), ("prompt_tokens", 1), ("new_tokens", 1)):
            v = gen_raw.get(k, getattr(g, k))
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise RecipeError(f"generation.{k}: must be an integer >= {lo}, got {v!r}{_where(source)}")
            setattr(g, k, v)
        generation = g if g.prompts > 0 else None
    else:
        raise RecipeError(f"generation: must be a mapping or false, got {gen_raw!r}{_where(source)}")
    tasks = parse_tasks(data.get("tasks", ["ppl"]), source)
    retrieval = parse_retrieval(data.get("retrieval"), source)
    out = data.get("out") or os.path.join("results", name)
    if not isinstance(out, str):
        raise RecipeError(f"out: must be a folder path, got {out!r}{_where(source)}")
    out = expand(out)
    description = data.get("description", "") or ""
    if not isinstance(description, str):
        raise RecipeError(f"description: must be a string{_where(source)}")
    return Recipe(
        model=models[0],
        models=models,
        data=expand(_str(data, "data", source)),
        configs=list(configs),
        recommend=recommend,
        name=name,
        description=description.strip(),
        dtype=dtype,
        device=device,
        protocol=protocols if "ppl" in tasks else [],  # the protocols are those of the ppl task
        window=window,
        stride=stride,
        max_windows=max_windows,
        first_window=first_window,
        prefill=prefill,
        decode_chunk=decode_chunk,
        bos=bos,
        seed=seed,
        threads=threads,
        generation=generation,
        tasks=tasks,
        retrieval=retrieval,
        out=out,
        source=source,
        resolved_configs=resolved,
    )


def parse_tasks(value: Any, source: str = "") -> list[str]:
    """``tasks``: a list (or comma-separated string) of ``ppl``, ``passkey``, ``needle``, each at most once."""
    tasks = [t.strip() for t in value.split(",") if t.strip()] if isinstance(value, str) else value
    if not isinstance(tasks, list) or not tasks or any(t not in TASKS for t in tasks):
        raise RecipeError(f"tasks: must be a non-empty list of {', '.join(TASKS)}, got {value!r}{_where(source)}")
    if len(set(tasks)) != len(tasks):
        raise RecipeError(f"tasks: listed twice in {tasks}{_where(source)}")
    return list(tasks)


def parse_retrieval(value: Any, source: str = "") -> Retrieval:
    """``retrieval``: ``lengths`` (integers >= 16), ``depths`` (fractions in [0, 1]), ``trials`` (>= 1)."""
    r = Retrieval()
    if value is None:
        return r
    if not isinstance(value, Mapping):
        raise RecipeError(f"retrieval: must be a mapping (lengths, depths, trials), got {value!r}{_where(source)}")
    bad = [k for k in value if k not in ("lengths", "depths", "trials")]
    if bad:
        raise RecipeError(f"retrieval.{bad[0]}: unknown field (known: lengths, depths, trials){_where(source)}")
    lengths = value.get("lengths", r.lengths)
    if (not isinstance(lengths, list) or not lengths
            or any(isinstance(n, bool) or not isinstance(n, int) or not 16 <= n <= MAX_INT for n in lengths)):
        raise RecipeError(f"retrieval.lengths: must be a list of integers >= 16, got {lengths!r}{_where(source)}")
    depths = value.get("depths", r.depths)
    if (not isinstance(depths, list) or not depths
            or any(isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 1 for d in depths)):
        raise RecipeError(f"retrieval.depths: must be a list of fractions in [0, 1], got {depths!r}{_where(source)}")
    trials = value.get("trials", r.trials)
    if isinstance(trials, bool) or not isinstance(trials, int) or not 1 <= trials <= 10_000:
        raise RecipeError(f"retrieval.trials: must be an integer from 1 to 10000, got {trials!r}{_where(source)}")
    return Retrieval(sorted(set(lengths)), sorted({float(d) for d in depths}), trials)


def read_recipe_file(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"recipe: {path} not found")
    try:
        data = yaml.safe_load(read_text(p, "recipe"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise RecipeError(f"recipe: {path}: {problem}{at}") from None
    return {} if data is None else data


def load_recipe(path: str | os.PathLike, overrides: Mapping[str, Any] | None = None) -> Recipe:
    """Read, override (``None`` values are ignored) and validate a recipe file."""
    data = read_recipe_file(path)
    if isinstance(data, Mapping):
        data = dict(data)
        for k, v in (overrides or {}).items():
            if isinstance(v, Mapping) and isinstance(data.get(k), Mapping):
                data[k] = {**data[k], **v}  # e.g. --lengths overrides retrieval.lengths, keeps the depths
            elif v is not None:
                data[k] = v
    return parse_recipe(data, source=str(path), base=Path(path).resolve().parent)
