"""Checks of a run against the files and the machine it names, before Ray starts (controller/preflight.py):
each mistake exits ``train`` with code 2 in one line naming the key, within 2 seconds."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_quads.cli import main
from megatron_quads.controller.preflight import wandb_credentials
from megatron_quads.tasks import CharTokenizer

EXAMPLE = Path(__file__).parents[1] / "examples" / "embedded_default.yaml"
WANDB_VARIABLES = ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_CONFIG_DIR", "NETRC")


@pytest.fixture
def no_wandb_login(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home directory without wandb credentials, and none in the environment; returns the home."""
    home = tmp_path / "home"
    home.mkdir()
    for variable in WANDB_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(home))
    return home


def _refused(tmp_path: Path, overrides: list[str], pattern: str, capsys: pytest.CaptureFixture) -> None:
    """``train`` with ``overrides`` exits 2 with one line matching ``pattern`` and creates no run directory."""
    run_dir = tmp_path / "run"
    assert main(["train", str(EXAMPLE), f"run_dir={run_dir}", *overrides]) == 2
    err = capsys.readouterr().err
    assert re.search(pattern, " ".join(err.split())), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert not run_dir.exists()


def test_wandb_online_without_credentials_is_refused(no_wandb_login: Path, tmp_path: Path, capsys) -> None:
    _refused(tmp_path, ["logging.wandb=online"],
             r"logging\.wandb=online needs wandb credentials for https://api\.wandb\.ai and finds none .* run `wandb "
             r"login` or set WANDB_API_KEY, or use logging\.wandb=offline", capsys)


def test_wandb_credentials_are_found_where_wandb_looks(no_wandb_login: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = no_wandb_login
    assert wandb_credentials() is None
    (home / ".netrc").write_text("machine example.com login user password secret\n")
    assert wandb_credentials() is None  # an entry for another host
    (home / ".netrc").write_text("machine api.wandb.ai login user password 0123456789abcdef\n")
    assert wandb_credentials() == str(home / ".netrc")
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    assert wandb_credentials() is None  # a self-hosted server needs its own entry
    (home / ".netrc").unlink()
    settings = home / ".config" / "wandb" / "settings"
    settings.parent.mkdir(parents=True)
    settings.write_text("[default]\napi_key = 0123456789abcdef\n")
    assert wandb_credentials() == str(settings)
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef")
    assert wandb_credentials() == "WANDB_API_KEY"


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path: Path, capsys) -> None:
    tokenizer = tmp_path / "tokenizer.json"
    CharTokenizer("".join(chr(0x100 + i) for i in range(100))).save(tokenizer)  # 3 special tokens + 100
    _refused(tmp_path, ["task.kind=arithmetic", f"task.tokenizer={tokenizer}", "logging.wandb=disabled"],
             r"task\.tokenizer .*tokenizer\.json has 103 tokens but the model's vocab_size is 32: .* or a model with "
             r"vocab_size >= 103", capsys)
    _refused(tmp_path, ["task.kind=arithmetic", f"task.tokenizer={tmp_path / 'no_tokenizer'}", "logging.wandb=disabled"],
             r"task\.tokenizer .*no_tokenizer: tokenizer directory .* does not exist", capsys)


def test_a_missing_held_out_file_is_refused(tmp_path: Path, capsys) -> None:
    data = tmp_path / "qa.jsonl"
    data.write_text('{"question": "1+2=", "answer": "3"}\n')
    _refused(tmp_path, ["task.kind=qa", f"task.options.path={data}", "eval.every=2",
                        f"task.eval_options.path={tmp_path / 'test.jsonl'}", "logging.wandb=disabled"],
             r"task\.eval_options\.path .*test\.jsonl is not a file .* or set eval\.every=0", capsys)


MISTAKES = {
    "wandb": ["logging.wandb=online"],
    "tokenizer": ["task.kind=arithmetic", "task.tokenizer={dir}/tokenizer.json"],
    "eval_options": ["task.kind=qa", "task.options.path={dir}/qa.jsonl", "eval.every=2"],
    "eval_file": ["task.kind=qa", "task.options.path={dir}/qa.jsonl", "eval.every=2", "task.eval_options.path=x.jsonl"],
    "head_dim": ["model.embedded_default=false", "model.architecture.hidden_size=64",
                 "model.architecture.num_attention_heads=4", "rollout.engine=vllm"],
    "reward": ["reward.path={dir}/reward.py", "reward.name=missing"],
}
"""Each mistake's overrides and (by name) the key its message names."""

KEYS = {"wandb": "logging.wandb", "tokenizer": "task.tokenizer", "eval_options": "task.eval_options",
        "eval_file": "task.eval_options.path", "head_dim": "rollout.engine", "reward": "reward.name"}


def test_every_mistake_exits_2_within_2_seconds_without_torch_or_ray(tmp_path: Path) -> None:
    """One fresh interpreter (so the imports it made can be checked) runs ``train`` on each mistake and
    times it; the first call pays the CLI's own imports, as a user's command does."""
    CharTokenizer("".join(chr(0x100 + i) for i in range(100))).save(tmp_path / "tokenizer.json")
    (tmp_path / "qa.jsonl").write_text('{"question": "1+2=", "answer": "3"}\n')
    (tmp_path / "reward.py").write_text("def compute_score(prompt, response, row):\n    return 1.0\n")
    code = (
        "import json, os, sys, time\n"
        "for v in " + repr(WANDB_VARIABLES) + ": os.environ.pop(v, None)\n"
        "os.environ['HOME'] = sys.argv[2]\n"
        "from megatron_quads.cli import main\n"
        "mistakes, out = json.loads(sys.argv[1]), {}\n"
        "for name, overrides in mistakes.items():\n"
        "    start = time.perf_counter()\n"
        "    code = main(['train', sys.argv[3], 'run_dir=' + sys.argv[2] + '/run', *overrides])\n"
        "    out[name] = [code, time.perf_counter() - start]\n"
        "heavy = [m for m in ('torch', 'megatron', 'ray', 'vllm', 'wandb') if m in sys.modules]\n"
        "print(json.dumps({'runs': out, 'heavy': heavy}))\n"
    )
    import json

    mistakes = {name: [o.format(dir=tmp_path) for o in overrides] for name, overrides in MISTAKES.items()}
    result = subprocess.run([sys.executable, "-c", code, json.dumps(mistakes), str(tmp_path), str(EXAMPLE)],
                            capture_output=True, text=True, check=False, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["heavy"] == [], report
    for name, (code, seconds) in report["runs"].items():
        assert code == 2, (name, result.stderr)
        assert seconds < 2.0, (name, seconds)
    lines = [line for line in result.stderr.splitlines() if not line.startswith("WARNING") and "WARN" not in line]
    for name, key in KEYS.items():
        assert any(key in line for line in lines), (name, result.stderr)
