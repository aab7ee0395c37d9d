"""The run config's schema loads and reports errors without torch, Megatron, Ray, vLLM or transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "embedded_default.yaml"
HEAVY = ("torch", "megatron", "ray", "vllm", "transformers")


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in a fresh interpreter that imports this checkout's package."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, check=False, timeout=120,
                          cwd=ROOT, env=env)


VALIDATE = f"""
import json, sys
from megatron_quads.controller.config import ConfigError, validate_config

cases = {{
    "unknown key": ({{"grpo": {{"bogus": 1}}}}, "grpo.bogus"),
    "wrong type": ({{"grpo": {{"steps": "three"}}}}, "grpo.steps"),
    "bad value": ({{"rollout": {{"top_p": 0}}}}, "rollout.top_p"),
    "nested schema": ({{"grpo": {{"loss": {{"correction": {{"mode": "sometimes"}}}}}}}}, "grpo.loss.correction.mode"),
}}
out = {{}}
for name, (tree, key) in cases.items():
    try:
        validate_config(tree)
        out[name] = None
    except ConfigError as err:
        out[name] = [key, str(err)]
cfg = validate_config({{"model": {{"embedded_default": False, "architecture": {{"num_layers": 2}}}}}})
out["valid"] = [cfg.trainer_quads().enabled, cfg.model.architecture.num_layers]
out["heavy"] = [m for m in {HEAVY!r} if m in sys.modules]
print(json.dumps(out))
"""


def test_validating_a_config_imports_no_heavy_package() -> None:
    result = _run(["-c", VALIDATE])
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for name in ("unknown key", "wrong type", "bad value", "nested schema"):
        assert out[name] is not None, f"{name}: no ConfigError"
        key, message = out[name]
        assert message.startswith("invalid configuration: ") and f"{key}: " in message, (name, message)
    assert out["valid"] == [True, 2]
    assert out["heavy"] == [], f"imported by the schema: {out['heavy']}"


def test_cli_reports_a_bad_key_with_exit_code_2_and_no_traceback() -> None:
    result = _run(["-m", "megatron_quads.cli", "train", str(EXAMPLE), "grpo.bogus=1"])
    text = result.stdout + result.stderr
    assert result.returncode == 2, text
    assert "grpo.bogus" in text and "Traceback" not in text, text


def test_cli_schema_error_comes_before_heavy_imports() -> None:
    code = ("import sys\nfrom megatron_quads.cli import main\n"
            f"rc = main(['train', {str(EXAMPLE)!r}, 'grpo.steps=three'])\n"
            f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
            "assert not heavy, heavy\nsys.exit(rc)\n")
    result = _run(["-c", code])
    assert result.returncode == 2, result.stdout + result.stderr
    assert "grpo.steps" in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_cli_refuses_what_the_engines_would_refuse_in_one_line_before_heavy_imports() -> None:
    cases = {
        "run_dir=": ["run_dir=''"],
        "rollout.temperature=20.0": ["rollout.engine=vllm", "rollout.temperature=20"],
        "rollout.max_new_tokens=60": ["rollout.max_new_tokens=60"],
        "parallel.expert_parallel=2": ["trainer_world_size=4", "parallel.tensor_parallel=2", "parallel.expert_parallel=2"],
    }
    code = ("import json, sys\nfrom megatron_quads.cli import main\n"
            f"rcs = [main(['train', {str(EXAMPLE)!r}, *case]) for case in {list(cases.values())!r}]\n"
            f"print(json.dumps([rcs, [m for m in {HEAVY!r} if m in sys.modules]]))\n")
    result = _run(["-c", code])
    rcs, heavy = json.loads(result.stdout.strip().splitlines()[-1])
    assert rcs == [2] * len(cases) and heavy == [], result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("invalid configuration: ")]
    assert len(errors) == len(cases) and "Traceback" not in result.stderr, result.stderr
    for error, key in zip(errors, cases, strict=True):  # one line each: the key, then the fix ("set ..." / "give ...")
        assert key in error and (" set " in error or " give " in error), error
