"""Writing outputs safely: nothing is overwritten unless asked, nothing is left half-written.

Every kvquant command that writes files goes through this module:

* :func:`check_output` / :func:`check_output_dir` run BEFORE any long work: the path has the right kind
  (a ``.yaml`` config is never a ``.png``; a folder is a folder), an existing file is refused unless
  ``force`` (``--force`` on the command line), and the folder it goes into can be created and written.
* :func:`atomic_path` (and :func:`write_text`, :func:`save_figure`) write into a temporary file in the same
  folder and rename it onto the target at the end, so a crash or an error leaves the old file (or no file),
  never a partial one, and no stray temporary file.

Failures raise :class:`kvquant.errors.OutputError` with a one-line message naming the option and the path.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .errors import OutputError
from .inputs import user_path

FORCE_HINT = "pass --force to overwrite"


def _alternatives(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def _first_existing(folder: Path) -> Path:
    p = folder
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_writable_dir(folder: str | os.PathLike, what: str) -> Path:
    """Check that ``folder`` is, or can be created as, a writable folder (it is not created here)."""
    folder = user_path(folder, what, OutputError)
    anchor = _first_existing(folder)
    if not anchor.is_dir():
        raise OutputError(f"{what}: cannot create folder {folder}: {anchor} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvquant-probe-", dir=anchor)
    except OSError as e:
        raise OutputError(f"{what}: folder {anchor} is not writable ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(probe)
    return folder


def check_output(
    path: str | os.PathLike, suffixes: Sequence[str], what: str, force: bool = False
) -> Path:
    """Check an output file path before work starts; returns it as a ``Path``.

    Args:
        path: the file to be written.
        suffixes: the accepted suffixes, lower case with the dot (``(".yaml", ".yml")``); empty: any.
        what: the option or field it came from, for the message (``-o``, ``--plot``).
        force: an existing regular file may be replaced.

    Raises:
        OutputError: wrong suffix, a folder or other non-file in the way, an existing file without
            ``force``, or a folder that cannot be created or written.
    """
    p = user_path(path, what, OutputError)
    if suffixes and p.suffix.lower() not in suffixes:
        raise OutputError(f"{what}: {p} must end in {_alternatives(suffixes)}")
    if p.is_dir():
        raise OutputError(f"{what}: {p} is a folder, not a file")
    if p.exists() or p.is_symlink():
        if not p.is_file():
            raise OutputError(f"{what}: {p} exists and is not a regular file")
        if not force:
            raise OutputError(f"{what}: {p} exists; {FORCE_HINT} it")
    check_writable_dir(p.parent, what)
    return p


def check_output_dir(
    folder: str | os.PathLike, names: Sequence[str], what: str, force: bool = False
) -> Path:
    """Check an output folder that will receive the files ``names``; returns it as a ``Path``.

    An existing folder is fine; files in it that would be replaced are refused unless ``force``.
    """
    p = user_path(folder, what, OutputError)
    if p.exists() and not p.is_dir():
        raise OutputError(f"{what}: {p} exists and is not a folder")
    in_the_way = [n for n in names if (p / n).exists() or (p / n).is_symlink()]
    for n in in_the_way:
        if not (p / n).is_file():
            raise OutputError(f"{what}: {p / n} exists and is not a regular file")
    if in_the_way and not force:
        raise OutputError(
            f"{what}: {p} already holds {', '.join(in_the_way)}; {FORCE_HINT} them, or choose another folder"
        )
    check_writable_dir(p, what)
    return p


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, force: bool = True, what: str = "output") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed onto ``path``, on error removed.

    The temporary file keeps the target's suffix (``.out.png.x1y2.tmp.png``), so writers that choose a format
    by suffix work. With ``force=False`` an existing ``path`` raises :class:`OutputError` (checked again here,
    right before writing, in case the file appeared meanwhile).
    """
    p = user_path(path, what, OutputError)
    if not force and (p.exists() or p.is_symlink()):
        raise OutputError(f"{what}: {p} exists; {FORCE_HINT} it")
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp" + p.suffix, dir=p.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; an output is an ordinary file
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_text(path: str | os.PathLike, text: str, force: bool = True, what: str = "output") -> Path:
    """Write UTF-8 ``text`` to ``path`` atomically (see :func:`atomic_path`)."""
    with atomic_path(path, force=force, what=what) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 120, force: bool = True, what: str = "plot") -> Path:
    """Save a matplotlib figure atomically, in the format its suffix names."""
    p = Path(path)
    with atomic_path(p, force=force, what=what) as tmp:
        fig.savefig(tmp, dpi=dpi, format=p.suffix.lstrip(".").lower() or "png")
    return p
