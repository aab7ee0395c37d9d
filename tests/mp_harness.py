"""Run a test job in N spawned processes (one per rank) and collect what each rank recorded.

Megatron work runs in spawned workers so that each job gets its own torch.distributed world. A job
is ``job(rank, port, out_dir)``; inside it a :class:`Recorder` stores named results (JSON-able
values) per rank; the test process reads them back and asserts on them.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest


class Recorder:
    """Named results of one rank, rewritten atomically to ``<out_dir>/rank<R>.json`` after each check."""

    def __init__(self, out_dir: str, rank: int) -> None:
        self.path = os.path.join(out_dir, f"rank{rank}.json")
        self.results: dict = {}

    def __call__(self, name: str, **values) -> None:
        self.results[name] = values
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.results, f)
        os.replace(tmp, self.path)

    def run(self, name: str, fn: Callable, *args, **kwargs):
        """Call ``fn``; on an exception record its traceback under ``name`` and re-raise."""
        try:
            return fn(*args, **kwargs)
        except BaseException:
            self(name, error=traceback.format_exc())
            raise


def spawn(job: Callable, nprocs: int, out_dir: Path, timeout_s: float) -> dict:
    """Run ``job`` on ``nprocs`` spawned ranks; returns every rank's results and any error."""
    import torch.multiprocessing as mp

    from megatron_quads.trainer.rendezvous import find_free_port

    port = find_free_port()
    error = None
    try:
        ctx = mp.start_processes(job, args=(port, str(out_dir)), nprocs=nprocs, join=False, start_method="spawn")
        for _ in range(int(timeout_s * 10)):
            if ctx.join(timeout=0.1):
                break
        else:
            for p in ctx.processes:
                p.kill()
            error = f"job timed out after {timeout_s}s"
    except Exception as exc:  # a worker raised: its traceback is in the message
        error = str(exc)
    ranks = []
    for rank in range(nprocs):
        path = out_dir / f"rank{rank}.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else {})
    return {"ranks": ranks, "error": error}


def get(job: dict, name: str) -> list[dict]:
    """The named check's record on every rank; fails with the worker's error if it is missing."""
    out = []
    for rank, results in enumerate(job["ranks"]):
        if name not in results:
            pytest.fail(f"check {name!r} did not run on rank {rank}; job error:\n{job['error']}")
        if "error" in results[name]:
            pytest.fail(f"check {name!r} failed on rank {rank}:\n{results[name]['error']}")
        out.append(results[name])
    return out
