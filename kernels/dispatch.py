"""Choose the attention implementation for one call: Triton on CUDA, torch elsewhere.

``KVQUANT_ATTENTION=torch`` or ``=triton`` forces one (``triton`` on CPU needs
``TRITON_INTERPRET=1``). When Triton cannot serve a call (unsupported head_dim, precision or
mask), the torch path runs instead and the reason is logged once.
"""

from __future__ import annotations

import logging
import os

import torch

from kvquant.snapshot import KVSnapshot, SnapshotSource, as_snapshot

from .attention_torch import attend_torch
from .unsupported import Unsupported

logger = logging.getLogger("kvquant")
_logged: set[str] = set()

__all__ = ["Unsupported", "attend", "backend_for"]


def _log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        logger.warning("kvquant: Triton attention unavailable, using the torch path (%s)", reason)


def backend_for(device: torch.device) -> str:
    forced = os.environ.get("KVQUANT_ATTENTION", "").strip().lower()
    if forced in ("torch", "triton"):
        return forced
    if forced:
        raise ValueError(f"KVQUANT_ATTENTION: {forced!r} is not one of torch, triton")
    return "triton" if device.type == "cuda" else "torch"


def attend(
    query: torch.Tensor,
    fresh_k: torch.Tensor,
    fresh_v: torch.Tensor,
    layer: KVSnapshot | SnapshotSource,
    past_len: int,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of ``query[B, Hq, Tq, D]`` over the store's history and the fresh chunk.

    ``layer``: the layer's :class:`~kvquant.snapshot.KVSnapshot`, or its store (which publishes one; it is taken
    once per call, after the chunk was written).

    ``softcap`` (Gemma 2's attention logit softcapping): scores become ``softcap * tanh(scores / softcap)``
    before masking and softmax.

    With ``rotate`` on, queries and the fresh K (and V) are rotated into the store's space first
    and the output rotated back (the Hadamard matrix is its own inverse); with ``center_keys`` the
    fresh K loses the same per-channel mean as the stored keys (softmax ignores the common shift).
    Heads stored by a codebook quantizer (``tq*``) are then mapped into their own head space the same way
    (:attr:`~kvquant.snapshot.StorageSpace.query_to_head`), once per call; both paths then read the
    codebook codes in that space (Triton: :mod:`~kernels.triton_codebook`) and the output of a V head
    is mapped back once.
    """
    snap = as_snapshot(layer)
    space = snap.space
    if softcap is not None and space.key_mean is not None:
        # softcapping is not shift-invariant: q.(k - mu) would change the capped scores
        raise NotImplementedError(
            "center_keys: key centering is exact only without attention logit softcapping; "
            "set center_keys: false for this model"
        )
    if space.transforms:
        query = space.query_in(query)
        fresh_k, fresh_v = space.to_storage(fresh_k, fresh_v)
    head_space = space.head_space
    if head_space and softcap is not None and space.centered_keys:
        # q . (k - mu) shifts every score of a query alike: exact for softmax, not under tanh capping
        raise NotImplementedError(
            "softcap: codebook (tq*) keys remove a per-channel key mean, which is not exact under attention "
            "logit softcapping; use int*/fp8 keys on this model"
        )
    if head_space:  # codebook heads: queries rotated once per step, stored rows never un-rotated
        query = space.query_to_head(query)
        fresh_k, fresh_v = space.kv_to_head(fresh_k, fresh_v)
    slots = snap.slots
    mass = None
    use_triton = backend_for(query.device) == "triton"
    if slots is not None:  # an evicting layer: its history axis holds slots (kvquant.slots)
        mask = slots.attention_mask(mask, past_len, query.shape[2], query.shape[1] // snap.num_heads)
        if slots.tracking:  # H2O / TOVA: the attention returns each history slot's probability mass
            mass = torch.zeros((snap.batch, snap.num_heads, past_len), device=query.device)
        if use_triton and (snap.lanes or mass is not None or slots.holes):
            use_triton = False
            _log_once("eviction: per-key score mass (h2o/tova) and per-head kept sets of different sizes "
                      "(adakv) are read by the torch path only")  # fmt: skip
    out = None
    if use_triton:
        try:
            from .triton_attention import attend_triton

            with snap.staged() as staged:  # offloaded blocks: staged into device blocks for the kernels' tables
                out = attend_triton(query, fresh_k, fresh_v, staged, past_len, mask, scaling, softcap=softcap)
        except (Unsupported, ImportError) as e:
            _log_once(f"{type(e).__name__}: {e}")
    if out is None:
        out = attend_torch(query, fresh_k, fresh_v, snap, past_len, mask, scaling, softcap, key_mass=mass)
    if mass is not None and slots is not None:
        slots.observe(mass)
    if head_space:
        out = space.output_from_head(out)
    return space.output_out(out)
