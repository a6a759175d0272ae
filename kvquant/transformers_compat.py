"""Where transformers' API differs inside the range ``pyproject.toml`` supports, detected from transformers itself.

Each name here is decided once, at import, by looking at the installed transformers (its signatures and
classes), never at its version number, so a backport or a release candidate is judged by what it has.

* :data:`CACHE_ARG`: the keyword that hands a ``Cache`` to a model's ``forward()`` and ``generate()``.
  transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name is deprecated there, and removed
  from ``forward()`` in a later 5.x); earlier releases know only ``past_key_values`` and, worse, let an unknown
  ``cache=`` through ``forward(**kwargs)`` unused, so a wrong name silently runs without the cache.
  Call ``model(ids, **cache_kw(cache))`` to work on both.
* :data:`HF_QUANTIZED_BACKENDS`: the backends transformers' ``QuantizedCache`` has (``fp8`` came in 5.22).
"""

from __future__ import annotations

import inspect
from typing import Any

from transformers import cache_utils
from transformers.generation.utils import GenerationMixin


def _cache_arg() -> str:
    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


CACHE_ARG: str = _cache_arg()

#: ``QuantizedCache(backend=...)`` names whose layer class this transformers defines.
HF_QUANTIZED_BACKENDS: frozenset[str] = frozenset(
    name
    for name, layer_class in (("quanto", "QuantoQuantizedLayer"), ("hqq", "HQQQuantizedLayer"),
                              ("fp8", "Fp8QuantizedLayer"))
    if hasattr(cache_utils, layer_class)
)


def cache_kw(cache: Any) -> dict[str, Any]:
    """``{CACHE_ARG: cache}``: the keyword argument that passes ``cache`` to ``forward()`` / ``generate()``."""
    return {CACHE_ARG: cache}


def output_cache(output: Any) -> Any:
    """The cache a model's forward output carries (``output.cache``, or ``output.past_key_values`` before 5.24)."""
    return getattr(output, CACHE_ARG)
