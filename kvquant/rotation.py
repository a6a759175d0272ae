"""Hadamard rotation of K (and Q), optionally of V, per head (QuaRot / llama.cpp style).

``H`` is the normalised Walsh-Hadamard matrix of size head_dim (a power of two): symmetric and
orthonormal, so ``H @ H = I``. Rotating keys and queries alike keeps every score exact::

    (q H) . (k H) = q . k

while spreading a few outlier channels over all channels, so per-token quantization of ``k H``
loses far less. Rotating V too is undone on the attention output: ``(P (V H)) H = P V``.
"""

from __future__ import annotations

import functools
import math

import torch

from .errors import ConfigError

MATMUL_MAX_DIM = 512  # up to this head_dim the transform is one product with a cached matrix


@functools.lru_cache(maxsize=16)
def hadamard(d: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalised ``d x d`` Walsh-Hadamard matrix (``d`` a power of two), Sylvester's construction."""
    if d < 1 or d & (d - 1):
        raise ConfigError(f"head_dim: {d} is not a power of two; the Hadamard rotation needs one")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(device=device, dtype=dtype)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Normalised Walsh-Hadamard transform along the last dim (a power of two): ``x @ H``.

    One matrix product with a cached ``H`` up to :data:`MATMUL_MAX_DIM` (a decode step rotates a few
    rows per layer, where the butterfly's many small ops cost ~6x more on CPU), the butterfly beyond."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ConfigError(f"head_dim: {d} is not a power of two; the Hadamard rotation needs one")
    if d <= MATMUL_MAX_DIM:
        return x @ hadamard(d, x.dtype, x.device)
    lead = x.shape[:-1]
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(*lead, d) * (1.0 / math.sqrt(d))).to(x.dtype)
