"""Batch independence on stories260K: a request's logits alone vs. in a batch with other requests.

Two measurements, each printed as a markdown table (0 would be bit-identical; fp32 rounding gives ~1e-5):

* ``--mode similar`` (issue 11): prompt A decoded alone vs. A's row when batched after a longer prompt (A
  left-padded by 10 tokens), 8 greedy steps, every precision, with and without sink tokens.
* ``--mode lengths`` (issue 38): teacher-forced. Row 0 holds 60 real tokens, row 1 holds 3 real tokens
  left-padded to 60 (and, with ``--long``, row 2 holds 500); every row is then fed the same 24 next tokens,
  one decode step at a time. Max |logit difference| of each row (all steps, whole vocabulary) against that
  row's prompt run alone, per precision and preset.

    KVQUANT_SHARED=/work/shared python benchmarks/batch_independence.py --mode lengths

:func:`teacher_forced` is also what ``tests/test_batch_independence.py`` runs.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvquant import KVQuantConfig, QuantizedKVCache, wrap
from kvquant.config import PRESETS
from kvquant.errors import ConfigError
from kvquant.paths import shared_dir
from kvquant.quantizers import PRECISIONS
from kvquant.transformers_compat import cache_kw

A = "Once upon a time, there was a little girl named Lily. She"
LONGER = A + " loved to play outside in the park with her"
LENGTHS = (60, 3)
STEPS = 24


def teacher_forced(
    model: Any, prompts: list[list[int]], follow: list[list[int]], config: Any, pad_id: int = 0, chunk: int = 1,
    caches: list[Any] | None = None,
) -> torch.Tensor:
    """Logits ``[B, 1 + steps, vocab]`` of ``prompts`` (left-padded to the longest, one prefill), then of the
    tokens ``follow[b]`` fed ``chunk`` at a time (1: one decode step each), through a fresh
    ``QuantizedKVCache(model, config)``; positions count each row's real tokens only (what ``generate`` passes for
    a left-padded batch). ``caches``: the cache is appended to it (for a caller that inspects it after the run)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    cache = QuantizedKVCache(model, config)
    if caches is not None:
        caches.append(cache)
    out = []
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kw(cache), use_cache=True).logits
        out.append(logits[:, -1:].float())
        for t in range(0, len(follow[0]), chunk):
            step = torch.tensor([f[t:t + chunk] for f in follow])
            mask = torch.cat([mask, torch.ones_like(step)], dim=1)
            pos = pos[:, -1:] + 1 + torch.arange(step.shape[1])
            out.append(model(input_ids=step, attention_mask=mask, position_ids=pos, **cache_kw(cache),
                             use_cache=True).logits.float())
    return torch.cat(out, dim=1)


def row_drift(
    model: Any, prompts: list[list[int]], follow: list[list[int]], config: Any, chunk: int = 1
) -> list[tuple[float, bool]]:
    """Per row: max |logit difference| batched vs. the same row alone (:func:`teacher_forced`), and whether the
    greedy token (the argmax) of every step is the same."""
    batched = teacher_forced(model, prompts, follow, config, chunk=chunk)
    out = []
    for b, p in enumerate(prompts):
        alone = teacher_forced(model, [p], [follow[b]], config, chunk=chunk)[0]
        out.append((float((batched[b] - alone).abs().max()), bool(torch.equal(batched[b].argmax(-1),
                                                                              alone.argmax(-1)))))
    return out


def story_ids(tok: Any, text: str, lengths: tuple[int, ...], steps: int) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of ``lengths`` tokens cut from different places of ``text``, and ``steps`` next tokens each."""
    ids = tok(text)["input_ids"]
    prompts, follow = [], []
    at = 0
    for n in lengths:
        prompts.append(ids[at:at + n])
        follow.append(ids[at + n:at + n + steps])
        at += n + steps
    return prompts, follow


def configs() -> list[tuple[str, KVQuantConfig]]:
    """Every precision (block_size 16) and every preset."""
    out = [(p, KVQuantConfig.from_dict({"default": p, "block_size": 16})) for p in sorted(PRECISIONS)]
    return out + [(f"preset {name}", KVQuantConfig.preset(name)) for name in PRESETS]


def load() -> tuple[Any, Any]:
    path = shared_dir() / "models" / "stories260K" / "hf"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    wrap(model, "fp32")  # the kvquant attention reads the caches built below
    return model, tok


def similar(model: Any, tok: Any) -> None:
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.unk_token or tok.eos_token

    def logits(prompts: list[str], cfg: KVQuantConfig) -> tuple[torch.Tensor, torch.Tensor]:
        enc = tok(prompts, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, **cache_kw(QuantizedKVCache(model, cfg)), max_new_tokens=8, do_sample=False,
                                 pad_token_id=tok.pad_token_id, output_logits=True, return_dict_in_generate=True)
        return out.sequences[:, enc["input_ids"].shape[1]:], torch.stack(out.logits, 1)

    print("| precision | max abs logit diff | same greedy tokens | with 3 sinks: diff | same tokens |")
    print("|---|---:|:-:|---:|:-:|")
    for prec in sorted(PRECISIONS):
        cells = []
        for extra in ({}, {"sink_tokens": 3}):
            cfg = KVQuantConfig.from_dict({"default": prec, "block_size": 16, **extra})
            seq_a, log_a = logits([A], cfg)
            seq_b, log_b = logits([LONGER, A], cfg)
            cells += [f"{(log_a[0] - log_b[1]).abs().max().item():.1e}", str(bool(torch.equal(seq_a[0], seq_b[1])))]
        print(f"| {prec} | " + " | ".join(cells) + " |")


def lengths(model: Any, tok: Any, long: bool) -> None:
    text = (shared_dir() / "data" / "tinystories-valid-sample.txt").read_text()
    sizes = (*LENGTHS, 440) if long else LENGTHS
    prompts, follow = story_ids(tok, text, sizes, STEPS)
    heads = " | ".join(f"row {i} ({n} tokens) | same argmax" for i, n in enumerate(sizes))
    print(f"| config | {heads} |")
    print("|---|" + "---:|:-:|" * len(sizes))
    for name, cfg in configs():
        try:
            drift = row_drift(model, prompts, follow, cfg)
        except ConfigError as e:  # a preset this model's shape cannot take (e.g. group_size > head_dim)
            print(f"| {name} | n/a: {e} |")
            continue
        print(f"| {name} | " + " | ".join(f"{d:.1e} | {'yes' if same else 'NO'}" for d, same in drift) + " |",
              flush=True)


BATCHMATE_CONFIGS = [  # issue 38: the cases a short batch-mate used to change (beyond the static scales)
    ("int4, residual_tokens 8", {"default": "int4", "residual_tokens": 8}),
    ("int8, residual_tokens 8, 3 sinks", {"default": "int8", "residual_tokens": 8, "sink_tokens": 3}),
    ("tq3, residual_tokens 8", {"default": "tq3", "residual_tokens": 8}),
    ("tq3, heavy_tokens 4", {"default": "tq3", "heavy_tokens": 4}),
    ("int8, evict snapkv (uniform)", {"default": "int8", "evict": {
        "policy": "snapkv", "keep": 0.5, "window": 8, "sinks": 2, "budget": "uniform"}}),
    ("int8, evict snapkv (adakv lanes)", {"default": "int8", "evict": {
        "policy": "snapkv", "keep": 0.5, "window": 8, "sinks": 2, "budget": "adakv"}}),
    ("int8, evict h2o", {"default": "int8", "evict": {"policy": "h2o", "keep": 0.5, "window": 8, "sinks": 2}}),
    ("int2-channel (per-row block grids)", {"default": "int2-channel"}),
    ("int4-channel (per-row block grids)", {"default": "int4-channel"}),
    ("int8-kchannel (per-row block grids)", {"default": {"key": "int8-channel", "value": "int8-token"}}),
    ("int4-kchannel-sinks (per-row block grids)",
     {"default": {"key": "int4-channel", "value": "int4"}, "sink_tokens": 4}),
]


def batchmates(model: Any, tok: Any) -> None:
    """Rows of 60 and 3 tokens, one decode step at a time, and of 60, 3 and 440 tokens, in chunks of 8."""
    text = (shared_dir() / "data" / "tinystories-valid-sample.txt").read_text()
    prompts, follow = story_ids(tok, text, (*LENGTHS, 440), STEPS)
    print("| config | 60 / 3, decode: row 0 | row 1 | 60 / 3 / 440, chunks of 8: row 0 | row 1 | row 2 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, raw in BATCHMATE_CONFIGS:
        cfg = KVQuantConfig.from_dict({"block_size": 16, **raw})
        cells = [f"{d:.1e}{'' if same else ' (tokens differ)'}"
                 for n, chunk in ((2, 1), (3, 8)) for d, same in row_drift(model, prompts[:n], follow[:n], cfg, chunk)]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("similar", "lengths", "batchmates"), default="lengths")
    ap.add_argument("--long", action="store_true", help="lengths: a third row of 440 tokens (context 512)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load()
    if args.mode == "similar":
        similar(model, tok)
    elif args.mode == "batchmates":
        batchmates(model, tok)
    else:
        lengths(model, tok, args.long)


if __name__ == "__main__":
    main()
