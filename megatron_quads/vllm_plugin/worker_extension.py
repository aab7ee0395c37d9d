"""Calls that run inside vLLM's workers, for the rollout engine (``LLM(worker_extension_cls=...)``).

vLLM mixes :class:`QuadsWorkerExtension` into its worker class; ``llm.collective_rpc("quads_...")``
runs a method on every worker and returns their results. Arguments are plain Python values, and
tensors only where the engine runs in-process (vLLM's RPC cannot pickle tensors between processes).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from megatron_quads.rollout.rac import ChannelStatistic


class QuadsWorkerExtension:
    """Methods added to vLLM's worker (``self`` is the worker: ``self.model_runner`` holds the model)."""

    def _quads_layers(self) -> list[tuple[str, torch.nn.Module]]:
        """The model's modules computed by a QUADS method that can calibrate (MoE or linear)."""
        model = self.model_runner.get_model()
        return [(name, module) for name, module in model.named_modules()
                if hasattr(getattr(module, "quant_method", None), "begin_calibration")]

    def quads_update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load checkpoint-named tensors into the model in place through vLLM's layer-wise reload
        (every layer processed again, results copied into the parameters' storage); returns the count."""
        from vllm.config import set_current_vllm_config

        tensors = list(named_tensors)
        # vLLM 0.32's Worker.reload_weights sets the config context, 0.26's does not: set it here for both
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.reload_weights(weights_iterator=iter(tensors))
        model = self.model_runner.get_model()
        for module in model.modules():  # the reload processed temporary copies: derive from the parameters again
            if hasattr(getattr(module, "quant_method", None), "prepare"):
                module.quant_method.prepare(module)
        repack_unquantized_cpu_experts(model)
        return len(tensors)

    def quads_update_weights_from_file(self, path: str) -> int:
        """:meth:`quads_update_weights` of the tensors in one safetensors file (workers in other processes)."""
        from safetensors.torch import load_file

        return self.quads_update_weights(load_file(path).items())

    def quads_seed_sampler(self, seed: int) -> None:
        """Seed the generators vLLM's sampler draws from for requests without a seed of their own
        (the CPU's and every CUDA device's default generator of this worker's process), so that the
        next generation is reproducible with vLLM's batched sampling: one noise draw per step for
        the whole batch, where requests with their own seeds get one draw each, in a Python loop."""
        torch.manual_seed(seed)

    def quads_begin_calibration(self) -> int:
        """Start recording every QUADS layer's inputs; returns the number of layers."""
        layers = self._quads_layers()
        for _, module in layers:
            module.quant_method.begin_calibration(module)
        return len(layers)

    def quads_finish_calibration(self, statistic: str = ChannelStatistic.OUTPUT_ERROR.value) -> int:
        """Choose and write every layer's RAC channels from what was recorded; returns tokens seen."""
        return sum(module.quant_method.finish_calibration(module, ChannelStatistic(statistic))
                   for _, module in self._quads_layers())

    def quads_abandon_calibration(self) -> int:
        """Every QUADS layer stops recording calibration inputs and keeps the channels it has (after a
        calibration prefill that failed: nothing is chosen); returns the number of layers."""
        layers = self._quads_layers()
        for _, module in layers:
            module.quads_calibration = None
        return len(layers)

    def quads_plugin_status(self) -> dict[str, object]:
        """This worker's process id and whether the plugin's method is registered in it."""
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

        from megatron_quads.vllm_plugin.serving import QUANT_NAME

        return {"pid": os.getpid(), "registered": QUANT_NAME in QUANTIZATION_METHODS}

    def quads_start_routing_capture(self) -> int:
        """Record every MoE router's experts for every token the forwards compute until
        :meth:`quads_take_routing`; returns the routers hooked."""
        from megatron_quads.vllm_plugin.routing_capture import RoutingCapture

        if getattr(self, "_quads_routing", None) is None:
            self._quads_routing = RoutingCapture(self.model_runner)
        self._quads_routing.take()  # nothing left from an interrupted capture
        self._quads_routing.active = True
        return self._quads_routing.num_layers

    def quads_take_routing(self) -> dict[str, object]:
        """``{request id: int16 [positions, layers, k]}`` recorded since the capture started, which
        ends it (tensors: in-process engines only)."""
        capture = getattr(self, "_quads_routing", None)
        if capture is None:
            raise RuntimeError("routing capture was not started (quads_start_routing_capture)")
        return capture.take()

    def quads_layer_methods(self) -> dict[str, int]:
        """``{quant method class name: layers}`` over the model's modules that hold one (which of
        vLLM's or the plugin's methods serves each kind of layer)."""
        counts: dict[str, int] = {}
        for module in self.model_runner.get_model().modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                name = type(method).__name__
                counts[name] = counts.get(name, 0) + 1
        return counts

    def quads_residual_channels(self, as_lists: bool = False) -> dict[str, torch.Tensor | list[int]]:
        """This worker's routed experts' RAC channel sets (CPU int32) by checkpoint module name;
        ``as_lists``: as lists of ints (workers in another process: RPC carries no tensors there)."""
        sets: dict[str, torch.Tensor] = {}
        for _, module in self._quads_layers():
            if hasattr(module.quant_method, "residual_channel_sets"):
                sets.update(module.quant_method.residual_channel_sets(module))
        return {name: channels.tolist() for name, channels in sets.items()} if as_lists else sets

    def quads_routed_token_counts(self) -> list[list[int]]:
        """Per MoE layer of a calibration in progress, the routed tokens each local expert has seen
        so far (how a batch spreads over the experts)."""
        return [module.quant_method.routed_token_counts(module) for _, module in self._quads_layers()
                if hasattr(module.quant_method, "routed_token_counts")]

    def quads_parameter_storage(self) -> dict[str, tuple[int, int]]:
        """``{parameter name: (data_ptr, nbytes)}`` of every model parameter."""
        model = self.model_runner.get_model()
        return {name: (p.data_ptr(), p.numel() * p.element_size()) for name, p in model.named_parameters()}


def repack_unquantized_cpu_experts(model: torch.nn.Module) -> int:
    """Re-run the CPU weight prepack of vLLM's unquantized MoE layers after a reload (its method
    skips the prepack on weight updates, which leaves raw weights in the packed layout), into the
    parameters' own storage; returns the layers repacked. A no-op off CPU and for the QUADS method."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    count = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        fused = getattr(kernel, "fused_experts", None)
        if fused is not None and type(fused).__name__.endswith("CPUUnquantizedExperts"):
            held = {name: getattr(module, name) for name in ("w13_weight", "w2_weight")}
            fused.process_weights_after_loading(module)
            for name, param in held.items():  # the packed weights into the storage the engine holds
                packed = getattr(module, name)
                if packed is not param and packed.shape == param.shape and packed.dtype == param.dtype:
                    param.data.copy_(packed.data)
                    module.register_parameter(name, param)
            count += 1
    return count
