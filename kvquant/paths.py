"""Where the shared reference data lives (``KVQUANT_SHARED``, default ``<repo>/../shared``)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def shared_dir() -> Path:
    """The shared data folder: ``$KVQUANT_SHARED`` if set, else ``../shared`` beside the repo."""
    env = os.environ.get("KVQUANT_SHARED")
    return Path(env).expanduser() if env else REPO_ROOT.parent / "shared"


def require_shared(*parts: str) -> Path:
    """A path inside the shared folder; raises ``FileNotFoundError`` naming the setting if missing."""
    p = shared_dir().joinpath(*parts)
    if not p.exists():
        raise FileNotFoundError(f"{p} not found: set KVQUANT_SHARED to the shared data folder")
    return p
