"""Attention over the quantized KV store: a pure-torch path (CPU, reference) and Triton kernels (CUDA).

``attend(...)`` picks the implementation: Triton on CUDA when the shapes are supported, torch
otherwise; ``KVQUANT_ATTENTION=torch|triton`` forces one.
"""

from .attention_torch import attend_naive, attend_torch, dequantize_history
from .dispatch import attend, backend_for

__all__ = ["attend", "attend_naive", "attend_torch", "backend_for", "dequantize_history"]
