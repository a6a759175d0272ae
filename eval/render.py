"""Rendering helpers shared by the run report and the retrieval tasks: markdown tables and figure files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvquant.outputs import save_figure


def md_table(head: list[str], body: list[list[str]]) -> str:
    """A markdown table: ``head`` as the header row, ``body`` as rows; ``|`` in a cell is escaped, and every column
    but the first is right-aligned."""
    head = [h.replace("|", "\\|") for h in head]
    body = [[c.replace("|", "\\|") for c in b] for b in body]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"]
    out += ["| " + " | ".join(b) + " |" for b in body]
    return "\n".join(out)


def finish_figure(fig: Any, path: Path, layout: bool = True) -> bool:
    """Lay out (unless ``layout`` is False: the caller laid it out and placed labels in that layout), save
    (atomically) and close a matplotlib figure; returns True (it was written)."""
    import matplotlib.pyplot as plt

    if layout:
        fig.tight_layout()
    try:
        save_figure(fig, path, dpi=120)
    finally:
        plt.close(fig)
    return True
