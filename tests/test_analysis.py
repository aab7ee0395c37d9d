"""The rollout-vs-trainer gap analysis on the tiny Megatron MoE (one CPU rank)."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_quads.analyze import (
    _megatron_forward,
    build_tiny_model,
    megatron_expert_linears,
    megatron_layer_of,
)
from megatron_quads.rollout.analysis import (
    Precision,
    QuantAnalysis,
    default_pairs,
    logprob_gap,
    run_pairs,
)
from megatron_quads.rollout.rac import ChannelStatistic


@pytest.fixture(scope="module")
def analysis() -> QuantAnalysis:
    model = build_tiny_model(None, seed=0)
    return QuantAnalysis(model, megatron_expert_linears(model), _megatron_forward)


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (4, 24), generator=torch.Generator().manual_seed(seed))


def test_scope_is_the_routed_expert_linears(analysis: QuantAnalysis) -> None:
    assert len(analysis.modules) == 4 * 8 * 2  # layers x experts x (fc1, fc2)
    assert megatron_layer_of("decoder.layers.3.mlp.experts.local_experts.7.linear_fc2") == "layer 3"


def test_aqat_trainer_has_exactly_zero_weight_error(analysis: QuantAnalysis) -> None:
    tokens = _tokens()
    for rollout in (Precision("w4a4"), Precision("w4a16")):
        sums = analysis.layer_errors(tokens, Precision("w4a16"), rollout)
        assert all(t["weight"] == 0.0 for t in sums.values())
    bf16 = analysis.layer_errors(tokens, Precision("bf16"), Precision("w4a4"))
    assert all(t["weight"] > 0 for t in bf16.values() if t["output"] > 0)


def test_weight_only_rollout_has_exactly_zero_activation_error(analysis: QuantAnalysis) -> None:
    sums = analysis.layer_errors(_tokens(), Precision("bf16"), Precision("w4a16"))
    assert all(t["activation"] == 0.0 for t in sums.values())
    assert any(t["weight"] > 0 for t in sums.values())


def test_aqat_simulation_equals_the_quads_trainer_model(analysis: QuantAnalysis) -> None:
    from megatron_quads.trainer.model import (
        ParallelConfig,
        PolicyModelConfig,
        build_gpt_model,
    )
    from megatron_quads.trainer.quads_config import QuadsTrainerConfig

    quads = build_gpt_model(PolicyModelConfig(dtype="fp32", init_method_std=0.05), ParallelConfig(), QuadsTrainerConfig())
    quads.load_state_dict(analysis.model.state_dict())
    tokens = _tokens()
    with torch.no_grad():
        real = torch.log_softmax(_megatron_forward(quads.eval(), tokens).float()[:, :-1], -1)
    real = real.gather(-1, tokens[:, 1:, None])[..., 0]
    assert torch.equal(analysis.logprobs(tokens, Precision("w4a16")), real)


def test_rac_shrinks_the_gap_and_ratio_one_removes_most_of_it(analysis: QuantAnalysis) -> None:
    tokens = _tokens()
    analysis.calibrate(_tokens(seed=2), [0.25, 1.0], ChannelStatistic.OUTPUT_ERROR)
    results = {r.label: r for r in run_pairs(analysis, tokens, default_pairs([0.25, 1.0]), megatron_layer_of)}
    assert set(results) == {"bf16 vs w4a4", "bf16 vs w4a16", "aqat vs w4a4", "aqat vs quads@0.25", "aqat vs quads@1"}
    naive, quads_full = results["aqat vs w4a4"].gap, results["aqat vs quads@1"].gap
    assert quads_full["mean_abs"] < naive["mean_abs"] / 3
    act = {label: sum(l["activation_rel"] for l in r.layers.values()) for label, r in results.items()}
    assert act["aqat vs quads@1"] < act["aqat vs quads@0.25"] < act["aqat vs w4a4"]


def test_logprob_gap_by_hand() -> None:
    trainer = torch.log(torch.tensor([[0.5, 0.25]]))
    rollout = torch.log(torch.tensor([[0.25, 0.25]]))
    gap = logprob_gap(trainer, rollout)
    assert gap["max_abs"] == pytest.approx(float(torch.log(torch.tensor(2.0))))
    assert gap["mean_abs"] == pytest.approx(float(torch.log(torch.tensor(2.0))) / 2)
    # k3 = r - 1 - log r with r = pi_T / pi_R: token 1: 2 - 1 - log 2; token 2: 0
    assert gap["k3_kl"] == pytest.approx((1 - float(torch.log(torch.tensor(2.0)))) / 2)
    masked = logprob_gap(trainer, rollout, mask=torch.tensor([[0, 1]]))
    assert masked["max_abs"] == 0.0


def test_unknown_precision_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown rollout precision 'fp8'"):
        Precision("fp8")


def test_analyze_command_writes_report_and_plot(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_quads.cli import main

    assert main(["analyze", "--out", str(tmp_path), "--ratios", "0.25", "1.0", "--sequences", "2", "--seq-len", "16"]) == 0
    report = json.loads((tmp_path / "analysis.json").read_text())
    assert "aqat vs quads@0.25 (output_error)" in report["pairs"]
    assert "aqat vs quads@1 (activation_magnitude)" in report["pairs"]
    assert (tmp_path / "analysis.png").stat().st_size > 10_000
    assert "wrote" in capsys.readouterr().out


def test_analyze_reads_the_architecture_of_a_dist_checkpoint(tmp_path) -> None:
    from megatron_quads import embedded
    from megatron_quads.cli import main

    checkpoint = embedded.ASSET_DIR / "checkpoint"  # vocab 32, not the default architecture's 64
    assert main(["analyze", "--checkpoint", str(checkpoint), "--out", str(tmp_path), "--ratios", "0.25",
                 "--sequences", "2", "--seq-len", "8"]) == 0
    report = json.loads((tmp_path / "analysis.json").read_text())
    assert str(checkpoint) in report["model"]


def test_a_grouped_experts_checkpoint_is_analysed_per_expert(tmp_path) -> None:
    """A dist checkpoint of GroupedMLP experts (what the GPU collapse study trains) loads into the
    analysis model's per-expert linears weight for weight, and every one of them is in scope."""
    from megatron.core import dist_checkpointing

    from megatron_quads.trainer.distributed import init_trainer_distributed
    from megatron_quads.trainer.model import ParallelConfig, PolicyModelConfig, build_gpt_model
    from megatron_quads.trainer.settings import save_model_config

    cfg = PolicyModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, num_query_groups=1, num_experts=4,
                            moe_router_topk=2, moe_ffn_hidden_size=16, ffn_hidden_size=32, vocab_size=32,
                            max_sequence_length=32, dtype="bf16", moe_grouped_gemm=True)
    init_trainer_distributed(1, 0, ParallelConfig(), seed=0)
    grouped = build_gpt_model(cfg, ParallelConfig())
    dist_checkpointing.save({"model": grouped.sharded_state_dict()}, str(tmp_path))
    save_model_config(cfg, tmp_path)

    model = build_tiny_model(str(tmp_path), seed=0)
    linears = megatron_expert_linears(model)
    assert len(linears) == cfg.num_layers * cfg.num_experts * 2
    for layer in range(cfg.num_layers):
        experts = grouped.decoder.layers[layer].mlp.experts
        fc1 = experts.weight1.view(cfg.num_experts, cfg.hidden_size, -1)
        fc2 = experts.weight2.view(cfg.num_experts, -1, cfg.hidden_size)
        for e in range(cfg.num_experts):
            prefix = f"decoder.layers.{layer}.mlp.experts.local_experts.{e}"
            assert torch.equal(linears[f"{prefix}.linear_fc1"].weight, fc1[e].t().float())
            assert torch.equal(linears[f"{prefix}.linear_fc2"].weight, fc2[e].t().float())


def _tiny_qwen3_moe(path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1,
    )
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)


def test_split_experts_keeps_the_hf_model_exact(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    from megatron_quads.rollout.hf_experts import split_experts

    _tiny_qwen3_moe(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    ids = _tokens()
    with torch.no_grad():
        before = model(ids).logits
        assert split_experts(model) == 2
        after = model(ids).logits
    assert torch.allclose(before, after, atol=1e-6)


def test_analyze_runs_on_a_hugging_face_qwen3_moe(tmp_path) -> None:
    from megatron_quads.analyze import run

    _tiny_qwen3_moe(tmp_path / "model")
    report = run(tmp_path / "out", hf_model=str(tmp_path / "model"), ratios=(1.0,),
                 statistics=(ChannelStatistic.OUTPUT_ERROR,), num_sequences=2, seq_len=12)
    pairs = report["pairs"]
    assert set(pairs["aqat vs w4a4"]["layers"]) == {"layer 0", "layer 1"}
    assert all(l["weight_rel"] == 0.0 for l in pairs["aqat vs w4a4"]["layers"].values())
    assert pairs["aqat vs quads@1 (output_error)"]["gap"]["mean_abs"] < pairs["aqat vs w4a4"]["gap"]["mean_abs"]


def test_missing_hf_model_directory_is_a_clear_error(tmp_path) -> None:
    from megatron_quads.analyze import load_hf_model

    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_model(str(tmp_path))


def test_embedded_task_tokens_are_held_out_problems_with_their_answers_and_differ_between_calibration_and_measure() -> None:
    from megatron_quads import embedded
    from megatron_quads.tasks.arithmetic import is_eval_problem

    calib, measured = embedded.task_token_rows(3, 40, seed=0), embedded.task_token_rows(3, 40, seed=1)
    assert calib.shape == measured.shape == (3, 40) and not torch.equal(calib, measured)
    tok, task = embedded.tokenizer(), embedded.task(split="eval")
    text = tok.decode(measured.view(-1).tolist(), skip_special_tokens=False)
    problems = [p for p in text.split("<bos>")[1:-1]]  # whole problems between the first and last <bos>
    assert len(problems) >= 5
    for problem in problems:
        prompt, answer = problem.removesuffix("<eos>").split("=")
        assert eval(prompt) == int(answer.removesuffix(";"))  # noqa: S307 (digits and + / - only)
        assert is_eval_problem(prompt + "=", task.config.eval_fraction)


def test_embedded_task_tokens_on_another_vocabulary_are_refused(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_quads.cli import main

    assert main(["analyze", "--tokens", "embedded-task", "--out", str(tmp_path), "--ratios", "0.25",
                 "--sequences", "2", "--seq-len", "8"]) == 2  # the default architecture: vocabulary 64
    err = capsys.readouterr().err
    assert "analyze: tokens 'embedded-task' are for a model of vocabulary" in err and "use tokens 'random'" in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_analyze_on_the_embedded_checkpoint_with_its_task_tokens(tmp_path) -> None:
    from megatron_quads import embedded
    from megatron_quads.cli import main

    assert main(["analyze", "--checkpoint", str(embedded.ASSET_DIR / "checkpoint"), "--tokens", "embedded-task",
                 "--out", str(tmp_path), "--ratios", "1.0", "--sequences", "2", "--seq-len", "24"]) == 0
    report = json.loads((tmp_path / "analysis.json").read_text())
    assert report["token_source"] == "embedded-task" and report["tokens"] == 48
    pairs = report["pairs"]
    assert pairs["aqat vs quads@1 (output_error)"]["gap"]["k3_kl"] < pairs["aqat vs w4a4"]["gap"]["k3_kl"]


def test_run_task_tokens_are_the_run_configs_held_out_problems(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--tokens run-task --run-config``: rows of the run's task (here the chain task) in its held-out
    split, on the embedded checkpoint (same tokenizer); without a config, a clear refusal."""
    from megatron_quads import embedded
    from megatron_quads.cli import main
    from megatron_quads.tasks import make_task
    from megatron_quads.tasks.arithmetic import is_eval_problem

    config = tmp_path / "config.yaml"
    config.write_text("task:\n  kind: chain\n  options: {min_steps: 2, max_steps: 3}\n")
    out = tmp_path / "analysis"
    assert main(["analyze", "--checkpoint", str(embedded.ASSET_DIR / "checkpoint"), "--tokens", "run-task",
                 "--run-config", str(config), "--out", str(out), "--ratios", "1.0", "--sequences", "2",
                 "--seq-len", "24"]) == 0
    report = json.loads((out / "analysis.json").read_text())
    assert report["token_source"] == "run-task" and report["tokens"] == 48

    held_out = make_task("chain", min_steps=2, max_steps=3, split="eval")
    rows = embedded.task_token_rows(4, 32, seed=0, held_out=held_out)
    text = embedded.tokenizer().decode(rows.flatten().tolist(), skip_special_tokens=False)
    problems = text.split("<bos>")[1:-1]  # whole problems between the first and last <bos>
    assert problems and all(p.endswith(");<eos>") and "(" in p for p in problems)
    assert all(is_eval_problem(p.split("=")[0] + "=", held_out.config.eval_fraction) for p in problems)

    assert main(["analyze", "--tokens", "run-task", "--out", str(out), "--sequences", "2", "--seq-len", "8"]) == 2
    assert "give --run-config RUN_DIR/config.yaml" in capsys.readouterr().err


@pytest.mark.gpu
def test_analysis_of_a_checkpoint_runs_on_the_gpu(tmp_path) -> None:
    """Where CUDA is available the analysis model and its token rows are on the GPU (Megatron's rotary
    embedding computes there), and the decomposition holds: zero weight error for the AQAT trainer,
    RAC at ratio 1 below W4A4 in k3 KL."""
    from megatron_quads import embedded
    from megatron_quads.cli import main

    config = tmp_path / "config.yaml"
    config.write_text("task:\n  kind: chain\n  options: {min_steps: 2, max_steps: 3}\n")
    assert next(build_tiny_model(str(embedded.ASSET_DIR / "checkpoint"), seed=0).parameters()).is_cuda
    assert main(["analyze", "--checkpoint", str(embedded.ASSET_DIR / "checkpoint"), "--tokens", "run-task",
                 "--run-config", str(config), "--out", str(tmp_path / "analysis"), "--ratios", "1.0",
                 "--sequences", "2", "--seq-len", "24"]) == 0
    pairs = json.loads((tmp_path / "analysis" / "analysis.json").read_text())["pairs"]
    assert all(layer["weight_rel"] == 0.0 for layer in pairs["aqat vs w4a4"]["layers"].values())
    assert pairs["aqat vs quads@1 (output_error)"]["gap"]["k3_kl"] < pairs["aqat vs w4a4"]["gap"]["k3_kl"]
