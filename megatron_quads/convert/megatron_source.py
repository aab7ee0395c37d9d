"""A Megatron dist checkpoint read offline, a few global-tensor slices at a time.

No trainer processes: one process joins a single-rank gloo group (Megatron's loader needs a
process group) and asks Megatron's dist-checkpointing loader for exactly the slices it wants, e.g.
one layer of every stacked tensor, so memory holds one unit (the embedding, a layer, the head) at a
time, whatever TP/EP layout the checkpoint was saved in.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_quads.convert.finite import require_finite
from megatron_quads.convert.names import (
    MegatronTensor,
    hf_from_megatron,
    hf_tensor_shapes,
    megatron_from_hf,
    megatron_tensors,
)
from megatron_quads.megatron_lm.checkpoint import megatron_lm_model_config
from megatron_quads.trainer.checkpoint_audit import audit_dist_checkpoint, load_dist_checkpoint, load_dist_tensors_metadata
from megatron_quads.trainer.model import PolicyModelConfig, load_model_config
from megatron_quads.trainer.rendezvous import find_free_port
from megatron_quads.trainer.settings import DIST_METADATA, dist_checkpoint_dir


@contextmanager
def single_process_group() -> Iterator[None]:
    """A one-rank gloo default group for the duration (none is created if one exists)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", world_size=1, rank=0,
        timeout=datetime.timedelta(seconds=600),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def is_dist_checkpoint(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a Megatron dist checkpoint (its ``metadata.json``), itself or as a
    GRPO run's checkpoint (:func:`dist_checkpoint_dir`)."""
    return (dist_checkpoint_dir(directory) / DIST_METADATA).is_file()


@dataclass(frozen=True)
class Unit:
    """What one read brings into memory: the embedding (``layer=None, part='embedding'``), one
    transformer layer, or the head (final norm and output matrix)."""

    part: str
    layer: int | None = None


class MegatronCheckpoint:
    """A dist checkpoint of a Qwen3-MoE-mappable GPT-MoE, its architecture and its global tensors.
    Its pickles are audited before anything of it is read; a tensor holding NaN or Inf is refused
    when read, naming it, unless ``allow_nonfinite``."""

    def __init__(self, directory: str | os.PathLike[str], model: PolicyModelConfig | None = None,
                 allow_nonfinite: bool = False) -> None:
        self.allow_nonfinite = allow_nonfinite
        self.directory = dist_checkpoint_dir(directory)
        if not is_dist_checkpoint(self.directory):
            raise FileNotFoundError(f"{self.directory} is not a complete Megatron dist checkpoint (no {DIST_METADATA})")
        audit_dist_checkpoint(self.directory)  # its pickles, before anything of it is read
        found = load_model_config(self.directory)
        if model is None and found is None:
            found = megatron_lm_model_config(self.directory)  # a Megatron-LM checkpoint records its arguments
        if model is None and found is None:
            raise FileNotFoundError(
                f"{self.directory} has no model_config.json and no Megatron-LM arguments recording its architecture; "
                "pass --model-config FILE (a model_config.json, or the run's config.yaml) to say what it holds"
            )
        self.model: PolicyModelConfig = model or found
        with single_process_group():
            self.metadata = load_dist_tensors_metadata(self.directory)
        self.tensors = megatron_tensors(self.model)
        self._check()

    def _expected_shape(self, tensor: MegatronTensor, slice_shape: tuple[int, ...]) -> tuple[int, ...]:
        stack = (self.model.num_layers, self.model.num_experts)[: tensor.depth]
        return (*stack, *slice_shape)

    def _check(self) -> None:
        # the shape of one slice of each global tensor, built from shape-only (meta) HF tensors
        probe = {name: torch.empty(shape, device="meta") for name, shape in hf_tensor_shapes(self.model).items()}
        index = {0: (), 1: (0,), 2: (0, 0)}
        for tensor in self.tensors:
            if tensor.key not in self.metadata:
                raise ValueError(f"{self.directory} lacks tensor '{tensor.key}' that a model of its architecture holds")
            slice_shape = tuple(megatron_from_hf(tensor.key, index[tensor.depth], probe.__getitem__, self.model).shape)
            expected = self._expected_shape(tensor, slice_shape)
            found = tuple(self.metadata[tensor.key].global_shape)
            if found != expected:
                raise ValueError(
                    f"tensor '{tensor.key}' in {self.directory} has shape {list(found)}, but its model config implies "
                    f"{list(expected)}: model_config.json does not describe this checkpoint"
                )
        known = {t.key for t in self.tensors}
        for key in self.metadata:
            if key not in known and "_extra_state" not in key and not key.startswith("optimizer"):
                raise ValueError(
                    f"{self.directory} holds tensor '{key}', which has no Hugging Face (Qwen3-MoE) counterpart"
                )

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the checkpoint's weights."""
        return self.metadata["embedding.word_embeddings.weight"].dtype

    def units(self) -> list[Unit]:
        """Read order: embedding, layers 0..L-1, head."""
        return [Unit("embedding"), *(Unit("layer", i) for i in range(self.model.num_layers)), Unit("head")]

    def _unit_tensors(self, unit: Unit) -> list[MegatronTensor]:
        if unit.part == "embedding":
            return [t for t in self.tensors if t.key == "embedding.word_embeddings.weight"]
        if unit.part == "head":
            return [t for t in self.tensors if t.depth == 0 and t.key != "embedding.word_embeddings.weight"]
        return [t for t in self.tensors if t.depth > 0]

    def unit_bytes(self, unit: Unit) -> int:
        """Bytes of the HF tensors ``unit`` yields (from the metadata: nothing is read)."""
        total = 0
        for tensor in self._unit_tensors(unit):
            meta = self.metadata[tensor.key]
            numel = int(torch.Size(meta.global_shape).numel())
            stack = (1, self.model.num_layers, self.model.num_layers)[tensor.depth]
            total += numel // stack * meta.dtype.itemsize
        return total

    def read(self, unit: Unit) -> list[tuple[str, torch.Tensor]]:
        """The HF tensors of ``unit``, each owning its memory (safetensors stores no shared views)."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        request = {}
        for tensor in self._unit_tensors(unit):
            meta = self.metadata[tensor.key]
            shape = tuple(meta.global_shape)
            if tensor.depth == 0:
                buf = torch.empty(shape, dtype=meta.dtype)
                request[tensor.key] = ShardedTensor.from_rank_offsets(tensor.key, buf, replica_id=0)
            else:  # one layer of a stacked tensor: [1, (E,) ...] at offset `layer` along the layer axis
                buf = torch.empty((1, *shape[1:]), dtype=meta.dtype)
                request[tensor.key] = ShardedTensor.from_rank_offsets(
                    tensor.key, buf, (0, unit.layer, shape[0]), replica_id=0
                )
        with single_process_group():
            loaded = load_dist_checkpoint(request, self.directory, validate_access_integrity=False)
        out: list[tuple[str, torch.Tensor]] = []
        for tensor in self._unit_tensors(unit):
            value = loaded.pop(tensor.key)
            mapped: list[tuple[str, torch.Tensor]] = []
            if tensor.depth == 0:
                mapped += hf_from_megatron(tensor.key, (), value, self.model)
            elif tensor.depth == 1:
                mapped += hf_from_megatron(tensor.key, (unit.layer,), value[0], self.model)
            else:
                for expert in range(value.shape[1]):
                    mapped += hf_from_megatron(tensor.key, (unit.layer, expert), value[0, expert], self.model)
            if not self.allow_nonfinite:
                for name, t in mapped:
                    require_finite(name, t, f"{self.directory} (Megatron tensor '{tensor.key}')")
            out += mapped
            del value
        return [(name, t.clone() if t.untyped_storage().nbytes() != t.nbytes else t) for name, t in out]
