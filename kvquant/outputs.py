"""Writing outputs safely: nothing is overwritten unless asked, nothing is left half-written.

Every kvquant command that writes files goes through this module:

* :func:`check_output` / :func:`check_output_dir` run BEFORE any long work: the path has the right kind
  (a ``.yaml`` config is never a ``.png``; a folder is a folder), an existing file is refused unless
  ``force`` (``--force`` on the command line), and the folder it goes into can be created and written.
* :func:`atomic_path` (and :func:`write_text`, :func:`save_figure`) write into a temporary file in the same
  folder and rename it onto the target at the end, so a crash or an error leaves the old file (or no file),
  never a partial one, and no stray temporary file.

* :func:`staged_files` records every file it writes in the folder's :data:`OWN_MANIFEST` (name and SHA-256), and
  ``force`` replaces a file of a run's set (``eval --out``, ``calibrate -o``) only when that record shows this tool
  wrote it, unchanged since (:func:`is_own_file`): a foreign file of the same name is never replaced.

Failures raise :class:`kvquant.errors.OutputError` with a one-line message naming the option and the path.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .errors import OutputError
from .inputs import user_path

FORCE_HINT = "pass --force to overwrite"
OWN_MANIFEST = ".kvquant-outputs.json"  # in a folder: the files kvquant wrote there (see staged_files)
_OWN_FORMAT = "kvquant-outputs"


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _own_records(folder: Path) -> dict[str, str]:
    """``{file name: sha256}`` of the files :data:`OWN_MANIFEST` in ``folder`` says kvquant wrote (empty when the
    manifest is missing or not one of ours: nothing is then taken as ours)."""
    try:
        doc = json.loads((folder / OWN_MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    if not isinstance(doc, dict) or doc.get("format") != _OWN_FORMAT or not isinstance(doc.get("files"), dict):
        return {}
    return {str(k): v for k, v in doc["files"].items() if isinstance(v, str)}


def is_own_file(path: str | os.PathLike) -> bool:
    """True when ``path`` is a regular file that kvquant wrote (its folder's :data:`OWN_MANIFEST` lists its name
    with these exact contents): the only kind of existing file ``--force`` replaces in a run's set of files."""
    p = Path(path)
    if p.is_symlink() or not p.is_file():
        return False
    want = _own_records(p.parent).get(p.name)
    try:
        return want is not None and _digest(p) == want
    except OSError:
        return False


def _not_own(p: Path, what: str) -> OutputError:
    return OutputError(f"{what}: {p} exists and was not written by kvquant (not recorded in {p.parent / OWN_MANIFEST}"
                       " with these contents); it is never replaced: remove it yourself or choose another name")


def _record_own(folder: Path, digests: dict[str, str], removed: Sequence[str]) -> None:
    """Record ``digests`` (name: sha256) as written by kvquant in ``folder``'s manifest, ``removed`` as gone."""
    files = {n: d for n, d in _own_records(folder).items() if n not in removed}
    files.update(digests)
    tmp = folder / _tmp_name(OWN_MANIFEST, "manifest.tmp")  # (a stale one is swept like any temporary)
    tmp.write_text(json.dumps({"format": _OWN_FORMAT, "files": dict(sorted(files.items()))}, indent=1) + "\n",
                   encoding="utf-8")
    os.replace(tmp, folder / OWN_MANIFEST)


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
    path: str | os.PathLike, suffixes: Sequence[str], what: str, force: bool = False, own: bool = False
) -> Path:
    """Check an output file path before work starts; returns it as a ``Path``.

    Args:
        path: the file to be written.
        suffixes: the accepted suffixes, lower case with the dot (``(".yaml", ".yml")``); empty: any.
        what: the option or field it came from, for the message (``-o``, ``--plot``).
        force: an existing regular file may be replaced.
        own: the file is one of a run's set (:func:`staged_files`): ``force`` replaces it only when kvquant wrote
            it (:func:`is_own_file`).

    Raises:
        OutputError: wrong suffix, a folder or other non-file in the way, an existing file without
            ``force`` (or with ``own``, one kvquant did not write), or a folder that cannot be created or written.
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
        if own and not is_own_file(p):
            raise _not_own(p, what)
    check_writable_dir(p.parent, what)
    return p


def check_output_dir(
    folder: str | os.PathLike, names: Sequence[str], what: str, force: bool = False
) -> Path:
    """Check an output folder that will receive the files ``names``; returns it as a ``Path``.

    An existing folder is fine; files in it that would be replaced are refused unless ``force``, and even then
    unless kvquant wrote them (:func:`is_own_file`: the files of an earlier run's :func:`staged_files`).
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
    for n in in_the_way:
        if not is_own_file(p / n):
            raise _not_own(p / n, what)
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
    sweep_stale(p.parent)
    fd, name = tempfile.mkstemp(prefix=f".{p.name}.kvq-{os.getpid()}-", suffix=".tmp" + p.suffix, dir=p.parent)
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


# ------------------------------------------------------------------------------------------ outputs vs inputs
def _resolved(p: Path) -> Path:
    return Path(os.path.realpath(p))


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def input_paths(what: str, path: str | os.PathLike | None) -> list[tuple[str, Path]]:
    """``[(what, path)]`` for a local input and, for a folder, every file in it that is a link (to where it points).

    A model folder whose weights are links to another folder (an export's ``--weights link``) has both folders
    as inputs; hub ids and names that are not local paths give nothing.
    """
    if path is None:
        return []
    p = user_path(path, what)
    if not (p.exists() or p.is_symlink()):
        return []
    out = [(what, p)]
    if p.is_dir():
        with contextlib.suppress(OSError):
            out += [(what, q) for q in p.iterdir() if q.is_symlink()]
    return out


def check_disjoint(outputs: Sequence[tuple[str, str | os.PathLike]], inputs: Sequence[tuple[str, Path]]) -> None:
    """Refuse an output that is, holds or lies inside an input (both resolved, links followed).

    ``outputs``: ``(option, path)`` of every file or folder a command creates or replaces; ``inputs``:
    ``(option, path)`` of what it reads (:func:`input_paths`). Checked before anything is loaded, so that no
    ``--force`` can replace a model's weights, its data or the scales it reads.

    Raises:
        OutputError: naming the output option, the input option and both paths.
    """
    resolved_inputs = []
    for i_what, i_path in inputs:
        resolved_inputs.append((i_what, _resolved(i_path)))
        if i_path.is_symlink():  # the link itself is an input too (replacing it loses where it points)
            resolved_inputs.append((i_what, _resolved(i_path.parent) / i_path.name))
    for o_what, o_path in outputs:
        o = user_path(o_path, o_what, OutputError)
        ro = _resolved(o)
        for i_what, ri in resolved_inputs:
            if ro == ri:
                raise OutputError(f"{o_what}: {o} is {i_what}'s {ri}; choose an output that is not an input")
        for i_what, ri in resolved_inputs:
            if _inside(ri, ro):
                raise OutputError(f"{o_what}: {o} holds {i_what}'s {ri}; choose an output outside the inputs")
        for i_what, ri in resolved_inputs:
            if _inside(ro, ri):
                raise OutputError(f"{o_what}: {o} lies inside {i_what}'s {ri}; write outputs outside the inputs")


# ------------------------------------------------------------------------------------------ temporaries
# Every temporary file or folder this module makes is named ``.{target}.kvq-{pid}-{kind}``: a later run finds the
# ones a killed process (SIGKILL: no cleanup ran) left behind and finishes or removes them (:func:`sweep_stale`).
_TMP_RE = re.compile(r"^\.(?P<target>.+)\.kvq-(?P<pid>\d+)-(?P<kind>stage|old|set|setold|[0-9a-z_]+\.tmp.*)$")
_SET_MANIFEST = ".kvq-set.json"


def _tmp_name(target: str, kind: str) -> str:
    return f".{target}.kvq-{os.getpid()}-{kind}"


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _remove(p: Path) -> None:
    with contextlib.suppress(OSError):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink()


def sweep_stale(folder: str | os.PathLike) -> list[Path]:
    """Finish or remove the temporaries a killed kvquant process left in ``folder``; returns what it removed.

    A folder swap cut between its two renames is finished (the complete new folder moved into place, else the
    old one moved back); a file set whose staging folder was complete is committed; anything else (a partial
    file, a partial staging folder) is removed. Temporaries of running processes are left alone.
    """
    d = Path(folder)
    removed: list[Path] = []
    try:
        entries = sorted(d.iterdir())
    except OSError:
        return removed
    stale: dict[tuple[str, int], dict[str, Path]] = {}
    for p in entries:
        m = _TMP_RE.match(p.name)
        if m and not _alive(int(m["pid"])):
            kind = m["kind"] if m["kind"] in ("stage", "old", "set", "setold") else "tmp"
            stale.setdefault((m["target"], int(m["pid"])), {})[kind] = p
    for (target, _pid), parts in stale.items():
        dest = d / target
        if "old" in parts and not (dest.exists() or dest.is_symlink()):  # killed between the two renames
            os.replace(parts.pop("stage") if "stage" in parts else parts.pop("old"), dest)
        if "set" in parts and (parts["set"] / _SET_MANIFEST).is_file():
            _commit_set(d, parts.pop("set"), parts.get("setold") or d / _tmp_name(target, "setold"))
        for p in parts.values():
            _remove(p)
            removed.append(p)
    return removed


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT / SIGTERM wait until the block ends (a few renames), so a swap is never cut by them."""
    sigs = {signal.SIGINT, signal.SIGTERM}
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    except (AttributeError, ValueError, OSError):  # no pthread_sigmask here
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def terminate_as_exit() -> Any:
    """Make SIGTERM raise ``SystemExit(143)`` in the main thread, so ``finally`` blocks remove temporaries.

    Returns the previous handler (for ``signal.signal(signal.SIGTERM, previous)``), or None where none can be
    set (not the main thread).
    """

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    try:
        return signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):  # not the main thread
        return None


# ------------------------------------------------------------------------------------------ folders and file sets
def is_own_folder(folder: Path, manifest: str) -> bool:
    """True when ``folder`` is empty or holds ``manifest`` (a JSON object this tool wrote there)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    if not names:
        return True
    try:
        return isinstance(json.loads((folder / manifest).read_text(encoding="utf-8")), dict)
    except (OSError, ValueError):
        return False


def check_output_folder(folder: str | os.PathLike, manifest: str, what: str, force: bool = False) -> Path:
    """Check a folder an output replaces whole: a new one, or (with ``force``) one this tool wrote.

    Stale temporaries beside it are cleaned first (:func:`sweep_stale`). Raises :class:`OutputError` for a
    file in the way, an existing folder without ``force``, one without ``manifest`` (not written by this tool:
    never replaced), or a parent folder that does not exist or cannot be written.
    """
    p = user_path(folder, what, OutputError)
    parent = p.parent
    if not parent.is_dir():
        raise OutputError(f"{what}: the folder {parent} does not exist (create it first)")
    sweep_stale(parent)
    if p.is_symlink() or (p.exists() and not p.is_dir()):
        raise OutputError(f"{what}: {p} exists and is not a folder")
    if p.exists():
        if not force:
            raise OutputError(f"{what}: {p} exists; pass --force to replace it")
        if not is_own_folder(p, manifest):
            raise OutputError(f"{what}: {p} exists and was not written by kvquant (no {manifest}); it is never "
                              "replaced: remove it yourself or choose another folder")
    check_writable_dir(parent, what)
    return p


@contextlib.contextmanager
def staged_folder(folder: str | os.PathLike, what: str = "output") -> Iterator[Path]:
    """Yield an empty staging folder beside ``folder``; on success it replaces ``folder`` whole, on error it goes.

    The swap is two renames with SIGINT / SIGTERM held; a SIGKILL between them is finished by the next
    :func:`sweep_stale` of the parent. The old folder is removed after the swap (links in it are not followed).
    """
    p = user_path(folder, what, OutputError)
    stage, old = p.parent / _tmp_name(p.name, "stage"), p.parent / _tmp_name(p.name, "old")
    for leftover in (stage, old):
        _remove(leftover)
    stage.mkdir()
    try:
        yield stage
        os.chmod(stage, 0o777 & ~_umask())
        with _signals_held():
            had_old = p.exists() or p.is_symlink()
            if had_old:
                os.replace(p, old)
            os.replace(stage, p)
        if had_old:
            _remove(old)
    except BaseException:
        _remove(stage)
        raise


def _commit_set(folder: Path, stage: Path, old: Path) -> None:
    """Move the staged files into ``folder`` (the replaced ones and the listed stale ones into ``old``, removed)."""
    manifest = json.loads((stage / _SET_MANIFEST).read_text(encoding="utf-8"))
    digests = {n: _digest(stage / n) for n in manifest["names"] if (stage / n).is_file()}
    old.mkdir(exist_ok=True)
    with _signals_held():
        for name in manifest["remove"]:
            if is_own_file(folder / name):  # (an earlier run's file; a foreign one of that name stays)
                os.replace(folder / name, old / name)
        for name in manifest["names"]:
            if (stage / name).exists():
                if (folder / name).exists() or (folder / name).is_symlink():
                    os.replace(folder / name, old / name)
                os.replace(stage / name, folder / name)
        _record_own(folder, digests, manifest["remove"])
    _remove(old)
    _remove(stage)


@contextlib.contextmanager
def staged_files(folder: str | os.PathLike, own: Sequence[str], what: str = "out") -> Iterator[Path]:
    """Yield a staging folder inside ``folder`` for one run's set of files; on success they replace it together.

    Every file written into the staging folder replaces its namesake in ``folder``; the other names in ``own``
    (this command's files of an earlier run that this run does not write) are removed, so a folder never holds
    one run's ``results.json`` beside another run's ``report.md``. Other files in ``folder`` are never touched.
    On error (or SIGINT / SIGTERM) the staging folder is removed and ``folder`` is as it was; after a SIGKILL the
    next :func:`sweep_stale` commits a complete set or removes a partial one.
    """
    d = user_path(folder, what, OutputError)
    d.mkdir(parents=True, exist_ok=True)
    sweep_stale(d)
    stage, old = d / _tmp_name(d.name, "set"), d / _tmp_name(d.name, "setold")
    for leftover in (stage, old):
        _remove(leftover)
    stage.mkdir()
    try:
        yield stage
        names = sorted(n for n in os.listdir(stage) if n != _SET_MANIFEST)
        for n in names:
            os.chmod(stage / n, 0o666 & ~_umask())
        remove = sorted(set(own) - set(names))
        tmp_manifest = stage / (_SET_MANIFEST + ".part")
        tmp_manifest.write_text(json.dumps({"names": names, "remove": remove}), encoding="utf-8")
        os.replace(tmp_manifest, stage / _SET_MANIFEST)  # from here on the set is complete: it is committed
        _commit_set(d, stage, old)
    except BaseException:
        if not (stage / _SET_MANIFEST).is_file():
            _remove(stage)
        raise
