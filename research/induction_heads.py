"""Induction (copy) score of every (layer, KV head) of a model: which heads find an earlier occurrence and copy on.

    python research/induction_heads.py smollm2-135m --length 200 --batch 4 --top 12 --json induction.json

A random token sequence of ``--length`` tokens is repeated once; at each position ``i`` of the second copy an
induction head attends to position ``i - length + 1``, the token that followed the same token the first time. A
query head's score is its mean attention weight there; a KV head's score is the largest of its query heads'
(GQA). Scores near 1 mark the heads a copied (often rare) token depends on. Eager attention, the model's own dtype
and device.

Used in issue 14 to ask whether copy heads need rotated (``tq4``) keys rather than per-channel ``tqc`` widths
(docs/results/lowbit-smollm2.md, "Held-out Δppl follows KL").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvquant.models import load_model


def induction_scores(model: torch.nn.Module, length: int = 200, batch: int = 4, seed: int = 0,
                     vocab: tuple[int, int] | None = None) -> dict[str, float]:  # fmt: skip
    """``{"layer.kv_head": score}`` (see the module doc). ``vocab``: the token id range to draw from (default: the
    upper 90% of the vocabulary, away from special tokens)."""
    cfg = model.config
    n_vocab = cfg.vocab_size
    lo, hi = vocab or (n_vocab // 10, n_vocab)
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(lo, hi, (batch, length), generator=g)
    ids = torch.cat([seq, seq], dim=1).to(next(model.parameters()).device)
    impl = cfg._attn_implementation
    cfg._attn_implementation = "eager"  # attention weights are returned by the eager path only
    try:
        with torch.no_grad():
            out = model(ids, output_attentions=True)
    finally:
        cfg._attn_implementation = impl
    if not out.attentions or out.attentions[0] is None:
        raise SystemExit("the model returned no attention weights (eager attention unavailable)")
    hq, hkv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    rep = hq // hkv
    pos = torch.arange(length + 1, 2 * length, device=ids.device)
    scores = {}
    for layer, a in enumerate(out.attentions):  # [B, Hq, T, T]
        per_q = a[:, :, pos, pos - length + 1].float().mean(dim=(0, 2))
        for h in range(hkv):
            scores[f"{layer}.{h}"] = float(per_q[h * rep:(h + 1) * rep].max())
    return scores


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a model name kvquant eval knows (e.g. smollm2-135m) or a local path")
    ap.add_argument("--length", type=int, default=200, help="tokens in the random sequence (repeated once)")
    ap.add_argument("--batch", type=int, default=4, help="random sequences averaged over")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top", type=int, default=12, help="heads to print, highest score first")
    ap.add_argument("--json", default=None, help="write every head's score here")
    args = ap.parse_args(argv)
    if args.length < 2 or args.batch < 1:
        raise SystemExit("--length must be >= 2 and --batch >= 1")
    lm = load_model(args.model, dtype=torch.float32, device="cpu", progress=False)
    scores = induction_scores(lm.model, args.length, args.batch, args.seed)
    for head, s in sorted(scores.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{head:>6}  {s:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(scores, indent=0))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
