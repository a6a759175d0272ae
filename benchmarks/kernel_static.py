"""Static performance model of the decode kernels, from their compiled Hopper code (no GPU needed).

For each variant (K/V precision of a layer), head_dim and GQA group, the decode kernel is compiled for
``sm_90a`` exactly as the runtime launcher would launch it: the launches come from
``kvquant.kernels.triton_decode.decode_launches`` (same constexprs, BLOCK_N, warps, stages, split
count) on ``meta`` tensors with the store's real part shapes and strides, and are compiled through
Triton's own runtime binder (``triton_launch.compile_launch``: integer 1 -> constant, divisibility-16
hints on pointers and integers). The cubin is disassembled (``nvdisasm``, shipped with Triton) and the
steady-state loop -- the body of the kernel's backward branch, one iteration = one tile of BLOCK_N
tokens, or ``SUB`` such tiles where a kernel unrolls several per step (the rows kernel: ``BLOCK_N x SUB``
tokens, shown as the tile) -- is counted. Per KV token (of one KV head; all ``group`` query heads of it):

* warp-instructions: loop body x warps / (BLOCK_N x SUB), plus the rest of the kernel (prologue, epilogue)
  x warps / tokens per program (the partition length of this shape);
* conversion instructions (``I2F F2I F2F I2I I2FP F2FP F2IP``) per token, the same way;
* shared-memory traffic: bytes moved by ``LDS STS LDSM STSM LDGSTS`` per token (all lanes);
* HBM bytes: the stored bytes of K and V per token (codes, scales and zeros; the quantizer's own
  ``bits_per_element``);
* registers, shared memory and spills (local memory) of the binary (``cuobjdump -res-usage``).

Model (H200, one time per token, the largest of three limits)::

    t = max(HBM bytes / 4.3 TB/s,
            warp-instructions / (132 SMs x 4 schedulers x 1.98 GHz),       # one issue per scheduler-clock
            conversions x 32 lanes / (132 SMs x 16 lanes/clock x 1.98 GHz)) # CUDA guide, cc 9.0: 16/clk/SM

``predicted_speedup_vs_fp16`` = t(kvquant's own fp16 kernel, same head_dim and group) / t(variant).
``mixed`` is one layer with half its KV heads int4 and half int8: two launches, one per head group,
so its time per (token, KV head) is the mean of the two groups' times. The model ignores latency
(it assumes enough warps in flight to cover it), wave quantisation and the reduction kernel; the
occupancy and wave fill columns are printed for reference.

Launch shape: the split count is the launcher's own (``triton_decode.num_splits``), given the occupancy the
runtime would read from its compile (``compiled_programs_per_sm``): here the programs per SM of the sm_90a binary
measured (``programs_per_sm``: its registers from ``cuobjdump``, ``metadata.shared``, its warps; Hopper limits),
on 132 SMs. The split count sets the partition length, hence each program's prologue / epilogue share per token
(the second term of the warp-instructions above); ``splits`` and ``wave fill`` (programs / the slots of the
waves they occupy, per head-group launch; the lowest) are reported.

    python benchmarks/kernel_static.py                      # full table -> docs/results/kernel_static.md
    python benchmarks/kernel_static.py --variants int8 --head-dims 64 --groups 4 --json rows.json --md -

Needs ``TRITON_INTERPRET`` unset (it is cleared here before Triton is imported).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

HBM_BYTES_PER_S = 4.3e12
SMS = 132
SCHEDULERS = 4
CLOCK_HZ = 1.98e9
CONV_LANES_PER_CLK = 16
ISSUE_PER_S = SMS * SCHEDULERS * CLOCK_HZ
CONV_PER_S = SMS * CONV_LANES_PER_CLK * CLOCK_HZ / 32  # warp-instructions per second

CONVERSIONS = ("I2F", "F2I", "F2F", "I2I", "I2FP", "F2FP", "F2IP")
SMEM_OPS = ("LDS", "STS", "LDSM", "STSM", "LDGSTS")

#: variant -> head groups of one layer: (K kind, V kind, share of the KV heads)
VARIANTS: dict[str, list[tuple[str, str, float]]] = {
    "fp16": [("fp16", "fp16", 1.0)],
    "int8": [("int8", "int8", 1.0)],
    "int8-token": [("int8-token", "int8-token", 1.0)],
    "fp8-e4m3": [("fp8-e4m3", "fp8-e4m3", 1.0)],
    "int4": [("int4", "int4", 1.0)],
    "int4-channel": [("int4-channel", "int4", 1.0)],  # KIVI: per-channel keys, per-token int4 values
    "int3": [("int3", "int3", 1.0)],
    "int2": [("int2", "int2", 1.0)],
    "mixed": [("int4", "int4", 0.5), ("int8", "int8", 0.5)],
    # rotated codebooks (issue 14): codes read in-kernel, level gather + 8-bit log norm per token
    "tq4": [("tq4", "tq4", 1.0)],
    "tq3": [("tq3", "tq3", 1.0)],
    "tq2": [("tq2", "tq2", 1.0)],
    "tq4-k4v3": [("tq4", "tq3", 1.0)],
    "tq3+int8": [("tq3", "tq3", 0.5), ("int8", "int8", 0.5)],
    # per-channel-width keys tqc-<widths> (real SmolLM2 heads, triton_compile_check.TQC_EXAMPLES): codes gathered
    # per channel (1-2 bytes, shift, mask), Lloyd-Max level by width, times the channel spread
    "tqc4": [("tqc4", "tq4", 1.0)],
    "tqc3": [("tqc3", "tq3", 1.0)],
    # 2-D vector codebook keys tqv3: a 6-bit code per channel pair (1-2 bytes, shift, mask), codeword coordinate
    "tqv3": [("tqv3", "tq3", 1.0)],
    "tqv4": [("tqv4", "tqv4", 1.0)],  # K and V as 2-D vector codes
    "tqv2": [("tqv2", "tqv2", 1.0)],
    # trellis codes tqt: an L-bit window of the row's circular code stream (3 byte loads, shift, mask), table lookup
    "tqt3": [("tqt3", "tqt3", 1.0)],
    "tqt2": [("tqt2", "tqt2", 1.0)],
    "tqt4": [("tqt4", "tqt4", 1.0)],
}
#: acceptance (head_dim 128, group 4): minimum predicted speed-up over the fp16 kernel
TARGETS = {"int8": 1.8, "fp8-e4m3": 1.8, "int4": 3.0, "int4-channel": 3.0}
MAX_ISSUE_OVER_HBM = 0.70

_INSN = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Za-z0-9_]+)*)\s*(.*?);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


@dataclass
class Sass:
    """One kernel's SASS, split into its steady-state loop and the rest."""

    body: list[tuple[str, str]]  # (opcode, modifiers) of the loop body, in order
    rest: list[tuple[str, str]]  # every other instruction

    @staticmethod
    def parse(text: str) -> Sass:
        insns: list[tuple[int, str, str, str]] = []
        labels: dict[str, int] = {}
        for line in text.splitlines():
            m = _LABEL.match(line)
            if m:
                labels[m.group(1)] = len(insns)
                continue
            m = _INSN.match(line)
            if m:
                insns.append((int(m.group(1), 16), m.group(2), m.group(3), m.group(4)))
        loops = []  # (first index, branch index) of every backward branch
        for i, (_, op, _, args) in enumerate(insns):
            t = _TARGET.search(args)
            if op == "BRA" and t and labels.get(t.group(1), i + 1) <= i:
                loops.append((labels[t.group(1)], i))
        loops = [(a, b) for a, b in loops if b > a]  # a branch to itself is the trailing trap loop
        if not loops:
            raise ValueError("no loop (backward branch) in the SASS")
        a, b = max(loops, key=lambda ab: ab[1] - ab[0])
        body = [(op, mod) for _, op, mod, _ in insns[a:b + 1]]
        rest = [(op, mod) for _, op, mod, _ in insns[:a] + insns[b + 1:] if op not in ("NOP",)]
        return Sass(body, rest)


def smem_bytes(op: str, mod: str) -> int:
    """Shared-memory bytes one warp-instruction moves (all 32 lanes; ``ldmatrix``: 128 B per 8x8 matrix)."""
    if op not in SMEM_OPS:
        return 0
    if op in ("LDSM", "STSM"):
        n = re.search(r"\.(\d)$", mod) or re.search(r"\.M88\.(\d)", mod)
        return 128 * (int(n.group(1)) if n else 1)
    width = re.search(r"\.(128|64|32|U16|S16|U8|S8)\b", mod)
    per_lane = {"128": 16, "64": 8, "32": 4, "U16": 2, "S16": 2, "U8": 1, "S8": 1}[width.group(1)] if width else 4
    return 32 * per_lane


@dataclass
class Row:
    variant: str
    head_dim: int
    group: int
    block_n: str
    warps: str
    sass_per_warp_per_tile: str
    warp_instructions_per_token: float
    conversions_per_token: float
    smem_bytes_per_token: float
    hbm_bytes_per_token: float
    registers: int
    shared_memory: int
    spills: int
    occupancy: str
    wave_fill: float
    splits: int
    t_hbm_ps: float
    t_issue_ps: float
    t_conv_ps: float
    t_pred_ps: float
    limit: str
    issue_time_over_hbm_time: float
    predicted_speedup_vs_fp16: float = float("nan")
    top_opcodes: str = ""


def compiled_occupancy(launch) -> int:
    """Programs per SM of ``launch`` compiled for sm_90a (the launcher's ``programs_per_sm`` of the binary)."""
    from kvquant.kernels.triton_decode import programs_per_sm
    from kvquant.kernels.triton_launch import compile_launch, resource_usage

    compiled = compile_launch(launch, 90)
    return programs_per_sm(resource_usage(compiled.asm["cubin"])["reg"], compiled.metadata.shared,
                           compiled.metadata.num_warps)  # fmt: skip


def measure(variant: str, head_dim: int, group: int, batch: int, kv_heads: int, context: int,
            sass_dir: Path | None = None) -> Row:  # fmt: skip
    from kvquant.kernels.triton_compile_check import kind_precision, meta_launches
    from kvquant.kernels.triton_decode import programs_per_sm, wave_fill
    from kvquant.kernels.triton_dequant import DOT_FP16
    from kvquant.kernels.triton_launch import compile_launch, disassemble, resource_usage
    from kvquant.quantizers import make_quantizer

    pairs = VARIANTS[variant]
    layer = [(k, v, max(1, round(share * kv_heads))) for k, v, share in pairs]
    launches = meta_launches("decode", layer, DOT_FP16, head_dim, group, has_range=False, batch=batch,
                             past_len=context - 1, capacity=context, sms=SMS, occupancy=compiled_occupancy)  # fmt: skip
    acc: dict[str, float] = Counter()
    parts: dict[str, list] = {"block_n": [], "warps": [], "tile": [], "occ": []}
    regs = smem = spills = 0
    ops: Counter = Counter()
    fill, splits = 1.0, 0
    for (k, v, share), launch in zip(pairs, launches, strict=True):
        compiled = compile_launch(launch, 90)
        text = disassemble(compiled.asm["cubin"])
        if sass_dir is not None:
            sass_dir.mkdir(parents=True, exist_ok=True)
            (sass_dir / f"{variant}-{k}-{v}-d{head_dim}-g{group}.sass").write_text(text)
        sass = Sass.parse(text)
        use = resource_usage(compiled.asm["cubin"])
        named = dict(zip(launch.kernel.arg_names, launch.args, strict=False))
        # tokens per loop iteration: BLOCK_N, times SUB tiles per step where a kernel unrolls several
        warps, block_n = compiled.metadata.num_warps, launch.meta["BLOCK_N"] * launch.meta.get("SUB", 1)
        per_program = named["part_len"]
        per_tok = warps / block_n
        per_prog = warps / per_program
        conv_body = sum(op in CONVERSIONS for op, _ in sass.body)
        conv_rest = sum(op in CONVERSIONS for op, _ in sass.rest)
        smem_body = sum(smem_bytes(op, mod) for op, mod in sass.body)
        smem_rest = sum(smem_bytes(op, mod) for op, mod in sass.rest)
        q = [make_quantizer(kind_precision(p.replace("-bits", ""), head_dim), head_dim, block_size=128) for p in (k, v)]
        hbm = sum(qz.bits_per_element() * head_dim / 8 for qz in q)
        instr = len(sass.body) * per_tok + len(sass.rest) * per_prog
        conv = conv_body * per_tok + conv_rest * per_prog
        t_hbm, t_issue, t_conv = hbm / HBM_BYTES_PER_S, instr / ISSUE_PER_S, conv / CONV_PER_S
        for key, val in (("instr", instr), ("conv", conv), ("smem", smem_body * per_tok + smem_rest * per_prog),
                         ("hbm", hbm), ("t_hbm", t_hbm), ("t_issue", t_issue), ("t_conv", t_conv),
                         ("t", max(t_hbm, t_issue, t_conv))):  # fmt: skip
            acc[key] += share * val
        regs, smem = max(regs, use["reg"]), max(smem, compiled.metadata.shared)
        spills = max(spills, use["local"] + use["stack"] + 4 * sum(op in ("LDL", "STL") for op, _ in sass.body))
        occ = programs_per_sm(use["reg"], compiled.metadata.shared, warps)
        fill = min(fill, wave_fill(math.prod(launch.grid), SMS, occ))
        splits = launch.grid[1]
        parts["block_n"].append(str(block_n))
        parts["warps"].append(str(warps))
        parts["tile"].append(str(len(sass.body)))
        parts["occ"].append(str(occ))
        ops.update(op for op, _ in sass.body)
    t = acc["t"]
    limit = max((("hbm", acc["t_hbm"]), ("issue", acc["t_issue"]), ("conv", acc["t_conv"])), key=lambda x: x[1])[0]
    return Row(
        variant=variant, head_dim=head_dim, group=group, block_n="/".join(parts["block_n"]),
        warps="/".join(parts["warps"]), sass_per_warp_per_tile="/".join(parts["tile"]),
        warp_instructions_per_token=acc["instr"], conversions_per_token=acc["conv"],
        smem_bytes_per_token=acc["smem"], hbm_bytes_per_token=acc["hbm"], registers=regs, shared_memory=smem,
        spills=spills, occupancy="/".join(parts["occ"]), wave_fill=fill, splits=splits,
        t_hbm_ps=acc["t_hbm"] * 1e12, t_issue_ps=acc["t_issue"] * 1e12, t_conv_ps=acc["t_conv"] * 1e12,
        t_pred_ps=t * 1e12, limit=limit, issue_time_over_hbm_time=acc["t_issue"] / acc["t_hbm"],
        top_opcodes=" ".join(f"{o}:{n}" for o, n in ops.most_common(8)),
    )  # fmt: skip


def table(rows: list[Row]) -> str:
    head = ("| variant | D | group | tokens / tile x warps | SASS / warp / tile | warp-instr / token | conv / token "
            "| smem B / token | HBM B / token | regs | smem B | spill B | programs / SM | splits | wave fill "
            "| issue / HBM time | limit | predicted vs fp16 |")
    lines = [head, "|" + "---|" * 3 + "---:|" * 15]
    for r in rows:
        lines.append(
            f"| {r.variant} | {r.head_dim} | {r.group} | {r.block_n} x {r.warps} | {r.sass_per_warp_per_tile} "
            f"| {r.warp_instructions_per_token:.1f} | {r.conversions_per_token:.1f} | {r.smem_bytes_per_token:.0f} "
            f"| {r.hbm_bytes_per_token:.0f} | {r.registers} | {r.shared_memory} | {r.spills} | {r.occupancy} "
            f"| {r.splits} | {r.wave_fill:.2f} | {r.issue_time_over_hbm_time:.2f} | {r.limit} "
            f"| {r.predicted_speedup_vs_fp16:.2f}x |"
        )
    return "\n".join(lines)


def acceptance(rows: list[Row]) -> tuple[str, bool]:
    """The issue's acceptance (head_dim 128, group 4) as a table, and whether all of it holds."""
    lines = ["| variant | predicted vs fp16 | target | issue / HBM time (<= 0.70) | spills | met |",
             "|---|---:|---:|---:|---:|---|"]
    ok_all = True
    for r in rows:
        if r.head_dim != 128 or r.group != 4 or r.variant == "fp16":
            continue
        target = TARGETS.get(r.variant)
        ok = r.issue_time_over_hbm_time <= MAX_ISSUE_OVER_HBM and r.spills == 0
        ok = ok and (target is None or r.predicted_speedup_vs_fp16 >= target)
        ok_all &= ok
        lines.append(f"| {r.variant} | {r.predicted_speedup_vs_fp16:.2f}x | {f'{target:.1f}x' if target else '-'} "
                     f"| {r.issue_time_over_hbm_time:.2f} | {r.spills} | {'yes' if ok else 'no'} |")
    return "\n".join(lines), ok_all


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + ", ".join(VARIANTS))
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--groups", default="1,4,8", help="query heads per KV head")
    ap.add_argument("--context", type=int, default=32768, help="tokens of history (past_len = context - 1)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--json", help="write the rows as a JSON list here")
    ap.add_argument("--md", default="docs/results/kernel_static.md", help="markdown report ('-': none)")
    ap.add_argument("--sass-dir", help="also write each kernel's SASS here")
    ap.add_argument("--before", help="JSON rows of an earlier run: add its figures as 'before' columns")
    args = ap.parse_args(argv)
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        ap.error("run in a fresh process without TRITON_INTERPRET (the kernels must be compiled functions)")
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset; 1 is its default
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    dims = [int(x) for x in args.head_dims.split(",")]
    groups = [int(x) for x in args.groups.split(",")]
    from triton.backends.nvidia.compiler import get_ptxas

    get_ptxas(90)  # raises when triton has no CUDA toolchain
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    t0 = time.perf_counter()
    base = {}
    rows: list[Row] = []
    for d in dims:
        for g in groups:
            base[(d, g)] = measure("fp16", d, g, args.batch, args.kv_heads, args.context,
                                   Path(args.sass_dir) if args.sass_dir else None)  # fmt: skip
            for v in variants:
                r = base[(d, g)] if v == "fp16" else measure(
                    v, d, g, args.batch, args.kv_heads, args.context, Path(args.sass_dir) if args.sass_dir else None)
                r.predicted_speedup_vs_fp16 = base[(d, g)].t_pred_ps / r.t_pred_ps
                rows.append(r)
                print(f"{v:13s} D={d:3d} group={g}  {r.sass_per_warp_per_tile:>9s} SASS/tile  "
                      f"{r.warp_instructions_per_token:6.1f} instr/token  issue/HBM {r.issue_time_over_hbm_time:5.2f}  "
                      f"limit {r.limit:5s}  {r.predicted_speedup_vs_fp16:5.2f}x vs fp16  regs {r.registers} "
                      f"spill {r.spills}", flush=True)  # fmt: skip
    elapsed = time.perf_counter() - t0
    acc_table, ok = acceptance(rows)
    before = ""
    if args.before:
        old = {(r["variant"], r["head_dim"], r["group"]): r for r in json.loads(Path(args.before).read_text())}
        lines = ["| variant | D | group | SASS / warp / tile | warp-instr / token | issue / HBM time | spill B "
                 "| predicted vs fp16 |", "|---|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in rows:
            o = old.get((r.variant, r.head_dim, r.group))
            if o is not None:
                lines.append(
                    f"| {r.variant} | {r.head_dim} | {r.group} | {o['sass_per_warp_per_tile']} -> "
                    f"{r.sass_per_warp_per_tile} | {o['warp_instructions_per_token']:.1f} -> "
                    f"{r.warp_instructions_per_token:.1f} | {o['issue_time_over_hbm_time']:.2f} -> "
                    f"{r.issue_time_over_hbm_time:.2f} | {o['spills']} -> {r.spills} "
                    f"| {o['predicted_speedup_vs_fp16']:.2f}x -> {r.predicted_speedup_vs_fp16:.2f}x |"
                )  # fmt: skip
        before = "\n".join([f"## Before -> after (before: `{args.before}`)", "", *lines, ""])
    cmd = "python benchmarks/kernel_static.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = "\n".join([
        "# Static decode-kernel benchmark (sm_90a SASS, no GPU)", "",
        f"Command: `{cmd.strip()}` ({elapsed:.0f} s on CPU; started {started}, load average {load:.1f} on "
        f"{os.cpu_count()} CPUs: the compile times depend on it, the counts do not). "
        f"Shape: batch {args.batch}, {args.kv_heads} KV heads, "
        f"history {args.context - 1} tokens, fp16 queries; the launches of `decode_launches` on `meta` tensors "
        "(split count: `num_splits` for 132 SMs at the binary's programs / SM), compiled through Triton's "
        "runtime binder for sm_90a. Model and column "
        "definitions: the docstring of `benchmarks/kernel_static.py` (t = max(HBM bytes / 4.3 TB/s, "
        "warp-instructions / (132 x 4 x 1.98 GHz), conversions x 32 / (132 x 16 x 1.98 GHz)); a prediction, "
        "not a measurement). Per token = per KV token of one KV head (all `group` query heads of it).", "",
        table(rows), "",
        "## Acceptance (head_dim 128, group 4)", "", acc_table, "",
        f"All met: {'yes' if ok else 'no'}.", "", before,
        "## Loop instruction mix (top opcodes per tile)", "",
        "| variant | D | group | opcodes |", "|---|---|---|---|",
        *[f"| {r.variant} | {r.head_dim} | {r.group} | {r.top_opcodes} |" for r in rows if r.group == 4], "",
    ])  # fmt: skip
    print(table(rows))
    print(acc_table)
    if args.md != "-":
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text(md)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
