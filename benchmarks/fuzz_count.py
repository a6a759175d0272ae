"""A pytest plugin that counts the command lines ``tests/test_fuzz.py`` tries through its ``_check`` harness
and how many of them were handled (exit 0, or one line and exit 2); printed when pytest ends.

    CI=true KVQUANT_SHARED=/work/shared PYTHONPATH=benchmarks python -m pytest -p fuzz_count tests/test_fuzz.py \\
        --hypothesis-show-statistics

The other fuzz tests' example counts are in hypothesis' statistics; the damaged-input table's size is
``len(_damaged_cases(...))``.
"""

from __future__ import annotations

import sys
from typing import Any

COUNTS = {"tried": 0, "handled": 0}


def pytest_collection_finish(session: Any) -> None:
    for mod in list(sys.modules.values()):
        if str(getattr(mod, "__file__", "")).endswith("test_fuzz.py") and hasattr(mod, "_check"):
            check = mod._check

            def counted(argv: list[str], _check: Any = check) -> None:
                COUNTS["tried"] += 1
                _check(argv)
                COUNTS["handled"] += 1

            mod._check = counted


def pytest_unconfigure(config: Any) -> None:
    print(f"\nfuzz command lines: {COUNTS['tried']} tried, {COUNTS['handled']} handled", file=sys.stderr)
