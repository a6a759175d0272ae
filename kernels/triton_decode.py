"""Split-K (flash-decoding) attention of one new token over the quantized history: the launcher.

:func:`decode_launches` returns the launches of one decode step as data
(:class:`~kvquant.kernels.triton_launch.Launch`): one partial launch per head group -- the kernel, its tile and
options chosen by the launch table (:mod:`triton_decode_table`) -- into one shared partial buffer, then the
reduction (:mod:`triton_decode_kernels`). The split count of the history comes from the compiled kernels'
occupancy (:func:`num_splits`).

The modules: :mod:`triton_decode_kernels` (the per-head partial kernels and the reduction, each followed by its
launch options or launcher), :mod:`triton_decode_tiles` (their tile steps), :mod:`triton_rows` (the grouped-rows
family, with :mod:`triton_rows_tiles` and :mod:`triton_rows_cols`), :mod:`triton_decode_table` (which kernel a
group runs, as data). Tuning history: ``docs/kernels.md``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import triton

from .triton_decode_kernels import partial_args, reduce_launch
from .triton_decode_table import block_n_for, choose, launch_config
from .triton_dequant import Operand
from .triton_launch import Launch
from .unsupported import Unsupported

LOG2E = 1.4426950408889634


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 off CUDA: the interpreter tests)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


#: Hopper (sm_90) limits per SM: registers, shared memory (bytes), resident warps and programs (CUDA guide, cc 9.0)
REGS_PER_SM, SMEM_PER_SM, WARPS_PER_SM, PROGRAMS_PER_SM = 65536, 228 * 1024, 64, 32
#: programs per SM assumed where the compiled kernel's occupancy is unknown (the CPU interpreter, no compile
#: metadata): the decode kernels' common case at head_dim 128 (166-255 registers x 4 warps)
DEFAULT_PROGRAMS_PER_SM = 2
#: a program's fixed cost in BLOCK_N tiles of history (prologue, masked edge tiles, epilogue, its share of the
#: reduction): the term that makes one wave of long partitions beat two of half-length ones (docs/kernels.md)
PROGRAM_OVERHEAD_TILES = 4
MAX_SPLITS = 128


def programs_per_sm(regs: int, shared: int, warps: int) -> int:
    """Programs of a compiled kernel resident on one SM (Hopper limits; registers allocated per warp in units
    of 256, 1 KB of shared memory reserved per program); ``regs`` per thread, ``shared`` bytes per program."""
    per_warp = math.ceil(regs * 32 / 256) * 256
    return max(0, min(WARPS_PER_SM // warps, REGS_PER_SM // max(1, per_warp * warps),
                      SMEM_PER_SM // (shared + 1024), PROGRAMS_PER_SM))  # fmt: skip


_OCCUPANCY: dict = {}
_SPLITS: dict = {}  # decode_launches: layer shape -> split count at the runtime's occupancy


def compiled_programs_per_sm(launch: Launch) -> int | None:
    """Programs per SM of ``launch``'s kernel as compiled for the current GPU (Triton's ``n_regs``,
    ``metadata.shared``, ``num_warps``); ``None`` where unknown: under ``TRITON_INTERPRET``, off CUDA, or when
    the compile metadata is missing. Compiling is host work only (no device synchronisation); cached per kernel
    and launch options."""
    import os

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or not hasattr(launch.kernel, "warmup"):
        return None
    dev = next((a.device for a in launch.args if isinstance(a, torch.Tensor)), None)
    if dev is None or dev.type != "cuda":
        return None
    key = (launch.kernel, tuple(sorted(launch.meta.items())), dev.index)
    if key not in _OCCUPANCY:
        try:
            k = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.meta)
            k._init_handles()
            _OCCUPANCY[key] = programs_per_sm(k.n_regs, k.metadata.shared, k.metadata.num_warps) or None
        except Exception:  # noqa: BLE001 - unknown occupancy: the default rule
            _OCCUPANCY[key] = None
    return _OCCUPANCY[key]


@functools.lru_cache(maxsize=4096)
def num_splits(batch: int, kv_heads: int, past_len: int, block_n: int, sms: int, per_sm: int | None = None) -> int:
    """Partitions of the history for ``batch * kv_heads`` programs per partition on ``sms`` SMs holding
    ``per_sm`` programs each (the compiled kernel's occupancy, :func:`programs_per_sm`; ``None``: unknown,
    :data:`DEFAULT_PROGRAMS_PER_SM`).

    Every program of a split launch walks ``ceil(tiles / S)`` tiles, so the launch takes about
    ``waves(S) * (ceil(tiles / S) + PROGRAM_OVERHEAD_TILES)`` with ``waves(S) = ceil(batch * kv_heads * S /
    (sms * per_sm))``; the smallest ``S`` in ``1 .. min(tiles, MAX_SPLITS)`` that minimises it. ``S`` is returned
    as the launcher realises it (``ceil(tiles / ceil(tiles / S))``): no partition is empty."""
    tiles = max(1, math.ceil(past_len / block_n))
    rows = max(1, batch * kv_heads)
    slots = max(1, sms) * max(1, per_sm or DEFAULT_PROGRAMS_PER_SM)
    best, best_cost = 1, math.inf
    for s in range(1, min(tiles, MAX_SPLITS) + 1):
        per = math.ceil(tiles / s)
        s = math.ceil(tiles / per)  # the split count this partition length gives
        cost = math.ceil(rows * s / slots) * (per + PROGRAM_OVERHEAD_TILES)
        if cost < best_cost:
            best, best_cost = s, cost
    return best


def wave_fill(programs: int, sms: int, per_sm: int | None) -> float:
    """Share of the launch's waves' program slots that hold a program (1.0: whole waves)."""
    slots = max(1, sms) * max(1, per_sm or DEFAULT_PROGRAMS_PER_SM)
    return programs / (math.ceil(programs / slots) * slots)


def decode_launches(
    query: torch.Tensor,
    fresh_k: torch.Tensor,
    fresh_v: torch.Tensor,
    groups: list[tuple[torch.Tensor, Operand, Operand]],
    num_kv: int,
    past_len: int,
    ranges: tuple[torch.Tensor, torch.Tensor] | None,
    scaling: float,
    out: torch.Tensor,
    dot_kind: int,
    splits: int | None = None,
    lse: torch.Tensor | None = None,
    softcap: float | None = None,
    sms: int | None = None,
    *,
    table: torch.Tensor,
    block_size: int,
    occupancy: Callable[[Launch], int | None] | None = None,
) -> list[Launch]:
    """The kernel launches of decode attention (``Tq == 1``) into ``out[B, Hq, 1, D]`` (one partial launch
    per head group, then the reduction; ``groups`` = (head_index int32, K, V)), with every argument,
    constexpr and launch option: ``attend_triton`` runs them (``Launch.run``), and the ahead-of-time
    tools (``triton_compile_check``, ``benchmarks/kernel_static.py``) compile exactly these (on
    ``meta`` tensors), so that what they measure is the binary the runtime would build.

    The history is read through ``table[B, max_blocks]`` (int32 block ids of each row, ``block_size``
    tokens per block) from the groups' block tensors.

    ``lse`` (optional, fp32 contiguous ``[B, Hq, 1]``) receives each row's base-2 log-sum-exp of the
    scores times ``scaling * log2(e)`` (``-inf`` for rows with no visible key). ``splits``: the partitions
    of the history (default: :func:`num_splits` for ``sms`` SMs (default: the query's device) holding as many
    programs as the fewest-resident partial kernel's binary allows: ``occupancy(launch)`` (default
    :func:`compiled_programs_per_sm`, the runtime's own compile; ``None`` = unknown, the documented default).
    The ahead-of-time tools pass the occupancy of the sm_90a binary they compile. The grid depends on
    the shapes and the pool's capacity only (not on ``past_len``), and nothing here reads a device
    value: a step can be captured in a CUDA graph (``past_len`` is still a scalar argument, so a
    captured graph serves one length; lengths in a device tensor would lift that).
    """
    B, Hq, Tq, D = query.shape
    if Tq != 1:
        raise Unsupported(f"decode kernel: Tq={Tq}, expected 1")
    rep = Hq // num_kv
    block_h = max(16, triton.next_power_of_2(rep))
    block_n = block_n_for(D)
    # partitions of the pool's capacity, not of past_len: the grid and the buffers are the same at
    # every step of a fixed pool (CUDA-graph capturable); partitions past the history exit at once
    capacity = max(past_len, table.shape[1] * block_size)  # the tokens the block tables address

    def _decode_build(S: int) -> list[Launch]:
        tiles = max(1, math.ceil(capacity / block_n))
        part_len = math.ceil(tiles / S) * block_n
        S = max(1, math.ceil(capacity / part_len))
        o_part = torch.empty((B, Hq, S, D), dtype=torch.float32, device=query.device)
        lse_part = torch.empty((B, Hq, S), dtype=torch.float32, device=query.device)
        qk_scale = scaling * LOG2E
        lo, hi = ranges if ranges is not None else (query, query)  # dummies when there is no mask
        lo_sb = lo.stride(0) if ranges is not None else 0
        launches = []
        for head_index, kop, vop in groups:
            group_block_n, num_warps = launch_config(kop, vop, dot_kind, D)
            group_block_n = min(group_block_n, block_size)  # every tile lies in one pool block
            args = partial_args(query, kop, vop, table, head_index, lo, hi, lo_sb, o_part, lse_part, qk_scale,
                                past_len, part_len, S)  # fmt: skip
            meta = dict(
                REP=rep, BLOCK_H=block_h, D=D, BLOCK_N=group_block_n, HAS_RANGE=ranges is not None, DOT=dot_kind,
                SOFTCAP=(softcap or 0.0) * LOG2E,
                K_KIND=kop.kind, K_BITS=kop.bits, K_GROUP=kop.group,
                V_KIND=vop.kind, V_BITS=vop.bits, V_GROUP=vop.group, BS=block_size,
                K_FOLD=1 if kop.folds4(D) else 2 if kop.folds_channel4() else 0, V_FOLD=vop.folds4(D),
                num_warps=num_warps,
            )  # fmt: skip
            row = choose(kop, vop, dot_kind, D, num_warps)
            meta.update(row.options(meta, kop, vop, rep, block_size))
            launches.append(Launch(row.kernel, (B * head_index.numel(), S), args, meta))
        launches.append(reduce_launch(o_part, lse_part, query, fresh_k, fresh_v, out, lse, lo, hi, lo_sb,
                                      ranges is not None, qk_scale, past_len, num_kv, (softcap or 0.0) * LOG2E,
                                      block_h))  # fmt: skip
        return launches

    sms = sms or sm_count(query.device)
    rows = B * max(int(h.numel()) for h, _, _ in groups)  # programs per partition of the widest group's launch
    if splits:
        return _decode_build(splits)
    # the split count from the compiled kernels' occupancy: build at the default rule's count, ask each
    # partial launch's binary how many programs an SM holds (the fewest), rebuild at that count if it differs.
    # The runtime's answer is remembered per layer shape (one build per step after the first; a stale entry could
    # only cost speed: every split count gives the same result)
    key = None
    if occupancy is None:
        ops = tuple((int(h.numel()), k.data.dtype, *k.meta(), *v.meta(), k.data.shape[1:], v.data.shape[1:])
                    for h, k, v in groups)  # fmt: skip
        key = (query.device, query.dtype, B, Hq, D, num_kv, capacity, block_size, dot_kind, ranges is None,
               softcap or 0.0, sms, ops)  # fmt: skip
        if key in _SPLITS:
            return _decode_build(_SPLITS[key])
    S0 = num_splits(B, rows // B, capacity, block_n, sms)
    launches = _decode_build(S0)
    probe = occupancy or compiled_programs_per_sm
    per_sm = [probe(launch) for launch in launches[:-1]]
    S = num_splits(B, rows // B, capacity, block_n, sms, min(per_sm)) if all(per_sm) else S0
    if key is not None:
        _SPLITS[key] = S
    return _decode_build(S) if S != S0 else launches
