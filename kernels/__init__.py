"""Attention over the quantized KV store: a pure-torch path (CPU, reference) and Triton kernels (CUDA).

``attend(...)`` picks the implementation: Triton on CUDA when the shapes are supported, torch
otherwise; ``KVQUANT_ATTENTION=torch|triton`` forces one.

Installed as ``kvquant.kernels``. The names below load lazily, so that importing this folder by
accident as a top-level ``kernels`` (Python started in the repository root, where transformers
probes for the unrelated ``kernels`` package) costs nothing and imports nothing.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "attend": ".dispatch",
    "backend_for": ".dispatch",
    "attend_torch": ".attention_torch",
    "attend_naive": ".attention_torch",
    "dequantize_history": ".attention_torch",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value  # later lookups (one per layer and step) skip this hook
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
