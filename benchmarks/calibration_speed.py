"""CPU decode speed of calibrated configs and of each calibration candidate, against int4-kchannel-sinks, same run.

Issue 36's speed rule: a calibrated config decodes at no less than half of ``int4-kchannel-sinks``'s tokens per
CPU-second on CPU, writing each token included; this script is how that is measured
(docs/results/calibration-tiers.md)::

    python benchmarks/calibration_speed.py                                   # every candidate, uniform K and V
    python benchmarks/calibration_speed.py --configs cal.yaml,int4-kchannel --candidates ""   # configs only

A named model (default SmolLM2-135M), fp32, one torch thread, the torch attention path (``KVQUANT_ATTENTION=torch``):
each config wraps the model, prefills ``--context`` random tokens, takes one warm-up step, then times ``--steps``
greedy decode steps through :class:`kvquant.QuantizedKVCache` (each step writes its token: the encoder's cost is
in). Rounds interleave the configs; the printed ratio is the median over rounds of tok/CPU-s divided by the
baseline's in the same round (process CPU time, which other jobs on a shared machine disturb less than wall time).
A candidate ``P`` runs as ``default: {key: P, value: P}`` when P is a value precision too, else with int4 values,
with ``--sinks`` fp16 sinks; a ``tqc<bits>`` candidate needs per-channel widths and is measured through a
calibrated config instead (``--configs``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("KVQUANT_ATTENTION", "torch")

import torch  # noqa: E402

import kvquant  # noqa: E402
from kvquant import KVQuantConfig  # noqa: E402
from kvquant.calibrate_target import BLOCK_KEY_CANDIDATES, KEY_CANDIDATES, VALUE_CANDIDATES  # noqa: E402
from kvquant.models import load_model  # noqa: E402
from kvquant.transformers_compat import cache_kw  # noqa: E402

BASELINE = "int4-kchannel-sinks"


def candidate_config(label: str, values: set[str], sinks: int) -> KVQuantConfig:
    """A uniform config of candidate ``label``: ``label`` for keys, and for values too when it is one."""
    value = label if label in values else "int4"
    return KVQuantConfig.from_dict({"default": {"key": label, "value": value}, "sink_tokens": sinks})


def decode_rate(model: torch.nn.Module, config: KVQuantConfig, ids: torch.Tensor, steps: int) -> float:
    """Greedy decode tokens per CPU-second after a prefill of ``ids`` and one warm-up step."""
    kvquant.wrap(model, config)
    try:
        cache = kvquant.QuantizedKVCache(model, config)
        with torch.no_grad():
            tok = model(ids, **cache_kw(cache), use_cache=True).logits[:, -1:].argmax(-1)
            tok = model(tok, **cache_kw(cache), use_cache=True).logits[:, -1:].argmax(-1)
            t0 = time.process_time()
            for _ in range(steps):
                tok = model(tok, **cache_kw(cache), use_cache=True).logits[:, -1:].argmax(-1)
            return steps / (time.process_time() - t0)
    finally:
        kvquant.unwrap(model)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", default="smollm2-135m", help="a named model, local directory or GGUF file")
    ap.add_argument("--configs", default="", help="comma-separated presets or config files (e.g. calibrated ones)")
    ap.add_argument("--candidates", default=None,
                    help="comma-separated candidate labels run as uniform configs (default: every key and value "
                    "candidate except tqc*; '' for none)")
    ap.add_argument("--context", type=int, default=256, help="prefill tokens (256)")
    ap.add_argument("--steps", type=int, default=12, help="timed decode steps per round (12)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median ratio is printed (3)")
    ap.add_argument("--sinks", type=int, default=4, help="fp16 sinks of the candidate configs (4)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    keys, values = (BLOCK_KEY_CANDIDATES + "," + KEY_CANDIDATES).split(","), VALUE_CANDIDATES.split(",")
    labels = [c for c in dict.fromkeys(keys + values) if not c.startswith("tqc")]
    if args.candidates is not None:
        labels = [c for c in args.candidates.split(",") if c]
    runs: dict[str, KVQuantConfig] = {BASELINE: KVQuantConfig.load(BASELINE)}
    runs.update({f"uniform {c}": candidate_config(c, set(values), args.sinks) for c in labels})
    runs.update({spec: KVQuantConfig.load(spec) for spec in args.configs.split(",") if spec})
    model = load_model(args.model, dtype="float32", progress=False).model
    ids = torch.randint(100, 20000, (1, args.context), generator=torch.Generator().manual_seed(0))
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.rounds):
        for name, config in runs.items():
            rates[name].append(decode_rate(model, config, ids, args.steps))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"model {args.model}, context {args.context}, {args.steps} steps x {args.rounds} rounds, 1 thread, "
          f"attention {os.environ['KVQUANT_ATTENTION']}; ratio = median over rounds of tok/CPU-s / {BASELINE}'s")
    print(f"| config | tok/CPU-s (median) | vs {BASELINE} |\n|---|---:|---:|")
    for name, rs in rates.items():
        ratio = statistics.median(x / b for x, b in zip(rs, rates[BASELINE], strict=True))
        print(f"| {name} | {statistics.median(rs):.2f} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
