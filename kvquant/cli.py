"""The ``kvquant`` command line: ``estimate``, ``eval``, ``calibrate``, ``show-config``, ``presets``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from importlib import import_module
from pathlib import Path
from typing import NoReturn

from . import __version__
from .config import DEFAULT_PRESET, PRESETS, KVQuantConfig, check_int
from .errors import ArgumentError, KVQuantError
from .memory import estimate, human, parse_bytes, plot_lengths_cdf, read_lengths
from .outputs import check_disjoint, check_output, input_paths, terminate_as_exit
from .quantizers import PRECISION_FAMILIES, PRECISIONS, make_quantizer
from .shape import ModelShape

DESCRIPTION = """\
kvquant: quantize the KV cache of transformers LLMs and measure what it costs.

Commands:
  estimate     size a KV cache: FP16 vs a config, what fits a memory budget, P95/P99 lengths
  eval         run an evaluation recipe (perplexity and drift vs FP16, with baselines)
  calibrate    measure per-head sensitivity and write a mixed-precision config for a bit budget
  export       write calibrated K/V scales: a kvquant scales file, or a checkpoint vLLM / SGLang load
  show-config  print a config's per-layer precisions and average bits
  presets      list the named presets and precisions
  inspect      run a prompt through a quantized cache and print its dump (block tables, scales, ids)

Run `kvquant COMMAND --help` for the options and examples of each command.

Errors: a bad config, recipe, option, file or device is one line naming it, exit status 2 (--debug
shows the traceback); a traceback without --debug is a bug in kvquant (exit status 1). Commands that
write files never overwrite an existing one unless --force is given, and write atomically.
"""

MAX_DIM = 1 << 20  # --layers / --kv-heads / --head-dim / --batch
MAX_TOKENS = 1 << 40  # --context

ESTIMATE_DESCRIPTION = """\
Size a KV cache: FP16 vs a kvquant config, budgets and request-length percentiles; and, with the
serving options, the three figures a capacity plan needs (ceilings from stated formulas, not
measurements; kvquant/serving.py).

A config's bytes are what its cache holds, laid out as the store lays it out: quantized rows in
whole blocks of block_size, the fp16 sink and residual tokens, the age ladder's and heavy rows'
refinement bits (the context taken as one prompt) and each head's scale state
(kvquant.memory.sequence_bytes; equal to a cache's memory_report).
"avg bits x tokens" is printed beside it: it leaves those fixed per-sequence bytes out, which
matters at short contexts. Eviction (evict:) is not modelled: every token is counted.

  prefix reuse   --prompt-tokens P --shared-prefix S: a request whose first S of P prompt tokens are
                 already cached (a PagedKVPool prefix hit) skips their prefill. Hit rate = S / P; the
                 prefill FLOPs saved are those of the S tokens: 2 x params per token (the matrix
                 products) + 4 x layers x q_heads x head_dim x position (causal attention), so they
                 are a bit less than S / P of the prefill (later tokens attend further)
  decode bound   --bandwidth 3.35TB/s: a decode step reads every weight once and every sequence's
                 whole KV cache once, so it takes at least (weight bytes + batch x context x KV
                 bytes per token) / bandwidth; tokens/s <= batch / that. Smaller KV bytes raise the
                 ceiling until the weights dominate the bytes read
  batch at P99   --memory 80GiB with --p99 N (or --lengths FILE): the batch that fits when every
                 sequence is at the P99 request length: (memory - weight bytes) // (P99 x KV bytes
                 per token)

The parameter count comes from --model's config (dense decoders; --params overrides, e.g. for
mixture-of-experts models), weights at --weight-bytes bytes each (2: bf16/fp16).
"""

ESTIMATE_EPILOG = """\
examples:
  kvquant estimate --model HuggingFaceTB/SmolLM2-135M --config int8 --context 8192 --batch 16
  kvquant estimate --layers 32 --kv-heads 8 --head-dim 128 --config int4 --context 32768 --budget 24GiB
  kvquant estimate --model ./my-model --config my.yaml --context 4096 --lengths lengths.txt --plot cdf.png
  kvquant estimate --model smollm2-135m --config int4-kchannel --context 8192 --batch 64 \\
      --bandwidth 3.35TB/s --memory 80GiB --lengths lengths.txt --prompt-tokens 2048 --shared-prefix 1536
      serving: decode tokens/s ceiling, batch at P99, and what a 75% prefix hit saves in prefill FLOPs

The formula: batch x tokens x 2 x layers x kv_heads x head_dim x bytes per element, where a
config's bytes per element is its average bits / 8 with scale and zero-point overhead included.
With --lengths (one request length per line), the P95/P99 lengths are the context to size the
cache by: most requests are far shorter than the model's maximum context.
"""


def _shape_from_args(args: argparse.Namespace) -> ModelShape:
    dims = {n: getattr(args, n) for n in ("layers", "kv_heads", "head_dim")}
    for n, v in dims.items():
        if v is not None:
            check_int(v, "--" + n.replace("_", "-"), 1, MAX_DIM, ArgumentError)
    if args.model:
        given = [n for n, v in dims.items() if v is not None]
        if given:
            raise ArgumentError(f"--{given[0].replace('_', '-')}: give --model or the shape options, not both")
        from kvquant.models import read_model_config

        return ModelShape.from_config(read_model_config(args.model, what="--model"))
    missing = [n for n, v in dims.items() if v is None]
    if missing:
        raise ArgumentError(
            "--model: give --model, or all of --layers, --kv-heads and --head-dim "
            f"(missing: {', '.join('--' + m.replace('_', '-') for m in missing)})"
        )
    return ModelShape(args.layers, args.kv_heads, args.head_dim)


def cmd_estimate(args: argparse.Namespace) -> int:
    check_int(args.context, "--context", 1, MAX_TOKENS, ArgumentError)
    check_int(args.batch, "--batch", 1, MAX_DIM, ArgumentError)
    if args.plot and not args.lengths:
        raise ArgumentError("--plot: needs --lengths (it plots the distribution of the request lengths)")
    shape = _shape_from_args(args)
    cfg = KVQuantConfig.load(args.config)
    if args.plot:
        from kvquant.models import model_input_paths

        plot = check_output(args.plot, (".png",), "--plot", force=args.force)
        inputs = input_paths("--lengths", args.lengths) + input_paths("--config", cfg.scales_file)
        if Path(args.config).is_file():
            inputs += input_paths("--config", args.config)
        check_disjoint([("--plot", plot)], inputs + (model_input_paths(args.model) if args.model else []))
    cfg.check_model(shape)  # the same checks as a cache would run, the scales file read too
    budget = parse_bytes(args.budget) if args.budget else None
    lengths = read_lengths(args.lengths) if args.lengths else None
    res = estimate(shape, cfg, args.context, args.batch, budget, lengths)
    serving = _serving(args, shape, cfg, res)
    if serving is not None:
        res["serving"] = serving
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        s = res["shape"]
        print(f"model: {s['layers']} layers x {s['kv_heads']} KV heads x head_dim {s['head_dim']}")
        print(f"config: {cfg.name or args.config}  avg bits {res['avg_bits']:.3f} (overhead included)")
        print(f"KV cache at context {args.context}, batch {args.batch}:")
        print(f"  fp16    {human(res['fp16_bytes']):>12}")
        print(f"  config  {human(res['config_bytes']):>12}  ({res['ratio_vs_fp16']:.3f}x FP16; as a cache holds it)")
        parts = res["config_parts"]
        print(f"          pool {human(parts['pool'])}, fp16 sinks/residual {human(parts['dense'])}, "
              f"ladder {human(parts['ladder'])}, heavy rows {human(parts['heavy'])}, "
              f"scale state {human(parts['state'])}; "
              f"avg bits x tokens alone: {human(res['formula_bytes'])}")
        if cfg.evict is not None:
            print("          (evict: not modelled; these figures keep every token)")
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
        if serving is not None:
            from .serving import serving_lines

            print("\n".join(serving_lines(serving, args.context, args.batch)))
    if lengths and args.plot:
        plot_lengths_cdf(lengths, args.plot, {"p95": res["lengths"]["p95"], "p99": res["lengths"]["p99"]},
                         force=args.force)
        print(f"CDF plot written to {args.plot}", file=sys.stderr)
    return 0


SERVING_OPTIONS = ("bandwidth", "memory", "p99", "prompt_tokens", "shared_prefix", "params")


def _serving(args: argparse.Namespace, shape: ModelShape, cfg: KVQuantConfig, res: dict) -> dict | None:
    """The serving figures (:func:`kvquant.serving.serving_estimate`) when a serving option is given, else None."""
    if all(getattr(args, n, None) is None for n in SERVING_OPTIONS):
        return None
    from .serving import ModelCost, params_from_config, serving_estimate

    bandwidth = parse_bytes(args.bandwidth, "--bandwidth") if args.bandwidth else None
    memory = parse_bytes(args.memory, "--memory") if args.memory else None
    p99 = args.p99
    if p99 is not None:
        check_int(p99, "--p99", 1, MAX_TOKENS, ArgumentError)
    elif "lengths" in res:
        p99 = int(res["lengths"]["p99"])
    if memory and not p99:
        raise ArgumentError("--memory: the batch at P99 needs --p99 N or --lengths FILE")
    if args.shared_prefix is not None and args.prompt_tokens is None:
        raise ArgumentError("--shared-prefix: needs --prompt-tokens (the prompt it is a prefix of)")
    for name in ("prompt_tokens", "shared_prefix"):
        if getattr(args, name) is not None:
            check_int(getattr(args, name), "--" + name.replace("_", "-"), 0 if name == "shared_prefix" else 1,
                      MAX_TOKENS, ArgumentError)  # fmt: skip
    if args.shared_prefix is not None and args.shared_prefix > args.prompt_tokens:
        raise ArgumentError(f"--shared-prefix: {args.shared_prefix} is longer than --prompt-tokens "
                            f"({args.prompt_tokens})")  # fmt: skip
    wb = args.weight_bytes
    if not (isinstance(wb, float) and 0 < wb <= 64):
        raise ArgumentError(f"--weight-bytes: {wb!r} must be a number of bytes per weight in (0, 64]")
    q_heads = None
    if args.params is not None:
        params = args.params
        if not (0 < params < 1e16):
            raise ArgumentError(f"--params: {params!r} must be a parameter count, e.g. 1.35e8")
    elif args.model:
        from kvquant.models import read_model_config

        mc = read_model_config(args.model, what="--model")
        params = params_from_config(mc)
        text = mc.get_text_config(decoder=True) if hasattr(mc, "get_text_config") else mc
        q_heads = getattr(text, "num_attention_heads", None)
    else:
        raise ArgumentError("--params: the serving figures need the parameter count: give --model or --params")
    cost = ModelCost(params=float(params), weight_bytes_per_param=wb, q_heads=q_heads)
    return serving_estimate(shape, cfg, cost, args.context, args.batch, bandwidth=bandwidth, memory=memory,
                            p99=p99, prompt_tokens=args.prompt_tokens, shared_prefix=args.shared_prefix)


def cmd_presets(args: argparse.Namespace) -> int:
    from .measured import RECOMMENDED, STRESS_RUN, stress_result
    from .outliers import key_is_per_channel

    d = check_int(args.head_dim, "--head-dim", 8, 1024, ArgumentError)
    if d & (d - 1):
        raise ArgumentError(f"--head-dim: {d} must be a power of two (as real models' head_dim is)")
    print(f"presets (stored bits per element at head_dim {d}, scale/zero overhead included; "
          f"default: {DEFAULT_PRESET}; recommended: {', '.join(f'{v} ({k})' for k, v in RECOMMENDED.items())})")
    print(f"  measured on {STRESS_RUN}")
    for name, (_, desc, _) in PRESETS.items():
        cfg = KVQuantConfig.preset(name)
        gs, p = cfg.effective_group_size(d), cfg.default
        parts = []
        for kind, prec in (("K", p.key), ("V", p.value)):
            q = make_quantizer(prec, d, gs, cfg.headroom, cfg.block_size)
            parts.append(f"{kind} {prec} {q.bits_per_element():.2f} b ({q.granularity})")
        extra = [f"{n} {getattr(cfg, n)}" for n in ("sink_tokens", "residual_tokens") if getattr(cfg, n)]
        print(f"  {name:16s} {desc}")
        print(f"  {'':16s}   {'; '.join(parts + extra)}")
        if not key_is_per_channel(p.key):
            print(f"  {'':16s}   keys per token or per head: they lose accuracy on outlier / offset key channels")
        measured = stress_result(name)
        if measured is not None:
            print(f"  {'':16s}   {measured.line()}")
    print("precisions (per layer / per KV head, K and V separately):")
    for name, desc in PRECISIONS.items():
        print(f"  {name:16s} {desc}")
    for prefix, desc in PRECISION_FAMILIES.items():
        print(f"  {prefix + '...':16s} {desc}")
    return 0


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are :class:`ArgumentError` (one line, exit status 2 in ``main``)."""

    def error(self, message: str) -> NoReturn:
        raise ArgumentError(f"{message} (see {self.prog} --help)", prog=self.prog)


DEBUG_HELP = "show the traceback of an error (user errors are otherwise one line)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvquant", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"kvquant {__version__}")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "estimate",
        help="size a KV cache for a model and config",
        description=ESTIMATE_DESCRIPTION,
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
    p.add_argument("--force", action="store_true", help="overwrite an existing --plot file")
    g = p.add_argument_group("serving (see above; each figure is printed when its inputs are given)")
    g.add_argument("--bandwidth", help="memory bandwidth, e.g. 3.35TB/s (H100 SXM HBM3): decode tokens/s ceiling")
    g.add_argument("--memory", help="accelerator memory for weights + KV, e.g. 80GiB: the batch that fits at P99")
    g.add_argument("--p99", type=int, help="P99 request length in tokens (default: from --lengths)")
    g.add_argument("--prompt-tokens", dest="prompt_tokens", type=int, help="prompt length of a request")
    g.add_argument("--shared-prefix", dest="shared_prefix", type=int,
                   help="its tokens already in the prefix cache: hit rate and prefill FLOPs saved")
    g.add_argument("--params", type=float, help="parameter count (default: from --model's config)")
    g.add_argument("--weight-bytes", dest="weight_bytes", type=float, default=2.0,
                   help="bytes per weight (default 2: bf16/fp16; 1 for 8-bit weights)")
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser(
        "presets",
        help="list presets and precisions",
        description="List presets (granularity and stored bits of K and V, outlier behaviour) and precisions.",
    )
    p.add_argument("--head-dim", dest="head_dim", type=int, default=64, help="head_dim for the bit counts (default 64)")
    p.set_defaults(func=cmd_presets)

    for module in ("kvquant.eval.cli", "kvquant.calibrate", "kvquant.inspect_cmd", "kvquant.export"):
        try:
            mod = import_module(module)
        except ImportError as e:  # a broken optional piece must not take the whole CLI down
            if getattr(e, "name", "") not in (module, module.rsplit(".", 1)[0]):
                raise
            continue
        register = getattr(mod, "register", None)
        if register is not None:
            register(sub)
    for p in sub.choices.values():  # every command, registered here or by a module: the same --debug
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvquant ARGV``; returns the exit status (0 ok, 1 a bug or a failed run, 2 a user error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # known before parsing, so that a parse error honours it too
    parser = build_parser()
    prog = "kvquant"
    previous = terminate_as_exit()  # SIGTERM runs the cleanups (no temporary left behind), like Ctrl-C
    try:
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 0
        prog = f"kvquant {args.command}"
        args.argv = argv  # the command line as given, for reports that record the command that made them
        return int(args.func(args) or 0)
    except KVQuantError as e:
        if debug:
            raise
        print(f"{getattr(e, 'prog', None) or prog}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (``kvquant presets | head``): stop quietly, as cat does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not raise again
        return 141
    except OSError as e:
        if debug or not e.filename:  # a file the user named could not be read or written
            raise
        print(f"{prog}: error: {e.filename}: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - not a user error: a bug, shown with its traceback
        if debug:
            raise
        traceback.print_exc()
        print(f"{prog}: internal error (a bug in kvquant, please report it with the traceback above): "
              f"{type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
