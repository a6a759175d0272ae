"""Reading user-named inputs with one-line errors that name the file.

``read_text`` turns a missing file, a folder, an unreadable file or bytes that are not UTF-8 into a
:class:`kvquant.errors.InputError` naming the option (or field) and the path; ``looks_like_path`` tells a
local path from a hub repo id, so that a missing ``--model /some/dir`` is reported as a missing path.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import InputError, InputNotFoundError, KVQuantError


def user_path(path: str | os.PathLike, what: str, error: type[KVQuantError] = InputError) -> Path:
    """``path`` with a leading ``~`` expanded; a NUL byte (no file can have one) raises ``error`` naming ``what``."""
    s = os.fspath(path)
    if "\x00" in str(s):
        raise error(f"{what}: {s!r} contains a NUL byte")
    return Path(os.path.expanduser(s))  # unlike Path.expanduser, leaves an unknown ~user alone


def read_text(path: str | os.PathLike, what: str) -> str:
    """The UTF-8 text of ``path``; raises :class:`InputError` naming ``what`` and the file."""
    p = user_path(path, what)
    if not p.exists():
        raise InputNotFoundError(f"{what}: {p} does not exist")
    if p.is_dir():
        raise InputError(f"{what}: {p} is a folder, not a file")
    if not p.is_file():
        raise InputError(f"{what}: {p} is not a regular file")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise InputError(f"{what}: cannot read {p} ({e.strerror or e})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise InputError(f"{what}: {p} is not UTF-8 text (byte 0x{data[e.start]:02x} at line {line})") from None


def looks_like_path(spec: str) -> bool:
    """True when ``spec`` is meant as a local path rather than a hub id (``owner/name``)."""
    s = str(spec)
    return s.startswith((".", "/", "~")) or s.rstrip("/").count("/") > 1 or s.endswith(".gguf") or Path(s).exists()
