"""The embedded default: a tiny GPT-MoE warm-started on synthetic arithmetic, shipped in the package.

``tools/train_tiny_sft.py`` produces it (reproducibly, on CPU) as a model-only Megatron dist
checkpoint under ``megatron_quads/assets/tiny_moe_sft/`` with a manifest of sizes and sha256 checksums; the
main job starts GRPO from it without any download. Its character tokenizer ships beside it as Hugging
Face tokenizer files (:data:`TOKENIZER_DIR`).
"""

from __future__ import annotations

from pathlib import Path

from megatron_quads import manifest
from megatron_quads.precision import Precision
from megatron_quads.tasks import ArithmeticConfig, ArithmeticTask, CharTokenizer, Task

ASSET_DIR = Path(__file__).parent / "assets" / "tiny_moe_sft"
TOKENIZER_DIR = Path(__file__).parent / "assets" / "char_tokenizer"
"""The embedded model's tokenizer as Hugging Face files (``CharTokenizer().save_pretrained``; rewrite
them with ``tools/write_char_tokenizer.py``): what a converted copy of the model ships for
``transformers`` and vLLM."""
MANIFEST = manifest.MANIFEST
ARITHMETIC_LEVEL = 1  # two operands of 1-2 digits, + and -


def tokenizer() -> CharTokenizer:
    """The embedded model's character tokenizer."""
    return CharTokenizer()


def task(split: str = "all") -> ArithmeticTask:
    """The synthetic task the embedded model was warm-started on (and GRPO trains on)."""
    return ArithmeticTask(ArithmeticConfig.level(ARITHMETIC_LEVEL, split=split))


def model_config_fields() -> dict:
    """PolicyModelConfig fields of the embedded model (kept as a dict: this module imports no Megatron)."""
    return dict(
        num_layers=4, hidden_size=128, num_attention_heads=4, num_experts=8, moe_ffn_hidden_size=64,
        moe_router_topk=2, ffn_hidden_size=256, vocab_size=32, max_sequence_length=64, dtype="fp32",
    )


def write_manifest(directory: Path, extra: dict) -> None:
    """Record every file's size and sha256 (and ``extra``) in ``directory/manifest.json``."""
    manifest.write_manifest(directory, extra)


def verify(directory: Path = ASSET_DIR) -> dict:
    """Check the checkpoint against its manifest; returns the manifest or raises naming the bad file."""
    return manifest.verify_manifest(directory, regenerate="regenerate it with tools/train_tiny_sft.py")


def greedy_accuracy(weights: dict, hf_config, n: int = 200, seed: int = 1, precision: Precision = Precision("bf16"),
                    heldout: Task | None = None, max_new_tokens: int = 8, device: str = "cpu") -> float:
    """Fraction of held-out problems answered right by greedy decoding with the built-in engine.

    ``weights``: the model's tensors by Hugging Face name (``PolicyWorker.export_hf_weights``);
    ``hf_config``: its transformers config (``trainer.hf_export.qwen3_moe_config``); ``precision``:
    the engine's; ``heldout``: the problems (default: the embedded task's eval split), written with
    the character tokenizer.
    """
    import torch

    from megatron_quads.rollout.engine import SamplingParams
    from megatron_quads.rollout.torch_engine import TorchRolloutEngine
    from megatron_quads.tasks import encode_prompt

    tok, heldout = tokenizer(), heldout or task(split="eval")
    engine = TorchRolloutEngine(hf_config, precision=precision, device=device, dtype=torch.float32)
    engine.load_weights(weights, version=0)
    prompts = heldout.sample_prompts(n, seed=seed)
    outs = engine.generate([encode_prompt(tok, p.text) for p in prompts],
                           SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=(tok.eos_id,)))
    return sum(heldout.rewards(prompts, [tok.decode(g.token_ids) for g in outs])) / n


def task_token_rows(num_sequences: int, seq_len: int, seed: int, held_out: Task | None = None) -> "torch.Tensor":
    """``[num_sequences, seq_len]`` ids of held-out problems and their answers (``<bos>`` prompt,
    answer, ``<eos>``) in the embedded tokenizer, packed back to back and cut into rows: of the
    embedded task (text the embedded model knows), or of ``held_out`` (a task's eval split)."""
    import torch

    from megatron_quads.tasks import encode_sft_pair

    tok, pairs = tokenizer(), (held_out or task(split="eval")).iter_sft_pairs(seed=seed)
    ids: list[int] = []
    while len(ids) < num_sequences * seq_len:
        ids += encode_sft_pair(tok, *next(pairs))[0]
    return torch.tensor(ids[: num_sequences * seq_len]).view(num_sequences, seq_len)
