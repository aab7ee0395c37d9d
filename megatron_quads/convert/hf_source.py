"""A Hugging Face model directory read lazily: ``config.json`` plus safetensors tensors by name.

Tensors are read one at a time from memory-mapped safetensors files, so a reader holds only what
it asked for. :meth:`HfCheckpoint.check` compares the names and shapes in the files' headers with
what the config implies before anything is converted.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from megatron_quads.convert.finite import require_finite
from megatron_quads.convert.names import hf_tensor_shapes
from megatron_quads.rollout import checkpoint_format as fmt
from megatron_quads.trainer.hf_config import policy_config_from_hf
from megatron_quads.trainer.model import PolicyModelConfig

# HF files a converted model keeps beside its weights (what tokenizers and vLLM read)
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "generation_config.json", "chat_template.jinja",
)


class HfCheckpoint:
    """A local HF directory: its config, the trainer architecture it maps to, and its tensors.
    A tensor holding NaN or Inf is refused when read, naming it, unless ``allow_nonfinite``."""

    def __init__(self, directory: str | os.PathLike[str], allow_nonfinite: bool = False) -> None:
        self.directory = Path(directory)
        self.allow_nonfinite = allow_nonfinite
        config_path = self.directory / fmt.MODEL_CONFIG_FILE
        if not config_path.is_file():
            raise FileNotFoundError(f"{self.directory} is not a Hugging Face model directory (no config.json)")
        self.config: dict[str, Any] = json.loads(config_path.read_text())
        if "quantization_config" in self.config:
            raise ValueError(
                f"{self.directory} is a quantized checkpoint ({self.config['quantization_config'].get('quant_method')}); "
                "convert from the BF16 / FP32 Hugging Face model"
            )
        self.model: PolicyModelConfig = policy_config_from_hf(self.config)
        self.files = fmt.tensor_file_map(self.directory)
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}

    def _handle(self, file_name: str):
        if file_name not in self._handles:
            path = self.directory / file_name
            if not path.is_file():
                raise FileNotFoundError(f"{path} is listed in {fmt.INDEX_FILE} but is missing")
            try:
                self._handles[file_name] = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except (OSError, SafetensorError) as err:
                raise ValueError(f"cannot read {path}: {err}; the file is damaged") from err
        return self._handles[file_name]

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name`` from its file's header (nothing is read)."""
        return tuple(self._handle(self._file_of(name)).get_slice(name).get_shape())

    def _file_of(self, name: str) -> str:
        if name not in self.files:
            raise KeyError(f"{self.directory} has no tensor '{name}' (a Qwen3-MoE checkpoint of this config holds it)")
        return self.files[name]

    def get(self, name: str) -> torch.Tensor:
        """Tensor ``name`` (a fresh CPU tensor); finite unless ``allow_nonfinite``."""
        file_name = self._file_of(name)
        tensor = self._handle(file_name).get_tensor(name)
        if not self.allow_nonfinite:
            require_finite(name, tensor, str(self.directory / file_name))
        return tensor

    def check(self) -> None:
        """Every tensor the config implies is present with its shape, and no other tensor is: or ValueError."""
        expected = hf_tensor_shapes(self.model)
        missing = [n for n in expected if n not in self.files]
        if missing:
            raise ValueError(f"{self.directory} lacks {len(missing)} tensor(s) its config.json implies, e.g. '{missing[0]}'")
        extra = sorted(n for n in self.files if n not in expected)
        if extra == ["lm_head.weight"] and not self.model.untie_embeddings:
            extra = []  # a tied checkpoint saved with its (identical) output matrix
        if extra:
            raise ValueError(
                f"{self.directory} holds {len(extra)} tensor(s) a Qwen3-MoE model of its config.json has no place for, "
                f"e.g. '{extra[0]}'"
            )
        for name, shape in expected.items():
            found = self.shape(name)
            if found != shape:
                raise ValueError(
                    f"tensor '{name}' in {self.directory} has shape {list(found)}, but config.json implies {list(shape)}"
                )
        for name in expected:
            dtype = self._handle(self._file_of(name)).get_slice(name).get_dtype()
            if dtype not in ("BF16", "F32", "F16"):
                raise ValueError(f"tensor '{name}' in {self.directory} has dtype {dtype}; expected a floating-point tensor")

    def close(self) -> None:
        """Release the memory maps."""
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> HfCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
