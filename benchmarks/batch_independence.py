"""Batch independence on stories260K: max |logit difference| between prompt A decoded alone and A's
row when batched after a longer prompt (so A is left-padded), 8 greedy steps, every precision, with and
without sink tokens. Prints a markdown table (0 would be bit-identical; fp32 rounding gives ~1e-5).

    KVQUANT_SHARED=/work/shared python benchmarks/batch_independence.py
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvquant import KVQuantConfig, QuantizedKVCache, wrap
from kvquant.paths import shared_dir
from kvquant.quantizers import PRECISIONS
from kvquant.transformers_compat import cache_kw

A = "Once upon a time, there was a little girl named Lily. She"
LONGER = A + " loved to play outside in the park with her"


def main() -> None:
    path = shared_dir() / "models" / "stories260K" / "hf"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    wrap(model, "fp32")  # the kvquant attention reads the caches built below
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


if __name__ == "__main__":
    main()
