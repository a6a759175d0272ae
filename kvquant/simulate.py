"""The ``simulated`` protocol: fake quantization at every position (the KVQuant paper's protocol).

``SimulatedQuantCache`` is a ``DynamicCache``-like cache whose layers quantize-then-dequantize the
K/V they are given (the current chunk included) and keep the dequantized values. Use it with a
model whose attention is SDPA or eager (not :func:`kvquant.wrap`), in one forward over a window:
every attention layer then sees quantized K/V at all positions, including each token's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .config import KVPrecision, KVQuantConfig
from .errors import ConfigError
from .scales import load_static_amax
from .shape import ModelShape, model_dtype
from .store import LayerStore


class SimulatedLayer(DynamicLayer):
    """A ``DynamicLayer`` that stores fake-quantized K/V (static scales from its first chunk)."""

    def __init__(self, row: list[KVPrecision], config: KVQuantConfig, head_dim: int,
                 static_amax: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.row, self.kv_config, self.head_dim, self.static_amax = row, config, head_dim, static_amax
        self.quant: LayerStore | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.quant is None:
            self.quant = LayerStore(self.row, self.kv_config, self.head_dim, key_states.shape[0],
                                    key_states.device, static_amax=self.static_amax)
        k, v = self.quant.fake_quantize(key_states, value_states)
        return super().update(k, v)

    def reset(self) -> None:
        super().reset()
        self.quant = None


class SimulatedQuantCache(Cache):
    """Fake-quantizing cache for the ``simulated`` protocol (see module doc)."""

    def __init__(self, model: Any, config: KVQuantConfig | str | Path) -> None:
        self.kv_config = KVQuantConfig.load(config)
        if self.kv_config.evict is not None:
            raise ConfigError("evict: the simulated protocol fake-quantizes every position of one forward and keeps "
                              "every token; eviction needs the decode protocol (a QuantizedKVCache)")
        shape = ModelShape.of(model)
        plan = self.kv_config.resolve(shape)
        # calibration text, never the window scored
        static = load_static_amax(self.kv_config.scales_file, shape, model_dtype(model))
        super().__init__(layers=[SimulatedLayer(row, self.kv_config, shape.head_dim, static[i] if static else None)
                                 for i, row in enumerate(plan)])
