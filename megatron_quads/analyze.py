"""``megatron-quads analyze``: decompose the rollout-vs-trainer gap of an MoE model (table, JSON, PNG).

Runs on CPU on a Megatron-Core GPT-MoE (the tiny embedded architecture by default, random or from a
Megatron dist checkpoint) or on a local Hugging Face Qwen3-MoE-format model (a QUADS checkpoint
too: its NVFP4 weights dequantized); the routed experts' linears are the layers in scope. Token
sequences are random ids by default (any model), or rows the caller gives (``megatron-quads analyze
--tokens embedded-task``: the embedded task's held-out problems with their answers, the text the
embedded model was trained on, so the activations are the ones GRPO sees); calibration and
measurement use different sequences. For each pair
of :func:`megatron_quads.rollout.analysis.default_pairs` it reports the per-token log-prob gap of the
whole model and, per layer, the weight-error and activation-error terms; QUADS is measured at several
RAC ratios and with each channel-ranking statistic.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megatron_quads.atomic_io import save_figure_atomic, write_text_atomic
from megatron_quads.rollout.analysis import QuantAnalysis, default_pairs, run_pairs
from megatron_quads.rollout.checkpoint_format import QUANT_CONFIG_FILE
from megatron_quads.rollout.rac import ChannelStatistic

logger = logging.getLogger(__name__)

_EXPERT_LINEAR = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.\d+\.linear_fc[12]$")


def megatron_expert_linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The routed-expert linears of a Megatron GPT-MoE (SequentialMLP), by module name."""
    return {name: m for name, m in model.named_modules() if _EXPERT_LINEAR.match(name)}


def megatron_layer_of(name: str) -> str:
    """``decoder.layers.3.mlp...`` -> ``layer 3``."""
    return f"layer {int(_EXPERT_LINEAR.match(name).group(1))}"


def _megatron_forward(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    return model(tokens, positions, None)


_HF_EXPERT_LINEAR = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)\.\d+$")


@dataclass
class Target:
    """A model to analyse, with its in-scope linears and how to run it."""

    model: torch.nn.Module
    modules: dict[str, torch.nn.Module]
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    layer_of: Callable[[str], str]
    vocab_size: int
    description: str


def load_hf_model(path: str) -> Target:
    """A local Hugging Face Qwen3-MoE-format model (fp32, CPU) with its experts split per expert.

    A QUADS checkpoint (``hf_quant_config.json``, e.g. ``convert to-quads`` output) is loaded with
    its NVFP4 linears dequantized: the analysis then starts from the NVFP4 weights, what an AQAT
    trainer holds, not from the original high-precision ones."""
    from transformers import AutoModelForCausalLM

    from megatron_quads.rollout.hf_experts import split_experts

    if not Path(path, "config.json").exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    if Path(path, QUANT_CONFIG_FILE).exists():
        model = load_quads_model(path)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, local_files_only=True,
                                                     weights_only=True, trust_remote_code=False).eval()
    split_experts(model)
    modules = {name: m for name, m in model.named_modules() if _HF_EXPERT_LINEAR.match(name)}
    if not modules:
        raise ValueError(f"{path}: found no routed-expert linears (expected Qwen3-MoE-style model.layers.N.mlp.experts)")
    return Target(
        model=model,
        modules=modules,
        forward=lambda m, tokens: m(input_ids=tokens).logits,
        layer_of=lambda name: f"layer {int(_HF_EXPERT_LINEAR.match(name).group(1))}",
        vocab_size=model.config.vocab_size,
        description=f"Hugging Face model {path}",
    )


def load_quads_model(path: str) -> torch.nn.Module:
    """A QUADS checkpoint as a float32 transformers ``Qwen3MoeForCausalLM``: NVFP4 linears dequantized,
    the other tensors as stored (its ``config.json`` without the ``quantization_config`` block)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megatron_quads.rollout.hf_experts import load_checkpoint_weights
    from megatron_quads.rollout.quantized_checkpoint import load_quantized_weights

    doc = json.loads(Path(path, "config.json").read_text())
    doc.pop("quantization_config", None)
    weights = load_quantized_weights(path)
    tensors = {name: t.float() for name, t in weights.unquantized.items()}
    tensors.update({f"{module}.weight": lin.dequantized_weight(torch.float32) for module, lin in weights.quantized.items()})
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**doc)).to(torch.float32)
    load_checkpoint_weights(model, tensors)
    return model.eval()


def load_megatron_tiny(checkpoint: str | None, seed: int) -> Target:
    """The tiny Megatron GPT-MoE as an analysis target."""
    model = build_tiny_model(checkpoint, seed)
    return Target(
        model=model,
        modules=megatron_expert_linears(model),
        forward=_megatron_forward,
        layer_of=megatron_layer_of,
        vocab_size=model.vocab_size,
        description="Megatron GPT-MoE" + (f" from {checkpoint}" if checkpoint else " (tiny, random init)"),
    )


def build_tiny_model(checkpoint: str | None, seed: int) -> torch.nn.Module:
    """A Megatron GPT-MoE in fp32 on one rank: the architecture a dist checkpoint's
    ``model_config.json`` records, loaded from it; without a checkpoint (or that file) the tiny
    default architecture, random or loaded. Its experts are always SequentialMLP linears, one module
    per expert for the analysis to hook: Megatron's dist checkpoints of GroupedMLP experts load into
    them weight for weight. On the current CUDA device where there is one (Megatron's rotary
    embedding computes there whenever CUDA is available), else on the CPU."""
    from megatron_quads.trainer.checkpoint_audit import audit_dist_checkpoint, load_dist_checkpoint
    from megatron_quads.trainer.distributed import init_trainer_distributed
    from megatron_quads.trainer.model import (
        ParallelConfig,
        PolicyModelConfig,
        build_gpt_model,
        load_model_config,
    )

    if checkpoint:
        from megatron_quads.trainer.settings import dist_checkpoint_dir

        checkpoint = str(dist_checkpoint_dir(checkpoint))  # a GRPO run's checkpoints/step_N too
        audit_dist_checkpoint(checkpoint)  # before any work
    init_trainer_distributed(1, 0, ParallelConfig(), seed=seed)
    recorded = load_model_config(checkpoint) if checkpoint else None
    cfg = (recorded or PolicyModelConfig(init_method_std=0.05)).model_copy(
        update={"dtype": "fp32", "moe_grouped_gemm": False})
    model = build_gpt_model(cfg, ParallelConfig())
    if checkpoint:
        state = load_dist_checkpoint({"model": model.sharded_state_dict()}, checkpoint)
        model.load_state_dict(state["model"])
    if torch.cuda.is_available():
        model.cuda()
    return model.eval()


def plot(report: dict, path: Path) -> None:
    """Three panels: gap per pair; per-layer weight vs activation error; gap vs RAC ratio per statistic."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = report["pairs"]
    fig, (ax_gap, ax_layers, ax_ratio) = plt.subplots(1, 3, figsize=(18, 5.5))
    labels = list(pairs)
    xs = range(len(labels))
    ax_gap.bar([x - 0.2 for x in xs], [pairs[l]["gap"]["max_abs"] for l in labels], 0.4, label="max |Δlogp|")
    ax_gap.bar([x + 0.2 for x in xs], [pairs[l]["gap"]["mean_abs"] for l in labels], 0.4, label="mean |Δlogp|")
    ax_gap.set_xticks(list(xs), labels, rotation=40, ha="right", fontsize=7)
    ax_gap.set_ylabel("nats")
    ax_gap.set_title("rollout vs trainer log-prob gap")
    ax_gap.legend()

    for label in [l for l in labels if " quads@" not in l]:
        layers = sorted(pairs[label]["layers"], key=lambda s: int(s.split()[-1]))
        line = ax_layers.plot([pairs[label]["layers"][l]["activation_rel"] for l in layers], marker="o", label=f"{label}: activation")
        ax_layers.plot([pairs[label]["layers"][l]["weight_rel"] for l in layers], marker="x", linestyle="--",
                       color=line[0].get_color(), label=f"{label}: weight")
    ax_layers.set_xlabel("transformer layer")
    ax_layers.set_ylabel("relative error of routed-expert outputs")
    ax_layers.set_title("per-layer error terms")
    ax_layers.legend(fontsize=7)

    base = pairs.get("aqat vs w4a4", {}).get("gap", {}).get("mean_abs")
    by_stat: dict[str, list[tuple[float, float]]] = {}
    for label, r in pairs.items():
        if " quads@" in label:
            ratio = float(label.split("quads@")[1].split()[0])
            stat = label.split("(")[-1].rstrip(")")
            by_stat.setdefault(stat, []).append((ratio, r["gap"]["mean_abs"]))
    for stat, points in by_stat.items():
        points = sorted(([(0.0, base)] if base is not None else []) + points)
        ax_ratio.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=stat)
    ax_ratio.set_xlabel("RAC residual-channel ratio")
    ax_ratio.set_ylabel("mean |Δlogp| (AQAT trainer vs W4A4+RAC rollout)")
    ax_ratio.set_title("QUADS gap vs RAC ratio")
    ax_ratio.legend()
    fig.tight_layout()
    save_figure_atomic(fig, path)
    plt.close(fig)


def random_rows(vocab_size: int, num_sequences: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(calibration rows, measured rows) of random ids, different sequences each."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab_size, (num_sequences, seq_len), generator=gen),
            torch.randint(0, vocab_size, (num_sequences, seq_len), generator=gen))


def run(
    out_dir: Path,
    checkpoint: str | None = None,
    hf_model: str | None = None,
    ratios: tuple[float, ...] = (0.125, 0.25, 0.5, 1.0),
    statistics: tuple[ChannelStatistic, ...] = (ChannelStatistic.OUTPUT_ERROR, ChannelStatistic.ACTIVATION_MAGNITUDE),
    num_sequences: int = 8,
    seq_len: int = 64,
    seed: int = 0,
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    token_source: str = "random",
    rows_vocab_size: int | None = None,
) -> dict:
    """Run the analysis, write ``analysis.json`` and ``analysis.png`` to ``out_dir``; returns the report.

    ``rows``: (calibration, measured) token rows of a source named ``token_source``, made for a model
    of vocabulary ``rows_vocab_size`` (another model is refused); default: random ids."""
    if hf_model and checkpoint:
        raise ValueError("pass either a Megatron checkpoint or a Hugging Face model, not both")
    target = load_hf_model(hf_model) if hf_model else load_megatron_tiny(checkpoint, seed)
    if rows is None:
        calib, tokens = random_rows(target.vocab_size, num_sequences, seq_len, seed)
    elif rows_vocab_size is not None and rows_vocab_size != target.vocab_size:
        raise ValueError(f"tokens {token_source!r} are for a model of vocabulary {rows_vocab_size}; this model's "
                         f"vocabulary is {target.vocab_size}: use tokens 'random'")
    else:
        calib, tokens = rows
    device = next(target.model.parameters()).device
    calib, tokens = calib.to(device), tokens.to(device)
    analysis = QuantAnalysis(target.model, target.modules, target.forward)
    report: dict = {"model": target.description, "tokens": tokens.numel(), "token_source": token_source,
                    "ratios": list(ratios), "pairs": {}}
    for statistic in statistics:
        analysis.calibrate(calib, list(ratios), statistic)
        pairs = default_pairs(list(ratios))
        if statistic != statistics[0]:
            pairs = [p for p in pairs if p[1].uses_rac]  # the non-RAC pairs do not depend on S
        results = run_pairs(analysis, tokens, pairs, target.layer_of)
        for r in results:
            if r.label.startswith("aqat vs quads"):
                r.label = f"{r.label} ({statistic.value})"
            report["pairs"][r.label] = asdict(r)
    write_text_atomic(out_dir / "analysis.json", json.dumps(report, indent=1))
    plot(report, out_dir / "analysis.png")
    return report


def table_rows(report: dict) -> list[tuple[str, str, str, str, str, str]]:
    """(pair, max |Δlogp|, mean |Δlogp|, k3 KL, mean weight err, mean activation err) per pair."""
    rows = []
    for label, r in report["pairs"].items():
        layers = r["layers"].values()
        w = sum(l["weight_rel"] for l in layers) / max(len(layers), 1)
        a = sum(l["activation_rel"] for l in layers) / max(len(layers), 1)
        g = r["gap"]
        rows.append((label, f"{g['max_abs']:.4f}", f"{g['mean_abs']:.5f}", f"{g['k3_kl']:.2e}", f"{w:.4f}", f"{a:.4f}"))
    return rows
