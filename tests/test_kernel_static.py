"""benchmarks/kernel_static.py: the static (SASS-based) decode-kernel benchmark runs end to end.

One small variant (int8, head_dim 64, group 4, plus the fp16 baseline it is compared with) is
compiled for sm_90a in a subprocess (the kernels must be compiled, not interpreted, functions there);
skipped when this triton has no CUDA toolchain (ptxas / nvdisasm / cuobjdump).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "kernel_static.py"


def _bench():
    spec = importlib.util.spec_from_file_location("kernel_static", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("kernel_static", mod)  # dataclasses look their module up there
    spec.loader.exec_module(sys.modules["kernel_static"])
    return mod


def _tools_or_skip():
    try:
        from triton import knobs
        from triton.backends.nvidia.compiler import get_ptxas

        get_ptxas(90)
        for tool in ("nvdisasm", "cuobjdump"):
            if not Path(getattr(knobs.nvidia, tool).path).exists():
                raise FileNotFoundError(tool)
    except Exception as e:  # noqa: BLE001 - any missing piece of the toolchain
        pytest.skip(f"no CUDA toolchain in this triton: {type(e).__name__}: {e}")


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/               @P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/                   I2F.F16 R6, R4 ;
        /*0040*/                   LDSM.16.M88.4 R8, [R3] ;
        /*0050*/                   STS.64 [R3], R4 ;
        /*0060*/              @!P1 BRA `(.L_x_1) ;
.L_x_0:
        /*0070*/                   EXIT ;
.L_x_2:
        /*0080*/                   BRA `(.L_x_2);
"""


def test_sass_loop_and_counts():
    bench = _bench()
    sass = bench.Sass.parse(SASS)
    assert [op for op, _ in sass.body] == ["LDG", "I2F", "LDSM", "STS", "BRA"]
    assert [op for op, _ in sass.rest] == ["MOV", "BRA", "EXIT", "BRA"]
    assert sum(op in bench.CONVERSIONS for op, _ in sass.body) == 1
    assert [bench.smem_bytes(op, mod) for op, mod in sass.body] == [0, 0, 512, 256, 0]
    with pytest.raises(ValueError, match="no loop"):
        bench.Sass.parse(SASS.split(".L_x_1:")[0])


def test_kernel_static_small(tmp_path):
    _tools_or_skip()
    out_json, out_md = tmp_path / "rows.json", tmp_path / "static.md"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVQUANT_ATTENTION")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--variants", "int8", "--head-dims", "64", "--groups", "4",
         "--context", "4096", "--json", str(out_json), "--md", str(out_md)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads(out_json.read_text())
    assert (row["variant"], row["head_dim"], row["group"]) == ("int8", 64, 4)
    assert row["hbm_bytes_per_token"] == 128  # int8 K + V, 64 channels each (the per-head scale is static)
    assert row["spills"] >= 0 and row["registers"] > 0 and int(row["sass_per_warp_per_tile"]) > 50
    # the model: max of the three limits, and the issue/HBM ratio it reports
    assert row["t_pred_ps"] == pytest.approx(max(row["t_hbm_ps"], row["t_issue_ps"], row["t_conv_ps"]))
    assert row["issue_time_over_hbm_time"] == pytest.approx(row["t_issue_ps"] / row["t_hbm_ps"])
    assert row["predicted_speedup_vs_fp16"] > 0
    assert "| int8 | 64 | 4 |" in out_md.read_text()
