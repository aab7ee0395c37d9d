"""The ``megatron-quads`` command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


@pytest.fixture
def broken_configs(tmp_path):
    """Config files that are not a YAML mapping, each with the words its error must contain."""
    (tmp_path / "bad.yaml").write_text("grpo:\n  steps: [1\n")
    (tmp_path / "list.yaml").write_text("- grpo\n- steps\n")
    (tmp_path / "scalar.yaml").write_text("42\n")
    (tmp_path / "dir").mkdir()
    return {
        "bad.yaml": "is not valid YAML: line 3, column 1",
        "list.yaml": "holds a list at the top level",
        "scalar.yaml": r"holds a single value \(42\) at the top level",
        "dir": "is a directory, not a YAML file",
        "missing.yaml": "does not exist",
    }, tmp_path


def test_train_reports_config_file_errors_in_one_line_with_exit_code_2(broken_configs, capsys) -> None:
    import re

    expected, root = broken_configs
    for name, pattern in expected.items():
        assert main(["train", str(root / name)]) == 2, name
        err = capsys.readouterr().err
        assert re.search(pattern, err) and str(root / name) in err and "Traceback" not in err, err
        assert err.count("\n") == 1, err  # one message, one line
    example = str(Path(__file__).parents[1] / "examples" / "embedded_default.yaml")
    for overrides, pattern in ((["grpo.steps"], "must look like key=value"), (["=3"], "must look like key=value"),
                               (["grpo.steps=[1"], "its value is not valid YAML")):
        assert main(["train", example, *overrides]) == 2, overrides
        assert re.search(pattern, capsys.readouterr().err), overrides


def test_train_fails_on_a_broken_config_before_importing_torch(broken_configs) -> None:
    """The one subprocess: a fresh interpreter, so the imports it made can be checked."""
    _, root = broken_configs
    code = ("import sys\nfrom megatron_quads.cli import main\nrc = main(['train', sys.argv[1]])\n"
            "heavy = [m for m in ('torch', 'megatron', 'ray', 'vllm') if m in sys.modules]\n"
            "assert not heavy, heavy\nsys.exit(rc)\n")
    result = subprocess.run([sys.executable, "-c", code, str(root / "bad.yaml")], capture_output=True, text=True,
                            check=False, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "is not valid YAML: line 3" in result.stderr


@pytest.mark.parametrize(("text", "size"), [("2GB", 2 * 10**9), ("500MB", 500 * 10**6), ("1.5gb", 1_500_000_000),
                                            ("123", 123), ("1GiB", 2**30), (" 64KiB ", 65536)])
def test_shard_sizes_parse_in_decimal_and_binary_units(text: str, size: int) -> None:
    from megatron_quads.cli import _parse_bytes

    assert _parse_bytes(text) == size


def test_a_bad_shard_size_is_a_usage_error_naming_it(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "megatron-to-hf", "ckpt", "out", "--max-shard-size", "2XB"])
    assert exit_info.value.code == 2
    assert "not a size: '2XB'" in capsys.readouterr().err
