"""The embedded default checkpoint: intact, loadable, and a useful start for GRPO."""

from __future__ import annotations

import shutil

import pytest
import torch

from megatron_quads import embedded

CHECKPOINT = embedded.ASSET_DIR / "checkpoint"


def test_checksums_match_the_manifest() -> None:
    manifest = embedded.verify(CHECKPOINT)
    assert manifest["files"] and manifest["command"] == "python tools/train_tiny_sft.py"
    size = sum(p.stat().st_size for p in CHECKPOINT.iterdir())
    assert size < 8 * 2**20, "the shipped checkpoint must stay a few MB"


def test_a_changed_or_missing_file_is_detected(tmp_path) -> None:
    copy = tmp_path / "checkpoint"
    shutil.copytree(CHECKPOINT, copy)
    victim = next(p for p in sorted(copy.iterdir()) if p.name.endswith(".distcp"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=victim.name):
        embedded.verify(copy)
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        embedded.verify(copy)
    (copy / embedded.MANIFEST).unlink()
    with pytest.raises(FileNotFoundError, match="train_tiny_sft"):
        embedded.verify(copy)


def test_warm_start_reward_is_well_above_zero_and_below_the_ceiling() -> None:
    from megatron.core import dist_checkpointing

    from megatron_quads.trainer.distributed import init_trainer_distributed
    from megatron_quads.trainer.hf_export import export_hf_weights, qwen3_moe_config
    from megatron_quads.trainer.model import (
        ParallelConfig,
        PolicyModelConfig,
        build_gpt_model,
    )

    init_trainer_distributed(1, 0, ParallelConfig())
    cfg = PolicyModelConfig(**embedded.model_config_fields())
    model = build_gpt_model(cfg, ParallelConfig())
    model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, str(CHECKPOINT))["model"])
    accuracy = embedded.greedy_accuracy(dict(export_hf_weights(model)), qwen3_moe_config(cfg))
    assert 0.15 < accuracy < 0.9
    # greedy decoding is deterministic: the number recorded when the checkpoint was made comes back
    # (a few flips allowed for another CPU's floating-point summation order)
    assert accuracy == pytest.approx(embedded.verify(CHECKPOINT)["heldout_greedy_accuracy"], abs=0.03)


def test_the_tokenizer_covers_the_task_and_fits_the_model() -> None:
    tok, fields = embedded.tokenizer(), embedded.model_config_fields()
    assert tok.vocab_size <= fields["vocab_size"]
    for prompt in embedded.task().sample_prompts(50, seed=3):
        assert len(tok.encode(prompt.text)) + 8 < fields["max_sequence_length"]
    assert torch.tensor(tok.encode("12+7=")).max() < fields["vocab_size"]
