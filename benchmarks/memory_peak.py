"""Peak process memory while decoding at long context: no full-precision copy of the history.

    python benchmarks/memory_peak.py                       # 8 layers, 16K context, int8 (issue 2 target)
    python benchmarks/memory_peak.py --context 4096 --config int4

Method (Linux): RSS after the model is built = runtime + weights. The cache is filled to --context
tokens by chunked prefill, the kernel's peak-RSS counter is reset (/proc/self/clear_refs), then
--tokens decode steps run and the peak (VmHWM) is read. Expected = baseline + the cache's bytes
(``memory_report``, reserved) + the attention workspace bound. Target: measured within 10%.
DynamicCache is measured the same way in a fresh process for comparison. Both run with glibc's
mmap threshold fixed at 1 MiB (MALLOC_MMAP_THRESHOLD_), so that freed scratch tensors are returned
to the OS instead of being counted as resident heap.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

from kvquant.transformers_compat import cache_kw


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def trim() -> None:
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(args: argparse.Namespace) -> dict:
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    import kvquant
    import kvquant.kernels.attention_torch as at

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.heads * 64, intermediate_size=4 * args.heads * 64,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, head_dim=64, max_position_embeddings=args.context + 1024)
    model = LlamaForCausalLM(cfg).eval()
    kvquant.wrap(model, "int8")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if args.cache == "dynamic":
        cache = DynamicCache(config=model.config)
    else:
        cache = kvquant.QuantizedKVCache(model, args.cache, capacity=args.context + args.tokens)
    ids = torch.randint(0, args.vocab, (1, args.context))
    trim()
    baseline = rss_kib("VmRSS") * 1024
    with torch.no_grad():
        for s in range(0, args.context, args.chunk):
            out = model(ids[:, s:s + args.chunk], **cache_kw(cache), use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        del out
        trim()  # hand the prefill's freed scratch back to the OS before measuring the decode peak
        after_fill = rss_kib("VmRSS") * 1024
        reset_peak()
        for _ in range(args.tokens):
            nxt = model(nxt, **cache_kw(cache), use_cache=True).logits[:, -1:].argmax(-1)
    peak = rss_kib("VmHWM") * 1024
    if args.cache == "dynamic":
        cache_bytes = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)
    else:
        cache_bytes = cache.memory_report()["bytes_reserved"]
    # attention workspace bound: K tile, V tile, scores, probabilities (each <= WORKSPACE_BYTES)
    workspace = 4 * at.WORKSPACE_BYTES if args.cache != "dynamic" else 0
    return {"cache": args.cache, "weights": weights, "baseline_rss": baseline, "after_fill_rss": after_fill,
            "cache_bytes": cache_bytes, "workspace": workspace, "peak_rss_decode": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--config", default="int8")
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cache:
        print(json.dumps(child(args)))
        return
    rows = []
    for cache in (args.config, "dynamic"):
        cmd = [sys.executable, __file__, "--cache", cache] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("cache", "config")]
        # a fixed mmap threshold: glibc otherwise raises it after the first large free, and the decode
        # step's freed tiles then stay in the heap and count as resident (fragmentation, not data)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
        rows.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout))
    mib = 2**20
    print(f"model: {args.layers} layers, {args.heads} heads / {args.kv_heads} KV heads, head_dim 64, fp32 weights; "
          f"context {args.context}, {args.tokens} decode steps")
    print(f"{'cache':10s} {'baseline':>9s} {'cache':>9s} {'workspace':>9s} {'expected':>9s} {'filled':>9s} "
          f"{'peak':>9s} {'peak/exp':>8s}")
    for r in rows:
        expected = r["baseline_rss"] + r["cache_bytes"] + r["workspace"]
        print(f"{r['cache']:10s} {r['baseline_rss'] / mib:8.1f}M {r['cache_bytes'] / mib:8.1f}M "
              f"{r['workspace'] / mib:8.1f}M {expected / mib:8.1f}M {r['after_fill_rss'] / mib:8.1f}M "
              f"{r['peak_rss_decode'] / mib:8.1f}M "
              f"{r['peak_rss_decode'] / expected:8.3f}")
    q, d = rows
    met = q["peak_rss_decode"] <= 1.1 * (q["baseline_rss"] + q["cache_bytes"] + q["workspace"])
    print(f"peak during decode: {q['cache']} {q['peak_rss_decode'] / mib:.1f} MiB vs DynamicCache "
          f"{d['peak_rss_decode'] / mib:.1f} MiB ({q['peak_rss_decode'] / d['peak_rss_decode']:.2f}x); "
          f"target: {q['cache']} peak within 10% of expected -> "
          f"{'MET' if met else 'MISSED'}")


if __name__ == "__main__":
    main()
