"""Beam search over a 512-token prompt on SmolLM2-135M: peak bytes held by 4 beams vs 1 beam, and the
quantized bytes moved by copy-on-write, for int8-token and int4 at block_size 16 and 128.

    python benchmarks/paged_sharing.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import LogitsProcessorList

import kvquant
from kvquant.models import load_model

sys.path.insert(0, str(Path(__file__).parent))
from decode_throughput import PeakBytes  # noqa: E402

from kvquant.transformers_compat import cache_kw


def main() -> None:
    model = load_model("smollm2-135m", progress=False).model
    kvquant.wrap(model, "int8-token")
    vocab = model.config.vocab_size
    ids = torch.randint(100, vocab - 100, (1, 512), generator=torch.Generator().manual_seed(1))
    for preset in ("int8-token", "int4"):
        for block in (16, 128):
            cfg = kvquant.KVQuantConfig.load({**kvquant.KVQuantConfig.load(preset).to_dict(), "block_size": block})
            peak, rep = {}, {}
            for beams in (1, 4):
                cache = kvquant.QuantizedKVCache(model, cfg)
                watch = PeakBytes(cache)
                with torch.no_grad():
                    model.generate(ids, **cache_kw(cache), max_new_tokens=3, num_beams=beams, do_sample=False,
                                   logits_processor=LogitsProcessorList([watch]))  # fmt: skip
                peak[beams], rep[beams] = watch.peak, cache.memory_report()
            bound = 3 * 4 * rep[4]["bytes_per_block_all_layers"]
            print(f"SmolLM2-135M {preset} block {block}: 4 beams / 1 beam peak bytes = {peak[4] / peak[1]:.3f} "
                  f"({peak[4]} / {peak[1]}); bytes moved by copy-on-write {rep[4]['bytes_moved']} "
                  f"(bound: 3 steps x 4 rows x one block of every layer = {bound})", flush=True)


if __name__ == "__main__":
    main()
