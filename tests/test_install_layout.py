"""The repository's top-level ``kernels/`` and ``eval/`` never shadow installed packages of those names.

Contract (see the comment in ``pyproject.toml``): the two folders hold no ``__init__.py``, so from the
repository root they are namespace portions that lose to any regular package on ``sys.path``; they are
reached as ``kvquant.kernels`` / ``kvquant.eval`` (symlinks inside ``kvquant/`` in a checkout, real
folders in a wheel or an sdist install).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run_in_root(code: str, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if extra_path is not None:
        env["PYTHONPATH"] = str(extra_path)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_top_level_folders_are_not_regular_packages():
    for name in ("kernels", "eval"):
        assert not (ROOT / name / "__init__.py").exists(), f"{name}/__init__.py would shadow PyPI's {name!r}"
        assert (ROOT / "kvquant" / name).resolve() == (ROOT / name).resolve()


def test_stand_in_distribution_wins_over_repository_folders(tmp_path):
    for name in ("kernels", "eval"):
        pkg = tmp_path / name
        pkg.mkdir()
        (pkg / "__init__.py").write_text("STAND_IN = True\n")
        dist = tmp_path / f"{name}-9.9.9.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 9.9.9\n")
    code = (
        "import sys, kernels, eval as ev\n"
        "assert sys.path[0] == '', sys.path[:2]\n"  # the repository root comes first, as in any `python -c`
        "assert kernels.STAND_IN and ev.STAND_IN, (kernels, ev)\n"
        "import kvquant.kernels.dispatch, kvquant.eval.recipe\n"
        "print(kernels.__file__)\n"
    )
    proc = _run_in_root(code, extra_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "kernels" / "__init__.py")


def test_transformers_and_kvquant_import_from_repository_root():
    code = (
        "import transformers, transformers.modeling_utils, transformers.cache_utils\n"
        "import kvquant, kvquant.kernels.dispatch, kvquant.eval.runner\n"
        "from kvquant import wrap\n"
        "print(transformers.__version__)\n"
    )
    proc = _run_in_root(code)
    assert proc.returncode == 0, proc.stderr


def _build(kind: str, out: Path) -> Path:
    code = (
        "import sys\nfrom setuptools import build_meta as b\n"
        f"print(b.build_{kind}(sys.argv[1]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out / proc.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_wheel_and_sdist_hold_the_subpackages(tmp_path):
    import setuptools

    if int(setuptools.__version__.split(".")[0]) < 77:  # pyproject's build-system floor (PEP 639 licence field)
        pytest.skip(f"setuptools {setuptools.__version__} < 77 in this venv (make setup installs the locked one)")
    wheel = _build("wheel", tmp_path / "wheel")
    names = set(zipfile.ZipFile(wheel).namelist())
    for mod in ("kvquant/kernels/dispatch.py", "kvquant/kernels/triton_decode.py", "kvquant/eval/runner.py"):
        assert mod in names
    assert not any(n.startswith(("kernels/", "eval/")) for n in names), "a top-level package left the wheel"
    # every module of the library, its subpackages included (an editable install on the path would hide a missing one)
    for src in sorted((ROOT / "kvquant").rglob("*.py")):
        rel = src.relative_to(ROOT / "kvquant")
        if rel.parts[0] not in ("kernels", "eval"):
            assert f"kvquant/{rel.as_posix()}" in names, f"the wheel lacks kvquant/{rel.as_posix()}"
    for data in sorted((ROOT / "kvquant" / "data").glob("*.json")):
        assert f"kvquant/data/{data.name}" in names, f"the wheel lacks kvquant/data/{data.name}"

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = dict(os.environ, PYTHONPATH=str(site))
    proc = subprocess.run(
        [sys.executable, "-c", "import kvquant.kernels.dispatch as d, kvquant.eval.runner as r; print(d.__file__)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith(str(site))

    sdist = _build("sdist", tmp_path / "sdist")
    with tarfile.open(sdist) as tar:
        members = {m.split("/", 1)[1] for m in tar.getnames() if "/" in m}
    for path in ("kernels/dispatch.py", "eval/runner.py", "kvquant/wrap.py", "pyproject.toml"):
        assert path in members
