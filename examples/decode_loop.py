"""Greedy decoding written by hand over a preallocated quantized KV cache, next to ``generate()`` on the same model.

What a decode loop does under ``generate()``: one forward over the prompt (the prefill) writes every prompt token
into the cache; then each step feeds one token at the position the cache's write cursor (``cache.cache_pos``) names,
the cache quantizes that token's K/V once, and the attention reads the whole history from the quantized blocks.
The cache is preallocated (``capacity``: prompt plus new tokens), so no block is added while decoding.

    python examples/decode_loop.py                                  # stories260K from the shared data folder
    python examples/decode_loop.py --model smollm2-135m --config int4-kchannel-sinks --new-tokens 32

It prints the tokens per second of both loops and whether their tokens agree (exit status 1 if they do not).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch

import kvquant
from kvquant.models import load_model
from kvquant.paths import shared_dir
from kvquant.transformers_compat import cache_kw


def hand_loop(model, config: kvquant.KVQuantConfig, input_ids: torch.Tensor, new_tokens: int, eos: int | None):
    """Greedy tokens after ``input_ids[1, T]`` (at most ``new_tokens``, stopping after ``eos``), one step at a time."""
    cache = kvquant.QuantizedKVCache(model, config, capacity=input_ids.shape[1] + new_tokens)
    out: list[int] = []
    with torch.no_grad():
        positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
        logits = model(input_ids=input_ids, position_ids=positions, **cache_kw(cache), use_cache=True).logits
        for _ in range(new_tokens):
            token = int(logits[0, -1].argmax())
            out.append(token)
            if token == eos or len(out) == new_tokens:
                break
            position = torch.tensor([[cache.cache_pos]])  # the cursor: tokens written so far
            step = torch.tensor([[token]])
            logits = model(input_ids=step, position_ids=position, **cache_kw(cache), use_cache=True).logits
    return out, cache


def generate_loop(model, config: kvquant.KVQuantConfig, input_ids: torch.Tensor, new_tokens: int) -> list[int]:
    """The same greedy decode through ``generate()`` and a quantized cache of the same config."""
    cache = kvquant.QuantizedKVCache(model, config)
    with torch.no_grad():
        out = model.generate(input_ids, **cache_kw(cache), max_new_tokens=new_tokens, do_sample=False)
    return out[0, input_ids.shape[1]:].tolist()


def timed(fn, *args):
    t0 = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - t0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a named model, a local folder or a .gguf file (default: stories260K "
                    "from $KVQUANT_SHARED/models/stories260K/hf)")  # fmt: skip
    ap.add_argument("--config", default=kvquant.DEFAULT_PRESET, help="a preset or a config file")
    ap.add_argument("--prompt", default="Once upon a time, there was a little girl named Lily.")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args(argv)

    spec = args.model or str(shared_dir() / "models" / "stories260K" / "hf")
    loaded = load_model(spec, dtype="float32", progress=False)
    config = kvquant.KVQuantConfig.load(args.config)
    model, tok = kvquant.wrap(loaded.model, config), loaded.tokenizer
    input_ids = tok(args.prompt, return_tensors="pt").input_ids
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos

    hand_loop(model, config, input_ids, 2, eos)  # warm-up: first-call costs stay out of both timings
    (by_hand, cache), t_hand = timed(hand_loop, model, config, input_ids, args.new_tokens, eos)
    by_generate, t_generate = timed(generate_loop, model, config, input_ids, args.new_tokens)

    print(f"model {spec}, config {config.name}, prompt {input_ids.shape[1]} tokens")
    print(f"hand-written loop: {len(by_hand)} tokens, {len(by_hand) / t_hand:.1f} tokens/s; {cache}")
    print(f"generate():        {len(by_generate)} tokens, {len(by_generate) / t_generate:.1f} tokens/s")
    agree = by_hand == by_generate
    print(f"tokens agree: {agree}")
    print(repr(tok.decode(by_hand)))
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
