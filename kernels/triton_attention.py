"""``attend_triton``: Triton attention over the quantized store, with the semantics of ``attend_torch``.

    attend_triton(query, fresh_k, fresh_v, layer, past_len, mask, scaling) -> out[B, Hq, Tq, D]

* ``Tq == 1`` (decode): split-K flash-decoding (:mod:`triton_decode`), the fresh token merged in the
  reduction kernel.
* ``Tq > 1`` (chunk / prefill): :mod:`triton_chunk`, causal inside the chunk.
* Stores with full-precision history segments (sink tokens, residual window): the kernels attend
  over the quantized pool without the sink rows, ``[sinks, q_end)``, plus the chunk (their history
  length is ``q_end``, the mask's key ranges are mapped onto that axis) and also write each row's
  log-sum-exp; the dense keys (sink rows ``[0, sinks)``, residual ``[q_end, past_len)``, at most
  ``sink_tokens + residual_tokens + block_size`` of them) are attended in torch
  (:func:`attend_dense`), and the two partials merged by log-sum-exp (:func:`merge_lse`).
* Stores with an age ladder (``ladder_tokens``): its young pool rows ``[q_end - ladder_n, q_end)`` are
  decoded with their refinement bits by the store (at most ``ladder_tokens`` rows a head, each step) and
  join the dense side (:func:`ladder_segment`); the kernels read the pool below them, at its base width.
* Stores with heavy rows (``heavy_tokens``, :mod:`kvquant.heavy`): the kernels read the pool as it is, heavy rows
  at their base width; the store decodes those rows (at most ``heavy_tokens`` a head, base and refined) and
  :func:`swap_rows` trades each one's base term in the softmax for its refined term, exactly: the kernels' partial
  is ``(out, lse)``, so removing a row's ``exp(s_base) v_base`` and adding ``exp(s_refined) v_refined`` to the
  numerator and denominator is the softmax with that row refined (the kernels need no per-head skip).

Raises :class:`~kvquant.kernels.unsupported.Unsupported` (the dispatcher then runs the torch path and
logs the reason once) for: head_dim not a power of two in [16, 256]; a device Triton cannot run on
(CPU without ``TRITON_INTERPRET=1``); masks that are not one contiguous key range per query row,
or that differ between heads; quantizers without a kernel path (none of the built-in ones:
per-channel key blocks, ``int4/3/2-channel``, are read with per-block scales, see
:mod:`triton_dequant`). Hadamard rotation is handled
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
measured on a GPU yet (docs/kernels.md).
"""

from __future__ import annotations

import weakref

import torch

from kvquant.snapshot import KVSnapshot, SnapshotSource, as_snapshot

from .attention_torch import cap_scores
from .triton_chunk import BLOCK_M, _chunk_attn, chunk_launches
from .triton_decode import decode_launches
from .triton_dequant import dot_kind, native_fp8, operand
from .unsupported import Unsupported

MAX_REP = 128  # query heads per KV head held in one program
LN2 = 0.6931471805599453  # the kernels' log-sum-exp is base 2


def interpreted() -> bool:
    """True when the kernels were built by Triton's interpreter (``TRITON_INTERPRET=1`` at import)."""
    return type(_chunk_attn).__name__ == "InterpretedFunction"


def check_shapes(query: torch.Tensor, fresh_k: torch.Tensor, fresh_v: torch.Tensor, layer: KVSnapshot) -> None:
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
    memo = not torch.compiler.is_compiling()  # a host-side memo, not part of a traced graph
    key = (mask.shape, mask._version, batch, q_heads, q_len, past_len) if memo else None
    ref = _range_cache.get("mask")
    if memo and ref is not None and ref() is mask and _range_cache.get("key") == key:
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
    m0 = m[:, :1]
    idx = torch.arange(L, device=m.device, dtype=torch.int32)
    lo = torch.where(m0, idx, L).amin(-1)
    hi = torch.where(m0, idx + 1, 0).amax(-1)
    count = m0.sum(-1, dtype=torch.int32)
    ok = (count == (hi - lo).clamp_min(0)).all()
    if m.shape[1] > 1:
        ok = ok & (m == m0).all()
    if q_len == 1:
        # decode: checked on the device, without a host synchronisation (a failure raises at the next
        # synchronisation on CUDA, at once on CPU); prefill: checked here, the torch path takes over
        torch._assert_async(ok, "attention_mask: rows must be one contiguous key range, the same for every "
                                "head (packed sequences are not; set KVQUANT_ATTENTION=torch)")  # fmt: skip
    elif not bool(ok):
        raise Unsupported("mask rows are not contiguous key ranges (e.g. packed sequences) or differ between "
                          "heads; torch path")  # fmt: skip
    lo, hi, count = (t[:, 0].expand(batch, q_len) for t in (lo, hi, count))
    empty = count == 0
    lo = torch.where(empty, 0, lo).to(torch.int32).contiguous()
    hi = torch.where(empty, 0, hi).to(torch.int32).contiguous()
    if memo:
        _range_cache.update(mask=weakref.ref(mask), key=key, ranges=(lo, hi))
    return lo, hi


def split_ranges(
    ranges: tuple[torch.Tensor, torch.Tensor] | None, batch: int, q_len: int, past_len: int, q_end: int,
    sinks: torch.Tensor | int, device: torch.device, shift: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key ranges of the quantized side: ``ranges`` (on the history + chunk axis, ``None`` = causal)
    mapped onto the axis (pool ``[0, q_end)`` + chunk) the kernels see, with the sink rows
    (below ``sinks[b]``: each row's sinks end there; before them lie its pads, outside its range) and
    the residual ``[q_end, past_len)`` removed (they are the dense side's).

    ``shift[B]`` (per-row block grids, :attr:`~kvquant.snapshot.KVSnapshot.slot_shift`): the pool axis holds slots,
    row ``b``'s position ``p`` at slot ``p + shift[b]``; its pool holds positions below ``q_end - shift[b]``, its
    residual ``[q_end - shift[b], past_len)``.

    A contiguous range stays contiguous: removing a middle segment of the axis joins its two sides.
    """
    if ranges is None:
        lo = torch.zeros((batch, q_len), dtype=torch.int32, device=device)
        hi = (past_len + 1 + torch.arange(q_len, dtype=torch.int32, device=device)).expand(batch, q_len)
    else:
        lo, hi = ranges
    lo = torch.maximum(lo, torch.as_tensor(sinks, device=lo.device).view(-1, 1).to(lo.dtype))
    R = past_len - q_end
    d = 0 if shift is None else shift.to(lo.device, lo.dtype).view(-1, 1)

    def to_pool_axis(p: torch.Tensor) -> torch.Tensor:
        # positions in the residual map to its end (= the chunk's start, q_end on the new axis)
        return torch.where(p < q_end - d, p + d, torch.where(p < past_len, q_end, p - R))

    lo, hi = to_pool_axis(lo), to_pool_axis(hi)
    empty = lo >= hi
    lo = torch.where(empty, 0, lo).to(torch.int32).contiguous()
    hi = torch.where(empty, 0, hi).to(torch.int32).contiguous()
    return lo, hi


def dense_segments(layer: KVSnapshot, past_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The full-precision history of ``layer``: (K, V ``[B, Hkv, n, D]``, positions ``[B, n]``), or None.

    Each row's sink tokens (its first real tokens, ``row_start[b] + [0, sinks.tokens)``) from
    :attr:`~kvquant.snapshot.KVSnapshot.sinks`, below ``q_end`` only (tokens still in the residual are read from
    there; a slot at or beyond ``q_end`` gets position -1, never visible), and the residual ``[q_end, past_len)``.
    Per-row block grids (:func:`pool_end`): a row's pool ends at its own position; residual rows below it are
    its pool's (position -1 here).
    """
    q_end = min(layer.q_end, past_len)
    ks, vs, pos = [], [], []
    device = layer.device
    B = layer.batch
    sinks, residual = layer.sinks, layer.residual
    own = pool_end(layer, past_len)  # [B, 1] each row's pool end (positions), or q_end
    if sinks is not None and q_end > 0:
        p = layer.row_start.view(-1, 1) + torch.arange(sinks.tokens, device=device)
        ks.append(sinks.k)
        vs.append(sinks.v)
        pos.append(torch.where(p < own, p, -1))
    if past_len > q_end:
        if residual is None or residual.held < past_len - q_end:
            raise Unsupported(f"the residual buffer does not hold tokens [{q_end}, {past_len})")
        rk, rv = residual.rows(past_len)  # (rows fitted while a batch-mate waits: as their pool reads)
        ks.append(rk)
        vs.append(rv)
        p = torch.arange(q_end, past_len, device=device).expand(B, -1)
        pos.append(p if layer.slot_shift is None else torch.where(p >= own, p, -1))
    if not ks:
        return None
    return torch.cat(ks, dim=2).float(), torch.cat(vs, dim=2).float(), torch.cat(pos, dim=1).to(ks[0].device)


def pool_end(layer: KVSnapshot, past_len: int) -> torch.Tensor | int:
    """Where each row's quantized pool ends on the position axis: ``q_end`` (clamped to ``past_len``), or with
    per-row block grids (:attr:`~kvquant.snapshot.KVSnapshot.slot_shift`, the pool holding slots ``[0,
    pool_slots(layer))``) ``[B, 1]``: the slot end less the row's shift."""
    if layer.slot_shift is None:
        return min(layer.q_end, past_len)
    d = torch.tensor(layer.slot_shift, device=layer.device).view(-1, 1)
    return (pool_slots(layer) - d).clamp_max(past_len)


def pool_slots(layer: KVSnapshot) -> int:
    """The slots of every row the pool holds: ``q_end``, or with per-row block grids ``q_end + max(shift)`` (the
    store keeps ``q_end`` = the slot end less the largest shift, 0 while the pool holds no block)."""
    if layer.slot_shift is None or layer.q_end == 0:
        return layer.q_end
    return layer.q_end + max(layer.slot_shift)


def ladder_segment(layer: KVSnapshot, hist: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The age ladder's young pool rows ``[q_end - ladder_n, hist)`` decoded with their refinement bits, in each
    head's space (K, V ``[B, Hkv, n, D]`` float32, positions ``[B, n]``), or None without a ladder.

    At most ``ladder_tokens`` rows, decoded by the store (:attr:`~kvquant.snapshot.GroupSnapshot.read`, the torch
    path's own decode) and attended as a dense segment: the kernels read the pool below them at its base width.
    A row's sink slots get position -1 (the sink segment holds them).
    """
    lo = layer.q_end - layer.ladder_n
    if not layer.ladder_n or lo >= hist:
        return None
    B, H, D, n = layer.batch, layer.num_heads, layer.head_dim, hist - lo
    k = torch.empty((B, H, n, D), dtype=torch.float32, device=layer.device)
    v = torch.empty_like(k)
    for g in layer.groups:
        gk, gv = g.read(lo, hist)
        k[:, g.head_index], v[:, g.head_index] = gk, gv
    p = torch.arange(lo, hist, device=layer.device).expand(B, n)
    if layer.sinks is not None:
        slot = p - layer.row_start.view(-1, 1)
        p = torch.where((slot >= 0) & (slot < layer.sinks.tokens), -1, p)
    return k, v, p


def heavy_segment(
    layer: KVSnapshot, hist: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The heavy rows the kernels read (pool positions below ``hist``), decoded by the store in each head's space:
    K and V at their base width, then refined (``[B, Hkv, n, D]`` float32; a side without refinement: its base), and
    their positions ``[B, Hkv, n]`` (-1: none there, or not in the kernels' pool)."""
    B, H, D = layer.batch, layer.num_heads, layer.head_dim
    n = layer.heavy_rows
    out = [torch.zeros((B, H, n, D), dtype=torch.float32, device=layer.device) for _ in range(4)]
    pos = torch.full((B, H, n), -1, dtype=torch.long, device=layer.device)
    for g in layer.groups:
        at, refined, base = g.heavy_rows()
        if at is None:
            continue
        for i, (r, b) in enumerate(zip(refined, base, strict=True)):
            out[i][:, g.head_index] = b
            out[2 + i][:, g.head_index] = b if r is None else r
        pos[:, g.head_index] = torch.where(at < hist, at.long(), -1)
    return out[0], out[1], out[2], out[3], pos


def swap_rows(
    out: torch.Tensor,
    lse: torch.Tensor,
    query: torch.Tensor,
    heavy: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    ranges: tuple[torch.Tensor, torch.Tensor] | None,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention ``out[B, Hq, Tq, D]`` (log-sum-exp ``lse[B, Hq, Tq]``, natural log) over keys that include the
    heavy rows at their base width, turned into the attention with those rows refined (:func:`heavy_segment`): per
    visible heavy row, its base term ``exp(s) v`` leaves the softmax's numerator and denominator and its refined
    term joins them. Visible: ``lo <= position < hi`` (``ranges``; None: every position >= 0). Exact up to how
    closely this base term matches the kernels' own (fp32: float rounding; 16-bit queries: the same operand rounding,
    but not the same summation order or exp2; not measured on a GPU)."""
    kc, vc, kr, vr, pos = heavy
    B, Hq, Tq, D = query.shape
    Hkv, n = pos.shape[1], pos.shape[2]
    rep = Hq // Hkv
    q = query.float().reshape(B, Hkv, rep * Tq, D) * scaling
    if query.dtype != torch.float32:  # the kernels' dot takes 16-bit operands: the base term as they computed it
        kc, vc = kc.to(query.dtype).float(), vc.to(query.dtype).float()
    p = pos.view(B, Hkv, 1, 1, n)
    vis = p >= 0
    if ranges is not None:
        lo, hi = ranges
        vis = vis & (p >= lo.view(B, 1, 1, Tq, 1)) & (p < hi.view(B, 1, 1, Tq, 1))
    sc, sr = (cap_scores(q @ k.transpose(-1, -2), softcap).view(B, Hkv, rep, Tq, n).masked_fill(~vis, float("-inf"))
              for k in (kc, kr))  # fmt: skip
    lse5 = lse.reshape(B, Hkv, rep, Tq)
    m = torch.maximum(lse5, sr.amax(dim=-1))
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wp, wc, wr = torch.exp(lse5 - m), torch.exp(sc - m[..., None]), torch.exp(sr - m[..., None])
    den = wp - wc.sum(-1) + wr.sum(-1)
    flat = lambda w: w.reshape(B, Hkv, rep * Tq, n)  # noqa: E731
    num = wp[..., None] * out.reshape(B, Hkv, rep, Tq, D) + (
        (flat(wr) @ vr - flat(wc) @ vc).view(B, Hkv, rep, Tq, D))
    res = torch.where(den[..., None] > 0, num / torch.where(den > 0, den, 1.0)[..., None], out.reshape(num.shape))
    return res.reshape(B, Hq, Tq, D)


def block_table(layer: KVSnapshot, hist: int, batch: int, device: torch.device) -> torch.Tensor:
    """The rows' block tables as int32 ``[B, max(1, blocks)]`` on ``device``; raises :class:`Unsupported`
    when they do not cover ``hist`` tokens."""
    table = layer.table
    if table.shape[1] * layer.block_size < hist:
        raise Unsupported(f"the block tables cover {table.shape[1] * layer.block_size} tokens, the history {hist}")
    # padded (block 0, never visible) to the layer's capacity: the decode grid then depends on the
    # capacity, not on the length (the same at every step of a fixed pool: CUDA-graph capturable)
    width = max(1, table.shape[1], -(-layer.capacity // layer.block_size))
    out = torch.zeros((batch, width), dtype=torch.int32, device=device)
    out[:, : table.shape[1]] = table.to(device=device, dtype=torch.int32)
    return out


def attend_dense(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    ranges: tuple[torch.Tensor, torch.Tensor] | None,
    scaling: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``query[B, Hq, Tq, D]`` over a few dense keys ``[B, Hkv, n, D]`` (at history
    ``positions[B, n]``), visible where ``lo <= position < hi`` (``ranges=None``: causal over the
    history, i.e. every position >= 0).

    Returns fp32 ``(out[B, Hq, Tq, D], lse[B, Hq, Tq])``, natural log; rows with no visible key get
    ``out = 0`` and ``lse = -inf``.
    """
    B, Hq, Tq, D = query.shape
    Hkv, n = keys.shape[1], keys.shape[2]
    rep = Hq // Hkv
    q = query.float().reshape(B, Hkv, rep * Tq, D) * scaling
    s = cap_scores(q @ keys.transpose(-1, -2), softcap).view(B, Hkv, rep, Tq, n)
    pos = positions.view(-1, 1, n)
    if ranges is not None:
        lo, hi = ranges
        vis = (pos >= lo[..., None]) & (pos < hi[..., None])
    else:
        vis = (pos >= 0).expand(B, Tq, n)
    s = s.masked_fill(~vis[:, None, None], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    out = (p.view(B, Hkv, rep * Tq, n) @ values).view(B, Hkv, rep, Tq, D) / denom.clamp_min(1e-30)
    lse = torch.where(denom == 0, float("-inf"), m + torch.log(denom))  # NaN (corrupt keys) stays NaN
    return out.reshape(B, Hq, Tq, D), lse.reshape(B, Hq, Tq)


def merge_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Softmax-merge two attention partials ``out[..., D]`` by their (natural) log-sum-exp ``lse[...]``."""
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(lse_a - m)[..., None], torch.exp(lse_b - m)[..., None]
    den = wa + wb
    # rows with no visible key give 0; a NaN partial stays NaN
    return torch.where(den == 0, torch.zeros_like(out_a), (wa * out_a + wb * out_b) / torch.where(den == 0, 1.0, den))


def attend_triton(
    query: torch.Tensor,
    fresh_k: torch.Tensor,
    fresh_v: torch.Tensor,
    layer: KVSnapshot | SnapshotSource,
    past_len: int,
    mask: torch.Tensor | None,
    scaling: float,
    *,
    softcap: float | None = None,
    splits: int | None = None,
    block_m: int | None = None,
) -> torch.Tensor:
    """Attention of ``query[B, Hq, Tq, D]`` over ``layer``'s first ``past_len`` tokens plus the fresh chunk.

    Same arguments and result as :func:`~kvquant.kernels.attention_torch.attend_torch`; ``layer``'s snapshot must
    have its blocks on the device (:meth:`~kvquant.snapshot.KVSnapshot.staged`). ``splits``
    (decode partitions) and ``block_m`` (chunk query rows per program) are for tests and tuning.

    Stores with dense segments (sink tokens, residual window): the kernels attend over the quantized
    pool ``[sinks, q_end)`` plus the chunk (history length ``q_end``) and also return each row's
    log-sum-exp; the dense keys (sink rows, residual ``[q_end, past_len)``) are attended in torch
    (:func:`attend_dense`) and the two merged by log-sum-exp (:func:`merge_lse`). An age ladder's young
    rows join the dense side, refined (:func:`ladder_segment`); the kernels' pool then ends below them.
    """
    layer = as_snapshot(layer)
    B, Hq, Tq, D = query.shape
    check_shapes(query, fresh_k, fresh_v, layer)
    dk = dot_kind(query.dtype, interpreted())
    ranges = key_ranges(mask, B, Hq, Tq, past_len)
    fp8_native = native_fp8(query.device)
    groups = [
        (g.head_index, operand(g.key, D, fp8_native), operand(g.value, D, fp8_native)) for g in layer.groups
    ]
    ladder_n = layer.ladder_n
    dense = layer.has_dense_segments or ladder_n > 0
    if dense:
        hist = min(layer.q_end, past_len) if layer.slot_shift is None else pool_slots(layer)
        young = ladder_segment(layer, hist) if ladder_n else None
        if young is not None:  # the ladder's refined rows are the dense side's: the kernels stop below them
            hist = layer.q_end - ladder_n
        # hist: the history length the kernels see (the quantized pool they read); per row, pool rows below its
        # sinks' end are the dense side's sinks (or its pads)
        sinks = (layer.row_start + layer.sinks.tokens).clamp_max(hist) if layer.sinks is not None else 0
        segments = dense_segments(layer, past_len)
        if segments is not None and layer.space.head_space:  # codebook heads: their space
            segments = (*layer.space.kv_to_head(segments[0], segments[1]), segments[2])
        if young is not None and segments is not None:  # (the ladder's rows are in head space already)
            segments = (torch.cat([segments[0], young[0]], dim=2), torch.cat([segments[1], young[1]], dim=2),
                        torch.cat([segments[2], young[2]], dim=1))  # fmt: skip
        elif young is not None:
            segments = young
        shift = None if layer.slot_shift is None else torch.tensor(layer.slot_shift, device=query.device)
        kernel_ranges = split_ranges(ranges, B, Tq, past_len, hist, sinks, query.device, shift)
    else:
        if layer.q_end < past_len:
            raise Unsupported(f"the quantized pool holds {layer.q_end} tokens, the history {past_len}")
        hist, segments, kernel_ranges = past_len, None, ranges
    for _, k, v in groups:
        for op in (k, v):
            if op.data.device != query.device:
                raise Unsupported("store parts on another device")
    heavy = heavy_segment(layer, hist) if layer.heavy_rows else None
    table = block_table(layer, hist, B, query.device)
    if segments is not None and segments[0].device != query.device:
        raise Unsupported("dense segments on another device")
    # written as [B, Tq, Hq, D] and returned as its [B, Hq, Tq, D] view: the caller's
    # ``out.transpose(1, 2).contiguous()`` is then free
    out = torch.empty((B, Tq, Hq, D), dtype=query.dtype, device=query.device).transpose(1, 2)
    # Triton's interpreter converts fp32 -> bf16 by truncation (compiled code rounds to nearest even):
    # under the interpreter a bf16 result is written in fp32 and rounded by torch. With dense segments
    # the kernels' result is a partial, kept in fp32 for the merge.
    partial = segments is not None or heavy is not None
    fp32_res = partial or (interpreted() and out.dtype == torch.bfloat16)
    res = torch.empty(out.shape, device=out.device) if fp32_res else out
    lse = torch.empty((B, Hq, Tq), dtype=torch.float32, device=query.device) if partial else None
    if Tq == 1:
        launches = decode_launches(query, fresh_k, fresh_v, groups, layer.num_heads, hist, kernel_ranges, scaling,
                                   res, dk, splits=splits, lse=lse, softcap=softcap, table=table,
                                   block_size=layer.block_size)  # fmt: skip
    else:
        launches = chunk_launches(query, fresh_k, fresh_v, groups, layer.num_heads, hist, kernel_ranges, scaling,
                                  res, dk, block_m=block_m or BLOCK_M, lse=lse, softcap=softcap, table=table,
                                  block_size=layer.block_size)  # fmt: skip
    for launch in launches:
        launch.run()
    if segments is not None:
        d_out, d_lse = attend_dense(query, *segments, ranges, scaling, softcap)
        res = merge_lse(res, lse * LN2, d_out, d_lse)
        if heavy is not None:
            lse = torch.logaddexp(lse * LN2, d_lse) / LN2
    if heavy is not None:
        res = swap_rows(res, lse * LN2, query, heavy, ranges, scaling, softcap)
    if res is not out:
        out.copy_(res)
    return out


__all__ = [
    "attend_dense", "attend_triton", "check_shapes", "dense_segments", "heavy_segment", "interpreted", "key_ranges",
    "ladder_segment", "merge_lse", "split_ranges", "swap_rows",
]
