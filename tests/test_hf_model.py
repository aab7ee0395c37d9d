"""``model.hf_path`` and the ``data`` section: a tiny Qwen3-MoE directory (made with transformers, with a
word-level tokenizer and a chat template built in the test) converted once into a cache the runs share,
a GRPO run of 3 steps on a JSONL file of one's own with it, and each data or model mistake refused
before Ray starts (exit 2, one line naming the key, within 2 s)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_quads.cli import main
from megatron_quads.controller.config import load_config

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "embedded_default.yaml"
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
WORDS = "what is one plus two three four five six seven eight nine the answer 1 2 3 4 5 6 7 8 9 user assistant"
ROWS = [{"q": f"what is {a} plus {b}", "a": str(int(a) + int(b)), "level": "easy"}
        for a, b in (("1", "2"), ("3", "4"), ("2", "2"), ("5", "1"), ("4", "4"), ("6", "3"))]
FAST = ["grpo.prompts_per_step=2", "grpo.responses_per_prompt=2", "rollout.max_new_tokens=4", "logging.wandb=disabled",
        "rollout.engine=torch", "checkpoint.every=0", "grpo.micro_batch_size=4"]


def _tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.decoder = decoders.WordPiece(prefix="##")
    specials = ["<pad>", "<|endoftext|>", "<unk>", "<|im_start|>", "<|im_end|>"]
    raw.train_from_iterator([WORDS], trainer=trainers.WordLevelTrainer(special_tokens=specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<|endoftext|>", unk_token="<unk>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))


def make_hf_model(directory: Path) -> Path:
    """A 2-layer Qwen3-MoE (fp32, 4 experts) with the tokenizer above, in ``directory``."""
    import torch

    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=32, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=128, tie_word_embeddings=False, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(1.0 if p.ndim == 1 else 0.0, 0.05)
    model.to(torch.float32).save_pretrained(directory)
    _tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("hf") / "tiny-qwen3-moe")


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _data_overrides(data: Path) -> list[str]:
    return ["task.kind=qa", f"task.options.path={data}", "task.options.prompt_template='{question}'",
            "data.prompt_key=q", "data.answer_key=a"]


def test_the_directory_gives_the_architecture_tokenizer_chat_template_and_stop_tokens(hf_model: Path, data_file: Path,
                                                                                      tmp_path: Path) -> None:
    from megatron_quads.controller.prompts import draw_prompts, prompt_limit
    from megatron_quads.controller.sampling import rollout_sampling
    from megatron_quads.controller.training_task import task_and_tokenizer
    from megatron_quads.tasks import HFTokenizer

    cfg = load_config(EXAMPLE, [*FAST, f"run_dir={tmp_path / 'run'}", f"model.hf_path={hf_model}",
                                *_data_overrides(data_file), "data.apply_chat_template=true"])
    assert not cfg.model.embedded_default  # the directory is the policy, over the example's embedded_default: true
    arch = cfg.policy_architecture()
    assert (arch.num_layers, arch.num_experts, arch.vocab_size, arch.max_sequence_length) == (2, 4, 64, 128)
    task, tok = task_and_tokenizer(cfg)
    assert isinstance(tok, HFTokenizer) and tok.path == hf_model
    assert rollout_sampling(cfg, tok, 0).stop_token_ids == (1, 4)  # eos, and generation_config's <|im_end|>
    drawn = draw_prompts(task.stream(0), tok, 2, prompt_limit(cfg), chat=True)
    text = tok.decode(drawn.ids[0], skip_special_tokens=False)
    assert text.startswith("<|im_start|> user what is") and text.endswith("<|im_start|> assistant"), text
    assert drawn.prompts[0].text.startswith("what is")  # the task (and its reward) sees the prompt itself


def test_max_prompt_length_skips_and_counts_longer_prompts(hf_model: Path, data_file: Path, tmp_path: Path) -> None:
    from megatron_quads.controller.prompts import PromptsTooLong, draw_prompts, prompt_limit
    from megatron_quads.controller.training_task import task_and_tokenizer

    base = [*FAST, f"run_dir={tmp_path / 'run'}", f"model.hf_path={hf_model}", *_data_overrides(data_file)]
    cfg = load_config(EXAMPLE, [*base, "data.max_prompt_length=4"])  # "what is 1 plus 2": 5 words
    assert prompt_limit(cfg).tokens == 4 and "data.max_prompt_length" in str(prompt_limit(cfg))
    task, tok = task_and_tokenizer(cfg)
    with pytest.raises(PromptsTooLong):
        draw_prompts(task.stream(0), tok, 1, prompt_limit(cfg))
    cfg = load_config(EXAMPLE, [*base, "data.max_prompt_length=5"])
    assert draw_prompts(task.stream(0), tok, 2, prompt_limit(cfg)).skipped == 0
    chat = load_config(EXAMPLE, [*base, "data.max_prompt_length=8", "data.apply_chat_template=true"])
    with pytest.raises(PromptsTooLong):  # the chat turn's tokens count too
        draw_prompts(task.stream(0), tok, 1, prompt_limit(chat), chat=True)


def test_the_conversion_is_cached_beside_the_run_and_redone_when_damaged_or_changed(hf_model: Path, tmp_path: Path) -> None:
    """In a fresh process each time, as a run converts before Ray starts (the ranks fork from it)."""
    from megatron_quads.controller.hf_model import cached_conversion_problem, converted_checkpoint_dir
    from megatron_quads.controller.workers import start_checkpoint

    source = tmp_path / "model"
    source.mkdir()
    for f in hf_model.iterdir():
        (source / f.name).write_bytes(f.read_bytes())
    cfg = load_config(EXAMPLE, [f"run_dir={tmp_path / 'runs' / 'a'}", f"model.hf_path={source}"])
    target = converted_checkpoint_dir(cfg)
    assert target.parent == tmp_path / "runs" / "hf_converted" and start_checkpoint(cfg) == str(target)
    other_run = load_config(EXAMPLE, [f"run_dir={tmp_path / 'runs' / 'b'}", f"model.hf_path={source}"])
    assert converted_checkpoint_dir(other_run) == target  # later runs beside it reuse it
    code = ("import sys, logging\nlogging.basicConfig(level=logging.INFO)\n"
            "from megatron_quads.controller.config import load_config\n"
            "from megatron_quads.controller.hf_model import ensure_converted\n"
            "ensure_converted(load_config(sys.argv[1], sys.argv[2:]))\n")

    def ensure() -> str:
        result = subprocess.run([sys.executable, "-c", code, str(EXAMPLE), f"run_dir={tmp_path / 'runs' / 'a'}",
                                 f"model.hf_path={source}"], capture_output=True, text=True, check=True, timeout=600)
        return result.stderr

    assert "converting" in ensure() and cached_conversion_problem(target, source) is None
    assert (target / "metadata.json").is_file() and (target / "hf_base" / "tokenizer.json").is_file()
    assert "using the conversion" in ensure()
    from megatron_quads import manifest

    def no_hashing(paths):
        raise AssertionError(f"hashed {len(paths)} files of an unchanged conversion")

    with pytest.MonkeyPatch.context() as patch:  # verified once: unchanged files are not read again
        patch.setattr(manifest, "_sha256_all", no_hashing)
        assert cached_conversion_problem(target, source) is None
    shard = next(p for p in target.rglob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # damaged: one byte flipped
    shard.write_bytes(bytes(data))
    assert cached_conversion_problem(target, source).startswith("damaged")
    assert "converting" in ensure() and cached_conversion_problem(target, source) is None
    os.utime(source / "model.safetensors", ns=(1, 1))  # the source changed
    assert "changed since it was converted" in cached_conversion_problem(target, source)


REWARD_FILE = """
def compute_score(prompt, response, row):
    # the row's own fields reach the reward: the answer and the extra 'level' column
    return {"score": float(row["a"] in response), "easy": float(row["level"] == "easy"), "chars": float(len(response))}
"""


def test_grpo_three_steps_on_own_jsonl_with_hf_model(hf_model: Path, data_file: Path, tmp_path: Path) -> None:
    """The whole: model.hf_path + a JSONL file of one's own + the chat template + a reward file of one's
    own, 3 GRPO steps on CPU; the reward's extra metrics reach metrics.jsonl and TensorBoard, and sample
    generations are logged."""
    ray = pytest.importorskip("ray")
    run_dir = tmp_path / "runs" / "mine"
    reward = tmp_path / "my_reward.py"
    reward.write_text(REWARD_FILE)
    cfg = load_config(EXAMPLE, [*FAST, "grpo.steps=3", "precision.mode=quads", f"run_dir={run_dir}",
                                f"model.hf_path={hf_model}", *_data_overrides(data_file),
                                "data.apply_chat_template=true", "data.max_prompt_length=12",
                                f"reward.path={reward}", "logging.tensorboard=true", "logging.samples_every=1"])
    from megatron_quads.controller.run import run

    try:
        records = [json.loads(line) for line in run(cfg).read_text().splitlines()]
    finally:
        ray.shutdown()
    steps = [r for r in records if "reward" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert all(r["train/update_successful"] == 1.0 and r["mismatch/num_tokens"] > 0 for r in steps)
    assert (run_dir.parent / "hf_converted").is_dir()
    assert all(r["reward/easy"] == 1.0 and r["reward/chars"] > 0 for r in steps)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {0, 1, 2}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/easy")] == [0, 1, 2]


def _refused(capsys: pytest.CaptureFixture[str], overrides: list[str], pattern: str) -> None:
    start = time.perf_counter()
    assert main(["train", str(EXAMPLE), *overrides]) == 2
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert re.search(pattern, err) and "Traceback" not in err and err.count("\n") == 1, err
    assert elapsed < 2.0, elapsed


def test_a_missing_data_file_is_refused_naming_the_key(capsys, tmp_path: Path) -> None:
    _refused(capsys, [f"run_dir={tmp_path / 'r'}", "task.kind=qa", f"task.options.path={tmp_path / 'nope.jsonl'}"],
             r"task\.options\.path: data file .*nope\.jsonl does not exist")


def test_an_unreadable_data_file_is_refused_naming_the_line(capsys, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n{not json\n")
    _refused(capsys, [f"run_dir={tmp_path / 'r'}", "task.kind=qa", f"task.options.path={bad}"],
             r"task\.options\.path: .*bad\.jsonl, line 2: not valid JSON")


def test_a_prompt_key_not_in_the_first_row_is_refused(capsys, data_file: Path, tmp_path: Path) -> None:
    _refused(capsys, [f"run_dir={tmp_path / 'r'}", "task.kind=qa", f"task.options.path={data_file}", "data.answer_key=a"],
             r"data\.prompt_key: the field 'question' is not a field of the first record .*\['a', 'level', 'q'\].*"
             r"set data\.prompt_key")


def test_an_answer_key_not_in_the_first_row_is_refused(capsys, data_file: Path, tmp_path: Path) -> None:
    _refused(capsys, [f"run_dir={tmp_path / 'r'}", "task.kind=qa", f"task.options.path={data_file}", "data.prompt_key=q",
                      "data.answer_key=solution"],
             r"data\.answer_key: the field 'solution' is not a field of the first record")


def test_text_the_character_tokenizer_cannot_encode_is_refused(capsys, data_file: Path, tmp_path: Path) -> None:
    _refused(capsys, [f"run_dir={tmp_path / 'r'}", *_data_overrides(data_file)],
             r"task\.tokenizer=char cannot encode the prompts of .*set model\.hf_path")


def test_a_chat_template_without_one_to_apply_is_refused(capsys, tmp_path: Path) -> None:
    _refused(capsys, [f"run_dir={tmp_path / 'r'}", "data.apply_chat_template=true"],
             r"data\.apply_chat_template=true needs a Hugging Face tokenizer with a chat template")


def test_an_hf_path_that_is_not_a_qwen3_moe_directory_is_refused_naming_what_is_missing(capsys, tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _refused(capsys, [f"run_dir={tmp_path / 'r'}", f"model.hf_path={tmp_path / 'm'}"],
             r"model\.hf_path=.*m is not a Qwen3-MoE model directory: it lacks \*\.safetensors weights, tokenizer files")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    (tmp_path / "m" / "tokenizer.json").write_text("{}")
    _refused(capsys, [f"run_dir={tmp_path / 'r'}", f"model.hf_path={tmp_path / 'm'}"],
             r"model\.hf_path=.*: unsupported model: unsupported architecture .*llama")


def test_a_data_mistake_is_found_without_importing_torch_or_datasets(data_file: Path, tmp_path: Path) -> None:
    code = ("import sys\nfrom megatron_quads.cli import main\nrc = main(['train', *sys.argv[1:]])\n"
            "heavy = [m for m in ('torch', 'ray', 'datasets', 'transformers') if m in sys.modules]\n"
            "assert not heavy, heavy\nsys.exit(rc)\n")
    result = subprocess.run([sys.executable, "-c", code, str(EXAMPLE), f"run_dir={tmp_path / 'r'}", "task.kind=qa",
                             f"task.options.path={data_file}"], capture_output=True, text=True, check=False, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2 and "data.prompt_key" in result.stderr, result.stderr
