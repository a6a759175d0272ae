"""Serving at a fixed KV memory budget: transformers' continuous batching (its FP16 paged pool) vs kvquant.Scheduler.

    python benchmarks/serve_throughput.py                         # SmolLM2-135M on CPU, defaults below
    python benchmarks/serve_throughput.py --requests 32 --budget-mib 16 --threads 2 --out docs/results/x.json

One process, one model (SmolLM2-135M as ``kvquant.models.load_model`` loads ``smollm2-135m``, float32), one stream
of requests run through each system in turn:

* ``transformers-fp16``: transformers' continuous batching on the unwrapped model (the manager behind
  ``model.generate_batch``, ``continuous_batching_context_manager``, so that each request has its own
  ``max_new_tokens``), its ``PagedAttentionCache`` sized to the
  budget in FP16 bytes (``num_blocks = budget // fp16 bytes per page``, ``page_size = --block-size``). The pool's
  dtype is the model's: on CPU the model runs in float32, so its pages hold float32 values, but it holds exactly the
  tokens an FP16 pool of the budget holds, which is what the capacity comparison needs.
* ``kvquant-<config>``: ``kvquant.Scheduler`` with ``--configs`` (``fp16`` passthrough, ``int8-kchannel``,
  ``int4-kchannel-sinks``), block size ``--block-size``. The budget covers the pool's blocks **and** the running
  requests' full-precision buffers (fp16 sinks, the fp16 tail of an unfilled per-channel key block), split in two
  arenas cut in the ratio of what a request holds in each on average: the buffers get
  ``D = budget * b / (p * (L - t) + b) + one request's most buffers`` (``b``: mean buffer bytes per request, sinks
  and a tail of half a block, ``t`` tokens; ``p``: pool bytes per token; ``L``, mean held tokens: the mean of
  prompt + output / 2 over the stream; the tail's tokens are not in the pool), bounded by what they hold after each
  step (``Scheduler(max_dense_bytes=D)``: shared by use, not reserved per request), and the pool gets
  ``budget - D`` (configs without dense buffers: the whole budget). A request is admitted with the growth room of
  ``--reserve-tokens`` (default 4: the pool keeps free the blocks the running requests need for their next 4
  tokens; ``Scheduler(reserve_tokens=4)``).

Requests: prompt and output lengths drawn from log-normal distributions with the stated P50 and P99 (clipped to
[4, 1.5 * P99]), random token ids (``--seed``), no stop token (each request generates exactly its drawn output
length), greedy. All requests arrive at once (an offline burst larger than the budget holds, so admission,
waiting and, for kvquant, preemption all happen; time to first token includes the wait in the queue).

Reported per system: requests held at once (time-weighted mean and max, a request counted from its admission to
its last token; the same definition for both), KV bytes per token held (transformers: the FP16 formula; kvquant:
the bytes its caches hold, blocks, scales and dense buffers, sampled every 4 steps; and the pool's bytes per
token of a full block, without dense buffers; the most bytes held at once, which stays within the budget),
aggregate output tokens/s
(all output tokens / wall time of the run; and / the process's CPU time, which other jobs on a shared machine
disturb less, with one thread), time to first token P50 / P99 (from the burst's start), preemptions
(kvquant: its count; transformers does not report them: the requests whose token timestamps restarted, which a
recompute after preemption does, are shown as ``>= N requests``), and the ratios to ``transformers-fp16``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

import kvquant
from kvquant.memory import human
from kvquant.store import LayerStore

Z99 = 2.3263478740408408  # the standard normal's 99th percentile


def lengths(n: int, p50: int, p99: int, gen: torch.Generator) -> list[int]:
    """``n`` log-normal lengths with median ``p50`` and 99th percentile ``p99``, clipped to [4, 1.5 * p99]."""
    sigma = math.log(p99 / p50) / Z99
    z = torch.randn(n, generator=gen, dtype=torch.float64)
    return [int(min(max(4, round(p50 * math.exp(sigma * float(x)))), int(1.5 * p99))) for x in z]


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def held_at_once(intervals: list[tuple[float, float]], t0: float, t1: float) -> tuple[float, int]:
    """Time-weighted mean and max of the number of open ``[start, end]`` intervals over ``[t0, t1]``."""
    marks = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda m: (m[0], -m[1]))
    area, cur, peak, last = 0.0, 0, 0, t0
    for t, d in marks:
        area += cur * (t - last)
        last = t
        cur += d
        peak = max(peak, cur)
    return area / (t1 - t0), peak


def fp16_bytes_per_token(model) -> int:
    shape = kvquant.ModelShape.of(model)
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2


def run_transformers(model, prompts, outs, budget: int, block: int, step_tokens: int) -> dict:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    num_blocks = budget // (fp16_bytes_per_token(model) * block)
    cb = ContinuousBatchingConfig(page_size=block, num_blocks=num_blocks, max_batch_tokens=step_tokens,
                                  allow_block_sharing=False)  # fmt: skip
    gc = GenerationConfig(max_new_tokens=max(outs), do_sample=False, eos_token_id=-1)
    # generate_batch's machinery (its manager, public API) with each request's own max_new_tokens
    with model.continuous_batching_context_manager(generation_config=gc, continuous_batching_config=cb,
                                                   block=True, timeout=60) as manager:  # fmt: skip
        t0, c0 = time.perf_counter(), time.process_time()
        rids = [manager.add_request(p, max_new_tokens=n, streaming=True, record_timestamps=True)
                for p, n in zip(prompts, outs, strict=True)]  # fmt: skip
        res, first, last = {}, {}, {}
        while len(res) < len(rids):
            r = manager.get_result(timeout=1)
            if r is None:
                if not manager.is_running():
                    raise RuntimeError("transformers continuous batching: the generation thread stopped")
                continue
            now = time.perf_counter()
            if r.generated_tokens:
                first.setdefault(r.request_id, now - t0)
                last[r.request_id] = now
            if r.is_finished():
                res[r.request_id] = r
        t1, c1 = time.perf_counter(), time.process_time()
    results = [res[rid] for rid in rids]
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"transformers continuous batching failed: {errors[0]}")
    n_out = sum(len(r.generated_tokens) for r in results)
    # a preempted request is recomputed from its tokens and its timestamps start again: count those requests
    preempted = sum(len(r.timestamps or []) < len(r.generated_tokens) for r in results)
    end = max(last.values())
    mean, peak = held_at_once([(r.lifespan[0], last[rid]) for rid, r in zip(rids, results, strict=True)], t0, end)
    firsts = [first[rid] for rid in rids]
    return {"system": "transformers-fp16", "held_mean": mean, "held_max": peak,
            "kv_bytes_per_token": fp16_bytes_per_token(model), "tokens_per_s": n_out / (end - t0),
            "held_bytes_max": num_blocks * block * fp16_bytes_per_token(model), "budget_bytes": budget,
            "tokens_per_cpu_s": n_out / (c1 - c0),
            "ttft_p50": percentile(firsts, 50), "ttft_p99": percentile(firsts, 99), "preemptions": None,
            "preempted_requests": preempted, "wall_s": t1 - t0, "output_tokens": n_out, "kv_blocks": num_blocks,
            "outputs": [r.generated_tokens for r in results]}  # fmt: skip


def dense_bytes_per_request(model, cfg: kvquant.KVQuantConfig) -> tuple[int, float, float]:
    """Full-precision bytes of one request outside the pool: its fp16 sinks, the mean of its unfilled tail
    (per-channel keys or a residual window: uniform over a quantized step, ``residual + (step - 1) / 2`` tokens)
    and the tail's most (``residual + step - 1`` tokens)."""
    shape = kvquant.ModelShape.of(model)
    stores = [LayerStore(row, cfg, shape.head_dim, batch=1, device=torch.device("cpu")) for row in cfg.resolve(shape)]
    per = fp16_bytes_per_token(model)
    residual = any(st.residual_mode for st in stores)
    r, step = stores[0].residual_tokens, stores[0].residual_step
    mean, most = (r + (step - 1) / 2, r + step - 1) if residual else (0.0, 0)
    return cfg.sink_tokens * per, mean * per, most * per


def dense_arena_bytes(model, cfg: kvquant.KVQuantConfig, prompts, outs, budget: int, block: int) -> int | None:
    """The full-precision buffers' arena ``D`` cut from ``budget`` (None: the config has no such buffers); see the
    module doc."""
    sinks, tail, most = dense_bytes_per_request(model, cfg)
    if not (sinks or tail):
        return None
    # one budget, two arenas: the pool's blocks and the running requests' full-precision buffers, cut in the ratio
    # of what a request holds in each on average (mean held tokens: prompt + output / 2; the tokens of its tail are
    # not in the pool), plus one request's most buffers; bounded by what they hold (Scheduler's max_dense_bytes),
    # not reserved per request
    probe = kvquant.PagedKVPool(model, cfg)
    mean_tokens = statistics.mean(len(p) + n / 2 for p, n in zip(prompts, outs, strict=True))
    mean_dense = sinks + tail
    tail_tokens = tail / fp16_bytes_per_token(model)
    in_pool = probe.block_bytes / block * max(0.0, mean_tokens - tail_tokens)
    return min(budget - probe.block_bytes, int(budget * mean_dense / (in_pool + mean_dense)) + sinks + most)


def run_kvquant(model, name: str, prompts, outs, budget: int, block: int, step_tokens: int, chunk: int,
                dense_arena: int | None | str = "auto", reserve_tokens: int | None = None) -> dict:  # fmt: skip
    cfg = kvquant.KVQuantConfig.load({**kvquant.KVQuantConfig.load(name).to_dict(), "block_size": block})
    probe = kvquant.PagedKVPool(model, cfg)
    if dense_arena == "auto":
        dense_arena = dense_arena_bytes(model, cfg, prompts, outs, budget, block)
    pool_bytes = budget if dense_arena is None else budget - dense_arena
    sched = kvquant.Scheduler(model, cfg, max_bytes=pool_bytes, max_step_tokens=step_tokens, prefill_chunk=chunk,
                              max_dense_bytes=dense_arena, reserve_tokens=reserve_tokens)  # fmt: skip
    t0, c0 = time.perf_counter(), time.process_time()
    ids = [sched.submit(p, max_new_tokens=n, stop=[]) for p, n in zip(prompts, outs, strict=True)]
    admitted: dict[int, float] = {}
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    samples = []
    held_peak = 0  # the most bytes the running requests' caches held at once (blocks, scales, dense buffers)
    steps = 0
    aside, aside_cpu = 0.0, 0.0  # time spent sampling the bytes held: taken off every time measured
    while sched.busy:
        before = time.perf_counter() - aside
        events = sched.step()
        now = time.perf_counter() - aside
        for r in sched.running:
            admitted.setdefault(r.id, before)
        for ev in events:
            admitted.setdefault(ev.request_id, before)
            first.setdefault(ev.request_id, now - t0)
            last[ev.request_id] = now
        steps += 1
        if steps % 4 == 0 and sched.running:
            s0, sc0 = time.perf_counter(), time.process_time()
            held = [r.cache.memory_report() for r in sched.running if r.cache is not None]
            tokens = sum(m["tokens"] for m in held)
            if tokens:
                samples.append(sum(m["bytes_total"] for m in held) / tokens)
            held_peak = max(held_peak, sum(m["bytes_total"] for m in held))
            aside += time.perf_counter() - s0
            aside_cpu += time.process_time() - sc0
    cpu = time.process_time() - c0 - aside_cpu
    end = max(last.values())
    mean, peak = held_at_once([(admitted[i], last[i]) for i in ids], t0, end)
    st = sched.stats()
    n_out = sum(len(sched.output(i)) for i in ids)
    sched.pool.clear_prefixes()
    leaked = sched.pool.stats()["blocks_used"]
    if leaked:
        raise RuntimeError(f"{name}: {leaked} blocks still in use after the run")
    return {"system": f"kvquant-{name}", "held_mean": mean, "held_max": peak,
            "kv_bytes_per_token": statistics.mean(samples) if samples else float("nan"),
            "tokens_per_s": n_out / (end - t0), "tokens_per_cpu_s": n_out / cpu,
            "ttft_p50": percentile(list(first.values()), 50),
            "ttft_p99": percentile(list(first.values()), 99), "preemptions": st["preemptions"],
            "wall_s": end - t0, "output_tokens": n_out, "steps": st["steps"], "step_running_mean": st["running_mean"],
            "pool_bytes_per_token": probe.block_bytes / block, "pool_bytes": pool_bytes,
            "dense_arena_bytes": dense_arena, "dense_max_bytes": st["dense_max"], "held_bytes_max": held_peak,
            "budget_bytes": budget,
            "outputs": [sched.output(i) for i in ids]}  # fmt: skip


def table(rows: list[dict]) -> list[str]:
    base = next((r for r in rows if r["system"] == "transformers-fp16"), None)
    out = ["| system | held mean | held max | KV bytes/token | pool bytes/token | out tok/s | out tok/CPU-s "
           "| TTFT P50 s | TTFT P99 s | preemptions | KV held max / budget | held mean / FP16 | tok/s / FP16 "
           "| tok/CPU-s / FP16 |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        rh = f"{r['held_mean'] / base['held_mean']:.2f}x" if base else "-"
        rt = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        rc = f"{r['tokens_per_cpu_s'] / base['tokens_per_cpu_s']:.2f}x" if base else "-"
        pre = f">= {r['preempted_requests']} requests" if r["preemptions"] is None else str(r["preemptions"])
        pool = r.get("pool_bytes_per_token", r["kv_bytes_per_token"])
        held = r["held_bytes_max"] / r["budget_bytes"]
        out.append(f"| {r['system']} | {r['held_mean']:.1f} | {r['held_max']} | {r['kv_bytes_per_token']:,.0f} | "
                   f"{pool:,.0f} | {r['tokens_per_s']:.1f} | {r['tokens_per_cpu_s']:.1f} | "
                   f"{r['ttft_p50']:.1f} | {r['ttft_p99']:.1f} | {pre} | {held:.2f} | {rh} | {rt} | {rc} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt-p50", type=int, default=48)
    ap.add_argument("--prompt-p99", type=int, default=192)
    ap.add_argument("--output-p50", type=int, default=24)
    ap.add_argument("--output-p99", type=int, default=96)
    ap.add_argument("--budget-mib", type=float, default=12.0, help="KV memory budget of every system")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--step-tokens", type=int, default=256, help="tokens per forward at most (both systems)")
    ap.add_argument("--prefill-chunk", type=int, default=128)
    ap.add_argument("--configs", default="fp16,int8-kchannel,int4-kchannel-sinks")
    ap.add_argument("--reserve-tokens", type=int, default=4,
                    help="kvquant: growth room kept at admission (Scheduler(reserve_tokens=...)); -1: one block each")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvquant.models import load_model

    model = load_model(args.model, progress=False).model
    gen = torch.Generator().manual_seed(args.seed)
    p_len = lengths(args.requests, args.prompt_p50, args.prompt_p99, gen)
    o_len = lengths(args.requests, args.output_p50, args.output_p99, gen)
    vocab = model.config.vocab_size
    prompts = [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in p_len]
    budget = int(args.budget_mib * 2**20)
    print(f"{args.requests} requests, prompt P50/P99 {args.prompt_p50}/{args.prompt_p99} (drawn: mean "
          f"{statistics.mean(p_len):.0f}, max {max(p_len)}), output P50/P99 {args.output_p50}/{args.output_p99} "
          f"(mean {statistics.mean(o_len):.0f}, max {max(o_len)}); KV budget {human(budget)}", flush=True)
    rows = []
    warm = prompts[:2], [4, 4]
    if not args.no_transformers:
        run_transformers(model, *warm, budget, args.block_size, args.step_tokens)
        rows.append(run_transformers(model, prompts, o_len, budget, args.block_size, args.step_tokens))
        print(table(rows)[-1], flush=True)
    for name in [c for c in args.configs.split(",") if c]:
        reserve = None if args.reserve_tokens < 0 else args.reserve_tokens
        run_kvquant(model, name, *warm, budget, args.block_size, args.step_tokens, args.prefill_chunk,
                    reserve_tokens=reserve)  # fmt: skip
        rows.append(run_kvquant(model, name, prompts, o_len, budget, args.block_size, args.step_tokens,
                                args.prefill_chunk, reserve_tokens=reserve))  # fmt: skip
        kvquant.unwrap(model)
        print(table(rows)[-1], flush=True)
    print("\n".join(table(rows)))
    ref = {r["system"]: r["outputs"] for r in rows}
    if "transformers-fp16" in ref and "kvquant-fp16" in ref:
        same = sum(a == b for a, b in zip(ref["transformers-fp16"], ref["kvquant-fp16"], strict=True))
        print(f"greedy outputs identical, transformers vs kvquant fp16: {same} of {args.requests} requests")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]},
                                       indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
