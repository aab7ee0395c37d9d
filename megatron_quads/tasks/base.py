"""The task interface: prompts, rewards and resumable prompt streams.

A :class:`Task` hands out :class:`Prompt` s and scores a response with a :class:`RewardResult`.
Prompts come from a :class:`PromptStream`, an endless iterator whose position and RNG state fit in
a small JSON-able ``state_dict`` so the controller can checkpoint and resume it.

Only the standard library is imported here (no ray, megatron, vllm, torch).
"""

from __future__ import annotations

import enum
import random
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

STATE_VERSION = 1


class TaskDataError(ValueError):
    """A data file for a task is missing, unreadable or lacks a field; the message says how to fix it."""


class TaskDataFileNotFoundError(TaskDataError, FileNotFoundError):
    """A task's data file does not exist."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: what the policy sees (``text``), a stable ``id`` and the ground-truth ``answer``.

    ``answer`` is the bare ground truth (``"19"``, ``"\\frac{1}{2}"``), without end markers or
    ``####``; ``metadata`` carries extras (source file and record, difficulty) and is left out of
    equality and hashing.
    """

    id: str
    text: str
    answer: str
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False)


class RewardReason(enum.StrEnum):
    """Why a response got its reward."""

    CORRECT = "correct"  # the final answer equals the ground truth
    WRONG = "wrong"  # a well-formed answer that differs from the ground truth
    MALFORMED = "malformed"  # text is there, but no answer could be read from it
    EMPTY = "empty"  # nothing (or only whitespace) where the answer should be


@dataclass(frozen=True)
class RewardResult:
    """A scored response: the reward, why, and the answer read from the response (None if none)."""

    reward: float
    reason: RewardReason
    parsed: str | None = None
    detail: str = ""

    @property
    def correct(self) -> bool:
        return self.reason is RewardReason.CORRECT


class PromptStream(ABC, Iterator[Prompt]):
    """An endless, deterministic iterator over a task's prompts that can be checkpointed.

    ``state_dict()`` returns plain Python data (ints, strings, lists; JSON- and torch.save-able);
    ``load_state_dict(state)`` on a stream of the same task resumes at the same prompt.
    """

    def __init__(self, fingerprint: str, seed: int) -> None:
        self.fingerprint = fingerprint
        self.seed = int(seed)
        self.position = 0  # prompts handed out so far

    def __iter__(self) -> PromptStream:
        return self

    @abstractmethod
    def __next__(self) -> Prompt: ...

    def next_batch(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return [next(self) for _ in range(n)]

    @property
    @abstractmethod
    def kind(self) -> str: ...

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "kind": self.kind,
            "task": self.fingerprint,
            "seed": self.seed,
            "position": self.position,
        }

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Resume from ``state``; ``strict`` refuses a state saved for a different task or data."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"prompt stream state version {state.get('version')!r}, expected {STATE_VERSION}")
        if state.get("kind") != self.kind:
            raise ValueError(f"prompt stream state is for a {state.get('kind')!r} stream, this one is {self.kind!r}")
        if strict and state.get("task") != self.fingerprint:
            raise ValueError(
                f"prompt stream state was saved for task {state.get('task')!r} but this stream is for "
                f"{self.fingerprint!r} (different task settings or data); resume with the same task, or "
                "pass strict=False to take the position anyway"
            )
        self.seed = int(state["seed"])
        self.position = int(state["position"])


def _rng_state_to_list(rng: random.Random) -> list[Any]:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _rng_state_from_list(state: Sequence[Any]) -> tuple[Any, ...]:
    version, internal, gauss = state
    return (int(version), tuple(int(x) for x in internal), gauss)


class GeneratorStream(PromptStream):
    """Prompts drawn one after another from a ``random.Random(seed)`` (synthetic tasks).

    ``draw(rng, seed, position)`` makes the prompt at ``position``; the state holds the position and the
    generator's full state (Mersenne Twister words), so a restored stream continues exactly.
    """

    kind = "generator"

    def __init__(self, fingerprint: str, seed: int, draw: Callable[[random.Random, int, int], Prompt]) -> None:
        super().__init__(fingerprint, seed)
        self._draw = draw
        self._rng = random.Random(self.seed)

    def __next__(self) -> Prompt:
        prompt = self._draw(self._rng, self.seed, self.position)
        self.position += 1
        return prompt

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "rng_state": _rng_state_to_list(self._rng)}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        super().load_state_dict(state, strict)
        self._rng = random.Random()
        self._rng.setstate(_rng_state_from_list(state["rng_state"]))


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The order of a dataset's ``n`` records in ``epoch``: a pure function of (seed, epoch)."""
    order = list(range(n))
    if shuffle:
        # str seeds go through SHA-512: the same order in every process and Python version
        random.Random(f"{seed}/{epoch}").shuffle(order)
    return order


class DatasetStream(PromptStream):
    """Epochs over a finite list of prompts, reshuffled each epoch.

    The RNG state of this stream is ``(seed, epoch)``: each epoch's order is
    ``epoch_order(len(prompts), seed, epoch)``; the state holds those and the index in the epoch.
    """

    kind = "dataset"

    def __init__(self, fingerprint: str, seed: int, prompts: Sequence[Prompt], shuffle: bool = True) -> None:
        if not prompts:
            raise ValueError("a dataset stream needs at least one prompt")
        super().__init__(fingerprint, seed)
        self._prompts = prompts
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0  # position inside the current epoch
        self._order = epoch_order(len(prompts), self.seed, 0, shuffle)

    def __next__(self) -> Prompt:
        if self.index >= len(self._prompts):
            self.epoch += 1
            self.index = 0
            self._order = epoch_order(len(self._prompts), self.seed, self.epoch, self.shuffle)
        prompt = self._prompts[self._order[self.index]]
        self.index += 1
        self.position += 1
        return prompt

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "epoch": self.epoch,
            "index": self.index,
            "shuffle": self.shuffle,
            "num_prompts": len(self._prompts),
        }

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        if strict and state.get("num_prompts") != len(self._prompts):
            raise ValueError(
                f"prompt stream state was saved for {state.get('num_prompts')} prompts, this dataset has "
                f"{len(self._prompts)}; resume with the same data file, or pass strict=False"
            )
        super().load_state_dict(state, strict)
        self.shuffle = bool(state["shuffle"])
        self.epoch = int(state["epoch"])
        self.index = min(int(state["index"]), len(self._prompts))
        self._order = epoch_order(len(self._prompts), self.seed, self.epoch, self.shuffle)


def seed_from(seed: int | random.Random) -> int:
    """An int seed; a ``random.Random`` is advanced by one 63-bit draw."""
    if isinstance(seed, random.Random):
        return seed.getrandbits(63)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int or a random.Random, got {type(seed).__name__}")
    return seed


def fingerprint(*parts: object) -> str:
    """A short stable tag for a task's settings or data (CRC-32 of their reprs)."""
    return f"{zlib.crc32(repr(parts).encode()):08x}"


class Task(ABC):
    """Prompts plus a verifiable reward.

    Subclasses implement :meth:`stream` and :meth:`score`. ``sample_prompts(n, seed)`` is the first
    ``n`` prompts of ``stream(seed)``, so the same seed always gives the same prompts.
    """

    name: str = "task"

    @abstractmethod
    def stream(self, seed: int = 0) -> PromptStream:
        """A fresh resumable prompt stream; ``seed`` fixes the order."""

    @abstractmethod
    def score(self, prompt: Prompt, response_text: str) -> RewardResult:
        """Score the policy's ``response_text`` (the generated continuation only) for ``prompt``."""

    def sample_prompts(self, n: int, seed: int | random.Random = 0) -> list[Prompt]:
        """``n`` prompts, deterministic in ``seed`` (an int, or a ``random.Random`` to draw a seed from)."""
        return self.stream(seed_from(seed)).next_batch(n)

    def reward(self, prompt: Prompt, response_text: str) -> float:
        return self.score(prompt, response_text).reward

    def score_batch(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> list[RewardResult]:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        return [self.score(p, r) for p, r in zip(prompts, responses, strict=True)]

    def rewards(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> list[float]:
        return [r.reward for r in self.score_batch(prompts, responses)]


class GeneratedTask(Task):
    """A task whose problems are drawn from a random generator and whose ideal completion is known:
    built from a frozen dataclass ``config`` and a ``name`` (the stream's identity is both), subclasses
    give :meth:`draw_problem`, :meth:`target` and :meth:`score`; the stream and the SFT pairs follow."""

    def __init__(self, config: Any, name: str) -> None:
        self.config = config
        self.name = name
        self._fingerprint = f"{name}:{fingerprint(sorted(asdict(config).items()))}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, config={self.config!r})"

    @abstractmethod
    def draw_problem(self, rng: random.Random) -> tuple[str, int]:
        """One problem ``(prompt_text, result)`` drawn from ``rng``."""

    @abstractmethod
    def target(self, prompt: Prompt) -> str:
        """The completion the policy should write for ``prompt``."""

    def stream(self, seed: int = 0) -> PromptStream:
        def draw(rng: random.Random, seed: int, position: int) -> Prompt:
            text, result = self.draw_problem(rng)
            return Prompt(id=f"{self.name}/s{seed}/{position}", text=text, answer=str(result))

        return GeneratorStream(self._fingerprint, seed_from(seed), draw)

    def sft_pairs(self, n: int, seed: int | random.Random = 0) -> list[tuple[str, str]]:
        """``n`` supervised ``(prompt, completion)`` pairs for warm-start SFT."""
        return [(p.text, self.target(p)) for p in self.sample_prompts(n, seed)]

    def iter_sft_pairs(self, seed: int | random.Random = 0) -> Iterator[tuple[str, str]]:
        """An endless stream of ``(prompt, completion)`` pairs."""
        for p in self.stream(seed_from(seed)):
            yield p.text, self.target(p)
