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


def cmd_inspect(args: argparse.Namespace) -> int:
    import kvquant
    from kvquant.eval.models import load_model  # the CLI front end loads models; the library does not

    cfg = kvquant.KVQuantConfig.load(args.config)  # bad arguments fail before the model loads
    if args.block_size:
        cfg = kvquant.KVQuantConfig.load({**cfg.to_dict(), "block_size": args.block_size})
    loaded = load_model(args.model, progress=False)
    model, tok = loaded.model, loaded.tokenizer
    if args.text is not None:
        ids = tok(args.text, return_tensors="pt").input_ids
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
