"""Per-channel key widths for ``tqc-<widths>`` (issue 14), calibrated per (layer, KV head) from text.

    python research/codebook_channels.py research/configs/tq4-v4mix-r16.yaml --name tqc4-v4mix-r16 \\
        --out research/configs/tqc4-v4mix-r16.yaml

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
from kvquant.models import load_model
from kvquant.quantizers import CODEBOOK, TRELLIS, VECTOR, allocate_widths, channel_precision, make_quantizer
from kvquant.text import load_text, tokenize

WINDOW, SINK, PREFILL = 1024, 4, 960


def attention_kl(q: torch.Tensor, k: torch.Tensor, kh: torch.Tensor, residual: int) -> float:
    """Mean KL(exact || quantized) of the attention of decode queries ``q[G, Tq, D]`` (the last ``Tq`` positions)
    over keys ``k[T, D]`` vs ``kh`` (stored rows; the sinks and the newest ``residual`` keys of each query exact)."""
    T, d = k.shape
    pos = torch.arange(T - q.shape[1], T)
    j = torch.arange(T)[None, :]
    causal = j <= pos[:, None]
    exact = (j < SINK) | (j > pos[:, None] - max(residual, 1))
    s = (q @ k.T) / d**0.5
    sh = torch.where(exact, s, (q @ kh.T) / d**0.5)
    lp = torch.log_softmax(s.masked_fill(~causal, -torch.inf), -1)
    lph = torch.log_softmax(sh.masked_fill(~causal, -torch.inf), -1)
    return float((lp.exp() * (lp - lph)).masked_fill(~causal, 0).sum(-1).mean())


def head_kls(captured: dict[int, list[tuple[torch.Tensor, torch.Tensor]]], layer: int, h: int, names: list[str],
             residual: int) -> list[float]:  # fmt: skip
    """Per candidate key precision, the mean :func:`attention_kl` of KV head ``h`` of ``layer`` over the captured
    windows (state fitted on the prefill's non-sink tokens, like the recipe)."""
    out = []
    for name in names:
        kls = []
        for q, k in captured[layer]:
            qz = make_quantizer(name, k.shape[-1])
            kk = k[h][None, None]
            state = qz.fit(kk[:, :, SINK:PREFILL])
            kh = qz.dequantize(qz.quantize(kk, state), state, torch.float32)[0, 0]
            g = q.shape[0] // k.shape[0]
            kls.append(attention_kl(q[g * h:g * (h + 1), PREFILL:], k[h], kh, residual))
        out.append(sum(kls) / len(kls))
    return out


def channel_weights(windows: int, captured: dict | None = None) -> dict[int, torch.Tensor]:
    """Per layer ``[Hkv, D]``: ``E[q_j^2]`` of each KV head's query group times the keys' ``var(k_j)``;
    ``captured`` (if given) receives per layer the windows' ``(q, k)`` (float32, batch dim dropped)."""
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
        if captured is not None:
            captured.setdefault(module.layer_idx, []).append((q[0].float(), k[0].float()))
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
    ap.add_argument("base", help="a kvquant config whose tq2/3/4 (or tqv / tqt 2/3/4) key heads get per-channel widths")
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--calib-windows", type=int, default=2)
    ap.add_argument("--select", action="store_true",
                    help="keep a head's base precision unless tqc lowers its decode attention KL on the calibration "
                    "windows (queries 960..1023, the base config's residual window exact)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    captured: dict[int, list] = {}
    weights = channel_weights(args.calib_windows, captured if args.select else None)
    shape = ModelShape(num_layers=len(weights), num_kv_heads=next(iter(weights.values())).shape[0],
                       head_dim=next(iter(weights.values())).shape[1])  # fmt: skip
    plan = KVQuantConfig.load(args.base).resolve(shape)
    raw = yaml.safe_load(Path(args.base).read_text())
    residual = int(raw.get("residual_tokens", 0))
    heads, picked, est = {}, 0, [0.0, 0.0]
    rotated = {**CODEBOOK, **VECTOR, **TRELLIS}  # the rotated key codes tqc may replace: name -> bits
    for layer, row in enumerate(plan):
        for h, p in enumerate(row):
            key = p.key
            if key in rotated:
                bits = rotated[key]
                tqc = channel_precision(allocate_widths(weights[layer][h], bits * shape.head_dim))
                if args.select:
                    base_kl, tqc_kl = head_kls(captured, layer, h, [key, tqc], residual)
                    est[0] += base_kl
                    est[1] += min(base_kl, tqc_kl)
                    if tqc_kl < base_kl:
                        key, picked = tqc, picked + 1
                else:
                    key, picked = tqc, picked + 1
            heads[f"{layer}.{h}"] = {"key": key, "value": p.value}
    if args.select:
        print(f"{picked} key heads as tqc; summed attention KL on the calibration windows (keys only, residual "
              f"{residual}): base {est[0]:.4f} -> {est[1]:.4f} (in-sample: the same windows chose the heads)")
    raw["name"] = args.name
    sel = "where they lower the attention KL there" if args.select else "all"
    raw["description"] = (f"{raw.get('description', '')} {picked} key heads as tqc per-channel widths (same bits; "
                          f"{sel}), E[q^2] var(k) allocation on the last {args.calib_windows} x {WINDOW} tokens.")
    raw["heads"] = heads
    head = (f"# {args.name}: {args.base} with tq(v)2/3/4 key heads as tqc-<per-channel widths> at the same bits,\n"
            f"# written by: python research/codebook_channels.py {args.base} --name {args.name} --out {args.out}"
            f" --calib-windows {args.calib_windows}{' --select' if args.select else ''}\n"
            f"# (calibration: the LAST {args.calib_windows} x {WINDOW} tokens of"
            " the WikiText-2 test split; evaluation windows come from its start)\n")
    Path(args.out).write_text(head + yaml.safe_dump(raw, sort_keys=False, width=200))
    KVQuantConfig.load(args.out).validate(shape)
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
