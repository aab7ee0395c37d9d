"""Write and read :class:`QuantizedModelWeights` as a safetensors checkpoint directory (file mechanics
in ``checkpoint_format``), and check the high-precision tensors of a checkpoint finite.
docs/format.md is the schema."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from megatron_quads.precision import Precision
from megatron_quads.rollout import checkpoint_format as fmt
from megatron_quads.rollout.model_weights import QuantizedModelWeights
from megatron_quads.rollout.quant_config import make_quant_config, recorded_precision

logger = logging.getLogger(__name__)


def _quads_block(weights: QuantizedModelWeights, include_residual: bool, precision: Precision | None) -> dict[str, Any]:
    recorded = precision if precision is not None else recorded_precision(weights.config)
    return fmt.quads_block(
        residual_ratio=weights.config["residual_ratio"],
        weight_version=weights.config["weight_version"],
        residual_tensors=include_residual,
        input_scales=weights.input_scales,
        num_quantized_modules=len(weights.quantized),
        num_unquantized_tensors=len(weights.unquantized),
        precision=None if recorded is None else str(recorded),
    )


def save_quantized_weights(
    weights: QuantizedModelWeights,
    directory: str | os.PathLike[str],
    max_shard_bytes: int = fmt.DEFAULT_MAX_SHARD_BYTES,
    *,
    include_residual: bool = True,
    model_config: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    finish: Callable[[Path], object] | None = None,
    precision: Precision | None = None,
) -> Path:
    """Write ``weights`` as a safetensors checkpoint directory, atomically; return its path.

    Files: ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` + index when the tensors
    exceed ``max_shard_bytes``), ``hf_quant_config.json``, and ``config.json`` (``model_config``
    with a ``quantization_config`` block) when ``model_config`` is given. ``include_residual=False``
    writes only the ModelOpt-named tensors: a plain ModelOpt NVFP4 checkpoint. ``finish(tmp)`` runs
    on the complete temporary directory before it is renamed into place (more files, a manifest).
    ``precision``: the rollout precision the ``quads`` block records (default: the weights' own, if any).
    """
    if not isinstance(weights, QuantizedModelWeights):
        raise TypeError(f"save_quantized_weights expects QuantizedModelWeights, got {type(weights).__name__}")
    quads = _quads_block(weights, include_residual, precision)
    exclude = weights.config["exclude_modules"]
    files: dict[str, Any] = {fmt.QUANT_CONFIG_FILE: fmt.hf_quant_config(exclude, quads)}
    if model_config is not None:
        files[fmt.MODEL_CONFIG_FILE] = {**model_config, "quantization_config": fmt.quantization_config_block(exclude, quads)}
    if not weights.input_scales and weights.quantized:
        logger.warning(
            "no input_scale tensors: activations use dynamic scales; stock ModelOpt/vLLM NVFP4 loaders expect a "
            "static input_scale per quantized linear"
        )
    metadata = {"quads_version": str(fmt.FORMAT_VERSION), "weight_version": str(weights.config["weight_version"])}
    return fmt.write_checkpoint(
        directory,
        weights.state_dict(include_residual),
        files,
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
        safetensors_metadata=metadata,
        finish=finish,
    )


def _non_finite(name: str, tensor: torch.Tensor, file: Path, more: str = "") -> ValueError:
    count = int((~torch.isfinite(tensor)).sum())
    return ValueError(
        f"unquantized tensor '{name}' in {file} holds {count} NaN or Inf values{more}; the checkpoint is damaged or "
        "was exported from diverged weights: re-export it"
    )


def _require_finite_unquantized(unquantized: Mapping[str, torch.Tensor], root: Path) -> None:
    """Every high-precision tensor read from the checkpoint ``root`` is finite; the first that holds a
    NaN or Inf raises ValueError naming it and its file. One pass: one device sync."""
    names = list(unquantized)
    if not names:
        return
    finite = torch.stack([torch.isfinite(unquantized[n]).all() for n in names]).tolist()
    bad = [n for n, ok in zip(names, finite, strict=True) if not ok]
    if bad:
        file = root / fmt.tensor_file_map(root)[bad[0]]
        raise _non_finite(bad[0], unquantized[bad[0]], file, f" ({len(bad)} tensor(s) in all)")


def require_finite_unquantized_files(directory: str | os.PathLike[str]) -> int:
    """Every floating-point tensor of the checkpoint files in ``directory`` that belongs to no quantized
    module (embeddings, norms, router, ``lm_head``, excluded linears) is finite: else ValueError naming
    the first that is not and its file. Reads one tensor at a time (memory-mapped); returns how many
    tensors it checked. For readers that do not load the checkpoint through :func:`load_quantized_weights`."""
    root = Path(directory)
    files = fmt.tensor_file_map(root)
    quantized = {fmt.split_tensor_name(n)[0] for n in files if fmt.split_tensor_name(n)[1] in fmt.QUANTIZED_ONLY_LEAVES}
    by_file: dict[str, list[str]] = {}
    for name, file_name in files.items():
        if fmt.split_tensor_name(name)[0] not in quantized:
            by_file.setdefault(file_name, []).append(name)
    checked = 0
    for file_name, names in by_file.items():
        try:
            with safe_open(str(root / file_name), framework="pt") as f:
                for name in names:
                    tensor = f.get_tensor(name)
                    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                        raise _non_finite(name, tensor, root / file_name)
                    checked += 1
        except (OSError, SafetensorError) as err:
            raise ValueError(f"cannot read {root / file_name}: {err}; the file is damaged: re-export the checkpoint") from err
    return checked


def load_quantized_weights(
    directory: str | os.PathLike[str], device: str | torch.device = "cpu", verify_residual: bool = False
) -> QuantizedModelWeights:
    """Read and validate a checkpoint written by :func:`save_quantized_weights`.

    A missing tensor, a tensor whose dtype or shape disagrees with the config or with the module's
    other tensors, an unquantized tensor holding NaN or Inf, or a damaged config raises ValueError
    naming it. ``verify_residual`` also rebuilds
    every ``W_S`` from ``q(W)`` and the channels and requires identical bytes.
    """
    root = Path(directory)
    source = str(root / fmt.QUANT_CONFIG_FILE)
    exclude, quads = fmt.parse_hf_quant_config(fmt.read_json_file(root, fmt.QUANT_CONFIG_FILE), source)
    fmt.check_quant_configs_agree(root)
    tensors = fmt.read_checkpoint_tensors(root, device)
    config = make_quant_config(quads["residual_ratio"], exclude, quads["weight_version"], quads.get("precision"))
    weights = QuantizedModelWeights.from_state_dict(tensors, config, quads["residual_tensors"], quads["input_scales"])
    _require_finite_unquantized(weights.unquantized, root)
    for key, found in (("num_quantized_modules", len(weights.quantized)), ("num_unquantized_tensors", len(weights.unquantized))):
        if found != quads[key]:
            raise ValueError(
                f"{source} says {key} = {quads[key]} but the safetensors files hold {found}; tensors are missing or "
                "extra: re-export the checkpoint"
            )
    if verify_residual:
        for module, lin in weights.quantized.items():
            rebuilt = lin.with_residual_channels(lin.residual_channels)
            for leaf in (fmt.RESIDUAL_WEIGHT, fmt.RESIDUAL_WEIGHT_SCALE):
                if not torch.equal(getattr(rebuilt, leaf).view(torch.uint8), getattr(lin, leaf).view(torch.uint8)):
                    raise ValueError(f"'{module}.{leaf}' is not W_S re-blocked from '{module}.weight'; re-export it")
    logger.info("loaded %d quantized linears and %d other tensors from %s", len(weights.quantized), len(weights.unquantized), root)
    return weights
