"""Where the rollout-vs-trainer gap comes from: per-layer weight vs activation error, and log-prob gaps.

A :class:`~megatron_quads.precision.Precision` kind says how one side computes each linear in scope
(routed experts by default):

| kind | output of a linear with input x |
|---|---|
| ``bf16``  | ``x W^T`` (the BF16 trainer) |
| ``w4a16`` | ``x q(W)^T`` (the AQAT trainer, labelled ``aqat`` on the trainer side; the W4A16 rollout) |
| ``w4a4``  | ``q(x) q(W)^T`` (naive NVFP4 rollout) |
| ``quads`` | ``[q(x), q(r_S)] [q(W), W_S]^T`` (W4A4 + RAC at a ratio) |

For a pair (trainer T, rollout R) and a linear whose trainer-side input is ``x``:

    y_R - y_T = x (W_R - W_T)^T  +  (A_R(x) - x) W_R^T
                 weight error       activation error

where ``A_R(x)`` is the activation the rollout's GEMM effectively sees. With the AQAT trainer the
weight term is exactly zero. The model-level gap compares per-token log-probs of the same tokens
under both sides: max and mean ``|logp_R - logp_T|`` (the paper's gap) and the k3 estimate of
``KL(pi_R || pi_T)``.

Precisions are applied to a model with forward hooks on its in-scope linears (any module whose
``weight`` is ``[N, K]`` and whose forward takes the input first: ``nn.Linear`` and Megatron's
parallel linears at TP = 1), so the same code measures the tiny Megatron MoE and other models.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from megatron_quads.nvfp4 import quantize
from megatron_quads.nvfp4.reblock import reblock_columns
from megatron_quads.precision import TRAINER_FAKE_QUANT, Precision
from megatron_quads.rollout.calibration import RacCalibrator
from megatron_quads.rollout.precision import LinearState, linear_output, replace_output
from megatron_quads.rollout.rac import ChannelStatistic


_W4A16 = Precision("w4a16")
"""``x q(W)^T``: the AQAT trainer's forward, and the weight-only rollout."""


class QuantAnalysis:
    """Runs a model under trainer and rollout precisions and measures the gap between them.

    ``modules`` are the in-scope linears by name. ``forward(model, tokens) -> logits [b, s, V]`` runs
    the model (the caller knows its signature).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        modules: Mapping[str, torch.nn.Module],
        forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    ) -> None:
        self.model = model
        self.modules = dict(modules)
        self.forward = forward
        self.states = {name: LinearState(quantize(m.weight.detach())) for name, m in self.modules.items()}

    def calibrate(self, tokens: torch.Tensor, ratios: list[float], statistic: ChannelStatistic) -> None:
        """Choose RAC channels for each ratio from the BF16 trainer's activations on ``tokens``."""
        in_features = {name: state.in_features for name, state in self.states.items()}
        calibrator = RacCalibrator(self.modules, in_features)
        try:
            with torch.no_grad():
                self.forward(self.model, tokens)
        finally:
            calibrator.detach()
        weights = {name: state.quantized for name, state in self.states.items()}
        for ratio in ratios:
            chosen = calibrator.select(ratio, statistic, weights)
            for name, state in self.states.items():
                channels = chosen.get(name, torch.zeros(0, dtype=torch.int32))
                state.channels[ratio] = channels
                state.residual[ratio] = reblock_columns(state.quantized, channels) if channels.numel() else None

    @contextlib.contextmanager
    def precision(self, precision: Precision) -> Iterator[None]:
        """Within the context, every in-scope linear computes under ``precision``."""
        handles = []
        if precision.quantized_rollout:
            for name, module in self.modules.items():
                state = self.states[name]

                def hook(mod, args, result, state=state):
                    return replace_output(result, linear_output(args[0], state, precision))

                handles.append(module.register_forward_hook(hook))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _output(self, x: torch.Tensor, name: str, precision: Precision) -> torch.Tensor:
        """In-scope linear ``name``'s output for ``x`` under ``precision`` (bf16: with its own weight)."""
        if not precision.quantized_rollout:
            weight = self.modules[name].weight.detach()
            return (x.float() @ weight.float().t()).to(x.dtype)
        return linear_output(x, self.states[name], precision)

    @torch.no_grad()
    def logprobs(self, tokens: torch.Tensor, precision: Precision) -> torch.Tensor:
        """fp32 log-probs ``[b, s-1]`` of ``tokens[:, 1:]`` under ``precision``."""
        with self.precision(precision):
            logits = self.forward(self.model, tokens).float()
        return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]

    @torch.no_grad()
    def layer_errors(self, tokens: torch.Tensor, trainer: Precision, rollout: Precision) -> dict[str, dict[str, float]]:
        """Per linear: ``||weight term||^2``, ``||activation term||^2`` and ``||y_T||^2`` on the trainer's inputs."""
        sums: dict[str, dict[str, float]] = {name: {"weight": 0.0, "activation": 0.0, "output": 0.0} for name in self.modules}
        handles = []
        for name, module in self.modules.items():

            def record(mod, args, result, name=name):
                x = args[0]
                y_t = self._output(x, name, trainer).double()
                w_r_only = self._output(x, name, _W4A16 if rollout.quantized_rollout else rollout).double()
                y_r = self._output(x, name, rollout).double()
                # x W_R^T - x W_T^T, then the rest: what the rollout's activation handling adds
                sums[name]["weight"] += float((w_r_only - y_t).square().sum())
                sums[name]["activation"] += float((y_r - w_r_only).square().sum())
                sums[name]["output"] += float(y_t.square().sum())
                return replace_output(result, y_t.to(x.dtype))

            handles.append(module.register_forward_hook(record))
        try:
            self.forward(self.model, tokens)
        finally:
            for handle in handles:
                handle.remove()
        return sums


def logprob_gap(logp_trainer: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    """Max and mean ``|logp_R - logp_T|`` and the k3 estimate of ``KL(pi_R || pi_T)`` over tokens."""
    delta = (logp_rollout - logp_trainer).double()
    if mask is not None:
        delta = delta[mask.bool()]
    log_ratio = -delta  # log(pi_T / pi_R) on tokens sampled from the rollout side
    k3 = (log_ratio.exp() - 1 - log_ratio).mean()
    return {"max_abs": float(delta.abs().max()), "mean_abs": float(delta.abs().mean()), "k3_kl": float(k3)}


def default_pairs(ratios: list[float]) -> list[tuple[Precision, Precision]]:
    """The analysis's pairs: naive, weight-only, AQAT + W4A4, and QUADS at each RAC ratio."""
    bf16 = Precision("bf16")
    pairs = [(bf16, Precision("w4a4")), (bf16, _W4A16), (_W4A16, Precision("w4a4"))]
    return pairs + [(_W4A16, Precision("quads", r)) for r in ratios]


def pair_label(trainer: Precision, rollout: Precision) -> str:
    """``trainer vs rollout``; the trainer's ``x q(W)^T`` forward is named ``aqat``."""
    trainer_name = TRAINER_FAKE_QUANT if trainer.kind == "w4a16" else trainer.label
    return f"{trainer_name} vs {rollout.label}"


@dataclass
class PairResult:
    """The gap of one (trainer, rollout) pair: model-level log-prob gaps and per-layer error terms."""

    label: str
    gap: dict[str, float]
    layers: dict[str, dict[str, float]]


def group_by_layer(sums: dict[str, dict[str, float]], layer_of: Callable[[str], str]) -> dict[str, dict[str, float]]:
    """Relative weight / activation error (``sqrt(term / output)``) per layer, summed over its linears."""
    grouped: dict[str, dict[str, float]] = {}
    for name, terms in sums.items():
        acc = grouped.setdefault(layer_of(name), {"weight": 0.0, "activation": 0.0, "output": 0.0})
        for key, value in terms.items():
            acc[key] += value
    return {
        layer: {
            "weight_rel": (t["weight"] / t["output"]) ** 0.5 if t["output"] else 0.0,
            "activation_rel": (t["activation"] / t["output"]) ** 0.5 if t["output"] else 0.0,
        }
        for layer, t in grouped.items()
    }


def run_pairs(
    analysis: QuantAnalysis,
    tokens: torch.Tensor,
    pairs: list[tuple[Precision, Precision]],
    layer_of: Callable[[str], str],
) -> list[PairResult]:
    """Measure every pair on ``tokens`` (RAC channels must be calibrated for the quads ratios)."""
    results = []
    cache: dict[str, torch.Tensor] = {}
    for trainer, rollout in pairs:
        for p in (trainer, rollout):
            if p.label not in cache:
                cache[p.label] = analysis.logprobs(tokens, p)
        layers = group_by_layer(analysis.layer_errors(tokens, trainer, rollout), layer_of)
        gap = logprob_gap(cache[trainer.label], cache[rollout.label])
        results.append(PairResult(pair_label(trainer, rollout), gap, layers))
    return results
