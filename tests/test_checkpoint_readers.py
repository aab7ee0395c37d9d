"""Every command that reads a Megatron dist checkpoint refuses one whose ``.metadata`` pickle would run
code, before anything of it runs: exit code 2, one line naming the file, no output, no marker file.

The checkpoint is the embedded model's with its ``.metadata`` rewritten (``pickle_payloads``): a plain
unpickler creates the marker file and still returns the valid metadata, so a reader that skipped the
audit would go on working (``tests/test_checkpoint_audit.py`` shows the payload runs under DCP's reader).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatron_quads.cli import main
from pickle_payloads import poison_dcp_metadata

EMBEDDED_CHECKPOINT = Path(__file__).parents[1] / "megatron_quads" / "assets" / "tiny_moe_sft" / "checkpoint"
EXAMPLE = Path(__file__).parents[1] / "examples" / "embedded_default.yaml"


@pytest.fixture
def poisoned(tmp_path: Path) -> tuple[Path, Path, Path]:
    """``(checkpoint, its .metadata, marker)``: the embedded checkpoint with a poisoned ``.metadata``."""
    ckpt = Path(shutil.copytree(EMBEDDED_CHECKPOINT, tmp_path / "ckpt"))
    marker = tmp_path / "ran"
    return ckpt, poison_dcp_metadata(ckpt, marker), marker


def _commands(ckpt: Path, out: Path) -> dict[str, list[str]]:
    return {
        "megatron-to-hf": ["convert", "megatron-to-hf", str(ckpt), str(out)],
        "reshard": ["convert", "reshard", str(ckpt), str(out), "--ep", "2"],
        "to-quads": ["convert", "to-quads", str(ckpt), str(out), "--ratio", "0.25", "--tokenizer", "char"],
        "analyze": ["analyze", "--checkpoint", str(ckpt), "--out", str(out)],
        "train": ["train", str(EXAMPLE), "model.embedded_default=false", f"model.checkpoint={ckpt}",
                  f"run_dir={out}", "rollout.engine=torch"],
    }


@pytest.mark.parametrize("command", ["megatron-to-hf", "reshard", "to-quads", "analyze", "train"])
def test_a_command_refuses_a_checkpoint_whose_metadata_would_run_code(poisoned, tmp_path, command: str,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, metadata, marker = poisoned
    out = tmp_path / "out"
    assert main(_commands(ckpt, out)[command]) == 2
    err = capsys.readouterr().err
    assert str(metadata) in err and "its metadata pickle is not plain checkpoint metadata" in err, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert not marker.exists(), "the pickle ran"
    assert not out.exists()


def test_the_unpoisoned_checkpoint_passes_the_same_commands(tmp_path) -> None:
    """The refusals above are the audit's, not some other problem of the copied checkpoint."""
    ckpt = Path(shutil.copytree(EMBEDDED_CHECKPOINT, tmp_path / "ckpt"))
    assert main(_commands(ckpt, tmp_path / "hf")["megatron-to-hf"]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
