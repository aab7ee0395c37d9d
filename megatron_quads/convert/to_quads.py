"""``megatron-quads convert to-quads``: an HF directory or a Megatron dist checkpoint -> NVFP4-plus-residual.

The source is read tensor by tensor (HF) or unit by unit (Megatron) and quantized as it streams in:
the linears in scope become NVFP4 (gate/up and q/k/v with one shared global amax), everything else
is kept in bfloat16, or in float32 when the source model is float32. The RAC channel sets (and, with
static input scales, each linear's activation amax) are then chosen on calibration prompts by the
built-in engine's rule (:mod:`megatron_quads.rollout.weight_calibration`). The output is a
checkpoint directory of docs/format.md with ``config.json`` (what the vLLM plugin claims), the
source's tokenizer files and a ``manifest.json``, all renamed into place together.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_quads import embedded
from megatron_quads.convert.commands import (
    HF_BASE_DIR,
    command_line,
    copy_hf_files,
    has_tokenizer,
    tokenizer_files_dir,
)
from megatron_quads.convert.hf_source import HfCheckpoint
from megatron_quads.convert.megatron_source import MegatronCheckpoint, is_dist_checkpoint
from megatron_quads.convert.names import hf_tensor_shapes
from megatron_quads.convert.progress import progress_bar
from megatron_quads.manifest import write_manifest
from megatron_quads.megatron_lm.checkpoint import recorded_rac_ratio
from megatron_quads.rollout import checkpoint_format as fmt
from megatron_quads.rollout.model_weights import QuantizedModelWeights
from megatron_quads.rollout.quantize_model import quantize_hf_weights
from megatron_quads.rollout.quantized_checkpoint import save_quantized_weights
from megatron_quads.rollout.scopes import experts_and_attention_scope, routed_expert_scope
from megatron_quads.rollout.weight_calibration import WeightCalibration, calibrate_weights
from megatron_quads.tasks import encode_prompt, load_tokenizer
from megatron_quads.trainer.hf_config import UnsupportedModelError, hf_config_from_policy
from megatron_quads.trainer.hf_export import qwen3_moe_config
from megatron_quads.trainer.model import PolicyModelConfig

logger = logging.getLogger(__name__)

SCOPES = ("routed_experts", "routed_experts_and_attention")
"""The converter's scopes (names and meanings of :data:`megatron_quads.precision.SCOPES`)."""
_WIDER_SCOPES = {"experts": "routed_experts", "experts_and_attention": "routed_experts_and_attention"}
"""Scope names that include shared experts, which the converter does not quantize -> its nearest scope."""
INPUT_SCALES = ("static", "dynamic")
DEFAULT_CALIBRATION_PROMPTS = 64


@dataclass
class _Source:
    """A checkpoint to convert: its architecture, config and tokenizer files, and its tensors."""

    directory: Path
    kind: str  # "hf" or "megatron-dist"
    model: PolicyModelConfig
    base_config: dict[str, Any]
    files_dir: Path | None  # where its tokenizer files live
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]


@dataclass(frozen=True)
class _Prompts:
    """Calibration prompts as token ids, and how they were made (for the manifest)."""

    ids: list[list[int]]
    source: str
    tokenizer: str
    truncated: int


def to_quads(
    source: str | os.PathLike[str], out: str | os.PathLike[str], ratio: float | None, *,
    calibration_file: str | os.PathLike[str] | None = None, calibration_prompts: int | None = None,
    input_scales: str = "dynamic", scope: str = "routed_experts", model: PolicyModelConfig | None = None,
    tokenizer: str | os.PathLike[str] | None = None, overwrite: bool = False, progress: bool = True, seed: int = 0,
) -> Path:
    """Convert ``source`` (HF directory or Megatron dist checkpoint) into a QUADS checkpoint at ``out``.

    ``ratio``: the RAC ratio in [0, 1] (None: the ``--quads-rac-ratio`` a Megatron-LM checkpoint
    recorded); ``scope``: ``routed_experts`` or ``routed_experts_and_attention`` (plus attention
    q/k/v/o); ``input_scales``: ``static`` (an
    ``input_scale`` per linear from its calibration amax) or ``dynamic`` (none). Calibration prompts
    come from ``calibration_file`` (text, one prompt per line, or JSONL with a ``prompt`` / ``text``
    field) or are ``calibration_prompts`` prompts (default 64) of the built-in arithmetic task drawn
    with ``seed``; they are tokenized by ``tokenizer`` (``"char"``, an HF tokenizer directory or a
    saved CharTokenizer file; default: the source's tokenizer files, else ``char`` for a model with
    the embedded model's vocabulary size) and truncated to ``max_position_embeddings``. Without RAC
    (ratio 0) and with dynamic scales nothing is calibrated. ``model``: the architecture of a dist
    checkpoint without ``model_config.json``. Unquantized tensors are float32 when the source model's
    dtype is float32 (so small fp32 models compare exactly), else bfloat16. Returns ``Path(out)``.
    """
    if ratio is None:
        ratio = _recorded_ratio(source)
    _check_options(ratio, input_scales, scope, calibration_file, calibration_prompts)
    if Path(out).exists() and not overwrite:  # before the work, not after it
        raise FileExistsError(f"{out} already exists; pass --overwrite (overwrite=True) to replace it, or choose a new directory")
    start = time.perf_counter()
    with _open_source(source, model) as src:
        if Path(out).resolve() == src.directory.resolve():
            raise ValueError(f"the output directory {out} is the source: write the QUADS checkpoint elsewhere")
        needs_calibration = ratio > 0 or input_scales == "static"
        prompts = _prompts(src, calibration_file, calibration_prompts, tokenizer, seed) if needs_calibration else None
        weights = _quantize(src, ratio, scope, progress)
        calibration = None
        if prompts is not None:
            logger.info("calibrating on %d prompts (%d tokens)", len(prompts.ids), sum(map(len, prompts.ids)))
            calibration = calibrate_weights(weights, qwen3_moe_config(src.model), prompts.ids)
            weights = calibration.apply(weights, static_input_scales=input_scales == "static")
        extra = _manifest_extra(src, weights, ratio, scope, input_scales, prompts, calibration)

        def finish(tmp: Path) -> None:
            copy_hf_files(tokenizer_files_dir(src.files_dir, src.model.vocab_size), tmp)
            write_manifest(tmp, extra)

        config = hf_config_from_policy(src.model, src.base_config)
        save_quantized_weights(weights, out, model_config=config, overwrite=overwrite, finish=finish)
    logger.info("wrote %s (%d NVFP4 linears, residual fraction %.3f) in %.1f s", out, len(weights.quantized),
                weights.residual_fraction, time.perf_counter() - start)
    return Path(out)


def _recorded_ratio(source: str | os.PathLike[str]) -> float:
    """The ``--quads-rac-ratio`` a Megatron-LM checkpoint's run recorded (the ratio when none is given)."""
    ratio = recorded_rac_ratio(source) if is_dist_checkpoint(source) else None
    if ratio is None:
        raise ValueError(f"--ratio is required: {source} records no --quads-rac-ratio (only a Megatron-LM run "
                         "given that flag does)")
    logger.info("RAC ratio %s, as %s's run recorded it (--quads-rac-ratio)", ratio, source)
    return ratio


def _check_options(ratio: float, input_scales: str, scope: str, calibration_file: Any, calibration_prompts: int | None) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not math.isfinite(ratio) or not 0 <= ratio <= 1:
        raise ValueError(f"--ratio must be a fraction of input channels in [0, 1], got {ratio!r}")
    if input_scales not in INPUT_SCALES:
        raise ValueError(f"--input-scales must be one of {INPUT_SCALES}, got {input_scales!r}")
    if scope in _WIDER_SCOPES:
        raise ValueError(f"--scope {scope} includes shared experts (as the trainer's scope of that name does), which the "
                         f"converter does not quantize: use --scope {_WIDER_SCOPES[scope]}")
    if scope not in SCOPES:
        raise ValueError(f"--scope must be one of {SCOPES}, got {scope!r}")
    if calibration_file is not None and calibration_prompts is not None:
        raise ValueError("give --calibration FILE or --calibration-prompts N, not both")
    if calibration_prompts is not None and calibration_prompts < 1:
        raise ValueError(f"--calibration-prompts must be at least 1, got {calibration_prompts}")


# ---------------------------------------------------------------------- the source
@contextmanager
def _open_source(source: str | os.PathLike[str], model: PolicyModelConfig | None) -> Iterator[_Source]:
    """The source checkpoint, HF or Megatron (HF memory maps are released after the block)."""
    directory = Path(source)
    try:
        if is_dist_checkpoint(directory):
            yield _megatron_source(directory, model)
            return
        if not (directory / fmt.MODEL_CONFIG_FILE).is_file():
            raise FileNotFoundError(f"{directory} is neither a Hugging Face model directory (config.json + safetensors) "
                                    "nor a Megatron dist checkpoint (metadata.json)")
        if model is not None:
            raise ValueError(f"--model-config is for Megatron dist checkpoints; {directory}'s config.json describes its model")
        with HfCheckpoint(directory) as hf:
            hf.check()
            names = list(hf_tensor_shapes(hf.model))  # a tied checkpoint's duplicate lm_head.weight is left out
            yield _Source(directory, "hf", hf.model, dict(hf.config), directory,
                          lambda: ((name, hf.get(name)) for name in names))
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"{directory}: {err}") from None


def _megatron_source(directory: Path, model: PolicyModelConfig | None) -> _Source:
    checkpoint = MegatronCheckpoint(directory, model)
    base_dir = directory / HF_BASE_DIR
    base_file = base_dir / fmt.MODEL_CONFIG_FILE
    base = json.loads(base_file.read_text()) if base_file.is_file() else {}

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for unit in checkpoint.units():
            yield from checkpoint.read(unit)

    return _Source(directory, "megatron-dist", checkpoint.model, base, base_dir if base_dir.is_dir() else None, tensors)


def _quantize(src: _Source, ratio: float, scope: str, progress: bool) -> QuantizedModelWeights:
    """The source's tensors, streamed through :func:`quantize_hf_weights` at ``scope`` (no channels yet)."""
    is_quantized = routed_expert_scope() if scope == "routed_experts" else experts_and_attention_scope()
    dtype = torch.float32 if src.model.dtype == "fp32" else torch.bfloat16
    total = len(hf_tensor_shapes(src.model))
    with progress_bar(progress, "to-quads: quantize", total) as advance:
        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in src.tensors():
                yield name, tensor
                advance()

        return quantize_hf_weights(stream(), is_quantized, ratio=ratio, unquantized_dtype=dtype)


# ---------------------------------------------------------------------- calibration prompts
def read_calibration_file(path: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """``(line number, prompt)`` of a calibration file: a ``.jsonl`` file holds one JSON object per
    line with a ``"prompt"`` or ``"text"`` string, any other file one prompt per line; blank lines
    are skipped. A file that is not UTF-8 text or holds no prompts, or a JSONL line without such a
    field, raises ValueError naming the file (and the line)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"calibration file {file} does not exist")
    jsonl = file.suffix == ".jsonl"
    prompts = []
    for number, line in enumerate(_utf8_text(file).splitlines(), start=1):
        if not line.strip():
            continue
        prompts.append((number, _jsonl_prompt(file, number, line) if jsonl else line))
    if not prompts:
        raise ValueError(f"calibration file {file} holds no prompts (blank lines are skipped)")
    return prompts


def _utf8_text(file: Path) -> str:
    """The file's text; ValueError naming the file, line and byte where it is not UTF-8."""
    data = file.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = len((data[: err.start].decode("utf-8") + "x").splitlines())  # the text before the bad byte is valid
        raise ValueError(f"calibration file {file}:{line} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset "
                         f"{err.start}); give a text or JSONL file of prompts encoded in UTF-8") from None


def _jsonl_prompt(file: Path, number: int, line: str) -> str:
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}:{number} is not a JSON object ({err.msg}); a .jsonl calibration file holds one "
                         'object per line, e.g. {"prompt": "..."}') from None
    text = next((doc[k] for k in ("prompt", "text") if isinstance(doc, dict) and isinstance(doc.get(k), str)), None)
    if not text:
        raise ValueError(f'{file}:{number} has no non-empty "prompt" or "text" string field')
    return text


def _prompts(src: _Source, calibration_file: Any, count: int | None, tokenizer: Any, seed: int) -> _Prompts:
    """The calibration prompts as token ids for the model (checked against its vocabulary, truncated
    to its maximum length)."""
    tok, tok_name = _tokenizer(src, tokenizer)
    if calibration_file is not None:
        texts = [(f"{calibration_file}:{number}", text) for number, text in read_calibration_file(calibration_file)]
        described = f"file {Path(calibration_file).resolve()}"
    else:
        count = count or DEFAULT_CALIBRATION_PROMPTS
        sampled = embedded.task(split="eval").sample_prompts(count, seed=seed)
        texts = [(f"arithmetic prompt {i}", p.text) for i, p in enumerate(sampled)]
        described = f"built-in arithmetic task (eval split), {count} prompts, seed {seed}"
    max_len, vocab = src.model.max_sequence_length, src.model.vocab_size
    ids, truncated = [], 0
    for where, text in texts:
        try:
            tokens = encode_prompt(tok, text)
        except ValueError as err:
            raise ValueError(f"calibration prompt {where}: {err}") from None
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"calibration prompt {where} has token id {bad}, outside the model's vocabulary "
                             f"(vocab_size {vocab}): is --tokenizer {tok_name} the model's tokenizer?")
        if len(tokens) > max_len:
            tokens, truncated = tokens[:max_len], truncated + 1
        if tokens:
            ids.append(tokens)
    if not ids:
        raise ValueError(f"the calibration prompts ({described}) tokenize to nothing")
    if truncated:
        logger.warning("%d calibration prompts were longer than max_position_embeddings (%d) and were truncated", truncated, max_len)
    return _Prompts(ids, described, tok_name, truncated)


def _tokenizer(src: _Source, spec: Any):
    """The calibration tokenizer and its name: ``spec`` (``"char"``, an HF directory or a saved
    CharTokenizer), else the source's tokenizer files (``char`` when they are the embedded model's
    character tokenizer), else ``char`` for the embedded vocabulary size."""
    if spec is not None:
        return load_tokenizer(spec), str(spec)
    char_vocab = embedded.model_config_fields()["vocab_size"]
    files = tokenizer_files_dir(src.files_dir, src.model.vocab_size)
    if files == embedded.TOKENIZER_DIR or _is_char_tokenizer(files):
        return embedded.tokenizer(), "char"
    if has_tokenizer(files):
        return load_tokenizer(files), str(files)
    raise ValueError(f"{src.directory} has no tokenizer files and its vocab_size ({src.model.vocab_size}) is not the "
                     f"embedded model's ({char_vocab}, the char tokenizer): pass --tokenizer DIR (or 'char')")


def _is_char_tokenizer(directory: Path | None) -> bool:
    """Whether ``directory`` holds the embedded model's character tokenizer (its shipped ``tokenizer.json``)."""
    if directory is None or not (directory / "tokenizer.json").is_file():
        return False
    return (directory / "tokenizer.json").read_bytes() == (embedded.TOKENIZER_DIR / "tokenizer.json").read_bytes()


# ---------------------------------------------------------------------- output
def _manifest_extra(src: _Source, weights: QuantizedModelWeights, ratio: float, scope: str, input_scales: str,
                    prompts: _Prompts | None, calibration: WeightCalibration | None) -> dict[str, Any]:
    calibrated = None
    if prompts is not None and calibration is not None:
        calibrated = {"source": prompts.source, "tokenizer": prompts.tokenizer, "prompts": len(prompts.ids),
                      "tokens": calibration.tokens, "truncated_prompts": prompts.truncated}
    return {
        "command": command_line(), "source": str(src.directory.resolve()), "source_kind": src.kind, "kind": "quads",
        "producer": fmt.producer_info(),
        "quads": {"ratio": float(ratio), "scope": scope, "input_scales": input_scales, "calibration": calibrated,
                  "quantized_modules": len(weights.quantized), "residual_fraction": weights.residual_fraction},
    }
