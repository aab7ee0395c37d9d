"""Reading a run config: a YAML file plus dotted ``key=value`` overrides -> one plain mapping.

This module imports no torch, Megatron, Ray or vLLM (nor does the schema,
``megatron_quads.controller.config``), so the command line reports a file that is missing, a
directory, invalid YAML, a top-level list or scalar, or a malformed override at once.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

try:  # OmegaConf.load's own YAML loader: 1e-4 is a float, a duplicate key is an error
    from omegaconf._yaml import get_yaml_loader
except ImportError:  # omegaconf < 2.4
    from omegaconf._utils import get_yaml_loader


class ConfigError(ValueError):
    """An invalid configuration, with every problem named by its dotted key."""


_OVERRIDE = re.compile(r"^[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)*=")
"""``key=value`` with a dotted key of identifiers, e.g. ``grpo.steps=3``."""


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error as ``line L, column C: problem`` (1-based, as editors count)."""
    if isinstance(err, yaml.MarkedYAMLError) and err.problem_mark is not None:
        mark = err.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: {err.problem}"
        if err.context and err.context_mark is not None:
            where += f" ({err.context} at line {err.context_mark.line + 1}, column {err.context_mark.column + 1})"
        return where
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _read_file(path: Path) -> DictConfig:
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist: give the path of a YAML file (e.g. "
                          "examples/embedded_default.yaml), or no file for the embedded default")
    if not path.is_file():
        raise ConfigError(f"config file {path} is a directory, not a YAML file: give the path of a file in it "
                          "(a run writes RUN_DIR/config.yaml)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {path} cannot be read: {err}") from None
    try:
        tree = yaml.load(text, Loader=get_yaml_loader())
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(err)}") from None
    if tree is None:  # an empty file: every key at its default
        return OmegaConf.create({})
    if not isinstance(tree, dict):
        kind = "a list" if isinstance(tree, list) else f"a single value ({tree!r})"
        raise ConfigError(f"config file {path} holds {kind} at the top level; a run config is a mapping of keys "
                          "(e.g. 'grpo:' with 'steps: 3' under it)")
    try:
        return OmegaConf.create(tree)
    except OmegaConfBaseException as err:
        raise ConfigError(f"config file {path}: {str(err).splitlines()[0]}") from None


def read_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """YAML file (optional) + ``key=value`` overrides -> the merged, resolved mapping (not yet validated);
    raises :class:`ConfigError` naming the file and line, or the override, that is wrong."""
    base = OmegaConf.create({}) if path is None else _read_file(Path(path))
    merged = base
    for item in overrides:
        if not _OVERRIDE.match(item):
            raise ConfigError(f"override {item!r} must look like key=value (dotted keys, e.g. grpo.steps=3)")
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: its value is not valid YAML ({_yaml_problem(err)}); "
                              "quote the value") from None
        except OmegaConfBaseException as err:
            raise ConfigError(f"override {item!r}: {str(err).splitlines()[0]}") from None
    try:
        tree = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as err:
        raise ConfigError(f"config: {str(err).splitlines()[0]} (an interpolation ${{...}} that cannot be resolved)") \
            from None
    assert isinstance(tree, dict)
    return tree
