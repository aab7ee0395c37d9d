"""A reward function of the user's own (``reward.path``, ``reward.name``): loaded from its file, tried
once on a sample row before Ray starts, and called on every response of the run.

The function's signature (docs/rewards.md)::

    def compute_score(prompt: str, response: str, row: dict) -> float | dict:

``prompt`` is the text the policy saw, ``response`` the text it generated (the continuation only),
``row`` the fields of the dataset row the prompt came from (:func:`row_fields`). It returns the reward
as a number, or a dict with a ``"score"`` number and any other numeric metrics, which are averaged
over the step's responses and logged as ``reward/<name>``.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_quads.controller.config_file import ConfigError
from megatron_quads.tasks import Prompt

METRIC_PREFIX = "reward/"
"""The records' prefix of a reward function's extra metrics."""

PROMPT_PREVIEW_CHARS = 60
"""Characters of a prompt quoted in an error about its row."""


class RewardFunctionError(RuntimeError):
    """The reward function raised, or returned something that is not a reward, on a row of the run."""


@dataclass(frozen=True)
class RewardScore:
    """One response's reward and the extra metrics the function returned with it."""

    score: float
    metrics: dict[str, float] = field(default_factory=dict)


def row_fields(prompt: Prompt) -> dict[str, Any]:
    """The fields of the row ``prompt`` came from: a data file's record as read (``task.kind`` qa, gsm8k,
    math), else the prompt's ``id`` and ``answer`` (the synthetic arithmetic task)."""
    row = prompt.metadata.get("row")
    if row is not None:
        return dict(row)
    return {"id": prompt.id, "answer": prompt.answer}


def _number(value: Any) -> float | None:
    """``value`` as a finite float when it is a real number (bools count as 0 / 1), else None."""
    if not isinstance(value, numbers.Real):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def reward_score(value: Any) -> RewardScore:
    """A reward function's return value as a :class:`RewardScore`. The rule: a finite number, or a
    mapping with a finite number under ``"score"`` whose other keys are strings with finite numbers.
    Raises TypeError saying what was wrong."""
    if isinstance(value, Mapping):
        if "score" not in value:
            raise TypeError(f"returned a dict without a 'score' key (keys: {sorted(map(str, value))})")
        score = _number(value["score"])
        if score is None:
            raise TypeError(f"returned a dict whose 'score' is {value['score']!r}, not a finite number")
        metrics = {}
        for key, extra in value.items():
            if key == "score":
                continue
            number = _number(extra)
            if not isinstance(key, str) or number is None:
                raise TypeError(f"returned an extra metric {key!r}: {extra!r}; extra metrics must be finite numbers "
                                "under string keys")
            metrics[key] = number
        return RewardScore(score, metrics)
    score = _number(value)
    if score is None:
        raise TypeError(f"returned {value!r} ({type(value).__name__}); return a finite number, or a dict with a "
                        "'score' number and other numeric metrics")
    return RewardScore(score)


def load_reward_function(path: str, name: str) -> Callable[..., Any]:
    """The function ``name`` of the Python file ``path``. Raises :class:`ConfigError` naming
    ``reward.path`` or ``reward.name`` and the fix when the file is missing, fails to import, or does
    not define a callable ``name``."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"reward.path {path} is not a file: give the Python file that defines the reward function "
                          f"(resolved: {file.resolve()})")
    module_name = f"megatron_quads_user_reward_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ConfigError(f"reward.path {path} cannot be imported as a Python module: give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look a module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # the user's module: any error it raises is the config's problem
        sys.modules.pop(module_name, None)
        raise ConfigError(f"reward.path {path} failed to import: {type(err).__name__}: {_one_line(err)}"
                          f"{_where_in(file, err)}; fix the file") from None
    function = getattr(module, name, None)
    if function is None:
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                         and getattr(v, "__module__", None) == module_name)
        raise ConfigError(f"reward.name {name!r}: {path} defines no such function (its functions: {defined}); set "
                          "reward.name to one of them")
    if not callable(function):
        raise ConfigError(f"reward.name {name!r} in {path} is a {type(function).__name__}, not a function: set "
                          "reward.name to the reward function")
    return function


def _one_line(text: object) -> str:
    """``text`` with its whitespace runs (newlines included) as single spaces."""
    return " ".join(str(text).split())


def _where_in(file: Path, err: BaseException) -> str:
    """`` (file:line)`` of the innermost line of ``err``'s traceback inside ``file``; empty when the
    traceback never entered it (a call with the wrong arguments) or the error names its line itself (a
    SyntaxError)."""
    if isinstance(err, SyntaxError):
        return ""
    inside = [f for f in traceback.extract_tb(err.__traceback__) if Path(f.filename).resolve() == file.resolve()]
    return f" ({file.name}:{inside[-1].lineno})" if inside else ""


class CustomReward:
    """The configured reward function, called on (prompt, response, row); its errors name the row."""

    def __init__(self, function: Callable[..., Any], path: str, name: str) -> None:
        self.function, self.path, self.name = function, path, name

    @classmethod
    def from_config(cls, path: str, name: str) -> CustomReward:
        """The function ``name`` of ``path`` (:func:`load_reward_function`)."""
        return cls(load_reward_function(path, name), path, name)

    def label(self) -> str:
        """``name in path``, as errors name the function."""
        return f"reward function {self.name} in {self.path}"

    def score(self, prompt: Prompt, response: str) -> RewardScore:
        """``response``'s reward for ``prompt``. Raises :class:`RewardFunctionError` naming the row (its
        source, or id, and the prompt's start) and the function when it raises or returns a non-reward."""
        try:
            value = self.function(prompt.text, response, row_fields(prompt))
        except Exception as err:  # the user's code: whatever it raises is reported with the row
            where = _where_in(Path(self.path), err)
            raise self._row_error(prompt, f"raised {type(err).__name__}: {_one_line(err)}{where}") from err
        try:
            return reward_score(value)
        except TypeError as err:
            raise self._row_error(prompt, _one_line(err)) from None

    def _row_error(self, prompt: Prompt, what: str) -> RewardFunctionError:
        where = prompt.metadata.get("source", prompt.id)
        start = prompt.text[:PROMPT_PREVIEW_CHARS] + ("..." if len(prompt.text) > PROMPT_PREVIEW_CHARS else "")
        return RewardFunctionError(f"{self.label()} {what} on row {where} (prompt {start!r}); fix the function, "
                                   "then run the same command again")

    def scores(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> list[RewardScore]:
        """The reward of each response, ``responses[i]`` answering ``prompts[i]``."""
        return [self.score(p, r) for p, r in zip(prompts, responses, strict=True)]


def mean_metrics(scores: Sequence[RewardScore]) -> dict[str, float]:
    """Each extra metric averaged over the responses that returned it, keyed ``reward/<name>``."""
    totals: dict[str, list[float]] = {}
    for s in scores:
        for key, value in s.metrics.items():
            totals.setdefault(key, []).append(value)
    return {f"{METRIC_PREFIX}{key}": sum(values) / len(values) for key, values in totals.items()}


def check_reward_function(path: str, name: str, sample: Prompt) -> CustomReward:
    """Load the reward function and call it once on ``sample`` with the sample's answer as the response;
    raises :class:`ConfigError` naming the key and the fix when it cannot be loaded, raises, or returns
    something that is not a reward."""
    reward = CustomReward.from_config(path, name)
    try:
        reward.score(sample, sample.answer)
    except RewardFunctionError as err:
        raise ConfigError(f"reward.path / reward.name: {str(err).removesuffix(', then run the same command again')} "
                          "(a sample call before the run, with the row's answer as the response)") from None
    return reward
