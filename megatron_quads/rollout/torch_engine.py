"""The built-in rollout engine: a Qwen3-MoE decoder in PyTorch with NVFP4 (+RAC) routed experts.

The network is transformers' ``Qwen3MoeForCausalLM`` (checked against the Megatron trainer in
tests/test_hf_export.py), with its fused experts split per expert (:mod:`.hf_experts`) so each
expert linear computes under the engine's precision (:mod:`.precision`). Generation is batched with
left padding and a KV cache; sampling (temperature, top-p) draws from a seeded CPU generator, so a
seed reproduces the same tokens on any device. It runs on CPU and GPU.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping, Sequence

import torch

from megatron_quads.nvfp4 import NVFP4Tensor, quantize
from megatron_quads.rollout.calibration import RacCalibrator
from megatron_quads.rollout.engine import ENGINE_PRECISIONS, Generation, SamplingParams
from megatron_quads.rollout.grouped_experts import GroupedExperts
from megatron_quads.rollout.hf_experts import split_experts
from megatron_quads.rollout.precision import (
    LinearState,
    Precision,
    linear_output,
    replace_output,
)
from megatron_quads.rollout.rac import DEFAULT_RATIO, ChannelStatistic, reblock_columns
from megatron_quads.rollout.weights import QuantizedModelWeights

_CKPT_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$")
_ENGINE_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up|down)\.(\d+)$")
_PRECISION_KIND = {"bf16": "bf16", "w4a16": "aqat", "w4a4": "w4a4", "quads": "quads"}


def _concat_nvfp4(parts: list[NVFP4Tensor]) -> NVFP4Tensor:
    """Row-wise concatenation of NVFP4 weights that share one ``weight_scale_2`` (gate and up)."""
    if any(not torch.equal(p.weight_scale_2, parts[0].weight_scale_2) for p in parts):
        raise ValueError("gate_proj and up_proj must share weight_scale_2 to be fused (quantize them with one amax)")
    return NVFP4Tensor(
        codes=torch.cat([p.codes for p in parts]),
        scales=torch.cat([p.scales for p in parts]),
        weight_scale_2=parts[0].weight_scale_2,
        shape=torch.Size((sum(p.shape[0] for p in parts), parts[0].shape[1])),
        dtype=parts[0].dtype,
    )


class TorchRolloutEngine:
    """Built-in rollout engine (see module docstring). ``config`` is a transformers Qwen3MoeConfig."""

    def __init__(self, config, precision: str = "quads", ratio: float = DEFAULT_RATIO,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16, grouped: bool = True) -> None:
        from transformers import Qwen3MoeForCausalLM

        if precision not in ENGINE_PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; the built-in engine serves {ENGINE_PRECISIONS}")
        self.precision = precision
        self.ratio = ratio
        self.grouped = grouped  # grouped NVFP4 expert GEMMs per layer; False: the per-expert loop with hooks
        self.device = torch.device(device)
        self.dtype = dtype
        self.weight_version = -1
        self.model = Qwen3MoeForCausalLM(config).to(dtype=dtype, device=self.device).eval()
        split_experts(self.model)
        self.experts = {name: m for name, m in self.model.named_modules() if _ENGINE_EXPERT.match(name)}
        self.states: dict[str, LinearState] = {}
        self._hooks = []
        self._grouped_layers: list[torch.nn.Module] = []
        # transformers 5 renamed the KV-cache argument from past_key_values to cache
        self._cache_arg = "cache" if "cache" in inspect.signature(type(self.model).forward).parameters else "past_key_values"

    def to_device(self, device: str | torch.device) -> None:
        """Move the model and every linear's quantized state to ``device`` (colocated sleep / wake).

        Grouped layers move their stacks (the experts' states view them); the other states move one
        by one, mutated in place because the forward hooks hold these objects."""
        device = torch.device(device)
        self.model.to(device)
        grouped = set()
        for layer in self._grouped_layers:
            layer.grouped.to(device)
            grouped.update(id(state) for state in layer.grouped.states)
        for state in self.states.values():
            state.weight = state.weight.to(device)
            state.channels = {r: c.to(device) for r, c in state.channels.items()}
            if id(state) not in grouped:
                state.quantized = state.quantized.to(device)
                state.residual = {r: None if w is None else w.to(device) for r, w in state.residual.items()}
        self.device = device

    # ------------------------------------------------------------------ weights
    def _engine_name(self, module: str) -> tuple[str, str] | None:
        """Checkpoint expert module name -> (engine module name, 'gate'|'up'|'down')."""
        match = _CKPT_EXPERT.match(module)
        if not match:
            return None
        base, expert, proj = match.groups()
        kind = "down" if proj == "down_proj" else "gate_up"
        return f"{base}.{kind}.{expert}", proj

    def load_weights(self, weights: Mapping[str, torch.Tensor] | QuantizedModelWeights, version: int) -> None:
        """Load BF16 tensors by HF name, or a QuantizedModelWeights (NVFP4 experts, RAC channels)."""
        if isinstance(weights, QuantizedModelWeights):
            dense, quantized = dict(weights.unquantized), weights.quantized
        else:
            dense, quantized = dict(weights), {}
        state: dict[str, torch.Tensor] = {}
        gate_up: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in dense.items():
            mapped = self._engine_name(name.removesuffix(".weight")) if name.endswith(".weight") else None
            if mapped is None:
                state[name] = tensor
            elif mapped[1] == "down_proj":
                state[f"{mapped[0]}.weight"] = tensor
            else:
                gate_up.setdefault(mapped[0], {})[mapped[1]] = tensor
        for module, parts in gate_up.items():
            state[f"{module}.weight"] = torch.cat([parts["gate_proj"], parts["up_proj"]])
        q_parts: dict[str, dict[str, object]] = {}
        for module, lin in quantized.items():
            mapped = self._engine_name(module)
            if mapped is None:
                raise ValueError(f"the built-in engine quantizes routed experts only; got quantized module {module!r}")
            q_parts.setdefault(mapped[0], {})[mapped[1]] = lin
            state[f"{mapped[0]}.weight"] = None  # filled from the quantized weight below
        self.states = {}
        for module, parts in q_parts.items():
            order = ["down_proj"] if "down_proj" in parts else ["gate_proj", "up_proj"]
            lins = [parts[p] for p in order]
            nvfp4 = _concat_nvfp4([lin.to_nvfp4(self.dtype) for lin in lins]).to(self.device)
            channels = lins[0].residual_channels
            if any(not torch.equal(lin.residual_channels, channels) for lin in lins):
                raise ValueError(f"{module}: gate_proj and up_proj read the same input, so they need the same residual channels")
            residual = _concat_nvfp4([lin.residual_to_nvfp4(self.dtype) for lin in lins]).to(self.device) if channels.numel() else None
            dense_w = nvfp4.dequantize(self.dtype)
            state[f"{module}.weight"] = dense_w
            self.states[module] = LinearState(weight=dense_w, quantized=nvfp4, channels={self.ratio: channels}, residual={self.ratio: residual})
        missing, unexpected = self.model.load_state_dict({k: v for k, v in state.items() if v is not None}, strict=False)
        missing = [m for m in missing if not m.endswith("rotary_emb.inv_freq")]
        if missing or unexpected:
            raise ValueError(f"weights do not fit the engine's model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        if not quantized and self.precision != "bf16":  # BF16 weights, NVFP4 mode: quantize the experts here (gate and up fused: one amax)
            for name, module in self.experts.items():
                w = module.weight.detach()
                self.states[name] = LinearState(weight=w, quantized=quantize(w))
        self.weight_version = version
        self._install_hooks()

    def calibrate(self, prompts: Sequence[Sequence[int]], statistic: ChannelStatistic = ChannelStatistic.OUTPUT_ERROR) -> None:
        """Choose RAC channels from the engine's own activations on ``prompts`` (quads mode)."""
        if self.precision != "quads":
            raise ValueError(f"RAC calibration is for the quads precision; this engine serves {self.precision!r}")
        self._remove_hooks()  # calibrate on the unquantized forward's inputs, like the analysis
        calibrator = RacCalibrator(self.experts, {n: s.weight.shape[-1] for n, s in self.states.items()})
        try:
            with torch.no_grad():
                self.model(**self._batch(prompts))
        finally:
            calibrator.detach()
        # an expert nothing was routed to takes the channels of its layer's pooled statistics (same
        # projection), so every expert of a layer has the same channel count and the layer can be grouped
        pools = {name: ".".join(_ENGINE_EXPERT.match(name).groups()[:2]) for name in self.states}
        chosen = calibrator.select(self.ratio, statistic, {n: s.quantized for n, s in self.states.items()}, pools)
        for name, state in self.states.items():
            channels = chosen.get(name, torch.zeros(0, dtype=torch.int32))
            state.channels[self.ratio] = channels
            state.residual[self.ratio] = reblock_columns(state.quantized, channels) if channels.numel() else None
        self._install_hooks()

    def _install_hooks(self) -> None:
        """Apply the engine's precision to the routed experts: each MoE layer gets a grouped forward
        (:mod:`.grouped_experts`: one grouped NVFP4 call per projection); a layer whose experts cannot
        be grouped (RAC channel counts that differ) keeps the per-expert loop with output hooks."""
        self._remove_hooks()
        if self.precision == "bf16" or not self.states:
            return
        precision = Precision(_PRECISION_KIND[self.precision], self.ratio if self.precision == "quads" else 0.0)
        layers: dict[str, dict[str, dict[int, str]]] = {}
        for name in self.experts:
            base, kind, expert = _ENGINE_EXPERT.match(name).groups()
            layers.setdefault(base, {}).setdefault(kind, {})[int(expert)] = name
        for base, kinds in layers.items():
            names = {kind: [by_expert[e] for e in sorted(by_expert)] for kind, by_expert in kinds.items()}
            for name in names["gate_up"] + names["down"]:
                state = self.states[name]
                if precision.kind == "quads" and self.ratio not in state.channels:
                    state.channels[self.ratio] = torch.zeros(0, dtype=torch.int32, device=state.quantized.codes.device)  # until calibrated: plain W4A4
            layer = self.model.get_submodule(base)
            grouped = None
            if self.grouped:
                grouped = GroupedExperts.from_states([self.states[n] for n in names["gate_up"]],
                                                     [self.states[n] for n in names["down"]], precision)
            if grouped is not None:
                layer.grouped = grouped
                self._grouped_layers.append(layer)
                continue
            for name in names["gate_up"] + names["down"]:

                def hook(mod, args, result, state=self.states[name]):
                    return replace_output(result, linear_output(args[0], state, precision))

                self._hooks.append(self.experts[name].register_forward_hook(hook))

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for layer in self._grouped_layers:
            layer.grouped = None
        self._grouped_layers = []

    # ------------------------------------------------------------------ generation
    def _batch(self, prompts: Sequence[Sequence[int]], pad_id: int = 0) -> dict[str, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every prompt ends at the last column
            ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            mask[i, width - len(p):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device), "position_ids": positions.to(self.device)}

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """Continue every prompt (see :class:`Generation` for the log-prob convention)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt and no empty prompt")
        if self.weight_version < 0:
            raise RuntimeError("no weights loaded: call load_weights first")
        gen = torch.Generator().manual_seed(params.seed)
        batch = self._batch(prompts)
        mask, positions = batch["attention_mask"], batch["position_ids"]
        out = self.model(**batch, use_cache=True)
        results = [Generation(prompt_ids=list(p)) for p in prompts]
        done = torch.zeros(len(prompts), dtype=torch.bool)
        stop = torch.tensor(params.stop_token_ids, dtype=torch.long)
        for _ in range(params.max_new_tokens):
            logits = out.logits[:, -1].float().cpu()
            temperature = params.temperature if params.temperature > 0 else 1.0
            logp = torch.log_softmax(logits / temperature, dim=-1)
            token = logp.argmax(-1) if params.temperature == 0 else _sample_top_p(logp, params.top_p, gen)
            token_logp = logp.gather(-1, token[:, None])[:, 0]
            for i in torch.nonzero(~done).flatten().tolist():
                results[i].token_ids.append(int(token[i]))
                results[i].logprobs.append(float(token_logp[i]))
            finished = torch.isin(token, stop) & ~done
            for i in torch.nonzero(finished).flatten().tolist():
                results[i].finish_reason = "stop"
            done |= finished
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            positions = positions[:, -1:] + 1
            cache = getattr(out, "cache", None) or out.past_key_values
            out = self.model(input_ids=token[:, None].to(self.device), attention_mask=mask, position_ids=positions,
                             use_cache=True, **{self._cache_arg: cache})
        return results


def _sample_top_p(logp: torch.Tensor, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """Sample from the smallest set of tokens whose probability reaches ``top_p`` (nucleus sampling)."""
    probs = logp.exp()
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        sorted_probs = torch.where(before < top_p, sorted_probs, torch.zeros_like(sorted_probs))
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=gen)[:, 0]
