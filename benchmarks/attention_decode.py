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

Also (issue 13): ``--dry-run`` (no GPU needed) prints the plan -- every point's shapes, bytes, the
decode launches (grid, BLOCK_N, warps) -- checks that no 32-bit offset term of the kernels can
overflow, and compiles each launch for sm_90a through Triton's runtime binder; ``--gate`` asserts the
Triton decode against the chunked fp32 torch path (``attend_torch``) on the same store (exit 1 on
failure); SDPA runs with its backend pinned (``--sdpa-backend``, logged); the copy bandwidth of the
same GPU is measured in the same run and every point's bandwidth reported against it; the JSON is
rewritten after every point (``--out``).

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


def store_capacity(tokens: int, block: int = 128) -> int:
    return -(-tokens // block) * block


def plan(args, contexts: list[int], batches: list[int], precs: list[str]) -> int:
    """``--dry-run``: shapes, bytes and launches of every point; 32-bit offset check; compile for sm_90a."""
    from kvquant.kernels.triton_compile_check import meta_launches
    from kvquant.kernels.triton_dequant import DOT_FP16
    from kvquant.kernels.triton_launch import compile_launch, resource_usage

    Hq, Hkv, D = args.q_heads, args.kv_heads, args.head_dim
    failed = 0
    compiled: dict = {}
    for ctx in contexts:
        for B in batches:
            print(f"point context {ctx} batch {B}: sdpa fp16 K/V {2 * B * Hkv * (ctx + 1) * D * 2 / 2**30:.2f} GiB")
            for prec in ["fp16", *[p for p in precs if p != "fp16"]]:
                cap = store_capacity(ctx + 1)
                launches = meta_launches("decode", [(prec, prec, Hkv)], DOT_FP16, D, Hq // Hkv, False, batch=B,
                                         past_len=ctx, capacity=cap, sms=args.sms)  # fmt: skip
                (part,) = launches
                named = dict(zip(part.kernel.arg_names, part.args, strict=False))
                # the kernels index (head, token, channel) in 32 bits, the batch term in 64 bits
                worst = max(t.stride(1) * t.shape[1] + t.stride(2) * t.shape[2] for t in
                            (named["K"], named["KS"], named["V"], named["VS"]))  # fmt: skip
                ok64 = worst < 2**31
                failed += not ok64
                key = (prec, ctx % 16 == 0, B == 1)
                msg = ""
                if key not in compiled:
                    try:
                        c = compile_launch(part, 90)
                        use = resource_usage(c.asm["cubin"])
                        compiled[key] = f"compiled sm_90a: {use['reg']} regs, {use['local']} B spill"
                    except Exception as e:  # noqa: BLE001 - report every failing point
                        failed += 1
                        compiled[key] = f"COMPILE FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                msg = compiled[key]
                print(f"  {prec:>10}: grid {part.grid} BLOCK_N {part.meta['BLOCK_N']} warps {part.meta['num_warps']} "
                      f"part_len {named['part_len']}; 32-bit offsets up to {worst:,} ({'ok' if ok64 else 'OVERFLOW'}); "
                      f"{msg}")  # fmt: skip
    print("dry run:", "ok" if not failed else f"{failed} problem(s)")
    return 1 if failed else 0


def copy_gbs(device) -> float:
    """Device-to-device copy bandwidth (read + write bytes / time) of a 1 GiB buffer, GB/s."""
    import triton.testing

    src = torch.empty(2**29, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    ms = float(triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median"))
    return 2 * src.numel() * 2 / ms / 1e6


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
    ap.add_argument("--dry-run", action="store_true", help="plan + 32-bit offset check + sm_90a compile, no GPU")
    ap.add_argument("--sms", type=int, default=132, help="SM count the dry run plans the split count for")
    ap.add_argument("--gate", action="store_true", help="assert Triton vs the chunked torch path at every point")
    ap.add_argument("--gate-tol", type=float, default=2e-3, help="max abs error the gate accepts (fp16 queries)")
    ap.add_argument("--sdpa-backend", default="flash", choices=("flash", "efficient", "math", "cudnn"),
                    help="SDPA backend pinned for the FP16 baseline")
    ap.add_argument("--no-sdpa", action="store_true", help="skip the SDPA baseline (the gate alone)")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.float16 if gpu else torch.float32
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    precs = [p.strip() for p in args.precisions.split(",") if p.strip()]
    Hq, Hkv, D = args.q_heads, args.kv_heads, args.head_dim
    rep = Hq // Hkv
    if args.dry_run:
        return plan(args, contexts, batches, precs)
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

    sdpa_ctx, backend = _sdpa_backend(args.sdpa_backend) if gpu else (None, "default (CPU)")
    copy = copy_gbs(device) if gpu else None
    print(f"SDPA backend: {backend}; copy bandwidth {copy or 0:.0f} GB/s")
    tag = "".join(c if c.isalnum() else "_" for c in name)[:40] if gpu else "cpu"
    meta = {"device": name, "peak_gbs": peak, "copy_gbs": copy, "sdpa_backend": backend, "q_heads": Hq,
            "kv_heads": Hkv, "head_dim": D, "impl": impl_name, "torch": torch.__version__,
            "argv": sys.argv[1:] if argv is None else argv}  # fmt: skip
    gate_failed = []
    rows = []

    def save() -> None:
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            write_text(out / f"attention_decode_{tag}.json", json.dumps({"meta": meta, "rows": rows}, indent=1))

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
                if sdpa_ctx is None:
                    return F.scaled_dot_product_attention(qf, k, v, scale=scaling)
                with sdpa_ctx():
                    return F.scaled_dot_product_attention(qf, k, v, scale=scaling)

            t_sdpa = float("nan") if args.no_sdpa else bench(sdpa, device)
            rec = {"context": ctx, "batch": B, "impl": "sdpa-fp16" if gpu else "sdpa-fp32", "ms": t_sdpa,
                   "bytes": fp16_bytes if gpu else fp16_bytes * 2}  # fmt: skip
            if not args.no_sdpa:
                rows.append(rec)
                _print(rec, peak, t_sdpa, None)
                save()
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
                if gpu and (args.gate or ctx * B <= 8192 * 8):  # against the chunked torch path, same store
                    err = (run().float() - attend_torch(q, fk, fv, layer, ctx, None, scaling).float()).abs().max()
                    err = float(err)
                    if args.gate and not err <= args.gate_tol:
                        gate_failed.append(f"{prec} context {ctx} batch {B}: max err {err:.2e} > {args.gate_tol}")
                t = bench(run, device)
                nbytes = kv_bytes(layer, ctx)
                rec = {"context": ctx, "batch": B, "impl": prec, "ms": t, "bytes": nbytes,
                       "speedup_vs_sdpa": t_sdpa / t, "max_err_vs_torch": err,
                       "gbs": nbytes / t / 1e6, "of_copy_bw": nbytes / t / 1e6 / copy if copy else None}  # fmt: skip
                rows.append(rec)
                _print(rec, peak, t_sdpa, err)
                save()
                del layer
                if gpu:
                    torch.cuda.empty_cache()

    if args.out:
        save()
        write_text(Path(args.out) / f"attention_decode_{tag}.md", markdown(meta, rows))
        print(f"wrote {args.out}/attention_decode_{tag}.md/.json")
    if gate_failed:
        print("GATE FAILED:\n  " + "\n  ".join(gate_failed))
        return 1
    if args.gate:
        print(f"gate: every point within {args.gate_tol} of the chunked torch path")
    return 0


def _sdpa_backend(name: str):
    """A context-manager factory pinning SDPA to one backend, and the backend's name."""
    from functools import partial

    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "math": SDPBackend.MATH, "cudnn": SDPBackend.CUDNN_ATTENTION}[name]  # fmt: skip
    return partial(sdpa_kernel, [backend]), str(backend)


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
        f"SDPA backend {meta.get('sdpa_backend')}; copy bandwidth {meta.get('copy_gbs') or 0:.0f} GB/s (same run). "
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
