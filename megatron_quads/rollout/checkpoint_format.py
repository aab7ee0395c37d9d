"""The on-disk NVFP4-plus-residual checkpoint: tensor names, config files, safetensors shards.

This module knows files and names, not NVFP4 arithmetic: it turns a flat ``{name: tensor}`` dict
plus a config into a Hugging Face style directory (``model.safetensors`` or
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``, ``hf_quant_config.json``
and optionally ``config.json``) and back, atomically. ``megatron_quads.rollout.quantized_checkpoint``
maps the in-memory weights to and from the flat dict and checks every tensor; docs/format.md is the
schema.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megatron_quads.atomic_io import atomic_directory

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Version of the ``quads`` config block and the tensor layout it describes."""

QUANT_ALGO = "NVFP4"
GROUP_SIZE = 16

QUANT_CONFIG_FILE = "hf_quant_config.json"
MODEL_CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000
"""Hugging Face's default shard bound ("5GB")."""

# Per-module tensor leaves (``<module>.<leaf>``). The first four are ModelOpt's NVFP4 names.
WEIGHT = "weight"
WEIGHT_SCALE = "weight_scale"
WEIGHT_SCALE_2 = "weight_scale_2"
INPUT_SCALE = "input_scale"
RESIDUAL_CHANNELS = "residual_channels"
RESIDUAL_WEIGHT = "residual_weight"
RESIDUAL_WEIGHT_SCALE = "residual_weight_scale"

MODELOPT_LEAVES = (WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2, INPUT_SCALE)
RESIDUAL_LEAVES = (RESIDUAL_CHANNELS, RESIDUAL_WEIGHT, RESIDUAL_WEIGHT_SCALE)
QUANTIZED_ONLY_LEAVES = (WEIGHT_SCALE, WEIGHT_SCALE_2, INPUT_SCALE, *RESIDUAL_LEAVES)
"""Leaves that exist only on quantized modules: any of them marks ``<module>`` as quantized."""

UNQUANTIZED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Dtypes accepted for tensors stored in high precision (norms, embeddings, router, ...)."""

SHARED_GLOBAL_SCALE_GROUPS = (("gate_proj", "up_proj"), ("w1", "w3"), ("q_proj", "k_proj", "v_proj"))
"""Sibling linears that inference engines fuse and that therefore share one ``weight_scale_2``."""


def tensor_name(module: str, leaf: str) -> str:
    """The checkpoint name of one tensor of a module: ``<module>.<leaf>``."""
    return f"{module}.{leaf}"


def split_tensor_name(name: str) -> tuple[str, str]:
    """``"a.b.weight_scale"`` -> ``("a.b", "weight_scale")``; a name without a dot has module ``""``."""
    module, _, leaf = name.rpartition(".")
    return module, leaf


def producer_info() -> dict[str, str]:
    """The ``producer`` entry written into the config files."""
    try:
        version = metadata.version("megatron_quads")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"name": "megatron_quads", "version": version}


def quads_block(
    *,
    residual_ratio: float,
    weight_version: int,
    residual_tensors: bool,
    input_scales: bool,
    num_quantized_modules: int,
    num_unquantized_tensors: int,
    precision: str | None = None,
) -> dict[str, Any]:
    """The ``quads`` block: what a QUADS reader needs beyond ModelOpt's keys; ``precision`` (the text
    form of a :class:`~megatron_quads.precision.Precision`, e.g. ``quads@0.25``), when given, is the
    rollout precision the checkpoint is served at."""
    block = {
        "version": FORMAT_VERSION,
        "residual_ratio": float(residual_ratio),
        "residual_channels_key": RESIDUAL_CHANNELS,
        "residual_weight_key": RESIDUAL_WEIGHT,
        "residual_weight_scale_key": RESIDUAL_WEIGHT_SCALE,
        "residual_tensors": bool(residual_tensors),
        "input_scales": bool(input_scales),
        "weight_version": int(weight_version),
        "num_quantized_modules": int(num_quantized_modules),
        "num_unquantized_tensors": int(num_unquantized_tensors),
        "shared_global_scale": [list(group) for group in SHARED_GLOBAL_SCALE_GROUPS],
    }
    return block if precision is None else {**block, "precision": precision}


def hf_quant_config(exclude_modules: list[str], quads: dict[str, Any]) -> dict[str, Any]:
    """``hf_quant_config.json``: ModelOpt's nested layout plus ``quant_method`` and the ``quads`` block."""
    return {
        "producer": producer_info(),
        "quant_method": "modelopt",
        "quantization": {
            "quant_algo": QUANT_ALGO,
            "kv_cache_quant_algo": None,
            "group_size": GROUP_SIZE,
            "exclude_modules": list(exclude_modules),
        },
        "quads": dict(quads),
    }


def quantization_config_block(exclude_modules: list[str], quads: dict[str, Any]) -> dict[str, Any]:
    """The flat ``quantization_config`` block of ``config.json`` (``ignore`` is vLLM's key for excludes)."""
    return {
        "quant_method": "modelopt",
        "quant_algo": QUANT_ALGO,
        "group_size": GROUP_SIZE,
        "exclude_modules": list(exclude_modules),
        "ignore": list(exclude_modules),
        "producer": producer_info(),
        "quads": dict(quads),
    }


def _require(doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``doc[key]``, checked to exist and to be of ``kind``; a ValueError naming ``where.key`` otherwise."""
    if key not in doc:
        raise ValueError(f"{where} has no key '{key}'; the file was not written by save_quantized_weights or is damaged")
    value = doc[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{where}.{key} is {value!r} ({type(value).__name__}); expected {kind}")
    return value


def parse_hf_quant_config(doc: Any, source: str = QUANT_CONFIG_FILE) -> tuple[list[str], dict[str, Any]]:
    """Validate an ``hf_quant_config.json`` document; return ``(exclude_modules, quads block)``."""
    if not isinstance(doc, dict) or not doc:
        raise ValueError(f"{source} must hold a non-empty JSON object, got {doc!r:.80}")
    quant = _require(doc, "quantization", dict, source)
    algo = _require(quant, "quant_algo", str, f"{source}: quantization")
    if algo.upper() != QUANT_ALGO:
        raise ValueError(f"{source}: quantization.quant_algo is '{algo}'; this reader handles only '{QUANT_ALGO}'")
    group = _require(quant, "group_size", int, f"{source}: quantization")
    if group != GROUP_SIZE:
        raise ValueError(f"{source}: quantization.group_size is {group}; NVFP4 uses blocks of {GROUP_SIZE}")
    exclude = _require(quant, "exclude_modules", list, f"{source}: quantization")
    if not all(isinstance(e, str) for e in exclude):
        raise ValueError(f"{source}: quantization.exclude_modules must be a list of module names (strings)")
    quads = _require(doc, "quads", dict, source)
    version = _require(quads, "version", int, f"{source}: quads")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{source}: quads.version is {version}; this megatron_quads reads version {FORMAT_VERSION}: "
            "upgrade megatron_quads or re-export the checkpoint"
        )
    ratio = _require(quads, "residual_ratio", (int, float), f"{source}: quads")
    if isinstance(ratio, bool) or not 0.0 <= float(ratio) <= 1.0:
        raise ValueError(f"{source}: quads.residual_ratio is {ratio!r}; expected a number in [0, 1]")
    for key, expected in (
        ("residual_channels_key", RESIDUAL_CHANNELS),
        ("residual_weight_key", RESIDUAL_WEIGHT),
        ("residual_weight_scale_key", RESIDUAL_WEIGHT_SCALE),
    ):
        value = _require(quads, key, str, f"{source}: quads")
        if value != expected:
            raise ValueError(f"{source}: quads.{key} is '{value}'; format version {FORMAT_VERSION} uses '{expected}'")
    for key in ("residual_tensors", "input_scales"):
        _require(quads, key, bool, f"{source}: quads")
    if "precision" in quads:  # absent in checkpoints that predate it: the reader derives it
        _require(quads, "precision", str, f"{source}: quads")
    for key in ("weight_version", "num_quantized_modules", "num_unquantized_tensors"):
        if _require(quads, key, int, f"{source}: quads") < 0:
            raise ValueError(f"{source}: quads.{key} must be >= 0, got {quads[key]}")
    return list(exclude), dict(quads)


_SHARED_KEYS = ("quant_algo", "group_size", "exclude_modules")
"""Keys both quantization configs hold (``config.json`` flat, ``hf_quant_config.json`` under ``quantization``)."""


def check_quant_configs_agree(directory: str | os.PathLike[str]) -> None:
    """``config.json``'s ``quantization_config`` and ``hf_quant_config.json``, where a checkpoint has
    both, agree on ``quant_algo``, ``group_size``, ``exclude_modules`` and the ``quads`` block (engines
    read one file, ModelOpt's tools the other): else ValueError naming the key and both files."""
    root = Path(directory)
    model = read_json_file(root, MODEL_CONFIG_FILE, required=False)
    flat = model.get("quantization_config") if isinstance(model, dict) else None
    quant = read_json_file(root, QUANT_CONFIG_FILE, required=False)
    if not isinstance(flat, dict) or not isinstance(quant, dict):
        return
    nested = quant.get("quantization") if isinstance(quant.get("quantization"), dict) else quant
    pairs = [(f"quantization_config.{k}", flat.get(k), f"quantization.{k}", nested.get(k)) for k in _SHARED_KEYS]
    pairs.append(("quantization_config.quads", flat.get("quads"), "quads", quant.get("quads")))
    for key_a, a, key_b, b in pairs:
        if key_a.endswith("quant_algo") and isinstance(a, str) and isinstance(b, str):
            a, b = a.upper(), b.upper()
        if a != b and not (key_a != "quantization_config.quads" and (a is None or b is None)):
            raise ValueError(
                f"{root / MODEL_CONFIG_FILE} says {key_a} = {a!r} but {root / QUANT_CONFIG_FILE} says {key_b} = {b!r}; "
                "the two files describe different checkpoints (one was edited): re-export the checkpoint"
            )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_shards(tensors: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Split names, in order, into shards of at most ``max_shard_bytes`` (a bigger tensor gets its own)."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = _nbytes(t)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def shard_file_name(index: int, count: int) -> str:
    """Hugging Face's shard name: ``model-00001-of-00003.safetensors`` (index from 1)."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def owned_cpu_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors that share no storage (safetensors refuses shared storage, e.g. tied embeddings)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        c = t.detach().to("cpu").contiguous()
        ptr = c.untyped_storage().data_ptr()
        if c.numel() and (ptr in seen or c.untyped_storage().nbytes() != _nbytes(c)):
            c = c.clone()
            ptr = c.untyped_storage().data_ptr()
        if c.numel():
            seen.add(ptr)
        out[name] = c
    return out


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _write_json(path: Path, doc: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _write_into(
    tmp: Path,
    tensors: dict[str, torch.Tensor],
    json_files: Mapping[str, Any],
    max_shard_bytes: int,
    safetensors_metadata: Mapping[str, str],
) -> list[str]:
    """Write shards (+ index when more than one) and JSON files into ``tmp``; return the shard names."""
    shards = plan_shards(tensors, max_shard_bytes)
    names = [SINGLE_FILE] if len(shards) == 1 else [shard_file_name(i + 1, len(shards)) for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    for file_name, shard in zip(names, shards, strict=True):
        save_file({n: tensors[n] for n in shard}, str(tmp / file_name), metadata=dict(safetensors_metadata))
        _fsync_file(tmp / file_name)
        weight_map.update({n: file_name for n in shard})
        logger.debug("wrote %s: %d tensors", file_name, len(shard))
    if len(shards) > 1:
        total = sum(_nbytes(t) for t in tensors.values())
        _write_json(tmp / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    for file_name, doc in json_files.items():
        _write_json(tmp / file_name, doc)
    return names


def write_checkpoint(
    directory: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    json_files: Mapping[str, Any],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    safetensors_metadata: Mapping[str, str] | None = None,
    finish: Callable[[Path], object] | None = None,
) -> Path:
    """Write tensors and JSON files as one directory, atomically: a temporary directory renamed into place.

    A crash leaves either no ``directory`` (or the previous one) and a hidden ``.<name>.tmp-*`` sibling,
    never a directory with some of the files. ``overwrite`` replaces an existing directory.
    ``finish(tmp)`` runs on the complete temporary directory before the rename (e.g. to add a manifest).
    """
    meta = {"format": "pt", **(safetensors_metadata or {})}
    with atomic_directory(directory, overwrite) as tmp:
        names = _write_into(tmp, owned_cpu_tensors(tensors), json_files, max_shard_bytes, meta)
        if finish is not None:
            finish(tmp)
    logger.info("wrote %d tensors in %d file(s) to %s", len(tensors), len(names), directory)
    return Path(directory)


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); the file is damaged: re-export the checkpoint") from err


def read_json_file(directory: str | os.PathLike[str], file_name: str, required: bool = True) -> Any:
    """Parse ``directory/file_name``; None when it is absent and not ``required``."""
    path = Path(directory) / file_name
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{path} not found: is {directory} a directory written by save_quantized_weights?")
        return None
    return _read_json(path)


def tensor_file_map(directory: str | os.PathLike[str]) -> dict[str, str]:
    """``{tensor name: file name}`` from the index, or every tensor of ``model.safetensors``."""
    directory = Path(directory)
    index_path, single_path = directory / INDEX_FILE, directory / SINGLE_FILE
    if index_path.is_file() and single_path.is_file():
        raise ValueError(f"{directory} holds both {SINGLE_FILE} and {INDEX_FILE}; keep one (re-export the checkpoint)")
    if single_path.is_file():
        try:
            with safe_open(str(single_path), framework="pt") as f:
                return dict.fromkeys(f.keys(), SINGLE_FILE)
        except (OSError, SafetensorError) as err:
            raise ValueError(f"cannot read {single_path}: {err}; the file is damaged: re-export the checkpoint") from err
    if not index_path.is_file():
        raise FileNotFoundError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    index = _read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index_path} has no valid 'weight_map' object mapping tensor names to shard files")
    return dict(weight_map)


def read_checkpoint_tensors(directory: str | os.PathLike[str], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) safetensors checkpoint, checked against the index."""
    root = Path(directory)
    weight_map = tensor_file_map(root)
    by_file: dict[str, list[str]] = {}
    for name, file_name in weight_map.items():
        by_file.setdefault(file_name, []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for file_name, expected in by_file.items():
        path = root / file_name
        if Path(file_name).name != file_name or not path.is_file():
            raise FileNotFoundError(f"{path} is listed in {INDEX_FILE} (for '{expected[0]}' and others) but is missing")
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                present = set(f.keys())
                missing = [n for n in expected if n not in present]
                if missing:
                    raise ValueError(f"tensor '{missing[0]}' is listed in {INDEX_FILE} for {file_name} but that file lacks it")
                extra = sorted(present - set(expected))
                if extra:
                    raise ValueError(f"{file_name} holds tensor '{extra[0]}' that {INDEX_FILE} does not list")
                for name in expected:
                    tensors[name] = f.get_tensor(name)
        except (OSError, SafetensorError, RuntimeError, TypeError) as err:  # damaged file or a dtype torch lacks
            raise ValueError(f"cannot read {path}: {err}; the file is damaged: re-export the checkpoint") from err
    return tensors
