"""The embedded default: a tiny GPT-MoE warm-started on synthetic arithmetic, shipped in the package.

``tools/train_tiny_sft.py`` produces it (reproducibly, on CPU) as a model-only Megatron dist
checkpoint under ``megatron_quads/assets/tiny_moe_sft/`` with a manifest of sha256 checksums; the
main job starts GRPO from it without any download.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from megatron_quads.tasks import ArithmeticConfig, ArithmeticTask, CharTokenizer

ASSET_DIR = Path(__file__).parent / "assets" / "tiny_moe_sft"
MANIFEST = "manifest.json"
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


def sha256(path: Path) -> str:
    """Hex sha256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path, extra: dict) -> None:
    """Record every file's sha256 (and ``extra``) in ``directory/manifest.json``."""
    files = {p.name: sha256(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
    (directory / MANIFEST).write_text(json.dumps({"files": files, **extra}, indent=1, sort_keys=True) + "\n")


def verify(directory: Path = ASSET_DIR) -> dict:
    """Check the checkpoint against its manifest; returns the manifest or raises naming the bad file."""
    manifest_path = directory / MANIFEST
    if not manifest_path.exists():
        raise FileNotFoundError(f"{directory} has no {MANIFEST}: regenerate it with tools/train_tiny_sft.py")
    manifest = json.loads(manifest_path.read_text())
    for name, expected in manifest["files"].items():
        path = directory / name
        if not path.exists():
            raise FileNotFoundError(f"embedded checkpoint file {path} is missing")
        if sha256(path) != expected:
            raise ValueError(f"embedded checkpoint file {path} does not match its sha256 in {MANIFEST}")
    return manifest


def greedy_accuracy(weights: dict, hf_config, n: int = 200, seed: int = 1, precision: str = "bf16") -> float:
    """Fraction of held-out problems answered right by greedy decoding with the built-in engine.

    ``weights``: the model's tensors by Hugging Face name (``PolicyWorker.export_hf_weights``);
    ``hf_config``: its transformers config (``trainer.hf_export.qwen3_moe_config``).
    """
    import torch

    from megatron_quads.rollout.engine import SamplingParams
    from megatron_quads.rollout.torch_engine import TorchRolloutEngine
    from megatron_quads.tasks import encode_prompt

    tok, heldout = tokenizer(), task(split="eval")
    engine = TorchRolloutEngine(hf_config, precision=precision, dtype=torch.float32)
    engine.load_weights(weights, version=0)
    prompts = heldout.sample_prompts(n, seed=seed)
    outs = engine.generate([encode_prompt(tok, p.text) for p in prompts],
                           SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(tok.eos_id,)))
    return sum(heldout.rewards(prompts, [tok.decode(g.token_ids) for g in outs])) / n
