"""Tokenizers with one small interface: a fixed character-level one for the tiny model, and a thin
wrapper around a Hugging Face tokenizer loaded from a local directory.

Both have ``encode(text, add_bos=False, add_eos=False) -> list[int]``,
``decode(ids, skip_special_tokens=True) -> str``, ``vocab_size``, ``pad_id``, ``bos_id``,
``eos_id``. :func:`encode_prompt` and :func:`encode_sft_pair` build the token sequences rollouts
and warm-start SFT share (``<bos>`` + prompt, then completion + ``<eos>``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)  # ids 0, 1, 2
# ids 3.. in this order; never reorder (checkpoints depend on it), only append
DEFAULT_ALPHABET = "0123456789+-*/=;(). "


@runtime_checkable
class Tokenizer(Protocol):
    """What tasks, rollouts and SFT need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


class CharTokenizer:
    """One token per character of a fixed alphabet, after ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2.

    The default alphabet ``"0123456789+-*/=;(). "`` gives 23 tokens; digit ``d`` is token ``d + 3``.
    Characters outside the alphabet raise ``ValueError``.
    """

    def __init__(self, alphabet: str = DEFAULT_ALPHABET) -> None:
        if len(set(alphabet)) != len(alphabet):
            dupes = sorted({c for c in alphabet if alphabet.count(c) > 1})
            raise ValueError(f"alphabet has repeated characters {dupes}")
        if not alphabet:
            raise ValueError("alphabet must not be empty")
        self.alphabet = alphabet
        self._tokens = list(SPECIAL_TOKENS) + list(alphabet)
        self._ids = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(alphabet)}

    def __repr__(self) -> str:
        return f"CharTokenizer(alphabet={self.alphabet!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other.alphabet == self.alphabet

    def __hash__(self) -> int:
        return hash(self.alphabet)

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bos_id(self) -> int:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(range(len(SPECIAL_TOKENS)))

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [self.bos_id] if add_bos else []
        try:
            ids.extend(self._ids[c] for c in text)
        except KeyError:
            pos, ch = next((i, c) for i, c in enumerate(text) if c not in self._ids)
            raise ValueError(
                f"character {ch!r} at position {pos} of {text[:64]!r} is not in the tokenizer's alphabet "
                f"{self.alphabet!r}; remove it from the text or build CharTokenizer with an alphabet that has it"
            ) from None
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self._tokens):
                raise ValueError(f"token id {i} is outside this tokenizer's vocabulary (0..{len(self._tokens) - 1})")
            if i < len(SPECIAL_TOKENS) and skip_special_tokens:
                continue
            out.append(self._tokens[i])
        return "".join(out)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "char", "special_tokens": list(SPECIAL_TOKENS), "alphabet": self.alphabet}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CharTokenizer:
        if data.get("type") != "char" or list(data.get("special_tokens", [])) != list(SPECIAL_TOKENS):
            raise ValueError(f"not a char tokenizer description: {dict(data)!r}")
        return cls(data["alphabet"])

    def save(self, path: str | Path) -> None:
        """Write ``{"type": "char", ...}`` JSON to ``path`` (a file)."""
        Path(path).write_text(json.dumps(self.to_dict()) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> CharTokenizer:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


class HFTokenizer:
    """The same interface over ``transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)``.

    ``vocab_size`` is ``len(tokenizer)`` (base vocabulary plus added tokens; a model's embedding
    may be padded larger). ``pad_id`` falls back to ``eos_id`` when the tokenizer has no pad token;
    ``bos_id`` is None when it has no BOS token (Qwen, for example), and then ``add_bos`` adds nothing.
    """

    def __init__(self, path_or_tokenizer: str | Path | Any) -> None:
        if isinstance(path_or_tokenizer, (str, Path)):
            path = Path(path_or_tokenizer).expanduser()
            if not path.is_dir():
                raise FileNotFoundError(
                    f"tokenizer directory {path} does not exist; pass a local directory holding tokenizer.json "
                    "or tokenizer_config.json (e.g. one written by save_pretrained); nothing is downloaded"
                )
            try:
                from transformers import AutoTokenizer
            except ImportError:
                raise ImportError("HFTokenizer needs transformers: pip install transformers") from None
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            except (OSError, ValueError) as e:
                raise ValueError(f"could not load a Hugging Face tokenizer from {path}: {e}") from e
            self.path: Path | None = path
        else:
            self.tokenizer = path_or_tokenizer
            self.path = None
        if self.tokenizer.eos_token_id is None:
            raise ValueError(
                f"tokenizer {self.path or self.tokenizer!r} has no EOS token; set eos_token before using it"
            )

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path) if self.path else type(self.tokenizer).__name__!r})"

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return self.eos_id if pad is None else int(pad)

    @property
    def bos_id(self) -> int | None:
        bos = self.tokenizer.bos_token_id
        return None if bos is None else int(bos)

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The tokens a response ends at: ``eos_id`` and the ``eos_token_id`` (one or a list) of the
        directory's ``generation_config.json``, when it has one (Qwen's chat models end turns there)."""
        ids = [self.eos_id]
        config = self.path / "generation_config.json" if self.path is not None else None
        if config is not None and config.is_file():
            found = json.loads(config.read_text(encoding="utf-8")).get("eos_token_id")
            ids += [int(i) for i in (found if isinstance(found, list) else [found]) if i is not None]
        return tuple(dict.fromkeys(ids))

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def chat_prompt(self, text: str, system: str | None = None) -> str:
        """``text`` as a user turn in the tokenizer's chat template, ready for the assistant's reply;
        ``text`` unchanged when the tokenizer has no chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            return text
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def load_tokenizer(spec: str | Path) -> CharTokenizer | HFTokenizer:
    """``"char"`` → the default :class:`CharTokenizer`; a ``.json`` file → a saved CharTokenizer;
    a directory → :class:`HFTokenizer`."""
    if str(spec) == "char":
        return CharTokenizer()
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and data.get("type") == "char":
            return CharTokenizer.from_dict(data)
    return HFTokenizer(path)


def stop_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The tokens a response ends at: an :class:`HFTokenizer`'s ``stop_ids``, else ``(eos_id,)``."""
    return tokenizer.stop_ids if isinstance(tokenizer, HFTokenizer) else (tokenizer.eos_id,)


def has_chat_template(tokenizer: Tokenizer) -> bool:
    """Whether ``tokenizer`` is an :class:`HFTokenizer` with a chat template."""
    return isinstance(tokenizer, HFTokenizer) and bool(getattr(tokenizer.tokenizer, "chat_template", None))


def encode_chat_prompt(tokenizer: Tokenizer, prompt_text: str, chat: bool) -> list[int]:
    """What the policy is fed at rollout time: with ``chat``, the prompt as a user turn of the
    tokenizer's chat template (the template writes any ``<bos>``), else :func:`encode_prompt`."""
    if not chat:
        return encode_prompt(tokenizer, prompt_text)
    if not has_chat_template(tokenizer):
        raise ValueError(f"{tokenizer!r} has no chat template to apply: set data.apply_chat_template=false, or use a "
                         "Hugging Face tokenizer with one")
    return tokenizer.encode(tokenizer.chat_prompt(prompt_text))


def encode_prompt(tokenizer: Tokenizer, prompt_text: str) -> list[int]:
    """What the policy is fed at rollout time: ``<bos>`` (when the tokenizer has one) and the prompt."""
    return tokenizer.encode(prompt_text, add_bos=True)


def encode_sft_pair(tokenizer: Tokenizer, prompt_text: str, completion: str) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` for one supervised pair: ``encode_prompt(prompt)`` then the completion
    and ``<eos>``; the mask is 1 on completion and ``<eos>`` tokens, 0 on ``<bos>`` and prompt."""
    prompt_ids = encode_prompt(tokenizer, prompt_text)
    completion_ids = tokenizer.encode(completion, add_eos=True)
    return prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids)
