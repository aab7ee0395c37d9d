"""The GRPO loop reads as the algorithm: its phases are named calls in order, and the tensor building
and timing it needs live in helpers (``controller.batch``, ``controller.step_metrics``)."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import torch

from megatron_quads.controller.batch import mini_batches
from megatron_quads.controller.step_metrics import PhaseClock

LOOP = Path(__file__).resolve().parents[1] / "megatron_quads" / "controller" / "loop.py"

PHASES = ["sync", "calibrate", "evaluate", "generate", "response_rewards", "build_batch", "trainer_logprobs",
          "policy_updates", "log_step", "save"]
"""The step's calls, in the order the algorithm makes them."""


def _loop_body() -> ast.For:
    train = next(n for n in ast.parse(LOOP.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == "train")
    return next(n for n in ast.walk(train) if isinstance(n, ast.For))


def _called(node: ast.AST) -> list[str]:
    calls = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
    names = [c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", "") for c in calls]
    return [name for _, name in sorted(zip([(c.lineno, c.col_offset) for c in calls], names, strict=True))]


def test_the_step_makes_the_algorithms_calls_in_order() -> None:
    called = _called(_loop_body())
    assert [name for name in called if name in PHASES] == PHASES


def test_the_loop_module_builds_no_tensors_and_reads_no_clock() -> None:
    imported = {alias.name.split(".")[0] for node in ast.walk(ast.parse(LOOP.read_text()))
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(ast.parse(LOOP.read_text()))
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert not imported & {"torch", "time", "dataclasses"}


def test_mini_batches_cover_every_sequence_once_per_epoch_in_a_seeded_shuffle() -> None:
    batch = {"tokens": torch.arange(12).view(6, 2), "advantages": torch.arange(6.0)}
    parts = list(mini_batches(batch, epochs=2, count=3, seed=7))
    assert [len(p["tokens"]) for p in parts] == [2] * 6
    for epoch in (parts[:3], parts[3:]):
        assert sorted(torch.cat([p["advantages"] for p in epoch]).tolist()) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    for p in parts:  # every tensor of a mini-batch holds the same sequences
        assert torch.equal(p["tokens"][:, 0], 2 * p["advantages"].long())
    again = list(mini_batches(batch, epochs=2, count=3, seed=7))
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(parts, again, strict=True))
    whole = list(mini_batches(batch, epochs=1, count=1, seed=7))
    assert len(whole) == 1 and torch.equal(whole[0]["tokens"], batch["tokens"])  # one update: in order


def test_a_phase_clock_times_each_phase_from_the_end_of_the_one_before() -> None:
    clock = PhaseClock()
    time.sleep(0.02)
    clock.lap("first")
    time.sleep(0.2)
    clock.lap(None)  # not recorded, and not counted in the next phase
    time.sleep(0.01)
    clock.lap("second")
    assert set(clock.seconds) == {"first", "second"}
    assert clock.seconds["first"] >= 0.02 and 0.01 <= clock.seconds["second"] < 0.2
