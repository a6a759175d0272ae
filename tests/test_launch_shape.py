"""Decode launch shape (issue 13, Build 3): the split count from the compiled kernel's occupancy.

CPU only, no kernel runs: ``num_splits`` (full waves, bounds, no empty partition, the default where the
occupancy is unknown), ``programs_per_sm`` (Hopper limits), and ``decode_launches`` asking its occupancy
probe (on ``meta`` tensors, as ``benchmarks/kernel_static.py`` does).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from kvquant.kernels import triton_decode as td  # noqa: E402
from kvquant.kernels.triton_compile_check import meta_launches  # noqa: E402
from kvquant.kernels.triton_dequant import DOT_FP16  # noqa: E402


def _old_rule(batch: int, kv_heads: int, past_len: int, block_n: int, sms: int) -> int:
    """The rule before Build 3: enough programs to fill the GPU about twice."""
    tiles = max(1, math.ceil(past_len / block_n))
    return max(1, min(tiles, math.ceil(2 * sms / max(1, batch * kv_heads)), 128))


@pytest.mark.parametrize("per_sm", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [1, 2, 8, 16, 64])
@pytest.mark.parametrize("kv_heads", [2, 8])
@pytest.mark.parametrize("past", [4096, 32768, 131072])
def test_full_waves_and_bounds(per_sm, batch, kv_heads, past):
    sms, block_n = 132, 64
    s = td.num_splits(batch, kv_heads, past, block_n, sms, per_sm)
    tiles = math.ceil(past / block_n)
    assert 1 <= s <= min(tiles, td.MAX_SPLITS)
    assert math.ceil(tiles / math.ceil(tiles / s)) == s  # as the launcher realises it: no empty partition
    fill = td.wave_fill(batch * kv_heads * s, sms, per_sm)
    if batch * kv_heads * min(tiles, td.MAX_SPLITS) < sms * per_sm:
        assert s == min(tiles, td.MAX_SPLITS)  # less than one wave at most: every partition it can have
    elif past >= 32768:
        # long histories: partitions fine enough to fill the waves (short ones may prefer one part-filled wave
        # of two-tile partitions to two waves of one-tile ones)
        assert fill >= 0.85, (s, fill)

    def cost(n: int) -> int:  # waves x (tiles per program + the program's fixed cost)
        per = math.ceil(tiles / n)
        return math.ceil(batch * kv_heads * math.ceil(tiles / per) / (sms * per_sm)) * (per + td.PROGRAM_OVERHEAD_TILES)

    assert cost(s) <= cost(_old_rule(batch, kv_heads, past, block_n, sms))
    assert cost(s) <= min(cost(n) for n in (1, 2, 4, 8, 16, 32, 64, 128) if n <= tiles)


def test_batch8_32k_two_programs_per_sm():
    # int3 / int2 at head_dim 128: 2 programs / SM; the old rule gave 5 splits = 320 programs on 264 slots
    assert _old_rule(8, 8, 32768, 64, 132) == 5
    assert td.wave_fill(8 * 8 * 5, 132, 2) == pytest.approx(320 / 528)
    s = td.num_splits(8, 8, 32768, 64, 132, 2)
    assert s == 4 and td.wave_fill(8 * 8 * s, 132, 2) == pytest.approx(256 / 264)
    assert td.num_splits(8, 8, 32768, 64, 132, 1) == 2  # one program / SM: one wave of 128 on 132


def test_short_history_and_fallback():
    assert td.num_splits(8, 8, 10, 64, 132, 2) == 1  # one tile: one partition
    assert td.num_splits(1, 1, 64 * 7, 64, 132, 4) == 7  # never more partitions than tiles
    assert td.num_splits(1, 1, 10**7, 64, 132, 32) == td.MAX_SPLITS
    for args in [(8, 8, 32768, 64, 132), (2, 2, 200, 64, 4), (1, 8, 4096, 64, 132)]:
        assert td.num_splits(*args) == td.num_splits(*args, td.DEFAULT_PROGRAMS_PER_SM)


def test_programs_per_sm_hopper_limits():
    assert td.programs_per_sm(255, 0, 4) == 2  # 256 x 128 threads = 32K registers
    assert td.programs_per_sm(176, 16384, 4) == 2  # 176 x 128 = 22.5K registers: 3 would need 67.5K
    assert td.programs_per_sm(166, 16384, 4) == 3  # 168 x 128 = 21.5K: 3 fit in 64.5K
    assert td.programs_per_sm(128, 0, 4) == 4
    assert td.programs_per_sm(32, 0, 4) == 16  # 64 warps
    assert td.programs_per_sm(32, 0, 1) == 32  # 32 programs
    assert td.programs_per_sm(64, 120 * 1024, 4) == 1  # shared memory
    assert td.programs_per_sm(255, 0, 8) == 1


def test_compiled_occupancy_unknown_on_cpu():
    launch = td.Launch(lambda: None, (1, 1), (torch.zeros(1),), {})
    assert td.compiled_programs_per_sm(launch) is None


def _splits(occupancy, past=32767, capacity=32768, batch=8):
    launches = meta_launches("decode", [("int2", "int2", 8)], DOT_FP16, 128, 4, has_range=False, batch=batch,
                             past_len=past, capacity=capacity, sms=132, occupancy=occupancy)  # fmt: skip
    return [launch.grid for launch in launches]


def test_decode_launches_ask_the_occupancy():
    seen = []

    def probe(launch):
        seen.append(launch.grid)
        return 1

    assert _splits(probe) == [(64, 2)]
    assert seen == [(64, td.num_splits(8, 8, 32768, 64, 132))]  # asked with the default rule's launch
    assert _splits(lambda launch: 2) == [(64, 4)]
    assert _splits(lambda launch: None) == [(64, td.num_splits(8, 8, 32768, 64, 132))]  # unknown: the default
    # the grid depends on capacity and shapes, not on the history length (CUDA-graph capturable)
    assert _splits(lambda launch: 2, past=100) == _splits(lambda launch: 2, past=30000)


def test_runtime_occupancy_remembered_per_layer_shape(monkeypatch):
    from kvquant.kernels.triton_compile_check import BLOCK_SIZE, META, meta_groups

    calls = []

    def probe(launch):
        calls.append(launch.grid)
        return 1

    monkeypatch.setattr(td, "compiled_programs_per_sm", probe)
    monkeypatch.setattr(td, "_SPLITS", {})
    B, kv, D, cap = 8, 8, 128, 32768
    query = torch.empty((B, kv * 4, 1, D), dtype=torch.float16, device=META)
    fresh = torch.empty((B, kv, 1, D), dtype=torch.float16, device=META)
    table = torch.empty((B, cap // BLOCK_SIZE), dtype=torch.int32, device=META)

    def grids(past):
        launches = td.decode_launches(query, fresh, fresh, meta_groups([("int2", "int2", kv)], B, D, cap), kv, past,
                                      None, D**-0.5, torch.empty_like(query), DOT_FP16, sms=132, table=table,
                                      block_size=BLOCK_SIZE)  # fmt: skip
        return [launch.grid for launch in launches]

    assert grids(100) == [(64, 2), (64,)]  # 1 / SM: 2 splits
    assert grids(30000) == [(64, 2), (64,)]
    assert len(calls) == 1  # asked once for this layer shape
