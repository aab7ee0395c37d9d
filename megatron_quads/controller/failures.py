"""Why a trainer rank failed: the root cause behind Ray's wrappers, the failing rank, and whether a
resume can get past it (:class:`TrainerFailure`)."""

from __future__ import annotations

import builtins
import dataclasses
import re

import ray

from megatron_quads.controller.faults import WRITE_FAULTS, StorageError, storage_error

NOT_RESUMABLE = (ValueError, TypeError, KeyError, IndexError, AttributeError, NameError, NotImplementedError,
                 AssertionError, ImportError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
"""Errors a resume would meet again: bad inputs (a missing path, a config that cannot build the model, a
corrupt file) and program errors. A rank that died (its process or node gone) or raised anything else
(CUDA out of memory, NCCL, timeouts: RuntimeError and OSError) may succeed when resumed."""

NOT_RESUMABLE_NAMES = frozenset({"CheckpointingException", "ValidationError", "ConfigError"})
"""Such errors known by name only (the class is not imported here, or only the text came back)."""


class TrainerFailure(RuntimeError):
    """A trainer rank died or raised: the run stops; the last complete checkpoint is intact. ``rank``,
    ``error_type`` and ``resumable`` (see :data:`NOT_RESUMABLE`) describe the root cause."""

    def __init__(self, message: str, *, rank: int | None = None, error_type: str = "", resumable: bool = True) -> None:
        super().__init__(message)
        self.rank, self.error_type, self.resumable = rank, error_type, resumable

    def with_note(self, note: str) -> TrainerFailure:
        """The same failure with ``note`` (what to do) on a line of its own."""
        return TrainerFailure(f"{self}\n{note}", rank=self.rank, error_type=self.error_type, resumable=self.resumable)


NO_RESUME_NOTE = ("a resume would meet the same error (it comes from the inputs or the code, not from a lost process): "
                  "fix its cause, then start the run again")

TRAINER_RANKS: dict[str, int] = {}
"""Ray actor id (hex) -> trainer rank, for naming the rank of a failure."""

_FINAL_LINE = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:\([\w.]+\))?)(?:: ?(?P<message>.*))?$")


def _last_exception_line(traceback_text: str) -> tuple[str, str] | None:
    """``(type, message's first line)`` of the last exception a traceback text shows."""
    lines = traceback_text.rstrip().splitlines()
    after_frames = max((i for i, line in enumerate(lines) if line.startswith("  File ")), default=-1) + 1
    for line in lines[after_frames:]:
        match = _FINAL_LINE.match(line)
        if match and not line.startswith(" "):
            return match["type"].rsplit(".", 1)[-1], (match["message"] or "").strip()
    return None


@dataclasses.dataclass(frozen=True)
class RootCause:
    """What a rank's error comes down to."""

    error_type: str  # the original exception's class name (RayActorError / ActorDiedError for a lost process)
    message: str  # its message's first line
    died: bool  # the rank's process (or its node) was lost
    resumable: bool  # a resume may get past it (see NOT_RESUMABLE)


def _resumable(error_type: str, error: BaseException | None) -> bool:
    if error is not None:
        names = {c.__name__ for c in type(error).__mro__}
        return not (isinstance(error, NOT_RESUMABLE) or names & NOT_RESUMABLE_NAMES)
    builtin = getattr(builtins, error_type, None)
    known = isinstance(builtin, type) and issubclass(builtin, NOT_RESUMABLE)
    return not (known or error_type in NOT_RESUMABLE_NAMES)


def root_cause(err: BaseException) -> RootCause:
    """The error behind Ray's wrappers: a RayTaskError is unwrapped through ``RayTaskError.cause`` (nested
    ones too) to the exception object the rank raised. Only where Ray carries no object is the last
    exception of the traceback text read: a cause that could not be pickled (Ray sends a plain RayError
    with the text instead) and an actor whose ``__init__`` failed (ActorDiedError keeps the creation
    task's error as a message only); any other RayActorError is a lost process. A
    storage fault (a checkpoint write refused, a full disk) is told by path, cause and fix, and a
    resume gets past it once it is fixed."""
    for _ in range(16):
        cause = getattr(err, "cause", None) if isinstance(err, ray.exceptions.RayTaskError) else None
        unsent = isinstance(cause, ray.exceptions.RayError) and not isinstance(
            cause, ray.exceptions.RayTaskError | ray.exceptions.RayActorError)
        if cause is None or cause is err or unsent:
            break
        err = cause
    if isinstance(err, ray.exceptions.RayTaskError):
        found = _last_exception_line(err.traceback_str or "")
        name, message = found or (type(err).__name__, str(err).strip().split("\n", 1)[0])
        return RootCause(name, message, died=False, resumable=_resumable(name, None))
    if isinstance(err, ray.exceptions.RayActorError):
        text = err.error_msg or ""
        found = _last_exception_line(text) if err.actor_init_failed else None
        if found:
            return RootCause(found[0], found[1], died=False, resumable=_resumable(found[0], None))
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        detail = [line for line in lines[1:] if not re.match(r"^(class_name|actor_id|pid|name|namespace|ip):", line)]
        why = detail[0].split(". ", 1)[0].rstrip(".") + "." if detail else ""  # e.g. its worker process has died
        return RootCause(type(err).__name__, " ".join(filter(None, [*lines[:1], why])), died=True, resumable=True)
    if isinstance(err, StorageError):  # a checkpoint write the storage refused: fixed outside, then resumed
        return RootCause(type(err).__name__, str(err), died=False, resumable=True)
    if isinstance(err, OSError) and err.errno in WRITE_FAULTS:  # a full disk, anywhere
        return RootCause(type(err).__name__, str(storage_error(err)), died=False, resumable=True)
    text = str(err).strip()
    return RootCause(type(err).__name__, text.split("\n", 1)[0], died=False, resumable=_resumable("", err))


def _failed_rank(refs, err: BaseException) -> int | None:
    """The trainer rank behind ``err``: the actor a RayActorError names, else the actor of the first
    finished call of ``refs`` that failed."""
    actor = getattr(err, "actor_id", None) if isinstance(err, ray.exceptions.RayActorError) else None
    if isinstance(actor, str) and actor in TRAINER_RANKS:
        return TRAINER_RANKS[actor]
    for ref in refs if isinstance(refs, list) else [refs]:
        if ray.wait([ref], timeout=0)[0]:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayError:
                return TRAINER_RANKS.get(ref.task_id().actor_id().hex())
    return None


def trainer_get(refs):
    """``ray.get`` for trainer calls: a dead or failing rank becomes a :class:`TrainerFailure` naming the
    rank and its root cause (:func:`root_cause`)."""
    try:
        return ray.get(refs)
    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as err:
        cause = root_cause(err)
        rank = _failed_rank(refs, err)
        who = "a trainer rank" if rank is None else f"trainer rank {rank}"
        said = f"{cause.error_type}: {cause.message}" if cause.message else cause.error_type
        what = f"{who} died ({said})" if cause.died else f"{who} failed: {said}"
        raise TrainerFailure(what, rank=rank, error_type=cause.error_type, resumable=cause.resumable) from err
