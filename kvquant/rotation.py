"""Hadamard rotation of K (and Q), optionally of V, per head (QuaRot / llama.cpp style).

``H`` is the normalised Walsh-Hadamard matrix of size head_dim (a power of two): symmetric and
orthonormal, so ``H @ H = I``. Rotating keys and queries alike keeps every score exact::

    (q H) . (k H) = q . k

while spreading a few outlier channels over all channels, so per-token quantization of ``k H``
loses far less. Rotating V too is undone on the attention output: ``(P (V H)) H = P V``.
"""

from __future__ import annotations

import math

import torch


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Fast Walsh-Hadamard transform along the last dim (a power of two), normalised: ``x @ H``."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"head_dim: {d} is not a power of two; the Hadamard rotation needs one")
    lead = x.shape[:-1]
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(*lead, d) * (1.0 / math.sqrt(d))).to(x.dtype)
