"""The ``megatron-quads`` command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_quads.cli import main
from megatron_quads.demo import demo_tensors, error_table


def test_demo_table_orders_blockings_as_expected() -> None:
    rows = {(r.tensor, r.blocking): r for r in error_table(demo_tensors(64, 256))}
    assert len(rows) == 6
    for name in ("gaussian", "outlier channels", "student-t (df=2)"):
        one_d, two_d = rows[(name, "1x16")], rows[(name, "16x16")]
        # 16x16 tiles share a scale across rows: never more accurate than 1x16 blocks on these inputs
        assert 0.0 < one_d.relative_error < two_d.relative_error < 0.3


def test_demo_is_deterministic() -> None:
    assert error_table(demo_tensors(32, 64, seed=3)) == error_table(demo_tensors(32, 64, seed=3))


def test_demo_command_prints_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--rows", "32", "--cols", "64"]) == 0
    out = capsys.readouterr().out
    assert "relative error" in out and "outlier channels" in out


def test_console_script_runs() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "megatron_quads.cli", "demo", "--rows", "16", "--cols", "32"],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "16x16" in result.stdout


def test_unknown_command_fails() -> None:
    with pytest.raises(SystemExit):
        main(["no-such-command"])
