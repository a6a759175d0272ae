"""The decode and chunk launches (kernel, constexprs, grid, warps, stages, arguments) equal the recorded table.

``tests/data/decode_launches.json.gz`` was written by ``python -m kvquant.kernels.launch_record`` from the launcher
before its modules were split; this regenerates the record on ``meta`` tensors (no kernel runs, no GPU) for every
variant the compile tools enumerate and fails on the first launch that differs. A deliberate launch change
rewrites the file with the same command, in its own commit.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

pytest.importorskip("triton")

from kvquant.kernels import launch_record  # noqa: E402

RECORD = Path(__file__).parent / "data" / "decode_launches.json.gz"


@pytest.mark.slow
def test_launches_equal_the_recorded_table():
    want = json.loads(gzip.decompress(RECORD.read_bytes()))
    got = json.loads(launch_record.dumps(launch_record.record()))
    if got["channel_keys_transposed"] != want["channel_keys_transposed"]:
        pytest.skip("the installed triton release chooses another kernel for per-channel int4 keys")
    assert [row["variant"] for row in got["variants"]] == [row["variant"] for row in want["variants"]]
    for g, w in zip(got["variants"], want["variants"], strict=True):
        assert g == w, f"variant {w['variant']} at occupancy {w['occupancy']}"


def test_every_table_row_is_enumerated():
    """Each row of the decode launch table is taken by some variant the compile tools enumerate."""
    use = launch_record.table_use()
    assert use and all(n > 0 for n in use.values()), use


def test_record_sees_a_changed_launch(monkeypatch):
    """The comparison can fail: one changed launch option changes the record."""
    from kvquant.kernels.triton_compile_check import meta_launches

    (launch,) = meta_launches("decode", [("int4", "int4", 2)], 1, 128, 4, True)
    before = launch_record.launch_record(launch)
    launch.meta["num_warps"] = launch.meta["num_warps"] * 2
    assert launch_record.launch_record(launch) != before
