"""Decode attention latency: kvquant's Triton kernels on the quantized store vs torch SDPA on FP16 K/V.

    python benchmarks/attention_decode.py                       # GPU: contexts 1K-128K, batch 1-16
    python benchmarks/attention_decode.py --contexts 32768 --batches 8 --precisions fp16,int8,int4
    python benchmarks/attention_decode.py --out docs/results    # also write a markdown + JSON table

One layer's decode step (one new query token per sequence, ``--q-heads`` query heads over
``--kv-heads`` KV heads, head_dim ``--head-dim``), the history of ``context`` tokens in the store.
Both sides are measured in the same run, with the same shapes:

* ``sdpa``: ``F.scaled_dot_product_attention`` on FP16 K/V ``[B, Hkv, context + 1, D]``, GQA folded
  into the query length (``q: [B, Hkv, rep, D]``, no mask: every key is visible in decode), which
  lets it use its fused (flash / memory-efficient) kernels;
* ``<precision>``: :func:`kvquant.kernels.triton_attention.attend_triton` (split-K decode + reduction).

Latency is the median of ``triton.testing.do_bench`` (L2 flushed between runs). Achieved bandwidth
counts the K/V bytes each implementation must read (codes + scales for kvquant, fp16 K/V for SDPA)
and is compared with the GPU's peak HBM bandwidth (table below; unknown GPUs: ``--peak-gbs``).
Targets (issue 3, H100/H200): int8 >= 1.6x and int4 >= 2.5x faster than FP16 SDPA at 32K context,
batch 8, and >= 70% of peak bandwidth.

On CPU there is no Triton to time: the script runs the torch block-walking path (``attend_torch``)
on small defaults against SDPA in fp32, and says that the Triton figures need a GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvquant.config import KVPrecision, KVQuantConfig
from kvquant.kernels.attention_torch import attend_torch
from kvquant.outputs import write_text  # atomic: a re-run replaces results whole, never half
from kvquant.store import LayerStore

# peak HBM bandwidth, GB/s (vendor datasheets)
PEAK_GBS = {
    "H200": 4800,
    "H100 SXM": 3350,
    "H100 80GB HBM3": 3350,
    "H100 NVL": 3900,
    "H100 PCIe": 2000,
    "GH200": 4000,
    "A100-SXM4-80GB": 2039,
    "A100 80GB PCIe": 1935,
    "A100-SXM4-40GB": 1555,
    "A100-PCIE-40GB": 1555,
    "L40S": 864,
    "L4": 300,
    "A10G": 600,
}


def peak_gbs(name: str) -> float | None:
    for key in sorted(PEAK_GBS, key=len, reverse=True):
        if key.lower() in name.lower():
            return PEAK_GBS[key]
    if "H100" in name:
        return PEAK_GBS["H100 SXM"]
    return None


def build_store(prec: str, batch: int, kv_heads: int, head_dim: int, context: int, device, dtype) -> LayerStore:
    """A store holding ``context`` random tokens plus one fresh token (written in chunks, like a prefill)."""
    cfg = KVQuantConfig(block_size=128)
    layer = LayerStore([KVPrecision(prec, prec)] * kv_heads, cfg, head_dim, batch, device, capacity=context + 1)
    g = torch.Generator(device=device).manual_seed(0)
    chunk = max(1, min(context, (1 << 26) // max(1, batch * kv_heads * head_dim)))
    for s in range(0, context, chunk):
        n = min(chunk, context - s)
        k = torch.randn(batch, kv_heads, n, head_dim, device=device, generator=g, dtype=dtype)
        v = torch.randn(batch, kv_heads, n, head_dim, device=device, generator=g, dtype=dtype)
        layer.append(k, v)
    return layer


def kv_bytes(layer: LayerStore, tokens: int) -> int:
    return sum(g.key.nbytes(tokens) + g.value.nbytes(tokens) for g in layer.groups)


def bench(fn, device) -> float:
    """Median milliseconds of ``fn()``."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="1024,4096,8192,32768,65536,131072" if gpu else "256,1024")
    ap.add_argument("--batches", default="1,4,8,16" if gpu else "1,2")
    ap.add_argument("--precisions", default="fp16,int8,int4,fp8-e4m3" if gpu else "fp16,int8,int4")
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--peak-gbs", type=float, default=None, help="peak HBM GB/s (default: from the GPU name)")
    ap.add_argument("--max-gib", type=float, default=40.0, help="skip points whose K/V exceed this many GiB")
    ap.add_argument("--out", default=None, help="folder for attention_decode_<gpu>.md / .json")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.float16 if gpu else torch.float32
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    precs = [p.strip() for p in args.precisions.split(",") if p.strip()]
    Hq, Hkv, D = args.q_heads, args.kv_heads, args.head_dim
    rep = Hq // Hkv
    name = torch.cuda.get_device_name(device) if gpu else platform.processor() or "cpu"
    peak = args.peak_gbs or (peak_gbs(name) if gpu else None)
    scaling = D**-0.5
    if gpu:
        from kvquant.kernels.triton_attention import attend_triton

        impl, impl_name = attend_triton, "triton"
    else:
        impl, impl_name = attend_torch, "torch (block walk)"
        print("NOTE: no GPU: timing the torch path on CPU; the Triton figures (the point of this benchmark) need a "
              "GPU. SDPA runs on fp32 K/V here.")  # fmt: skip
    print(f"device: {name}; peak {peak or '?'} GB/s; q_heads {Hq}, kv_heads {Hkv}, head_dim {D}, "
          f"kvquant path: {impl_name}, torch {torch.__version__}")  # fmt: skip

    rows = []
    hdr = f"{'ctx':>7} {'B':>3} {'impl':>9} {'ms':>9} {'GB/s':>8} {'%peak':>6} {'x SDPA':>7} {'max err':>8}"
    print(hdr)
    for ctx in contexts:
        for B in batches:
            fp16_bytes = 2 * B * Hkv * (ctx + 1) * D * 2
            if fp16_bytes * 2 / 2**30 > args.max_gib:
                print(f"{ctx:>7} {B:>3}  skipped: {fp16_bytes / 2**30:.1f} GiB of fp16 K/V (--max-gib)")
                continue
            g = torch.Generator(device=device).manual_seed(1)
            q = torch.randn(B, Hq, 1, D, device=device, dtype=dtype, generator=g)
            k = torch.randn(B, Hkv, ctx + 1, D, device=device, dtype=dtype, generator=g)
            v = torch.randn(B, Hkv, ctx + 1, D, device=device, dtype=dtype, generator=g)
            qf = q.view(B, Hkv, rep, D)

            def sdpa(qf=qf, k=k, v=v):
                return F.scaled_dot_product_attention(qf, k, v, scale=scaling)

            t_sdpa = bench(sdpa, device)
            rec = {"context": ctx, "batch": B, "impl": "sdpa-fp16" if gpu else "sdpa-fp32", "ms": t_sdpa,
                   "bytes": fp16_bytes if gpu else fp16_bytes * 2}  # fmt: skip
            rows.append(rec)
            _print(rec, peak, t_sdpa, None)
            del k, v
            for prec in precs:
                try:
                    layer = build_store(prec, B, Hkv, D, ctx + 1, device, dtype)
                except torch.OutOfMemoryError:
                    print(f"{ctx:>7} {B:>3} {prec:>9}  out of memory")
                    continue
                fk = torch.randn(B, Hkv, 1, D, device=device, dtype=dtype, generator=g)
                fv = torch.randn_like(fk)

                def run(layer=layer, fk=fk, fv=fv, q=q, ctx=ctx):
                    return impl(q, fk, fv, layer, ctx, None, scaling)

                err = None
                if gpu and ctx * B <= 8192 * 8:  # a correctness check against the torch path, same store
                    err = (run().float() - attend_torch(q, fk, fv, layer, ctx, None, scaling).float()).abs().max()
                    err = float(err)
                t = bench(run, device)
                rec = {"context": ctx, "batch": B, "impl": prec, "ms": t, "bytes": kv_bytes(layer, ctx),
                       "speedup_vs_sdpa": t_sdpa / t, "max_err_vs_torch": err}  # fmt: skip
                rows.append(rec)
                _print(rec, peak, t_sdpa, err)
                del layer
                if gpu:
                    torch.cuda.empty_cache()

    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tag = "".join(c if c.isalnum() else "_" for c in name)[:40] if gpu else "cpu"
        meta = {"device": name, "peak_gbs": peak, "q_heads": Hq, "kv_heads": Hkv, "head_dim": D,
                "impl": impl_name, "torch": torch.__version__, "argv": sys.argv[1:]}  # fmt: skip
        write_text(out / f"attention_decode_{tag}.json", json.dumps({"meta": meta, "rows": rows}, indent=1))
        write_text(out / f"attention_decode_{tag}.md", markdown(meta, rows))
        print(f"wrote {out}/attention_decode_{tag}.md/.json")
    return 0


def _print(rec, peak, t_sdpa, err) -> None:
    gbs = rec["bytes"] / rec["ms"] / 1e6
    pct = f"{100 * gbs / peak:5.1f}%" if peak else "     ?"
    ratio = t_sdpa / rec["ms"]
    e = f"{err:.1e}" if err is not None else "-"
    print(f"{rec['context']:>7} {rec['batch']:>3} {rec['impl']:>9} {rec['ms']:>9.4f} {gbs:>8.1f} {pct:>6} "
          f"{ratio:>6.2f}x {e:>8}")  # fmt: skip


def markdown(meta, rows) -> str:
    gpu = meta["impl"] == "triton"
    kv = "FP16" if gpu else "fp32"
    timing = "median of triton.testing.do_bench (L2 flushed)" if gpu else (
        "median of 5 wall-clock runs on CPU (the torch path; Triton figures need a GPU)")
    lines = [
        f"# Decode attention: kvquant ({meta['impl']}) vs SDPA on {kv} K/V",
        "",
        f"Device: {meta['device']} (peak {meta['peak_gbs'] or '?'} GB/s); q_heads {meta['q_heads']}, "
        f"kv_heads {meta['kv_heads']}, head_dim {meta['head_dim']}; torch {meta['torch']}; {timing}. "
        "GB/s = K/V bytes read (codes + scales) / latency.",
        "",
        "| context | batch | impl | ms | GB/s | % peak | speed-up vs SDPA |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    sdpa = {(r["context"], r["batch"]): r["ms"] for r in rows if r["impl"].startswith("sdpa")}
    for r in rows:
        gbs = r["bytes"] / r["ms"] / 1e6
        pct = f"{100 * gbs / meta['peak_gbs']:.0f}%" if meta["peak_gbs"] else "?"
        ref = sdpa.get((r["context"], r["batch"]))
        sp = f"{ref / r['ms']:.2f}x" if ref else "-"
        lines.append(f"| {r['context']} | {r['batch']} | {r['impl']} | {r['ms']:.4f} | {gbs:.0f} | {pct} | {sp} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
