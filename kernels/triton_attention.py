"""``attend_triton``: Triton attention over the quantized store, with the semantics of ``attend_torch``.

    attend_triton(query, fresh_k, fresh_v, layer, past_len, mask, scaling) -> out[B, Hq, Tq, D]

* ``Tq == 1`` (decode): split-K flash-decoding (:mod:`triton_decode`), the fresh token merged in the
  reduction kernel.
* ``Tq > 1`` (chunk / prefill): :mod:`triton_chunk`, causal inside the chunk.

Raises :class:`~kvquant.kernels.dispatch.Unsupported` (the dispatcher then runs the torch path and
logs the reason once) for: head_dim not a power of two in [16, 256]; a device Triton cannot run on
(CPU without ``TRITON_INTERPRET=1``); masks that are not one contiguous key range per query row,
or that differ between heads; quantizers without a kernel path (per-channel key blocks); stores
with full-precision history segments (sink tokens, residual window). Hadamard rotation is handled
by the caller (:func:`kvquant.kernels.dispatch.attend` rotates queries / fresh K/V into the store's
space and the output back), so the kernels never see it.

Mixed per-head precision: one launch per head group (a group = the KV heads sharing a (K, V)
precision pair, stored in their own part tensors). Chosen over a per-head dtype table because
(1) the store already keeps each group in separate tensors with different part shapes (int4 packs
D/2 bytes plus scale/zero parts, int8 D bytes, fp16 2D bytes), so a table kernel would need
per-head pointer/stride tables and runtime branches over every format; (2) with the format a
``constexpr``, each launch compiles only its own dequantization, which keeps registers and
instruction cache small; (3) the cost is one extra launch per extra group (a few microseconds;
typical configs have 1-2 groups per layer), and the decode reduction is shared by all groups. Not
measured on a GPU yet: no GPU was available when this was written (see docs/results/).
"""

from __future__ import annotations

import weakref

import torch

from kvquant.store import LayerStore

from .dispatch import Unsupported
from .triton_chunk import BLOCK_M, _chunk_attn, chunk
from .triton_decode import decode
from .triton_dequant import dot_kind, native_fp8, operand

MAX_REP = 128  # query heads per KV head held in one program


def interpreted() -> bool:
    """True when the kernels were built by Triton's interpreter (``TRITON_INTERPRET=1`` at import)."""
    return type(_chunk_attn).__name__ == "InterpretedFunction"


def check_shapes(query: torch.Tensor, fresh_k: torch.Tensor, fresh_v: torch.Tensor, layer: LayerStore) -> None:
    """Raise :class:`Unsupported` (with the reason) for inputs the kernels do not serve."""
    B, Hq, Tq, D = query.shape
    if query.device.type == "cpu" and not interpreted():
        raise Unsupported("Triton on CPU needs TRITON_INTERPRET=1 (set before kvquant's kernels are imported)")
    if query.device.type not in ("cuda", "cpu"):
        raise Unsupported(f"device {query.device.type}: no Triton path")
    if D < 16 or D > 256 or D & (D - 1):
        raise Unsupported(f"head_dim {D}: the Triton kernels need a power of two in [16, 256]")
    if layer.head_dim != D:
        raise Unsupported(f"head_dim: query {D}, store {layer.head_dim}")
    Hkv = layer.num_heads
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    if Hq // Hkv > MAX_REP:
        raise Unsupported(f"{Hq // Hkv} query heads per KV head (at most {MAX_REP})")
    if fresh_k.shape != (B, Hkv, Tq, D) or fresh_v.shape != fresh_k.shape:
        raise Unsupported(f"fresh K/V shape {tuple(fresh_k.shape)}, expected {(B, Hkv, Tq, D)}")
    if layer.batch != B:
        raise Unsupported(f"store batch {layer.batch}, query batch {B}")
    if getattr(layer, "has_dense_segments", False):
        raise Unsupported("sink / residual tokens (full-precision history segments) are read by the torch path")
    for t in (query, fresh_k, fresh_v):
        if t.stride(-1) != 1 or t.device != query.device:
            raise Unsupported("query/K/V must share a device and have unit stride along head_dim")


# one-entry cache: transformers builds one mask per forward and passes the same tensor to every layer
_range_cache: dict[str, object] = {}


def key_ranges(
    mask: torch.Tensor | None, batch: int, q_heads: int, q_len: int, past_len: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per (batch row, query position) visible key range ``[lo, hi)`` of the (history + chunk) axis.

    ``None`` for no mask (causal). A boolean mask ``[B or 1, 1 or Hq, Tq, >= past_len + Tq]`` is
    accepted when every row's True entries are one contiguous range (left padding, causal,
    sliding windows) and all heads share it; otherwise :class:`Unsupported`. Rows with no True
    entry get the empty range ``[0, 0)`` (output 0, as the torch path).
    """
    if mask is None:
        return None
    L = past_len + q_len
    key = (mask.shape, mask._version, batch, q_heads, q_len, past_len)
    ref = _range_cache.get("mask")
    if ref is not None and ref() is mask and _range_cache.get("key") == key:
        return _range_cache["ranges"]  # type: ignore[return-value]
    if mask.dtype != torch.bool:
        raise Unsupported(f"mask dtype {mask.dtype}: expected bool")
    if (
        mask.dim() != 4
        or mask.shape[0] not in (1, batch)
        or mask.shape[1] not in (1, q_heads)
        or mask.shape[2] != q_len
        or mask.shape[3] < L
    ):
        raise Unsupported(f"mask shape {tuple(mask.shape)}: expected [{batch}|1, 1|{q_heads}, {q_len}, {L}]")
    m = mask[..., :L]
    if m.shape[1] > 1 and not bool((m == m[:, :1]).all()):
        raise Unsupported("mask differs between heads")
    m = m[:, 0].expand(batch, q_len, L)
    idx = torch.arange(L, device=m.device, dtype=torch.int32)
    lo = torch.where(m, idx, L).amin(-1)
    hi = torch.where(m, idx + 1, 0).amax(-1)
    count = m.sum(-1, dtype=torch.int32)
    if not bool((count == (hi - lo).clamp_min(0)).all()):
        raise Unsupported("mask rows are not contiguous key ranges (e.g. packed sequences); torch path")
    empty = count == 0
    lo = torch.where(empty, 0, lo).to(torch.int32).contiguous()
    hi = torch.where(empty, 0, hi).to(torch.int32).contiguous()
    _range_cache.update(mask=weakref.ref(mask), key=key, ranges=(lo, hi))
    return lo, hi


def attend_triton(
    query: torch.Tensor,
    fresh_k: torch.Tensor,
    fresh_v: torch.Tensor,
    layer: LayerStore,
    past_len: int,
    mask: torch.Tensor | None,
    scaling: float,
    *,
    splits: int | None = None,
    block_m: int | None = None,
) -> torch.Tensor:
    """Attention of ``query[B, Hq, Tq, D]`` over ``layer``'s first ``past_len`` tokens plus the fresh chunk.

    Same arguments and result as :func:`~kvquant.kernels.attention_torch.attend_torch`. ``splits``
    (decode partitions) and ``block_m`` (chunk query rows per program) are for tests and tuning.
    """
    B, Hq, Tq, D = query.shape
    check_shapes(query, fresh_k, fresh_v, layer)
    dk = dot_kind(query.dtype, interpreted())
    ranges = key_ranges(mask, B, Hq, Tq, past_len)
    fp8_native = native_fp8(query.device)
    groups = [
        (g.head_index, operand(g.key, D, fp8_native), operand(g.value, D, fp8_native)) for g in layer.groups
    ]
    if getattr(layer, "q_end", past_len) < past_len:
        raise Unsupported(f"the quantized pool holds {layer.q_end} tokens, the history {past_len}")
    for _, k, v in groups:
        for op in (k, v):
            if op.data.device != query.device or op.data.shape[2] < past_len:
                raise Unsupported("store parts on another device or shorter than past_len")
    # written as [B, Tq, Hq, D] and returned as its [B, Hq, Tq, D] view: the caller's
    # ``out.transpose(1, 2).contiguous()`` is then free
    out = torch.empty((B, Tq, Hq, D), dtype=query.dtype, device=query.device).transpose(1, 2)
    # Triton's interpreter converts fp32 -> bf16 by truncation (compiled code rounds to nearest even):
    # under the interpreter a bf16 result is written in fp32 and rounded by torch
    res = torch.empty(out.shape, device=out.device) if interpreted() and out.dtype == torch.bfloat16 else out
    if Tq == 1:
        decode(query, fresh_k, fresh_v, groups, layer.num_heads, past_len, ranges, scaling, res, dk, splits=splits)
    else:
        chunk(query, fresh_k, fresh_v, groups, layer.num_heads, past_len, ranges, scaling, res, dk,
              block_m=block_m or BLOCK_M)  # fmt: skip
    if res is not out:
        out.copy_(res)
    return out


__all__ = ["attend_triton", "check_shapes", "interpreted", "key_ranges"]
