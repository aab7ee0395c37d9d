"""An engine's first error is the one a failed run names: a restart that fails after it does not hide it."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from megatron_quads.controller.actor_groups import Rollouts, engine_error  # noqa: E402
from megatron_quads.controller.config import load_config  # noqa: E402


def test_a_failed_restart_names_the_engines_first_error_first(monkeypatch: pytest.MonkeyPatch) -> None:
    rollouts = object.__new__(Rollouts)  # the retry logic alone: no actors
    rollouts.cfg = load_config(None, ["rollout.max_retries=2"])
    monkeypatch.setattr(rollouts, "_failed_engines", lambda hung_too: [0], raising=False)

    def restart(index: int) -> None:
        raise RuntimeError("layer 0: calibration saw no token for this layer: calibrate on more prompts")

    def generate() -> None:  # what the engine raised, as Ray hands it to the driver
        raise ray.exceptions.RayTaskError("generate", "Traceback (most recent call last): ...",
                                          ValueError("the attention backend does not support head size 16"))

    monkeypatch.setattr(rollouts, "_restart", restart, raising=False)
    with pytest.raises(RuntimeError) as caught:
        rollouts._retrying("generation", generate)
    message = str(caught.value)
    assert message.startswith("rollout engines [0] failed during generation: ValueError: the attention backend does "
                              "not support head size 16; restarting engine 0 failed too: RuntimeError: layer 0: "
                              "calibration saw no token"), message
    assert isinstance(caught.value.__cause__, ray.exceptions.RayTaskError)  # the traceback shows it as the cause


def test_an_engine_error_is_the_last_line_of_what_the_engine_raised() -> None:
    assert engine_error(ValueError("Traceback ...\n  File x\nValueError: head size 16 not supported\n")) == (
        "ValueError: ValueError: head size 16 not supported")
    assert engine_error(RuntimeError("")) == "RuntimeError: "
