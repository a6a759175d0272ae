"""Point labels on a matplotlib axis that overlap neither each other nor the plotted markers.

:func:`place_labels` puts each label at the first free spot of a ring of candidate offsets around its
point (nearest first), measured with the figure's renderer; a label pushed far from its point gets a
thin leader line. Call it after the axis scales, limits and the figure layout are final: the labels are
kept out of later ``tight_layout`` passes, so the layout they were placed in is the one saved.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

#: Candidate label offsets in points, nearest first: 8 directions at growing radii.
_RADII = (5, 11, 18, 27, 38, 52, 70)
_DIRECTIONS = ((1, 1), (1, -1), (-1, 1), (-1, -1), (1, 0), (-1, 0), (0, 1), (0, -1))
LEADER_FROM = 18  # offsets of at least this radius (points) draw a leader line


def _offsets() -> list[tuple[float, float]]:
    out = []
    for r in _RADII:
        for dx, dy in _DIRECTIONS:
            n = math.hypot(dx, dy)
            out.append((r * dx / n, r * dy / n))
    return out


def _align(dx: float, dy: float) -> tuple[str, str]:
    ha = "left" if dx > 0 else "right" if dx < 0 else "center"
    va = "bottom" if dy > 0 else "top" if dy < 0 else "center"
    return ha, va


def place_labels(
    ax: Any, points: Sequence[tuple[float, float, str]], fontsize: float = 7, bold: Iterable[str] = ()
) -> list[Any]:
    """Annotate ``(x, y, label)`` points in data coordinates; returns the annotations.

    Labels named in ``bold`` are drawn in bold. A label for which no candidate spot is free takes the
    least-overlapping one (never silently dropped).
    """
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    bold = set(bold)
    frame = ax.get_window_extent(renderer)
    px = fig.dpi / 72.0
    marker_pad = 10 * px  # clears the largest marker drawn (a 12-point star)
    taken = []
    for x, y, _ in points:
        mx, my = ax.transData.transform((x, y))
        taken.append((mx - marker_pad, my - marker_pad, mx + marker_pad, my + marker_pad))

    def overlap(box: tuple[float, float, float, float]) -> float:
        area = 0.0
        for o in taken:
            w = min(box[2], o[2]) - max(box[0], o[0])
            h = min(box[3], o[3]) - max(box[1], o[1])
            if w > 0 and h > 0:
                area += w * h
        outside = (box[0] < frame.x0) + (box[2] > frame.x1) + (box[1] < frame.y0) + (box[3] > frame.y1)
        return area + outside * 1e9

    annotations = []
    order = sorted(range(len(points)), key=lambda i: (-points[i][1], points[i][0]))
    for i in order:
        x, y, label = points[i]
        best: tuple[float, tuple[float, float], tuple] | None = None
        for dx, dy in _offsets():
            ha, va = _align(dx, dy)
            text = ax.annotate(label, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=fontsize,
                               ha=ha, va=va, fontweight="bold" if label in bold else "normal")  # fmt: skip
            bb = text.get_window_extent(renderer)
            text.remove()
            box = (bb.x0 - px, bb.y0 - px, bb.x1 + px, bb.y1 + px)
            score = overlap(box)
            if best is None or score < best[0]:
                best = (score, (dx, dy), box)
            if score == 0:
                break
        assert best is not None
        (dx, dy), box = best[1], best[2]
        ha, va = _align(dx, dy)
        arrow = {"arrowstyle": "-", "lw": 0.5, "color": "0.5"} if math.hypot(dx, dy) >= LEADER_FROM else None
        text = ax.annotate(label, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=fontsize, ha=ha,
                           va=va, fontweight="bold" if label in bold else "normal", arrowprops=arrow)  # fmt: skip
        text.set_in_layout(False)
        taken.append(box)
        annotations.append(text)
    return annotations


def label_boxes(annotations: Sequence[Any]) -> list[tuple[float, float, float, float]]:
    """The display-space boxes ``(x0, y0, x1, y1)`` of placed labels' text, leader lines left out."""
    from matplotlib.text import Text

    if not annotations:
        return []
    renderer = annotations[0].figure.canvas.get_renderer()
    boxes = []
    for a in annotations:
        a.update_positions(renderer)
        boxes.append(tuple(Text.get_window_extent(a, renderer).extents))
    return boxes
