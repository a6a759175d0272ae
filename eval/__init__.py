"""``kvquant.eval``: measure what a KV-cache configuration costs, against FP16 and against the usual baselines.

The pieces, each usable on its own:

- :mod:`~kvquant.eval.models`    load a model: hub id, local directory, GGUF file, or ``smollm2-135m``
- :mod:`~kvquant.eval.data`      load text and cut it into token windows (hub datasets, files, offline corpus)
- :mod:`~kvquant.eval.protocols` the ``simulated`` and ``decode`` protocols, and free-generation drift
- :mod:`~kvquant.eval.metrics`   KL(FP16 || quantized) mean / p99, top-1 agreement, |delta p|, perplexity
- :mod:`~kvquant.eval.baselines` transformers' QuantizedCache (HQQ, quanto, FP8) and bitsandbytes blockwise
- :mod:`~kvquant.eval.recipe`    the YAML recipe schema (one-line errors that name the field)
- :mod:`~kvquant.eval.runner`    run a recipe end to end
- :mod:`~kvquant.eval.report`    table, ``results.json``, ``report.md`` and the bits-vs-quality plot

Every number is labelled with the protocol it was measured on; the two protocols are never mixed.
"""

from __future__ import annotations

__all__ = ["Recipe", "RecipeError", "load_recipe", "run_recipe"]


def __getattr__(name: str):  # lazy: importing kvquant.eval must stay cheap (the CLI imports it)
    if name in ("Recipe", "RecipeError", "load_recipe"):
        from . import recipe

        return getattr(recipe, name)
    if name == "run_recipe":
        from .runner import run_recipe

        return run_recipe
    raise AttributeError(name)
