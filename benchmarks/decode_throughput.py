"""Greedy decode tok/s: kvquant's quantized cache vs transformers' DynamicCache, in the same run.

    python benchmarks/decode_throughput.py                 # 12 layers, head_dim 64, 2K context (issue target)
    python benchmarks/decode_throughput.py --context 4096 --configs int8,int4 --tokens 64

A random Llama-shaped model (weights do not change the cost), prefilled to --context tokens, then
--tokens greedy steps, timed after one warm-up step. Prints tok/s and the ratio to DynamicCache.
Target (issue 2): int8 >= 0.8x DynamicCache at 2K on CPU.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvquant


def build(layers: int, head_dim: int, heads: int, kv_heads: int, vocab: int) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=4 * heads * head_dim,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=1 << 17)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def decode_tps(model, cache, context: int, tokens: int, batch: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (batch, context))
    with torch.no_grad():
        out = model(ids, cache=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        out = model(nxt, cache=cache, use_cache=True)  # warm-up step
        nxt = out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(tokens):
            out = model(nxt, cache=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        dt = time.perf_counter() - t0
    return batch * tokens / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="best of N runs for each cache")
    ap.add_argument("--configs", default="int8,int8-token,int4")
    args = ap.parse_args()
    model = build(args.layers, args.head_dim, args.heads, args.kv_heads, args.vocab)
    kvquant.wrap(model, "int8")  # DynamicCache still runs plain SDPA on a wrapped model
    print(f"model: {args.layers} layers, {args.heads} heads / {args.kv_heads} KV heads, head_dim {args.head_dim}; "
          f"context {args.context}, batch {args.batch}, {args.tokens} timed steps, torch threads "
          f"{torch.get_num_threads()}")

    makers = {"DynamicCache": lambda: DynamicCache(config=model.config)}
    for name in args.configs.split(","):
        makers[name] = lambda n=name: kvquant.QuantizedKVCache(model, n)
    best = dict.fromkeys(makers, 0.0)
    for _ in range(args.repeats):  # interleaved, best of N: fair on a machine whose load changes
        for name, make in makers.items():
            best[name] = max(best[name], decode_tps(model, make(), args.context, args.tokens, args.batch))
    base = best["DynamicCache"]
    for name, tps in best.items():
        print(f"{name:16s} {tps:8.2f} tok/s  {tps / base:.2f}x DynamicCache")


if __name__ == "__main__":
    main()
