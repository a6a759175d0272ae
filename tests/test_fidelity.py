"""Fidelity on the real stories260K model, teacher-forced through the cache one token at a time.

The 200-token FP16 greedy continuation of "Once upon a time" is fed token by token; each
position's logits are compared with FP16's on the same tokens (top-1 agreement, KL(FP16 || q)).
Free-running agreement is printed, not asserted: a 260K-parameter model with head_dim 8 diverges.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

import kvquant
from kvquant.transformers_compat import cache_kw


def teacher_forced_logprobs(model, tokens, prompt_len, cache):
    outs = []
    with torch.no_grad():
        outs.append(model(tokens[:, :prompt_len], **cache_kw(cache), use_cache=True).logits[:, -1])
        for t in range(prompt_len, tokens.shape[1] - 1):
            outs.append(model(tokens[:, t:t + 1], **cache_kw(cache), use_cache=True).logits[:, -1])
    return torch.cat(outs).float().log_softmax(-1)


def test_int8_tracks_fp16_and_beats_int4(stories):
    model, tok = stories
    prompt = tok("Once upon a time", return_tensors="pt").input_ids
    with torch.no_grad():
        full = model.generate(prompt, max_new_tokens=200, do_sample=False,
                              **cache_kw(DynamicCache(config=model.config)))
    P = prompt.shape[1]
    ref = teacher_forced_logprobs(model, full, P, DynamicCache(config=model.config))
    kvquant.wrap(model, "fp16")
    results = {}
    for name in ["fp16", "int8", "int8-token", "int4"]:
        lp = teacher_forced_logprobs(model, full, P, kvquant.QuantizedKVCache(model, name))
        top1 = (lp.argmax(-1) == ref.argmax(-1)).float().mean().item()
        kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
        free = model.generate(prompt, max_new_tokens=200, do_sample=False,
                              **cache_kw(kvquant.QuantizedKVCache(model, name)))
        agree = (free[0, P:] == full[0, P:]).float().mean().item()
        results[name] = (top1, kl)
        print(f"{name:11s} teacher-forced top1={top1:.3f} KL={kl:.5f} | free-running agreement {agree:.3f}")
    assert results["fp16"][0] == 1.0 and results["fp16"][1] < 1e-6
    # each INT8 scheme held to its own bound (measured: int8-token top-1 0.995, KL 0.00075; the static
    # shared-scale int8 top-1 0.980, KL 0.0051; int4 top-1 0.835, KL 0.187)
    assert results["int8-token"][0] >= 0.985 and results["int8-token"][1] < 0.003
    assert results["int8"][0] >= 0.96 and results["int8"][1] < 0.02
    assert results["int4"][0] >= 0.75 and results["int4"][1] < 0.4
    assert results["int8"][1] < results["int4"][1] and results["int8-token"][1] < results["int4"][1]
