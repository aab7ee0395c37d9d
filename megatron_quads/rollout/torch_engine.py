"""The built-in rollout engine: a Qwen3-MoE decoder in PyTorch with NVFP4 (+RAC) routed experts.

The network is transformers' ``Qwen3MoeForCausalLM`` (checked against the Megatron trainer in
tests/test_hf_export.py), with its fused experts split per expert (:mod:`.hf_experts`). In the bf16
mode the expert linears are ``nn.Linear``; in an NVFP4 mode each is a
:class:`~megatron_quads.rollout.precision.QuantizedLinear` that holds the expert's NVFP4 weight (and
RAC tail) only and computes under the engine's precision (:mod:`.precision`), and each MoE layer
whose experts stack runs grouped (:mod:`.grouped_experts`). Weights are prepared when they arrive
or move (:meth:`TorchRolloutEngine.load_weights`, ``calibrate``, ``to_device``: quantized experts,
grouped stacks, the kernels' tail layout), never in a forward. Generation is batched with left
padding and a KV cache; sampling (temperature, top-p) draws from a seeded CPU generator, so a seed
reproduces the same tokens on any device. It runs on CPU and GPU.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping, Sequence

import torch

from megatron_quads.nvfp4 import NVFP4Tensor, quantize
from megatron_quads.nvfp4.reblock import reblock_columns
from megatron_quads.precision import Precision
from megatron_quads.rollout.calibration import ChannelStats, RacCalibrator
from megatron_quads.rollout.engine import Generation, SamplingParams
from megatron_quads.rollout.grouped_experts import GroupedExperts, GroupedProjection
from megatron_quads.rollout.hf_experts import split_experts
from megatron_quads.rollout.model_weights import QuantizedModelWeights
from megatron_quads.rollout.precision import LinearState, QuantizedLinear
from megatron_quads.rollout.rac import DEFAULT_RATIO, ChannelStatistic
from megatron_quads.rollout.routing import RoutingRecorder, SequenceRouting, recording

_CKPT_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$")
_ENGINE_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up|down)\.(\d+)$")
_CALIBRATION = Precision("w4a16")
"""What the expert linears compute while calibration records their inputs: W4A16 (``x q(W)^T``)."""


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
    """Built-in rollout engine (see module docstring). ``config`` is a transformers Qwen3MoeConfig;
    ``precision``: the run's precision (its rollout kind and RAC ratio are what the engine computes)."""

    def __init__(self, config, precision: Precision = Precision("quads", DEFAULT_RATIO),
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16, grouped: bool = True) -> None:
        from transformers import Qwen3MoeForCausalLM

        if not isinstance(precision, Precision):
            raise TypeError(f"precision must be a megatron_quads.precision.Precision, got {precision!r}")
        self.precision = precision
        self.grouped = grouped  # grouped NVFP4 expert GEMMs per layer; False: every layer expert by expert
        self.device = torch.device(device)
        self.dtype = dtype
        self.weight_version = -1
        self._expert_precision = precision.rollout() if precision.quantized_rollout else None
        """What the expert linears compute in an NVFP4 mode (``None``: bf16, ``nn.Linear`` experts)."""
        model = Qwen3MoeForCausalLM(config)
        # split before the move: in an NVFP4 mode the dense expert weights never reach the device
        split_experts(model, None if self._expert_precision is None else self._quantized_linear)
        self.model = model.to(dtype=dtype, device=self.device).eval()
        self.experts = {name: m for name, m in self.model.named_modules() if _ENGINE_EXPERT.match(name)}
        self.states: dict[str, LinearState] = {}
        self._grouped_layers: list[torch.nn.Module] = []
        self._layer_stacks: dict[str, dict[str, tuple]] = {}  # the stacks the last weights arrived in, by layer
        # transformers 5 renamed the KV-cache argument from past_key_values to cache
        self._cache_arg = "cache" if "cache" in inspect.signature(type(self.model).forward).parameters else "past_key_values"

    @property
    def ratio(self) -> float:
        """The RAC ratio (0 unless quads): the key of the experts' channel sets."""
        return self.precision.ratio

    def _quantized_linear(self, kind: str, expert: int, in_features: int, out_features: int) -> QuantizedLinear:
        """An expert linear of an NVFP4 mode; its state comes with the weights."""
        return QuantizedLinear(self._expert_precision)

    def to_device(self, device: str | torch.device) -> None:
        """Move the model and every expert's NVFP4 weights to ``device`` (colocated sleep / wake),
        the grouped layers' tails prepared for it.

        Grouped layers move their stacks (the experts' states view them); the other states move one
        by one, mutated in place because their expert modules hold these objects."""
        device = torch.device(device)
        self.model.to(device)
        grouped = set()
        for layer in self._grouped_layers:
            layer.grouped.to(device)
            grouped.update(id(state) for state in layer.grouped.states)
        for state in self.states.values():
            if id(state) not in grouped:
                state.quantized = state.quantized.to(device)
                state.channels = {r: c.to(device) for r, c in state.channels.items()}
                state.residual = {r: None if w is None else w.to(device) for r, w in state.residual.items()}
        self.device = device

    def expert_weight_bytes(self) -> int:
        """Bytes of every distinct storage the engine holds for its routed experts: the expert
        modules' parameters and buffers, the experts' NVFP4 states (codes, scales, decode scales,
        RAC channels and tails) and the grouped layers' stacks, each storage counted once."""
        tensors: list[torch.Tensor] = []
        for module in self.experts.values():
            tensors += [*module.parameters(), *module.buffers()]
        projections = [p for layer in self._grouped_layers for p in (layer.grouped.gate_up, layer.grouped.down)]
        for holder in [*self.states.values(), *projections]:
            for value in vars(holder).values():
                for item in value.values() if isinstance(value, dict) else [value]:
                    if isinstance(item, NVFP4Tensor):
                        tensors += [t for t in vars(item).values() if isinstance(t, torch.Tensor)]
                    elif isinstance(item, torch.Tensor):
                        tensors.append(item)
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())

    # ------------------------------------------------------------------ weights
    def _engine_name(self, module: str) -> tuple[str, str] | None:
        """Checkpoint expert module name -> (engine module name, 'gate_proj'|'up_proj'|'down_proj')."""
        match = _CKPT_EXPERT.match(module)
        if not match:
            return None
        base, expert, proj = match.groups()
        kind = "down" if proj == "down_proj" else "gate_up"
        return f"{base}.{kind}.{expert}", proj

    def load_weights(self, weights: Mapping[str, torch.Tensor] | QuantizedModelWeights, version: int) -> None:
        """Load BF16 tensors by HF name, or a QuantizedModelWeights (NVFP4 experts, RAC channels),
        and prepare them: in an NVFP4 mode every expert is held as NVFP4 only (BF16 experts are
        quantized here, gate and up fused with one amax) and the grouped layers are built; in the
        bf16 mode the experts are ``nn.Linear`` weights (NVFP4 ones dequantized)."""
        stacked = self._expert_precision is not None and isinstance(weights, QuantizedModelWeights) and bool(
            weights.expert_stacks)
        if isinstance(weights, QuantizedModelWeights):
            dense, quantized = dict(weights.unquantized), ({} if stacked else weights.quantized)
        else:
            dense, quantized = dict(weights), {}
        state: dict[str, torch.Tensor] = {}
        dense_experts: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in dense.items():
            mapped = self._engine_name(name.removesuffix(".weight")) if name.endswith(".weight") else None
            if mapped is None:
                state[name] = tensor
            else:
                dense_experts.setdefault(mapped[0], {})[mapped[1]] = tensor
        q_parts: dict[str, dict[str, object]] = {}
        for module, lin in quantized.items():
            mapped = self._engine_name(module)
            if mapped is None:
                raise ValueError(f"the built-in engine quantizes routed experts only; got quantized module {module!r}")
            q_parts.setdefault(mapped[0], {})[mapped[1]] = lin
        states: dict[str, LinearState] = {}
        self._layer_stacks = self._stacked_states(weights.expert_stacks, states) if stacked else {}
        for module, parts in dense_experts.items():
            w = parts["down_proj"] if "down_proj" in parts else torch.cat([parts["gate_proj"], parts["up_proj"]])
            if self._expert_precision is None:
                state[f"{module}.weight"] = w
            else:  # one amax for gate and up, the engine's dtype and device: the NVFP4 weight the trainer's export makes
                states[module] = LinearState(quantize(w.to(device=self.device, dtype=self.dtype)))
        for module, parts in q_parts.items():
            order = ["down_proj"] if "down_proj" in parts else ["gate_proj", "up_proj"]
            lins = [parts[p] for p in order]
            nvfp4 = _concat_nvfp4([lin.to_nvfp4(self.dtype) for lin in lins]).to(self.device)
            if self._expert_precision is None:
                state[f"{module}.weight"] = nvfp4.dequantize(self.dtype)
                continue
            states[module] = LinearState(nvfp4)
            if not self.precision.uses_rac:
                continue  # the RAC tail is for quads only
            channels = lins[0].residual_channels
            if any(not torch.equal(lin.residual_channels, channels) for lin in lins):
                raise ValueError(f"{module}: gate_proj and up_proj read the same input, so they need the same residual channels")
            residual = (_concat_nvfp4([lin.residual_to_nvfp4(self.dtype) for lin in lins]).to(self.device)
                        if channels.numel() else None)
            states[module].channels[self.ratio] = channels.to(self.device)
            states[module].residual[self.ratio] = residual
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.endswith("rotary_emb.inv_freq")]
        if self._expert_precision is not None:
            missing += sorted(set(self.experts) - set(states))
            unexpected += sorted(set(states) - set(self.experts))
        if missing or unexpected:
            raise ValueError(f"weights do not fit the engine's model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.states = states
        for name, linear_state in states.items():
            self.experts[name].state = linear_state
        self.weight_version = version
        self._prepare_experts()

    def _stacked_states(self, stacks: Mapping[str, object], states: dict[str, LinearState]) -> dict:
        """Per-expert states of each layer's arrived stacks (moved to the engine's device and dtype
        once per stack, not per expert); returns the stacks by engine layer and projection kind for
        :meth:`_prepare_experts`, whose grouped projections point each state at its expert's slice
        (until then a state holds the whole stack)."""
        layers: dict[str, dict[str, tuple]] = {}
        for key, stack in stacks.items():
            base, projection = key.rsplit(".", 1)
            kind = "down" if projection == "down_proj" else "gate_up"
            n, rows = stack.num_experts, stack.weight.shape[1]
            ws2 = stack.weight_scale_2.to(self.device)
            weight = NVFP4Tensor(stack.weight.to(self.device), stack.weight_scale.to(self.device), ws2,
                                 torch.Size((n, rows, 2 * stack.weight.shape[2])), self.dtype)
            channels = residual = None
            width = stack.residual_channels.shape[1]
            if self.precision.uses_rac and width:
                channels = stack.residual_channels.to(self.device)
                residual = NVFP4Tensor(stack.residual_weight.to(self.device), stack.residual_weight_scale.to(self.device),
                                       ws2, torch.Size((n, rows, width)), self.dtype)
            names = [f"{base}.{kind}.{e}" for e in range(n)]
            states.update((name, LinearState(weight)) for name in names)
            layers.setdefault(base, {})[kind] = (weight, channels, residual, names)
        return layers

    def calibrate(self, prompts: Sequence[Sequence[int]],
                  statistic: ChannelStatistic = ChannelStatistic.OUTPUT_ERROR) -> dict[str, ChannelStats]:
        """Choose RAC channels from the experts' inputs on ``prompts`` (quads mode) and prepare the
        grouped layers' tails for them; returns the recorded statistics by engine module name.

        The forward that records the inputs is the W4A16 one over the NVFP4 weights the engine holds
        (every expert linear computes ``x q(W)^T``, expert by expert, without RAC: the AQAT trainer's
        forward), over prompts batched by length so no padding token is recorded; channels are then
        scored with the quantized weights."""
        if not self.precision.uses_rac:
            raise ValueError(f"RAC calibration is for the quads precision; this engine serves {self.precision}")
        if self.weight_version < 0:
            raise RuntimeError("no weights loaded: call load_weights first")
        self._ungroup()
        self._layer_stacks = {}  # new channels: the layers are grouped from the states again
        for module in self.experts.values():
            module.precision = _CALIBRATION
        try:
            calibrator = RacCalibrator(self.experts, {n: s.in_features for n, s in self.states.items()})
            try:
                with torch.no_grad():
                    for group in _by_length(prompts):  # no padding: only the prompts' own tokens are recorded
                        self.model(**self._batch(group))
            finally:
                calibrator.detach()
            # an expert nothing was routed to takes the channels of its layer's pooled statistics (same
            # projection), so every expert of a layer has the same channel count and the layer can be grouped
            pools = {name: ".".join(_ENGINE_EXPERT.match(name).groups()[:2]) for name in self.states}
            chosen = calibrator.select(self.ratio, statistic, {n: s.quantized for n, s in self.states.items()}, pools)
            for name, state in self.states.items():
                channels = chosen.get(name, torch.zeros(0, dtype=torch.int32)).to(state.quantized.codes.device)
                state.channels[self.ratio] = channels
                state.residual[self.ratio] = reblock_columns(state.quantized, channels) if channels.numel() else None
        finally:
            self._prepare_experts()
        return calibrator.stats

    def residual_channels(self) -> dict[str, torch.Tensor]:
        """The RAC channel set (CPU int32) of every quantized expert linear at the engine's ratio, by
        checkpoint module name: an expert's ``gate_proj`` and ``up_proj`` get their fused linear's set."""
        if not self.precision.uses_rac:
            raise ValueError(f"RAC channels are held in the quads precision; this engine serves {self.precision}")
        return {module: state.channels[self.ratio].cpu()
                for name, state in self.states.items() for module in checkpoint_modules(name)}

    def _prepare_experts(self) -> None:
        """Set every expert linear to the engine's precision and build each MoE layer's grouped
        projections from the experts' states (:mod:`.grouped_experts`: stacks and tails prepared for
        the device, one grouped NVFP4 call per projection); a layer whose experts cannot be grouped
        (RAC channel counts that differ) computes expert by expert."""
        self._ungroup()
        if self._expert_precision is None or not self.states:
            return
        precision = self._expert_precision
        layers: dict[str, dict[str, dict[int, str]]] = {}
        for name, module in self.experts.items():
            module.precision = precision
            base, kind, expert = _ENGINE_EXPERT.match(name).groups()
            layers.setdefault(base, {}).setdefault(kind, {})[int(expert)] = name
        for base, kinds in layers.items():
            if base in self._layer_stacks:  # the projections point the states at the stacks they arrived in
                grouped = self._grouped_from_stacks(self._layer_stacks[base], precision)
            else:
                names = {kind: [by_expert[e] for e in sorted(by_expert)] for kind, by_expert in kinds.items()}
                for name in names["gate_up"] + names["down"]:
                    state = self.states[name]
                    if precision.uses_rac and self.ratio not in state.channels:
                        state.channels[self.ratio] = torch.zeros(0, dtype=torch.int32, device=state.quantized.codes.device)  # until calibrated: plain W4A4
                        state.residual[self.ratio] = None
                if not self.grouped:
                    continue
                grouped = GroupedExperts.from_states([self.states[n] for n in names["gate_up"]],
                                                     [self.states[n] for n in names["down"]], precision)
            if grouped is not None and self.grouped:
                layer = self.model.get_submodule(base)
                layer.grouped = grouped
                self._grouped_layers.append(layer)

    def _grouped_from_stacks(self, stacks: dict[str, tuple], precision: Precision) -> GroupedExperts:
        """A layer's grouped projections over the stacks its weights arrived in (no re-stacking)."""
        projections = {}
        for kind, (weight, channels, residual, names) in stacks.items():
            projection = GroupedProjection(precision, weight, channels, residual, [self.states[n] for n in names])
            projection.prepare()
            projections[kind] = projection
        return GroupedExperts(projections["gate_up"], projections["down"])

    def _ungroup(self) -> None:
        """Every MoE layer back to its per-expert loop (the states keep viewing the stacks they had)."""
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
        """Continue every prompt (see :class:`Generation` for the log-prob convention and, with
        ``params.return_routed_experts``, the routing recorded for every fed token)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt and no empty prompt")
        if self.weight_version < 0:
            raise RuntimeError("no weights loaded: call load_weights first")
        if not params.return_routed_experts:
            return self._generate(prompts, params, None)
        with recording(self.model) as recorder:
            return self._generate(prompts, params, recorder)

    def _generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                  recorder: RoutingRecorder | None) -> list[Generation]:
        gen = torch.Generator().manual_seed(params.seed)
        batch = self._batch(prompts)
        mask, positions = batch["attention_mask"], batch["position_ids"]
        out = self.model(**batch, use_cache=True)
        routing = None
        if recorder is not None:
            prefill = recorder.take()
            routing = SequenceRouting([len(p) for p in prompts], params.max_new_tokens, *prefill.shape[1:])
            routing.add_prefill(prefill, mask.shape[1])
        results = [Generation(prompt_ids=list(p)) for p in prompts]
        done = torch.zeros(len(prompts), dtype=torch.bool)
        stop = torch.tensor(params.stop_token_ids, dtype=torch.long)
        for step in range(params.max_new_tokens):
            logits = out.logits[:, -1].float().cpu()
            logp = torch.log_softmax(logits / params.logprob_temperature, dim=-1)
            token = logp.argmax(-1) if params.temperature == 0 else _sample_top_p(logp, params.top_p, gen)
            token_logp = logp.gather(-1, token[:, None])[:, 0]
            for i in torch.nonzero(~done).flatten().tolist():
                results[i].token_ids.append(int(token[i]))
                results[i].logprobs.append(float(token_logp[i]))
            finished = torch.isin(token, stop) & ~done
            for i in torch.nonzero(finished).flatten().tolist():
                results[i].finish_reason = "stop"
            done |= finished
            if bool(done.all()) or step == params.max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            positions = positions[:, -1:] + 1
            cache = getattr(out, "cache", None) or out.past_key_values
            out = self.model(input_ids=token[:, None].to(self.device), attention_mask=mask, position_ids=positions,
                             use_cache=True, **{self._cache_arg: cache})
            if routing is not None:
                routing.add_decode(recorder.take(), step, torch.nonzero(~done).flatten().tolist())
        if routing is not None:
            for i, result in enumerate(results):
                result.routed_experts = routing.result(i, len(result.token_ids))
        return results


def checkpoint_modules(engine_module: str) -> list[str]:
    """The checkpoint modules an engine expert linear holds: ``...experts.gate_up.E`` ->
    ``[...experts.E.gate_proj, ...experts.E.up_proj]``, ``...experts.down.E`` -> ``[...experts.E.down_proj]``."""
    match = _ENGINE_EXPERT.match(engine_module)
    if match is None:
        raise ValueError(f"{engine_module!r} is not an expert linear of the built-in engine (model.layers.N.mlp.experts.KIND.E)")
    base, kind, expert = match.groups()
    return [f"{base}.{expert}.{proj}" for proj in (("gate_proj", "up_proj") if kind == "gate_up" else ("down_proj",))]


def _by_length(prompts: Sequence[Sequence[int]]) -> list[list[Sequence[int]]]:
    """The prompts grouped by length (first-seen order), so each group batches without padding."""
    groups: dict[int, list[Sequence[int]]] = {}
    for prompt in prompts:
        groups.setdefault(len(prompt), []).append(prompt)
    return list(groups.values())


def _sample_top_p(logp: torch.Tensor, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """Sample from the smallest set of tokens whose probability reaches ``top_p`` (nucleus sampling)."""
    probs = logp.exp()
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        sorted_probs = torch.where(before < top_p, sorted_probs, torch.zeros_like(sorted_probs))
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=gen)[:, 0]
