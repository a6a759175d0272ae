"""Check that the GPU run of ``benchmarks/gpu_check.sh`` imports only distributions the GPU image holds.

The image (``benchmarks/gpu_image_packages.txt``) has torch, triton, transformers, pytest and the usual
scientific stack, but not kvquant's evaluation extras (datasets, evaluate, platformdirs, hqq, quanto, ...),
and nothing can be installed there. This imports what the GPU run imports -- the kernel modules, the decode
benchmark, and the kernel test files as pytest collects them (module-level imports) -- and fails, naming them,
if any module came from a distribution not on that list. kvquant itself comes from the checkout (not installed).

    python benchmarks/gpu_image_imports.py     # exit 0: nothing outside the image; 1: the offending names
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU_RUN_TESTS = ["tests/test_kernels.py", "tests/test_kernels_e2e.py"]
GPU_RUN_MODULES = ["kvquant.kernels.dispatch", "kvquant.kernels.triton_attention",
                   "kvquant.kernels.triton_compile_check"]


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    lines = (ROOT / "benchmarks" / "gpu_image_packages.txt").read_text().splitlines()
    return {_canon(x) for x in lines if x.strip() and not x.startswith("#")}


def main() -> int:
    import pytest

    for name in GPU_RUN_MODULES:
        importlib.import_module(name)
    runpy.run_path(str(ROOT / "benchmarks" / "attention_decode.py"), run_name="gpu_image_imports")  # no __main__
    rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *GPU_RUN_TESTS])
    if rc != 0:
        print(f"gpu_image_imports: collecting {' '.join(GPU_RUN_TESTS)} failed (rc {rc})")
        return 1
    dists = importlib.metadata.packages_distributions()
    allowed = image_packages()
    outside: dict[str, set[str]] = {}
    for mod in sorted({m.split(".")[0] for m in sys.modules}):
        for dist in dists.get(mod, []):
            if _canon(dist) not in allowed and _canon(dist) != "kvquant":
                outside.setdefault(dist, set()).add(mod)
    if outside:
        names = "; ".join(f"{d} (module {', '.join(sorted(m))})" for d, m in sorted(outside.items()))
        print(f"gpu_image_imports: the GPU run imports distributions the GPU image lacks: {names}")
        return 1
    print(f"gpu_image_imports: ok, every imported distribution is on the image ({len(allowed)} listed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
