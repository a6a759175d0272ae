"""Does the outlier warning (kvquant.outliers) fire? One prefill per (model, preset), on real text.

    python benchmarks/outlier_warning.py
    python benchmarks/outlier_warning.py --models smollm2-135m,smollm2-135m+kbias --presets int8,int8-kchannel

For each model (stress variants allowed, ``smollm2-135m+kbias``) and preset: a ``QuantizedKVCache``
with that preset takes a prefill of ``--tokens`` WikiText-2 tokens (from $KVQUANT_SHARED, offline) and
one decode step; the script prints whether kvquant logged its outlier warning (and its text), and
the key statistics of the prefill (largest offset / outlier ratio over layers and heads, the
quantities the warning thresholds). Issue 10's acceptance: it fires on a stress model with the
static ``int8`` preset and stays silent on SmolLM2 with the default preset.
"""

from __future__ import annotations

import argparse
import logging

import torch

from kvquant import DEFAULT_PRESET, QuantizedKVCache
from kvquant.attention import install_attention
from kvquant.models import load_model
from kvquant.outliers import key_channel_ratios
from kvquant.text import load_text, tokenize
from kvquant.transformers_compat import cache_kw, output_cache


class _Catch(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2-135m,smollm2-135m+koutlier,smollm2-135m+kbias,smollm2-135m+wide256")
    p.add_argument("--presets", default=f"int8,{DEFAULT_PRESET}")
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    text = load_text("wikitext-2")
    catch = _Catch()
    logging.getLogger("kvquant").addHandler(catch)
    print(f"prefill: the first {args.tokens} WikiText-2 test tokens, then one decode step")
    print("| model | offset ratio | outlier ratio | preset | warning |")
    print("|---|---:|---:|---|---|")
    for spec in args.models.split(","):
        lm = load_model(spec, progress=False)
        model = lm.model
        install_attention(model)
        ids = tokenize(text.text, lm.tokenizer)[: args.tokens].unsqueeze(0)
        with torch.no_grad():
            keys = output_cache(model(ids, use_cache=True))
            ratios = [key_channel_ratios(layer.keys) for layer in keys.layers]
        offset, outlier = max(r[0] for r in ratios), max(r[1] for r in ratios)
        for preset in args.presets.split(","):
            catch.messages.clear()
            cache = QuantizedKVCache(model, preset)
            with torch.no_grad():
                model(ids, **cache_kw(cache), use_cache=True)
                model(ids[:, -1:], **cache_kw(cache), use_cache=True)
            found = [m for m in catch.messages if "channels" in m]
            said = f"**fires** ({len(found)}x): {found[0]}" if found else "silent"
            print(f"| {spec} | {offset:.1f} | {outlier:.1f} | {preset} | {said} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
