"""The vLLM QuantizationConfig ``quads_nvfp4``: which layers the plugin computes and how.

It claims every checkpoint whose quantization config carries the project's ``quads`` block
(docs/format.md), and a plain ModelOpt NVFP4 checkpoint when asked (``LLM(quantization="quads_nvfp4")``),
e.g. where vLLM has no NVFP4 MoE backend. Routed experts get :class:`~.moe_method.QuadsFusedMoEMethod`,
other linears in scope :class:`~.linear_method.QuadsLinearMethod`, excluded linears vLLM's own
unquantized method. Importing this module registers the method.

What is checked, and where. vLLM calls :meth:`QuadsNVFP4Config.maybe_update_config` once, with the
checkpoint's directory, when it builds its config (before any worker starts): there the two
quantization configs (``config.json``, ``hf_quant_config.json``) must agree, and every tensor of
the checkpoint files that belongs to no quantized module (embeddings, norms, router, ``lm_head``,
excluded linears: what vLLM's own layers serve) must be finite, else the engine does not start and
the error names the tensor and its file. A checkpoint vLLM fetches from a hub (not a local
directory) is not read there. The quantized tensors are checked by the methods as they are loaded
(``process_weights_after_loading``, also on every in-place update): every tensor present, every
scale valid (:mod:`.scale_checks`), channel sets valid and shared by fused siblings.
"""

from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

from megatron_quads.rollout.checkpoint_format import QUANT_CONFIG_FILE, check_quant_configs_agree
from megatron_quads.rollout.quantized_checkpoint import require_finite_unquantized_files
from megatron_quads.vllm_plugin.serving import QUANT_NAME, ServingConfig, is_modelopt_nvfp4, serving_config


@register_quantization_config(QUANT_NAME)
class QuadsNVFP4Config(QuantizationConfig):
    """NVFP4-plus-residual serving (see module docstring); ``serving`` says the precision."""

    def __init__(self, serving: ServingConfig) -> None:
        super().__init__()
        self.serving = serving
        self.exclude_modules = list(serving.exclude_modules)

    def get_name(self) -> str:
        """The registered method name."""
        return QUANT_NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        """Activation dtypes the project's NVFP4 functions take."""
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        """Any GPU (the reference path runs everywhere; the Triton kernels pick their own arch)."""
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        """Where a checkpoint without a ``quantization_config`` in config.json keeps it."""
        return [QUANT_CONFIG_FILE]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuadsNVFP4Config:
        """The config of a checkpoint's quantization block (flat or nested)."""
        return cls(serving_config(config))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None,
                                     hf_config: Any = None) -> str | None:
        """Claim checkpoints with a ``quads`` block; plain ModelOpt NVFP4 ones only when asked for."""
        if not isinstance(hf_quant_cfg, dict) or user_quant not in (None, QUANT_NAME, "modelopt", "modelopt_fp4"):
            return None
        if "quads" in hf_quant_cfg:
            return QUANT_NAME
        return QUANT_NAME if user_quant == QUANT_NAME and is_modelopt_nvfp4(hf_quant_cfg) else None

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: str | None = None) -> None:
        """Check the checkpoint in directory ``model_name`` before vLLM builds anything: its two
        quantization configs agree and its unquantized tensors are finite (ValueError naming the key
        or the tensor). A model name that is not a local directory is not checked here."""
        directory = Path(model_name)
        if not directory.is_dir():
            return
        check_quant_configs_agree(directory)
        require_finite_unquantized_files(directory)

    def is_layer_excluded(self, prefix: str) -> bool:
        """ModelOpt's exclusion rules: exact (fused names resolved), substring or wildcard match."""
        if not self.exclude_modules:
            return False
        if is_layer_skipped(prefix, self.exclude_modules, self.packed_modules_mapping):
            return True
        return any(entry != prefix and (entry in prefix or fnmatch(prefix, entry)) for entry in self.exclude_modules)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method of one layer (``None``: vLLM's default for it)."""
        if not isinstance(layer, (RoutedExperts, LinearBase)):
            return None
        if self.is_layer_excluded(prefix):
            return UnquantizedLinearMethod() if isinstance(layer, LinearBase) else None
        if isinstance(layer, RoutedExperts):
            from megatron_quads.vllm_plugin.moe_method import QuadsFusedMoEMethod

            return QuadsFusedMoEMethod(self.serving, layer.moe_config)
        from megatron_quads.vllm_plugin.linear_method import QuadsLinearMethod

        return QuadsLinearMethod(self.serving)
