"""A reader that stops early (``kvquant presets | head -1``) ends the command quietly: no traceback."""

from __future__ import annotations

import subprocess
import sys


def test_closed_pipe_is_not_a_traceback():
    proc = subprocess.Popen([sys.executable, "-m", "kvquant.cli", "presets"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()  # the reader goes away after one line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) in (0, 141), err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
