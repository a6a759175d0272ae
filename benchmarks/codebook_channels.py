"""Per-channel key widths for ``tqc-<widths>`` (issue 14), calibrated per (layer, KV head) from text.

    python benchmarks/codebook_channels.py recipes/configs/tq4-v4mix-r16.yaml --name tqc4-v4mix-r16 \\
        --out recipes/configs/tqc4-v4mix-r16.yaml

Reads SmolLM2-135M's post-RoPE queries and keys on ``--calib-windows`` windows of 1024 tokens from the END
of the WikiText-2 test split (evaluation windows come from its start), and for every KV head whose key
precision in the base config is a rotated codebook (``tq2/3/4``: ``b`` bits per channel) allocates the
same ``b * head_dim`` bits over its channels with :func:`kvquant.quantizers.allocate_widths`, weights
``E[q_j^2] * var(k_j)`` (the query group's second moment, the keys' variance around their per-window
mean, sink tokens left out). Writes the base config with those key heads as ``tqc-<widths>`` (values,
sinks, residual unchanged), so both store the same key bits per row. Why: after RoPE a few channel
pairs carry most of the query energy; a rotation spreads every key error over all of them.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import yaml
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvquant import KVQuantConfig, ModelShape
from kvquant.eval.data import load_text, tokenize
from kvquant.eval.models import load_model
from kvquant.quantizers import CODEBOOK, allocate_widths, channel_precision

WINDOW, SINK = 1024, 4


def channel_weights(windows: int) -> dict[int, torch.Tensor]:
    """Per layer ``[Hkv, D]``: ``E[q_j^2]`` of each KV head's query group times the keys' ``var(k_j)``."""
    lm = load_model("smollm2-135m", dtype="float32", progress=False)
    ids = tokenize(load_text("wikitext-2").text, lm.tokenizer)
    n = len(ids) // WINDOW
    sums: dict[int, list[torch.Tensor]] = {}
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def hook(module, q, k, v, mask, scaling=None, **kw):  # noqa: ANN001 (transformers' signature)
        h, d = k.shape[1], k.shape[-1]
        qq = q[0, :, SINK:].double().reshape(h, -1, d)  # query heads grouped by KV head (GQA order)
        kk = k[0, :, SINK:].double()
        st = [(qq**2).mean(1), kk.var(1)]
        prev = sums.get(module.layer_idx)
        sums[module.layer_idx] = st if prev is None else [a + b for a, b in zip(prev, st, strict=True)]
        return sdpa(module, q, k, v, mask, scaling=scaling, **kw)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = hook
    try:
        with torch.no_grad():
            for i in range(n - windows, n):
                lm.model(ids[i * WINDOW:(i + 1) * WINDOW].unsqueeze(0))
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
    return {layer: (cq * vk).float() for layer, (cq, vk) in sums.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="a kvquant config whose tq2/tq3/tq4 key heads get per-channel widths")
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--calib-windows", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    weights = channel_weights(args.calib_windows)
    shape = ModelShape(num_layers=len(weights), num_kv_heads=next(iter(weights.values())).shape[0],
                       head_dim=next(iter(weights.values())).shape[1])  # fmt: skip
    plan = KVQuantConfig.load(args.base).resolve(shape)
    raw = yaml.safe_load(Path(args.base).read_text())
    heads = {}
    for layer, row in enumerate(plan):
        for h, p in enumerate(row):
            key = p.key
            if key in CODEBOOK:
                key = channel_precision(allocate_widths(weights[layer][h], CODEBOOK[key] * shape.head_dim))
            heads[f"{layer}.{h}"] = {"key": key, "value": p.value}
    raw["name"] = args.name
    raw["description"] = (f"{raw.get('description', '')} Key heads: tqc per-channel widths (same bits), "
                          f"E[q^2] var(k) allocation on the last {args.calib_windows} x {WINDOW} tokens.").strip()
    raw["heads"] = heads
    head = (f"# {args.name}: {args.base} with every tq2/3/4 key head as tqc-<per-channel widths> at the same bits,\n"
            f"# written by: python benchmarks/codebook_channels.py {args.base} --name {args.name} --out {args.out}"
            f" --calib-windows {args.calib_windows}\n# (calibration: the LAST {args.calib_windows} x {WINDOW} tokens of"
            " the WikiText-2 test split; evaluation windows come from its start)\n")
    Path(args.out).write_text(head + yaml.safe_dump(raw, sort_keys=False, width=200))
    KVQuantConfig.load(args.out).validate(shape)
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
