"""The run's precision object: construction rules, the text form, config modes and one scope vocabulary."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_quads.precision import CONFIG_MODES, ROLLOUT_KINDS, SCOPES, Precision


@pytest.mark.parametrize("text", ["bf16", "w4a16", "w4a4", "quads@0.25", "quads@0.0", "quads@1.0", "quads@0.3333333333333333"])
def test_the_text_form_reads_back_exactly(text: str) -> None:
    precision = Precision.parse(text)
    assert str(precision) == text and Precision.parse(str(precision)) == precision


def test_quads_without_a_ratio_takes_the_default_and_labels_round_to_three_digits() -> None:
    assert Precision.parse("quads", 0.5) == Precision("quads", 0.5)
    assert Precision("quads", 1 / 3).label == "quads@0.333"
    assert Precision("w4a16").label == "w4a16"


@pytest.mark.parametrize("kind, ratio, message", [
    ("aqat", 0.0, "unknown rollout precision 'aqat'"),
    ("w4a4", 0.25, "for the quads precision only"),
    ("quads", 1.5, r"in \[0, 1\]"),
    ("quads", -0.1, r"in \[0, 1\]"),
])
def test_construction_refuses_what_cannot_be_served(kind: str, ratio: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Precision(kind, ratio)


@pytest.mark.parametrize("text", ["aqat", "w4a4@0.25", "quads@half", "fp8"])
def test_parse_refuses_other_spellings(text: str) -> None:
    with pytest.raises(ValueError, match=f"precision {text!r}"):
        Precision.parse(text)


def test_properties_follow_the_kind() -> None:
    table = {k: (Precision(k).quantized_rollout, Precision(k).quantized_activations, Precision(k).uses_rac,
                 Precision(k).weight_format, Precision(k).activation_format) for k in ROLLOUT_KINDS}
    assert table == {
        "bf16": (False, False, False, "bf16", "bf16"),
        "w4a16": (True, False, False, "nvfp4", "bf16"),
        "w4a4": (True, True, False, "nvfp4", "nvfp4"),
        "quads": (True, True, True, "nvfp4", "nvfp4"),
    }


def test_config_modes_name_trainer_and_rollout() -> None:
    got = {mode: Precision.from_config_mode(mode, 0.5) for mode in CONFIG_MODES}
    assert {m: (p.kind, p.ratio, p.trainer_label) for m, p in got.items()} == {
        "bf16": ("bf16", 0.0, "bf16"),
        "naive-nvfp4": ("w4a4", 0.0, "bf16"),
        "w4a16": ("w4a16", 0.0, "aqat"),
        "aqat": ("w4a4", 0.0, "aqat"),
        "quads": ("quads", 0.5, "aqat"),
    }
    assert got["quads"].rollout() == Precision("quads", 0.5)
    with pytest.raises(ValueError, match="unknown precision mode"):
        Precision.from_config_mode("fp8", 0.0)


def test_the_trainer_scopes_are_the_shared_vocabulary() -> None:
    from megatron_quads.trainer.quads_config import QuadsScope

    assert {s.value for s in QuadsScope} <= set(SCOPES)
    with pytest.raises(ValueError, match="unknown scope"):
        Precision(scope="shared")


def test_the_module_loads_no_torch() -> None:
    code = "import sys, megatron_quads.precision; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
