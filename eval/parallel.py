"""Evaluation sweeps over several processes: configs split across ranks, rows gathered into one report.

``kvquant eval RECIPE --procs N`` starts N processes (``torch.multiprocessing.spawn``) joined in a
``torch.distributed`` group (gloo: CPU and GPU alike, only small Python objects travel). Rank r runs the
reference plus every N-th config from the r-th, on the same windows and seeds as a single process; rank 0
gathers the rows, puts them in the single-process order and writes the one report. Every metric row is
identical to a single-process run's (each rank scores its configs against its own, bit-identical reference);
only timings differ. With ``device: cuda`` rank r uses ``cuda:r`` (one GPU per process).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvquant.errors import ArgumentError

from .baselines import REFERENCE
from .recipe import Recipe
from .runner import RunResult, run_recipe


def shard_configs(configs: list[str], rank: int, world: int) -> list[str]:
    """Rank ``rank``'s share of ``configs`` (round robin; the reference runs on every rank)."""
    mine = [c for c in configs if c != REFERENCE][rank::world]
    return mine or [REFERENCE]


def merge_rows(recipe: Recipe, per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row list in the single-process order: per protocol, the reference, run configs, then skipped ones."""
    order = {c: i for i, c in enumerate(c for c in recipe.configs if c != REFERENCE)}
    rows = [r for r in per_rank[0] if r["config"] == REFERENCE]
    rows += [r for part in per_rank for r in part if r["config"] != REFERENCE]

    def key(r: dict[str, Any]) -> tuple[int, int, int]:
        return (recipe.protocol.index(r["protocol"]), r["status"] == "skipped", order.get(r["config"], -1))

    return sorted(rows, key=key)


def _worker(
    rank: int, world: int, recipe: Recipe, init_file: str, command: str, quiet: bool, force: bool = False
) -> None:
    import torch
    import torch.distributed as dist

    from .report import print_table, write_all

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        device = f"cuda:{rank}" if recipe.device == "cuda" else recipe.device
        torch.set_num_threads(recipe.threads or 1)
        sub = replace(recipe, configs=shard_configs(recipe.configs, rank, world), device=device)
        result = run_recipe(sub, command=command, quiet=quiet or rank > 0, progress=False)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (result.rows, result.meta.get("generation_seconds", {})))
        if rank == 0:
            meta = dict(result.meta)
            meta["recipe"] = recipe.to_dict()
            meta["processes"] = world
            meta["configs_per_process"] = [shard_configs(recipe.configs, r, world) for r in range(world)]
            gen = {k: v for _, g in gathered for k, v in g.items()}
            if gen:
                meta["generation_seconds"] = gen
            merged = RunResult(recipe, meta, merge_rows(recipe, [rows for rows, _ in gathered]))
            print_table(merged)
            paths = write_all(merged, Path(recipe.out), force=force)
            print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    finally:
        dist.destroy_process_group()


def run_parallel(recipe: Recipe, procs: int, command: str = "", quiet: bool = False, force: bool = False) -> Path:
    """Run ``recipe`` over ``procs`` processes; rank 0 prints the table and writes the report. Returns ``out``."""
    import torch.multiprocessing as mp

    if procs < 2:
        raise ArgumentError(f"--procs: {procs} must be >= 2 (1 runs in this process)")
    fd, init_file = tempfile.mkstemp(prefix="kvquant-dist-")
    os.close(fd)
    os.unlink(init_file)  # the file store creates it; it must not exist yet
    try:
        mp.spawn(_worker, args=(procs, recipe, init_file, command, quiet, force), nprocs=procs, join=True)
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)
    return Path(recipe.out)
