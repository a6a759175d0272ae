"""The Triton kernels compile for CUDA targets (sm_90, sm_80) on a machine without a GPU.

The interpreter tests (test_kernels.py) check the kernels' arithmetic; this checks that the same
source passes Triton's compiler and ptxas, which type-check more strictly. It runs
``python -m kvquant.kernels.triton_compile_check --quick`` in a subprocess, because the kernels
must be compiled (not interpreted) functions there.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_kernels_compile_for_cuda():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVQUANT_ATTENTION")}
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
    except Exception as e:  # pragma: no cover - triton built without the nvidia backend
        pytest.skip(f"triton has no CUDA backend here: {e}")
    proc = subprocess.run(
        [sys.executable, "-m", "kvquant.kernels.triton_compile_check", "--quick"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("ok", "FAIL"))]
    assert proc.returncode == 0 and lines and all(ln.startswith("ok") for ln in lines), (
        proc.stdout[-4000:] + proc.stderr[-4000:]
    )
    assert len(lines) == 18
