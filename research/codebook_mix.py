"""Write a per-head tq3/tq4 codebook config from a ``kvquant calibrate`` sensitivity cache (issue 14).

    kvquant calibrate --model smollm2-135m --data wikitext-2 --budget-bits 3.625 --kv-separate \\
        --candidates tq3,tq4 --method fisher --calib-windows 2 --calib-window 1024 --samples 4 -o cal/tq.yaml
    python research/codebook_mix.py cal/kvquant-sensitivity.json --base tq4:tq3 --raise value:35 \\
        --sinks 4 --residual 16 --name tq4-v4mix-r16 -o research/configs/tq4-v4mix-r16.yaml

Ranks the (layer, KV head) units of ONE side (``key`` or ``value``) by their estimated gain from the lower to
the higher width (the cache's ``tq3`` minus ``tq4`` sensitivity) and raises the ``N`` best to the higher width;
the other side keeps the base width everywhere. ``kvquant calibrate``'s own greedy allocation trades K and V
units against each other with sensitivities measured without a residual window, where keys dominate; with an
fp16 residual the keys' share shrinks (docs/results/lowbit-smollm2.md), so only one side is re-allocated here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SIDES = {"key": 0, "value": 1}


def rank_units(cache: Path, low: str, high: str, side: str) -> list[tuple[float, int, int]]:
    """``(gain, layer, head)`` of every unit of ``side``, best first, from the cache's only ``low``/``high`` entry."""
    entries = json.loads(cache.read_text(encoding="utf-8"))["entries"]
    found = [e for e in entries.values() if low in e["values"] and high in e["values"]]
    if len(found) != 1:
        raise ValueError(f"cache: {len(found)} entries measure both {low} and {high} in {cache}, expected 1")
    lo, hi = found[0]["values"][low], found[0]["values"][high]
    i = SIDES[side]
    units = [(lo[layer][h][i] - hi[layer][h][i], layer, h) for layer in range(len(lo)) for h in range(len(lo[layer]))]
    return sorted(units, key=lambda u: (-u[0], u[1], u[2]))


def mix_config(units: list[tuple[float, int, int]], base: tuple[str, str], side: str, width: str, n: int,
               name: str, sinks: int, residual: int, block: int) -> str:
    """The config YAML: ``base`` (key, value) widths, the ``n`` first ``units`` of ``side`` at ``width``."""
    key, value = base
    lines = [f"name: {name}", f"default: {{key: {key}, value: {value}}}", "heads:"]
    for _, layer, h in sorted(units[:n], key=lambda u: (u[1], u[2])):
        k, v = (width, value) if side == "key" else (key, width)
        lines.append(f"  '{layer}.{h}': {{key: {k}, value: {v}}}")
    lines.append(f"sink_tokens: {sinks}")
    if residual:
        lines += [f"residual_tokens: {residual}", f"block_size: {block}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cache", type=Path, help="kvquant-sensitivity.json written by kvquant calibrate")
    ap.add_argument("--base", default="tq4:tq3", help="KEY:VALUE widths everywhere else (default tq4:tq3)")
    ap.add_argument("--raise", dest="raise_", required=True, help="SIDE:N, e.g. value:35 (SIDE key or value)")
    ap.add_argument("--low", default="tq3")
    ap.add_argument("--high", default="tq4")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--residual", type=int, default=0)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--name", required=True)
    ap.add_argument("-o", "--output", type=Path, help="write here (default: print)")
    args = ap.parse_args(argv)
    side, _, n = args.raise_.partition(":")
    if side not in SIDES or not n.isdigit():
        ap.error(f"--raise: {args.raise_!r} is not key:N or value:N")
    key, _, value = args.base.partition(":")
    units = rank_units(args.cache, args.low, args.high, side)
    text = mix_config(units, (key, value), side, args.high, int(n), args.name, args.sinks, args.residual, args.block)
    if args.output:
        args.output.write_text(text, encoding="utf-8")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
