"""The ``kvquant`` command line: ``estimate``, ``eval``, ``calibrate``, ``show-config``, ``presets``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib import import_module

from . import __version__
from .config import PRESETS, ConfigError, KVQuantConfig
from .memory import estimate, human, parse_bytes, plot_lengths_cdf, read_lengths
from .quantizers import PRECISIONS
from .shape import ModelShape

DESCRIPTION = """\
kvquant: quantize the KV cache of transformers LLMs and measure what it costs.

Commands:
  estimate     size a KV cache: FP16 vs a config, what fits a memory budget, P95/P99 lengths
  eval         run an evaluation recipe (perplexity and drift vs FP16, with baselines)
  calibrate    measure per-head sensitivity and write a mixed-precision config for a bit budget
  show-config  print a config's per-layer precisions and average bits
  presets      list the named presets and precisions
  inspect      run a prompt through a quantized cache and print its dump (block tables, scales, ids)

Run `kvquant COMMAND --help` for the options and examples of each command.
"""

ESTIMATE_EPILOG = """\
examples:
  kvquant estimate --model HuggingFaceTB/SmolLM2-135M --config int8 --context 8192 --batch 16
  kvquant estimate --layers 32 --kv-heads 8 --head-dim 128 --config int4 --context 32768 --budget 24GiB
  kvquant estimate --model ./my-model --config my.yaml --context 4096 --lengths lengths.txt --plot cdf.png

The formula: batch x tokens x 2 x layers x kv_heads x head_dim x bytes per element, where a
config's bytes per element is its average bits / 8 with scale and zero-point overhead included.
With --lengths (one request length per line), the P95/P99 lengths are the context to size the
cache by: most requests are far shorter than the model's maximum context.
"""


def _shape_from_args(args: argparse.Namespace) -> ModelShape:
    if args.model:
        from transformers import AutoConfig

        source = args.model
        try:
            from kvquant.eval.models import NAMED_MODELS, resolve_named

            if source in NAMED_MODELS:  # e.g. smollm2-135m, converted once from its wheel
                source = str(resolve_named(source)[0])
        except ImportError:
            pass
        try:
            config = AutoConfig.from_pretrained(source)
        except Exception as e:  # noqa: BLE001 - any loading failure is reported the same way
            raise SystemExit(f"kvquant estimate: --model {args.model!r}: cannot read its config ({e})") from None
        return ModelShape.from_config(config)
    missing = [n for n in ("layers", "kv_heads", "head_dim") if getattr(args, n) is None]
    if missing:
        raise SystemExit(
            "kvquant estimate: give --model, or all of --layers, --kv-heads and --head-dim "
            f"(missing: {', '.join('--' + m.replace('_', '-') for m in missing)})"
        )
    return ModelShape(args.layers, args.kv_heads, args.head_dim)


def cmd_estimate(args: argparse.Namespace) -> int:
    shape = _shape_from_args(args)
    cfg = KVQuantConfig.load(args.config)
    budget = parse_bytes(args.budget) if args.budget else None
    lengths = read_lengths(args.lengths) if args.lengths else None
    res = estimate(shape, cfg, args.context, args.batch, budget, lengths)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        s = res["shape"]
        print(f"model: {s['layers']} layers x {s['kv_heads']} KV heads x head_dim {s['head_dim']}")
        print(f"config: {cfg.name or args.config}  avg bits {res['avg_bits']:.3f} (overhead included)")
        print(f"KV cache at context {args.context}, batch {args.batch}:")
        print(f"  fp16    {human(res['fp16_bytes']):>12}")
        print(f"  config  {human(res['config_bytes']):>12}  ({res['ratio_vs_fp16']:.3f}x FP16)")
        if budget is not None:
            print(f"within a budget of {human(budget)}:")
            print(f"  longest context at batch {args.batch}: fp16 {res['fp16_max_context']}, "
                  f"config {res['config_max_context']}")
            print(f"  largest batch at context {args.context}: fp16 {res['fp16_max_batch']}, "
                  f"config {res['config_max_batch']}")
        if lengths:
            L = res["lengths"]
            print(f"request lengths ({L['n']}): p50 {L['p50']:.0f}  p95 {L['p95']:.0f}  p99 {L['p99']:.0f}  "
                  f"max {L['max']:.0f}")
            for q in ("p95", "p99"):
                print(f"  size by {q}: fp16 {human(res[q + '_fp16_bytes'])}, config {human(res[q + '_config_bytes'])}")
    if lengths and args.plot:
        plot_lengths_cdf(lengths, args.plot, {"p95": res["lengths"]["p95"], "p99": res["lengths"]["p99"]})
        print(f"CDF plot written to {args.plot}", file=sys.stderr)
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    print("presets:")
    for name, (_, desc, _) in PRESETS.items():
        print(f"  {name:16s} {desc}")
    print("precisions (per layer / per KV head, K and V separately):")
    for name, desc in PRECISIONS.items():
        print(f"  {name:16s} {desc}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvquant", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"kvquant {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "estimate",
        help="size a KV cache for a model and config",
        description="Size a KV cache: FP16 vs a kvquant config, budgets and request-length percentiles.",
        epilog=ESTIMATE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", help="hub id, local directory (its config.json gives the shape) or smollm2-135m")
    p.add_argument("--layers", type=int, help="number of layers (instead of --model)")
    p.add_argument("--kv-heads", dest="kv_heads", type=int, help="KV heads per layer (instead of --model)")
    p.add_argument("--head-dim", dest="head_dim", type=int, help="head dimension (instead of --model)")
    p.add_argument("--config", default="int8", help="preset name or YAML/JSON config (default: int8)")
    p.add_argument("--context", type=int, default=4096, help="tokens per sequence (default: 4096)")
    p.add_argument("--batch", type=int, default=1, help="sequences held at once (default: 1)")
    p.add_argument("--budget", help="memory for the KV cache, e.g. 24GiB: prints the longest context / largest batch")
    p.add_argument("--lengths", help="file of observed request lengths, one per line: prints P95/P99")
    p.add_argument("--plot", help="with --lengths: save the CDF of lengths to this PNG")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("presets", help="list presets and precisions", description="List presets and precisions.")
    p.set_defaults(func=cmd_presets)

    for module in ("kvquant.eval.cli", "kvquant.calibrate", "kvquant.inspect_cmd"):
        try:
            mod = import_module(module)
        except ImportError as e:  # a broken optional piece must not take the whole CLI down
            if getattr(e, "name", "") not in (module, module.rsplit(".", 1)[0]):
                raise
            continue
        register = getattr(mod, "register", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"kvquant {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
