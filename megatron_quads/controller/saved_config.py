"""The run config as a run directory and its checkpoints keep it: written as YAML, read back with this
version's defaults."""

from __future__ import annotations

from pathlib import Path

from megatron_quads.atomic_io import write_atomic
from megatron_quads.controller.config import RunConfig


def save_config(cfg: RunConfig, path: Path) -> None:
    """The resolved config as YAML (what the resume command reads), written atomically."""
    from omegaconf import OmegaConf

    write_atomic(path, lambda tmp: OmegaConf.save(OmegaConf.create(cfg.model_dump(mode="json")), tmp))


def with_defaults(saved: dict) -> dict:
    """A saved config tree as this version resolves it (defaults of keys added since filled in);
    as it is when it no longer validates."""
    from pydantic import ValidationError

    try:
        return RunConfig.model_validate(saved).model_dump(mode="json")
    except ValidationError:
        return saved
