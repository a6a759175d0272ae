"""Which side of a config loses: its key precision with fp16 values, and its value precision with fp16 keys.

    python benchmarks/kv_side_probe.py --model qwen2.5-coder-0.5b
    python benchmarks/kv_side_probe.py --model gemma3-270m --window 576 --prefill 384

One WikiText-2 window ($KVQUANT_SHARED/data), prefilled through the cache, then its remaining tokens fed
``--chunk`` per forward (teacher-forced); KL(reference || config) and top-1 agreement against the unquantized
cache, for each (key, value) pair below. The tq pairs carry tq3-r8s1's 4 fp16 sinks and 8-token fp16 residual
(``residual_step`` 1, blocks of 16); the int4-channel pair 4 fp16 sinks, as int4-kchannel-sinks.
"""

from __future__ import annotations

import argparse

import torch

from kvquant import KVQuantConfig, QuantizedKVCache
from kvquant.attention import install_attention
from kvquant.eval.baselines import ReferenceMethod
from kvquant.eval.metrics import summarize
from kvquant.eval.protocols import decode_logits
from kvquant.models import load_model
from kvquant.text import load_text, token_windows, tokenize, window_bos

PAIRS = [("tq3", "tq3"), ("tq3", "fp16"), ("fp16", "tq3"), ("tq4", "fp16"), ("int4-channel", "fp16")]
TQ_EXTRA = {"sink_tokens": 4, "residual_tokens": 8, "residual_step": 1, "block_size": 16}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--window", type=int, default=576)
    p.add_argument("--prefill", type=int, default=384)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    lm = load_model(a.model, progress=False)
    model, tok = lm.model, lm.tokenizer
    text = load_text("wikitext-2").text[:20000]
    w = token_windows(tokenize(text, tok), a.window, max_windows=1, bos_id=window_bos(tok, "auto"),
                      min_score_from=a.prefill + 1)[0]
    with torch.no_grad():
        ref = decode_logits(model, w, ReferenceMethod().decode_cache(model), a.prefill, a.chunk)
        for key, value in PAIRS:
            extra = TQ_EXTRA if "tq" in key + value else {"sink_tokens": 4}
            cfg = KVQuantConfig.from_dict({"default": {"key": key, "value": value}, **extra})
            install_attention(model)
            q = decode_logits(model, w, QuantizedKVCache(model, cfg), a.prefill, a.chunk)
            model.set_attn_implementation("sdpa")
            s = summarize(ref.logits, q.logits, ref.targets)
            print(f"K {key:13s} V {value:5s} KL {s['kl_mean']:.4f} top-1 {s['top1']:.3f}", flush=True)


if __name__ == "__main__":
    main()
