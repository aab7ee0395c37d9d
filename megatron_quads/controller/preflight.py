"""Checks of a valid run config against the files and the machine it names, before Ray starts: the
tokenizer against the model's vocabulary, the held-out file, wandb's credentials, the reward function. Each raises
:class:`ConfigError` naming the key and the fix; none imports torch, Ray or vLLM."""

from __future__ import annotations

import configparser
import netrc
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from megatron_quads.controller.config_file import ConfigError
from megatron_quads.controller.task_settings import task_options, tokenizer_source

if TYPE_CHECKING:
    from megatron_quads.controller.config import RunConfig
    from megatron_quads.tasks import Task

WANDB_DEFAULT_BASE_URL = "https://api.wandb.ai"
"""wandb's server when ``WANDB_BASE_URL`` is unset."""


def run_task(cfg: RunConfig) -> Task:
    """The task the run trains on: the embedded default's arithmetic when ``task`` is unset, else
    ``make_task(task.kind, **task.options)`` with the ``data`` section's fields (:func:`task_options`)."""
    from megatron_quads import embedded
    from megatron_quads.tasks import make_task

    if cfg.task is None:
        return embedded.task(split="train")
    return make_task(cfg.task.kind, **task_options(cfg, cfg.task.options))


def check_tokenizer_vocab(cfg: RunConfig) -> None:
    """The run's tokenizer (``task.tokenizer``, or ``model.hf_path``'s: :func:`tokenizer_source`) must
    load and have no more tokens than the model's vocabulary (a larger id would index past the
    embedding). The embedded default's tokenizer fits its model."""
    arch, source = cfg.policy_architecture(), tokenizer_source(cfg)
    if source is None or arch is None:
        return
    from megatron_quads.tasks import load_tokenizer

    key = "model.hf_path" if source == cfg.model.hf_path else "task.tokenizer"
    try:
        tok = load_tokenizer(source)
    except (OSError, ValueError, ImportError) as err:
        raise ConfigError(f"{key} {source}: {' '.join(str(err).split())}") from None
    if tok.vocab_size > arch.vocab_size:
        raise ConfigError(f"{key} {source} has {tok.vocab_size} tokens but the model's vocab_size "
                          f"is {arch.vocab_size}: ids past the model's embedding cannot be trained; use the model's "
                          f"own tokenizer, or a model with vocab_size >= {tok.vocab_size}")


def check_eval_file(cfg: RunConfig) -> None:
    """With evaluation on, ``task.eval_options.path`` (a data-file task's held-out problems) must be a file."""
    if not cfg.eval.every or cfg.task is None or not cfg.task.eval_options or "path" not in cfg.task.eval_options:
        return
    path = Path(str(cfg.task.eval_options["path"])).expanduser()
    if not path.is_file():
        raise ConfigError(f"task.eval_options.path {path} is not a file (resolved: {path.resolve()}): give the "
                          "held-out data file, or set eval.every=0")


def wandb_credentials(environ: Mapping[str, str] = os.environ, home: Path | None = None) -> str | None:
    """Where wandb would find credentials for its server, looked up in wandb's order: ``WANDB_API_KEY``
    or ``WANDB_IDENTITY_TOKEN_FILE``; the netrc file (``NETRC``, else ``~/.netrc``, else ``~/_netrc``)
    entry for ``WANDB_BASE_URL``'s host; the ``api_key`` of wandb's settings file
    (``$WANDB_CONFIG_DIR/settings``, else ``~/.config/wandb/settings``). None when there are none. The
    key itself is not verified (that needs the network); wandb is not imported (seconds)."""
    for variable in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        if environ.get(variable):
            return variable
    home = home if home is not None else Path.home()
    host = urlsplit(environ.get("WANDB_BASE_URL") or WANDB_DEFAULT_BASE_URL).netloc
    candidates = ([Path(environ["NETRC"]).expanduser()] if environ.get("NETRC")
                  else [home / ".netrc", home / "_netrc"])
    for path in candidates:
        if not path.is_file():
            continue
        try:
            entry = netrc.netrc(path).authenticators(host)
        except (netrc.NetrcParseError, OSError):
            entry = None
        if entry and entry[2]:
            return str(path)
        break  # wandb reads the first netrc file that exists only
    settings = Path(environ.get("WANDB_CONFIG_DIR") or home / ".config" / "wandb") / "settings"
    parser = configparser.ConfigParser()
    try:
        parser.read(settings)
    except configparser.Error:
        return None
    if parser.get("default", "api_key", fallback=""):
        return str(settings)
    return None


def check_wandb_credentials(cfg: RunConfig, environ: Mapping[str, str] = os.environ, home: Path | None = None) -> None:
    """``logging.wandb=online`` needs wandb credentials on this machine (:func:`wandb_credentials`);
    without them the run is refused, since wandb would stop it at its first record."""
    if cfg.logging.wandb != "online" or wandb_credentials(environ, home) is not None:
        return
    host = environ.get("WANDB_BASE_URL") or WANDB_DEFAULT_BASE_URL
    raise ConfigError(f"logging.wandb=online needs wandb credentials for {host} and finds none (no WANDB_API_KEY, no "
                      "netrc entry, no api_key in wandb's settings file): run `wandb login` or set WANDB_API_KEY, or "
                      "use logging.wandb=offline (sync later with `wandb sync`)")


def check_custom_reward(cfg: RunConfig) -> None:
    """``reward.path`` / ``reward.name`` must load and score the task's first prompt (:func:`~megatron_quads.
    controller.custom_reward.check_reward_function`)."""
    if cfg.reward.path is None:
        return
    from megatron_quads.controller.custom_reward import check_reward_function

    try:
        sample = next(run_task(cfg).stream(seed=cfg.seed))
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(f"task.options: {' '.join(str(err).split())} (read for the sample row the reward "
                          "function is tried on)") from None
    check_reward_function(cfg.reward.path, cfg.reward.name, sample)


PREFLIGHT_CHECKS = (check_tokenizer_vocab, check_eval_file, check_wandb_credentials, check_custom_reward)
"""The checks :func:`~megatron_quads.controller.config.check_runnable` runs, in order."""
