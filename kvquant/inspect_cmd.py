"""``kvquant inspect``: run a prompt through a quantized cache and print ``cache.dump()`` as JSON.

A debugging aid (the "cache reused by accident" seed): the session id, every layer's block tables,
the blocks shared between rows, the cursors, static-scale statistics and clipped counts.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from .transformers_compat import cache_kw

INSPECT_EPILOG = """\
examples:
  kvquant inspect --model smollm2-135m --config int8 --text "Once upon a time" --new-tokens 8
  kvquant inspect --model smollm2-135m --config int4 --tokens 300 --beams 4 --block-size 16 --summary
"""


MAX_BEAMS = 64


def context_of(model_config: Any) -> int | None:
    """The longest sequence a model takes (``max_position_embeddings`` of its text config), or None if unknown."""
    text = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    n = getattr(text, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def check_inspect_args(args: argparse.Namespace, model_config: Any) -> None:
    """Every number option, checked before the model loads: ``--tokens`` and ``--new-tokens`` from 1 and together
    within the model's context, ``--beams`` from 1 to 64 (errors name the option)."""
    from kvquant.config import check_int
    from kvquant.errors import ArgumentError

    context = context_of(model_config) or (1 << 20)
    if args.text is not None and not args.text.strip():
        raise ArgumentError("--text: empty; give a prompt, or leave --text out for --tokens random ids")
    check_int(args.tokens, "--tokens", 1, context, ArgumentError)
    check_int(args.new_tokens, "--new-tokens", 1, context, ArgumentError)
    check_int(args.beams, "--beams", 1, MAX_BEAMS, ArgumentError)
    if args.text is None and args.tokens + args.new_tokens > context:
        raise ArgumentError(f"--tokens: {args.tokens} + --new-tokens {args.new_tokens} exceed the model's context of "
                            f"{context} positions")
    if args.text is None and getattr(model_config, "vocab_size", 0) <= 200:
        raise ArgumentError("--tokens: random ids need a vocabulary of more than 200 tokens; give --text instead")


def cmd_inspect(args: argparse.Namespace) -> int:
    import kvquant
    from kvquant.errors import ArgumentError
    from kvquant.models import load_model, read_model_config

    cfg = kvquant.KVQuantConfig.load(args.config)  # bad arguments fail before the model loads
    if args.block_size is not None:
        try:
            cfg = kvquant.KVQuantConfig.load({**cfg.to_dict(), "block_size": args.block_size})
        except kvquant.ConfigError as e:
            raise ArgumentError(f"--block-size: {str(e).split(': ', 1)[-1]}") from None
    model_config = read_model_config(args.model, what="--model")
    check_inspect_args(args, model_config)
    cfg.check_model(kvquant.ModelShape.from_config(model_config))
    loaded = load_model(args.model, progress=False)
    model, tok = loaded.model, loaded.tokenizer
    if args.text is not None:
        ids = tok(args.text, return_tensors="pt").input_ids
        context = context_of(model_config) or (1 << 20)
        if ids.shape[1] + args.new_tokens > context:
            raise ArgumentError(f"--text: {ids.shape[1]} tokens + --new-tokens {args.new_tokens} exceed the model's "
                                f"context of {context} positions")
    else:
        ids = torch.randint(100, model.config.vocab_size - 100, (1, args.tokens),
                            generator=torch.Generator().manual_seed(0))  # fmt: skip
    with kvquant.wrapped(model, cfg), torch.no_grad():
        cache = kvquant.QuantizedKVCache(model, cfg)
        model.generate(ids, **cache_kw(cache), max_new_tokens=args.new_tokens, num_beams=args.beams, do_sample=False)
    dump: dict[str, Any] = cache.dump()
    if args.summary:
        for layer in dump["layers"]:
            layer["block_tables"] = [len(t) for t in layer["block_tables"]]
            layer["shared_blocks"] = len(layer["shared_blocks"])
    dump["memory"] = {k: v for k, v in cache.memory_report().items() if not isinstance(v, (list, dict))}
    print(json.dumps(dump, indent=1))
    return 0


def register(subparsers: Any) -> None:
    """Add the ``inspect`` subcommand to the ``kvquant`` CLI."""
    p = subparsers.add_parser(
        "inspect",
        help="run a prompt through a quantized cache and print its dump (block tables, scales, ids)",
        description="Run a prompt through a QuantizedKVCache and print cache.dump() as JSON.",
        epilog=INSPECT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="smollm2-135m, a checkpoint directory, a .gguf file or a hub id")
    p.add_argument("--config", default="int8", help="preset name or YAML/JSON config (default: int8)")
    p.add_argument("--text", help="prompt text (default: --tokens random token ids)")
    p.add_argument("--tokens", type=int, default=64, help="random prompt length when --text is not given (64)")
    p.add_argument("--new-tokens", dest="new_tokens", type=int, default=4, help="tokens to generate (4)")
    p.add_argument("--beams", type=int, default=1, help="beam search width (1)")
    p.add_argument("--block-size", dest="block_size", type=int, help="tokens per block (default: the config's)")
    p.add_argument("--summary", action="store_true", help="block counts instead of whole block tables")
    p.set_defaults(func=cmd_inspect)
