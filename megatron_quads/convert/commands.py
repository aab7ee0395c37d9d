"""``megatron-quads convert hf-to-megatron | megatron-to-hf | reshard``.

Every command writes its output into a temporary directory beside the target and renames it into
place when complete (an existing target is an error unless ``overwrite``), with a ``manifest.json``
listing every file's size and sha256 and the command that made it.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from megatron_quads import embedded
from megatron_quads.atomic_io import atomic_directory
from megatron_quads.convert.hf_source import TOKENIZER_FILES, HfCheckpoint
from megatron_quads.convert.megatron_source import MegatronCheckpoint, Unit
from megatron_quads.convert.megatron_writer import SaveJob, check_layout, save_dist_checkpoint
from megatron_quads.convert.progress import progress_bar
from megatron_quads.manifest import write_manifest
from megatron_quads.rollout import checkpoint_format as fmt
from megatron_quads.trainer.hf_config import hf_config_from_policy
from megatron_quads.trainer.model import ParallelConfig, PolicyModelConfig, save_model_config
from megatron_quads.trainer.rendezvous import find_free_port

logger = logging.getLogger(__name__)

HF_BASE_DIR = "hf_base"
"""Inside a converted dist checkpoint: the source model's config.json and tokenizer files."""
DEFAULT_HF_SHARD_BYTES = 1_000_000_000


def command_line() -> str:
    """The command line of this process (program name and arguments), for manifests."""
    return shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else "python"


def copy_hf_files(source: Path | None, target: Path, with_config: bool = False) -> list[str]:
    """Copy the tokenizer files (and config.json) that exist in ``source`` into ``target``."""
    names = [*TOKENIZER_FILES, *([fmt.MODEL_CONFIG_FILE] if with_config else [])]
    copied = []
    for name in names:
        if source is not None and (source / name).is_file():
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / name, target / name)
            copied.append(name)
    return copied


TOKENIZER_DEFINITIONS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Files whose presence makes a directory a tokenizer directory (the others only accompany one)."""


def has_tokenizer(directory: Path | None) -> bool:
    """Whether ``directory`` holds a tokenizer (one of :data:`TOKENIZER_DEFINITIONS`)."""
    return directory is not None and any((directory / name).is_file() for name in TOKENIZER_DEFINITIONS)


def tokenizer_files_dir(files_dir: Path | None, vocab_size: int) -> Path | None:
    """Where a converted model's tokenizer files come from: ``files_dir`` when it holds a tokenizer;
    else, for a model of the embedded model's vocabulary size, the character tokenizer's files
    (:data:`megatron_quads.embedded.TOKENIZER_DIR`, whose ``<eos>`` vLLM then stops on); else ``files_dir``."""
    if not has_tokenizer(files_dir) and vocab_size == embedded.model_config_fields()["vocab_size"]:
        return embedded.TOKENIZER_DIR
    return files_dir


def _layout(parallel: ParallelConfig) -> dict[str, int]:
    return {"tensor_parallel": parallel.tensor_parallel, "expert_parallel": parallel.expert_parallel,
            "expert_tensor_parallel": parallel.expert_tensor_parallel or parallel.tensor_parallel}


def hf_to_megatron(
    hf_dir: str | os.PathLike[str], out: str | os.PathLike[str], parallel: ParallelConfig,
    overwrite: bool = False, progress: bool = True, allow_nonfinite: bool = False,
    manifest_extra: Mapping[str, Any] | None = None, fork_ranks: bool = True,
) -> Path:
    """A Megatron dist checkpoint of the HF model in ``hf_dir``, saved in layout ``parallel``, with
    ``model_config.json`` (what training reads) and the source's config and tokenizer in ``hf_base/``.
    A source tensor holding NaN or Inf stops it, naming the tensor, unless ``allow_nonfinite``.
    ``manifest_extra``: entries added to the output's ``manifest.json``; ``fork_ranks``: see
    :func:`~megatron_quads.convert.megatron_writer.save_dist_checkpoint` (``fork``)."""
    hf_dir = Path(hf_dir)
    with HfCheckpoint(hf_dir) as hf:
        hf.check()
        model = hf.model
    check_layout(model, parallel)
    start = time.perf_counter()
    with atomic_directory(out, overwrite) as tmp:
        save_dist_checkpoint(SaveJob("hf", str(hf_dir), str(tmp), model, parallel, find_free_port(), progress,
                                     allow_nonfinite), fork=fork_ranks)
        save_model_config(model, tmp)
        copy_hf_files(hf_dir, tmp / HF_BASE_DIR, with_config=True)
        write_manifest(tmp, {"command": command_line(), "source": str(hf_dir.resolve()), "kind": "megatron-dist",
                             "layout": _layout(parallel), "producer": fmt.producer_info(), **(manifest_extra or {})})
    logger.info("wrote %s (TP %d, EP %d) in %.1f s", out, parallel.tensor_parallel, parallel.expert_parallel,
                time.perf_counter() - start)
    return Path(out)


def reshard(
    checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], parallel: ParallelConfig,
    model: PolicyModelConfig | None = None, overwrite: bool = False, progress: bool = True,
    allow_nonfinite: bool = False,
) -> Path:
    """The model weights of dist checkpoint ``checkpoint`` saved again in layout ``parallel``
    (optimizer and RNG state are not carried over). A tensor holding NaN or Inf stops it, naming the
    tensor, unless ``allow_nonfinite``."""
    source = MegatronCheckpoint(checkpoint, model)
    check_layout(source.model, parallel)
    with atomic_directory(out, overwrite) as tmp:
        save_dist_checkpoint(SaveJob("megatron", str(source.directory), str(tmp), source.model, parallel,
                                     find_free_port(), progress, allow_nonfinite))
        save_model_config(source.model, tmp)
        if (source.directory / HF_BASE_DIR).is_dir():
            shutil.copytree(source.directory / HF_BASE_DIR, tmp / HF_BASE_DIR)
        write_manifest(tmp, {"command": command_line(), "source": str(source.directory.resolve()),
                             "kind": "megatron-dist", "layout": _layout(parallel), "producer": fmt.producer_info()})
    return Path(out)


def plan_hf_shards(units: Iterable[Unit], unit_bytes: dict[Unit, int], max_shard_bytes: int) -> list[list[Unit]]:
    """Consecutive units grouped into shards: a shard is closed once it holds ``max_shard_bytes``."""
    shards: list[list[Unit]] = [[]]
    size = 0
    for unit in units:
        if shards[-1] and size + unit_bytes[unit] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(unit)
        size += unit_bytes[unit]
    return shards


def _base_config(source: MegatronCheckpoint, hf_base: str | os.PathLike[str] | None) -> tuple[dict[str, Any], Path | None]:
    base_dir = Path(hf_base) if hf_base else source.directory / HF_BASE_DIR
    if not (base_dir / fmt.MODEL_CONFIG_FILE).is_file():
        if hf_base:
            raise FileNotFoundError(f"--hf-base {hf_base} has no config.json")
        return {}, None
    return json.loads((base_dir / fmt.MODEL_CONFIG_FILE).read_text()), base_dir


def megatron_to_hf(
    checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], model: PolicyModelConfig | None = None,
    hf_base: str | os.PathLike[str] | None = None, max_shard_bytes: int = DEFAULT_HF_SHARD_BYTES,
    overwrite: bool = False, progress: bool = True, allow_nonfinite: bool = False,
) -> Path:
    """Sharded safetensors + ``config.json`` of dist checkpoint ``checkpoint``, read and written one
    unit (embedding, layer, head) at a time. ``hf_base``: an HF directory whose config fields (token
    ids, ...) and tokenizer files the output keeps (default: the checkpoint's ``hf_base/``; without a
    tokenizer there, see :func:`tokenizer_files_dir`). A tensor
    holding NaN or Inf stops it, naming the tensor, unless ``allow_nonfinite``."""
    source = MegatronCheckpoint(checkpoint, model, allow_nonfinite=allow_nonfinite)
    base, base_dir = _base_config(source, hf_base)
    config = hf_config_from_policy(source.model, base)
    units = source.units()
    sizes = {u: source.unit_bytes(u) for u in units}
    shards = plan_hf_shards(units, sizes, max_shard_bytes)
    names = [fmt.SINGLE_FILE] if len(shards) == 1 else [fmt.shard_file_name(i + 1, len(shards)) for i in range(len(shards))]
    start = time.perf_counter()
    with atomic_directory(out, overwrite) as tmp, progress_bar(progress, "megatron-to-hf", sum(sizes.values()), in_bytes=True) as advance:
        weight_map: dict[str, str] = {}
        for file_name, shard in zip(names, shards, strict=True):
            tensors: dict[str, Any] = {}
            for unit in shard:
                tensors.update(source.read(unit))
                advance(sizes[unit])
            save_file(tensors, str(tmp / file_name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, file_name))
            del tensors
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
            (tmp / fmt.INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / fmt.MODEL_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        copy_hf_files(tokenizer_files_dir(base_dir, source.model.vocab_size), tmp, with_config=False)
        write_manifest(tmp, {"command": command_line(), "source": str(source.directory.resolve()), "kind": "hf",
                             "producer": fmt.producer_info()})
    logger.info("wrote %s (%d shard(s), %.1f MB) in %.1f s", out, len(shards), sum(sizes.values()) / 1e6,
                time.perf_counter() - start)
    return Path(out)
