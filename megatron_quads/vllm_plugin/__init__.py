"""The QUADS plugin for vLLM: serves NVFP4-plus-residual checkpoints (docs/format.md) in vLLM.

vLLM loads it through the entry point group ``vllm.general_plugins`` (setup.py) in every process
it starts (the front end, the engine core, each worker); :func:`register` adds the quantization
method ``quads_nvfp4`` (:mod:`.quant_config`). Importing this package does not import vLLM.

Modules: :mod:`.serving` (precision and RAC ratio the plugin serves), :mod:`.quant_config` (the
vLLM QuantizationConfig), :mod:`.moe_method` (routed experts), :mod:`.linear_method` (dense
linears in scope), :mod:`.worker_extension` (calls run inside vLLM's workers: weight updates,
RAC calibration), :mod:`.engine` (the rollout engine the controller drives).
"""

from __future__ import annotations


def register() -> None:
    """Register the ``quads_nvfp4`` quantization method with vLLM (the entry point's function)."""
    from megatron_quads.vllm_plugin import quant_config  # noqa: F401  (registration is the import)
