"""``kvquant eval --compare A,B``: do two configs differ beyond noise on the same tokens?

Every window of a run is scored by the reference and by each config on the same tokens, so two configs A and B
can be compared window by window (a paired test): for each metric, the per-window differences ``A - B`` give a
mean, a standard error (sample standard deviation / sqrt(windows)) and a t statistic with ``windows - 1``
degrees of freedom. A and B differ beyond noise in a metric when ``|t|`` exceeds the two-sided 95% critical
value of Student's t. With few windows that bar is high (4 windows: |t| > 3.18): few windows resolve only large
differences, which is the honest answer.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvquant.errors import ArgumentError, InputError

#: Per-window metrics compared: (key in a row's ``windows`` entries, label, lower is better).
COMPARED = (("ppl", "ppl", True), ("kl_mean", "KL mean", True), ("top1", "top-1", False))


def t_quantile(p: float, dof: int) -> float:
    """The ``p`` quantile (p > 0.5) of Student's t with ``dof`` degrees of freedom (numerical, no scipy)."""
    if not 0.5 < p < 1 or dof < 1:
        raise ValueError(f"t_quantile: needs 0.5 < p < 1 and dof >= 1, got p={p}, dof={dof}")
    c = math.exp(math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2)) / math.sqrt(dof * math.pi)

    def cdf(t: float) -> float:  # 0.5 + integral of the density over [0, t], Simpson's rule
        n = 2000
        h = t / n
        acc = 0.0
        for i in range(n + 1):
            w = 1 if i in (0, n) else (4 if i % 2 else 2)
            x = i * h
            acc += w * (1 + x * x / dof) ** (-(dof + 1) / 2)
        return 0.5 + c * acc * h / 3

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


@dataclass
class Difference:
    """Paired difference ``A - B`` of one metric over windows."""

    metric: str
    mean: float
    se: float | None
    t: float | None
    t_crit: float | None
    windows: int
    better: str | None  # "A", "B" or None (within noise)

    @property
    def beyond_noise(self) -> bool:
        return self.better is not None


def paired_difference(a: list[float], b: list[float], metric: str, lower_is_better: bool) -> Difference:
    """Mean and standard error of ``a[i] - b[i]``, and which side wins beyond noise (two-sided t test, 95%)."""
    if len(a) != len(b):
        raise InputError(f"compare: {len(a)} windows against {len(b)}: not the same run")
    d = [x - y for x, y in zip(a, b, strict=True)]
    n = len(d)
    mean = sum(d) / n
    if n < 2:
        return Difference(metric, mean, None, None, None, n, None)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    se = sd / math.sqrt(n)
    t_crit = t_quantile(0.975, n - 1)
    t = mean / se if se > 0 else (0.0 if mean == 0 else math.copysign(math.inf, mean))
    better = None
    if abs(t) > t_crit:
        a_lower = mean < 0
        better = "A" if a_lower == lower_is_better else "B"
    return Difference(metric, mean, se, t, t_crit, n, better)


def compare_rows(row_a: dict[str, Any], row_b: dict[str, Any]) -> list[Difference]:
    """Paired differences of every :data:`COMPARED` metric between two ``results.json`` rows of one protocol."""
    wa, wb = row_a.get("windows"), row_b.get("windows")
    if not wa or not wb:
        raise InputError("compare: the rows hold no per-window metrics (results.json from an older version?)")
    if [w["window"] for w in wa] != [w["window"] for w in wb]:
        raise InputError("compare: the two configs were not scored on the same windows")
    return [
        paired_difference([w[k] for w in wa], [w[k] for w in wb], label, lower)
        for k, label, lower in COMPARED
    ]


def _fmt(x: float | None, metric: str) -> str:
    if x is None:
        return "-"
    return f"{x:+.4f}" if metric != "KL mean" else f"{x:+.3e}"


def compare_text(rows: list[dict[str, Any]], a: str, b: str) -> str:
    """A readable verdict for configs ``a`` and ``b`` under every protocol both were run on."""
    out = []
    by = {(r["config"], r["protocol"]): r for r in rows if r.get("status") == "ok"}
    protocols = [p for p in dict.fromkeys(r["protocol"] for r in rows) if (a, p) in by and (b, p) in by]
    for name in (a, b):
        if not any(c == name for c, _ in by):
            raise ArgumentError(f"compare: {name!r} has no results in this run (configs: "
                             f"{', '.join(dict.fromkeys(c for c, _ in by))})")
    for p in protocols:
        diffs = compare_rows(by[(a, p)], by[(b, p)])
        n = diffs[0].windows
        out.append(f"{a} vs {b}, protocol {p}, {n} windows (paired, same tokens), A = {a}, B = {b}:")
        for d in diffs:
            if d.se is None:
                verdict = "one window: no standard error, no verdict"
            elif d.beyond_noise:
                verdict = f"differ beyond noise (|t| = {abs(d.t):.2f} > {d.t_crit:.2f}): {d.better} is better"
            else:
                verdict = f"within noise (|t| = {abs(d.t):.2f} <= {d.t_crit:.2f})"
            out.append(f"  {d.metric:8s} A - B = {_fmt(d.mean, d.metric)} ± {_fmt(d.se, d.metric).lstrip('+')}: "
                       f"{verdict}")
        beyond = [d.metric for d in diffs if d.beyond_noise]
        summary = f"they differ beyond noise in {', '.join(beyond)}" if beyond else "no difference beyond noise"
        out.append(f"  => {summary}")
    return "\n".join(out)


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``results.json`` written by ``kvquant eval``, checked for what a comparison reads.

    Raises :class:`InputError` naming the file and the first bad entry (a binary or truncated file, rows that
    are not objects, windows without numbers).
    """
    from kvquant.inputs import read_text

    text = read_text(path, "compare")  # missing, a folder, a FIFO, not UTF-8: one line naming it
    where = f"compare: {path}"
    try:
        rows = json.loads(text)["results"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise InputError(f"{where} is not a kvquant eval results.json ({e})") from None
    if not isinstance(rows, list):
        raise InputError(f"{where}: results is {type(rows).__name__}, expected a list of rows")
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or not isinstance(r.get("config"), str) or not isinstance(r.get("protocol"), str):
            raise InputError(f"{where}: results[{i}] is not a row with a config and a protocol")
        windows = r.get("windows")
        if windows is None or r.get("status") != "ok":  # only rows that ran are compared
            continue
        if not isinstance(windows, list):
            raise InputError(f"{where}: results[{i}].windows is not a list")
        for j, w in enumerate(windows):
            if not isinstance(w, dict) or "window" not in w:
                raise InputError(f"{where}: results[{i}].windows[{j}] is not a window entry")
            for k, _label, _lower in COMPARED:
                v = w.get(k)
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise InputError(f"{where}: results[{i}].windows[{j}].{k} is {v!r}, not a number")
    return rows


def parse_pair(text: str) -> tuple[str, str]:
    """``"A,B"`` -> ``("A", "B")`` (raises ValueError naming ``--compare``)."""
    parts = [x.strip() for x in text.split(",")]
    if len(parts) != 2 or not all(parts) or parts[0] == parts[1]:
        raise ArgumentError(f"--compare: expected two different configs as A,B, got {text!r}")
    return parts[0], parts[1]
