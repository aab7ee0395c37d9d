"""``python -m megatron_quads.megatron_lm.pretrain_gpt ARGS``: Megatron-LM's pretrain_gpt.py with QUADS flags.

Megatron-LM's ``pretrain_gpt.py`` (core_v0.16.1) hands ``pretrain`` a fixed ``extra_args_provider``
(ModelOpt's flags when ModelOpt is installed, else none), so its parser refuses flags of ours. This
launcher makes the same ``pretrain`` call with the script's own dataset provider, forward step,
model provider and builder, and adds :func:`~megatron_quads.megatron_lm.args.add_quads_args` to the
arguments and the QUADS spec as the default ``--spec``. Run it where ``import pretrain_gpt`` finds
the script: from the root of a Megatron-LM checkout, or with that root on ``PYTHONPATH``.
"""

from __future__ import annotations

import time

_PROGRAM_START = time.time()

import argparse  # noqa: E402
import importlib  # noqa: E402
from collections.abc import Callable  # noqa: E402
from functools import partial  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any  # noqa: E402

from megatron_quads.megatron_lm.args import SPEC, add_quads_args  # noqa: E402

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def quads_args_provider(other: ArgsProvider | None = None) -> ArgsProvider:
    """An ``extra_args_provider`` adding the ``--quads-*`` flags, then ``other``'s."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser = add_quads_args(parser)
        return other(parser) if other is not None else parser

    return provider


def check_spec_arg(args: Any) -> None:
    """Refuse a ``--spec`` other than QUADS's while ``--quads`` is on (QUADS would silently do nothing)."""
    spec = list(getattr(args, "spec", None) or [])
    if getattr(args, "quads", True) and spec != SPEC:
        raise ValueError(
            f"--spec {' '.join(spec)} replaces the QUADS layer spec, so --quads would change nothing: drop --spec "
            f"(this launcher defaults it to {' '.join(SPEC)}), or pass --no-quads"
        )


def checked_builder(builder: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron-LM's model builder, after :func:`check_spec_arg`."""

    def build(args, pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
        check_spec_arg(args)
        return builder(args, pre_process, post_process, vp_stage, config=config, pg_collection=pg_collection)

    return build


def import_pretrain_gpt() -> ModuleType:
    """Megatron-LM's ``pretrain_gpt.py``, imported as a module (its ``__main__`` block does not run)."""
    try:
        return importlib.import_module("pretrain_gpt")
    except ImportError as err:
        raise SystemExit(
            f"cannot import Megatron-LM's pretrain_gpt.py ({err}): run this from the root of a Megatron-LM checkout "
            "at core_v0.16.1, or put that root on PYTHONPATH"
        ) from None


def main() -> None:
    """Train as ``pretrain_gpt.py`` does, with the ``--quads-*`` flags and the QUADS ``--spec`` default."""
    script = import_pretrain_gpt()
    script.set_startup_timestamps(program_start=_PROGRAM_START, main_entry=time.time())
    script.train_valid_test_datasets_provider.is_distributed = True
    pretrain, store = script.inprocess_restart.maybe_wrap_for_inprocess_restart(script.pretrain)
    modelopt_args = script.add_modelopt_args if script.has_nvidia_modelopt else None
    pretrain(
        script.train_valid_test_datasets_provider,
        partial(script.model_provider, checked_builder(script.gpt_builder)),
        script.ModelType.encoder_or_decoder,
        script.forward_step,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer", "spec": list(SPEC)},
        extra_args_provider=quads_args_provider(modelopt_args),
        store=store,
        get_embedding_ranks=script.get_embedding_ranks,
    )


if __name__ == "__main__":
    main()
