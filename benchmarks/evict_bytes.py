"""Bytes a quantized cache holds with and without eviction, on a real model and text (memory_report()).

    python benchmarks/evict_bytes.py                                 # SmolLM2-135M, 2K WikiText-2 tokens, 64 steps
    python benchmarks/evict_bytes.py --model smollm2-135m --context 2048 --steps 64 --json out.json
    python benchmarks/evict_bytes.py --configs "int4,int4 + h2o 0.5" --steps 16

Each config prefills the same --context tokens, then decodes --steps more (teacher-forced, the text's next
tokens); the table gives ``bytes_total`` (K, V, scales, full-precision segments and the eviction index: every
kept token's position, and the scores of h2o/tova) after the prefill and at the end, as a ratio to the
first of --configs (``int4`` alone by default) at the same point, and the tokens layer 0 / KV head 0 holds.
Prefill-time policies append decoded tokens; h2o and tova keep each head at its prompt budget. AdaKV layers hold
per-head block lanes: ``lanes`` (all layers) beside the exact sum over (layer, head) of ceil(kept / block_size);
layers that quantize whole blocks (per-channel keys, a residual window) hold (kept - residual_tokens) // block_size
whole lanes per (layer, head) and the rest in the head's full-precision tail (``tail tokens``, ``dense``: the
tails' buffer, padded to each layer's longest tail).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

import kvquant
from kvquant.transformers_compat import cache_kw

# the presets' precisions (keys per channel over blocks, values per token)
INT8_KCHANNEL = kvquant.config.PRESETS["int8-kchannel"][0]
INT4_KCHANNEL = kvquant.config.PRESETS["int4-kchannel"][0]
CONFIGS = {
    "int4": {"default": "int4"},
    "int4 + streaming 0.5": {"default": "int4", "evict": {"policy": "streaming", "keep": 0.5}},
    "int4 + snapkv 0.5": {"default": "int4", "evict": {"policy": "snapkv", "keep": 0.5}},
    "int4 + snapkv 0.5 adakv": {"default": "int4", "evict": {"policy": "snapkv", "keep": 0.5, "budget": "adakv"}},
    "int4 + knorm 0.5": {"default": "int4", "evict": {"policy": "knorm", "keep": 0.5}},
    "int4 + h2o 0.5": {"default": "int4", "evict": {"policy": "h2o", "keep": 0.5}},
    "int4 + tova 0.5": {"default": "int4", "evict": {"policy": "tova", "keep": 0.5}},
    "int8-kchannel": {"default": INT8_KCHANNEL},
    "int8-kchannel + snapkv 0.5": {"default": INT8_KCHANNEL, "evict": {"policy": "snapkv", "keep": 0.5}},
    "int8-kchannel + snapkv 0.5 adakv": {"default": INT8_KCHANNEL,
                                         "evict": {"policy": "snapkv", "keep": 0.5, "budget": "adakv"}},
    "int4-kchannel": {"default": INT4_KCHANNEL},
    "int4-kchannel + snapkv 0.5 adakv": {"default": INT4_KCHANNEL,
                                         "evict": {"policy": "snapkv", "keep": 0.5, "budget": "adakv"}},
    "fp16": {"default": "fp16"},
    "fp16 + snapkv 0.5": {"default": "fp16", "evict": {"policy": "snapkv", "keep": 0.5}},
}


@torch.no_grad()
def held(model, config: dict, ids: torch.Tensor, prefill: int) -> tuple[dict, dict]:
    cache = kvquant.QuantizedKVCache(model, kvquant.KVQuantConfig.from_dict(config))
    model(ids[:, :prefill], **cache_kw(cache), use_cache=True, logits_to_keep=1)
    after_prefill = cache.memory_report()
    for i in range(prefill, ids.shape[1]):
        model(ids[:, i:i + 1], **cache_kw(cache), use_cache=True, logits_to_keep=1)
    st = cache.layers[0].store
    tokens = int(st.slots.counts()[0, 0]) if st.slots is not None else st.cache_pos
    end = cache.memory_report()
    end["tokens_held_layer0_head0"] = tokens
    # per-head lanes (AdaKV): lanes held vs sum over (layer, row, head) of ceil(kept tokens / block_size)
    lane_layers = [la.store for la in cache.layers if la.store is not None and la.store.lanes]
    end["lanes"] = sum(s.memory()["lanes"] for s in lane_layers)
    end["lanes_exact"] = sum(expected_lanes(s, int(n)) for s in lane_layers for n in s.slots.counts().flatten())
    end["tail_tokens"] = sum(n for s in lane_layers if s.tail_lanes for r in s.lanes.tail_lengths() for n in r)
    return after_prefill, end


def expected_lanes(store: kvquant.store.LayerStore, n: int) -> int:
    """Lanes a (row, head) holding ``n`` tokens needs: ceil(n / block), or with per-head tails (per-channel keys,
    a residual window) its whole blocks beyond ``residual_tokens``."""
    if store.tail_lanes:
        return max(0, (n - store.residual_tokens) // store.block_size)
    return -(-n // store.block_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default="wikitext-2")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from: {', '.join(CONFIGS)}")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvquant.models import load_model
    from kvquant.text import load_text, tokenize

    loaded = load_model(args.model, progress=False)
    model, tok = loaded.model, loaded.tokenizer
    ids = tokenize(load_text(args.data).text, tok, args.context + args.steps)[: args.context + args.steps]
    ids = ids.view(1, -1)
    kvquant.wrap(model, "int4")
    print(f"{args.model}, {args.data}: {args.context} prompt tokens + {args.steps} decode steps")
    rows, base = {}, None
    names = [n.strip() for n in args.configs.split(",")]
    for name in names:
        if name not in CONFIGS:
            raise SystemExit(f"--configs: unknown {name!r} (known: {', '.join(CONFIGS)})")
    for name in names:
        pre, end = held(model, CONFIGS[name], ids, args.context)
        base = base or (pre, end)
        rows[name] = {
            "bytes_after_prefill": pre["bytes_total"], "bytes_end": end["bytes_total"],
            "bytes_index_end": end["bytes_index"],
            "ratio_vs_int4_after_prefill": pre["bytes_total"] / base[0]["bytes_total"],
            "ratio_vs_int4_end": end["bytes_total"] / base[1]["bytes_total"],
            "tokens_held_layer0_head0": end["tokens_held_layer0_head0"],
            "lanes_end": end["lanes"], "lanes_exact_end": end["lanes_exact"],
            "tail_tokens_end": end["tail_tokens"], "bytes_dense_end": end["bytes_dense"],
        }  # fmt: skip
        r = rows[name]
        print(f"{name:26s} prefill {r['bytes_after_prefill'] / 2**20:7.2f} MiB "
              f"({r['ratio_vs_int4_after_prefill']:.3f}x {names[0]})  end {r['bytes_end'] / 2**20:7.2f} MiB "
              f"({r['ratio_vs_int4_end']:.3f}x {names[0]}, index {r['bytes_index_end'] / 2**10:.0f} KiB)  "
              f"layer 0 head 0 holds {r['tokens_held_layer0_head0']} tokens"
              + (f"  lanes {r['lanes_end']} (expected: {r['lanes_exact_end']})" if r["lanes_end"] else "")
              + (f"  tail tokens {r['tail_tokens_end']}" if r["tail_tokens_end"] else "")
              + f"  dense {r['bytes_dense_end'] / 2**10:.0f} KiB")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
