"""A Hugging Face Qwen3-MoE directory as the policy (``model.hf_path``): what it must hold, its
architecture, and its Megatron dist checkpoint, converted once and kept in a cache directory beside
the run (``model.hf_cache_dir``, default ``hf_converted/`` in ``run_dir``'s parent) for every later
run and resume.

A cached conversion is used only while its ``manifest.json`` verifies (every converted file's size and
sha256) and records the source as it is now (each source file's size and modification time); else it is
converted again. The sha256 pass runs when a converted file's size or modification time differs from
those recorded at its last verification (``<checkpoint>.verified.json``), so a run that reuses an
unchanged conversion does not read its weights. Only the conversion itself imports torch and Megatron-Core.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_quads.trainer.settings import PolicyModelConfig

if TYPE_CHECKING:
    from megatron_quads.controller.config import RunConfig

logger = logging.getLogger(__name__)

CACHE_DIR_NAME = "hf_converted"
"""The default cache directory, beside ``run_dir``."""
SOURCE_KEY = "hf_source"
"""The manifest entry recording the source directory's files (``{name: [bytes, mtime_ns]}``)."""
WEIGHT_SUFFIX = ".safetensors"
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json")


class HfConversionError(RuntimeError):
    """``model.hf_path`` could not be converted (a tensor missing, misshapen or not finite); the message
    names it."""


def hf_dir_problem(path: str) -> str | None:
    """What ``model.hf_path`` lacks to be a Qwen3-MoE directory the run can take (a ``config.json``
    of a supported Qwen3-MoE, safetensors weights, a tokenizer), with the fix; None when it is one."""
    from megatron_quads.trainer.hf_config import UnsupportedModelError, policy_config_from_hf

    root = Path(path).expanduser()
    if not root.is_dir():
        return f"model.hf_path={path} is not a directory: give a local Hugging Face model directory (save_pretrained's)"
    missing = []
    if not (root / "config.json").is_file():
        missing.append("config.json")
    if not any(root.glob(f"*{WEIGHT_SUFFIX}")):
        missing.append(f"*{WEIGHT_SUFFIX} weights")
    if not any((root / name).is_file() for name in TOKENIZER_MARKERS):
        missing.append(f"tokenizer files ({' or '.join(TOKENIZER_MARKERS)})")
    if missing:
        return (f"model.hf_path={path} is not a Qwen3-MoE model directory: it lacks {', '.join(missing)}; give the "
                "directory a model's save_pretrained (and its tokenizer's) wrote")
    try:
        policy_config_from_hf(json.loads((root / "config.json").read_text()))
    except (ValueError, OSError) as err:  # UnsupportedModelError and json's errors are ValueErrors
        kind = "unsupported model" if isinstance(err, UnsupportedModelError) else "unreadable config.json"
        return f"model.hf_path={path}: {kind}: {err}"
    return None


def hf_architecture(path: str) -> PolicyModelConfig:
    """The trainer's architecture of the Qwen3-MoE in ``path`` (its ``config.json``)."""
    from megatron_quads.trainer.hf_config import policy_config_from_hf

    return policy_config_from_hf(json.loads((Path(path).expanduser() / "config.json").read_text()))


def converted_checkpoint_dir(cfg: RunConfig) -> Path:
    """Where ``model.hf_path``'s conversion is kept: ``<cache>/<directory name>-<hash of its resolved path>``."""
    source = Path(str(cfg.model.hf_path)).expanduser().resolve()
    cache = Path(cfg.model.hf_cache_dir) if cfg.model.hf_cache_dir else Path(cfg.run_dir).parent / CACHE_DIR_NAME
    return cache / f"{source.name}-{hashlib.sha256(str(source).encode()).hexdigest()[:12]}"


def _size_and_mtime(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def source_files(hf_dir: str | Path) -> dict[str, list[int]]:
    """``{file name: [bytes, mtime_ns]}`` of the files directly in ``hf_dir`` (what the conversion reads)."""
    return {p.name: _size_and_mtime(p) for p in sorted(Path(hf_dir).iterdir()) if p.is_file()}


def verified_stamp(checkpoint: Path) -> Path:
    """Where the sizes and modification times of ``checkpoint``'s files at their last sha256
    verification are kept (beside it, so the checkpoint's own files stay the conversion's)."""
    return checkpoint.with_name(checkpoint.name + ".verified.json")


def _verify(checkpoint: Path) -> dict[str, Any]:
    """The checkpoint's manifest, its files hashed unless none changed since their last verification."""
    from megatron_quads.atomic_io import write_text_atomic
    from megatron_quads.manifest import read_manifest, verify_manifest

    stamp = verified_stamp(checkpoint)
    manifest = read_manifest(checkpoint)
    stats = {name: _size_and_mtime(checkpoint / name) if (checkpoint / name).is_file() else None  # None: missing
             for name in manifest.get("files") or {}}
    try:
        if json.loads(stamp.read_text()) == stats:
            return manifest
    except (OSError, ValueError):
        pass  # no stamp yet, or an unreadable one: verify
    manifest = verify_manifest(checkpoint)
    write_text_atomic(stamp, json.dumps(stats))
    return manifest


def cached_conversion_problem(checkpoint: Path, hf_dir: str | Path) -> str | None:
    """Why the conversion in ``checkpoint`` cannot be used for ``hf_dir`` (none there, damaged, or of
    other source files), None when it can."""
    if not checkpoint.is_dir():
        return "no conversion yet"
    try:
        manifest: dict[str, Any] = _verify(checkpoint)
    except (OSError, ValueError) as err:
        return f"damaged: {err}"
    if manifest.get(SOURCE_KEY) != source_files(hf_dir):
        return f"{hf_dir} changed since it was converted"
    return None


def ensure_converted(cfg: RunConfig) -> Path:
    """The Megatron dist checkpoint of ``model.hf_path``: the cached one when it verifies
    (:func:`cached_conversion_problem`), else converted now (TP 1, EP 1; training reshards on load),
    under a file lock so runs sharing the cache convert once; :class:`HfConversionError` when it cannot be."""
    from filelock import FileLock

    from megatron_quads.convert.commands import hf_to_megatron
    from megatron_quads.convert.megatron_writer import ConversionError
    from megatron_quads.trainer.settings import ParallelConfig

    hf_dir, target = Path(str(cfg.model.hf_path)).expanduser(), converted_checkpoint_dir(cfg)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        problem = cached_conversion_problem(target, hf_dir)
        if problem is None:
            logger.info("model.hf_path: using the conversion in %s", target)
            return target
        logger.info("model.hf_path: converting %s to %s (%s)", hf_dir, target, problem)
        try:
            hf_to_megatron(hf_dir, target, ParallelConfig(), overwrite=True, progress=False,
                           manifest_extra={SOURCE_KEY: source_files(hf_dir)},
                           fork_ranks=False)  # the driver already runs threads (tokenizers, Ray) a fork would inherit
        except (ValueError, KeyError, ConversionError) as err:
            raise HfConversionError(f"model.hf_path={cfg.model.hf_path} cannot be converted: {err}") from err
    return target
