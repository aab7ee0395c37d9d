"""Tokenizers with one small interface: the character-level one of the tiny model
(:mod:`megatron_quads.tasks.char_tokenizer`), and a thin wrapper around a Hugging Face tokenizer
loaded from a local directory.

Both have ``encode(text, add_bos=False, add_eos=False) -> list[int]``,
``decode(ids, skip_special_tokens=True) -> str``, ``vocab_size``, ``pad_id``, ``bos_id``,
``eos_id``. :func:`encode_prompt` and :func:`encode_sft_pair` build the token sequences rollouts
and warm-start SFT share (``<bos>`` + prompt, then completion + ``<eos>``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from megatron_quads.tasks.char_tokenizer import DEFAULT_ALPHABET, CharTokenizer

__all__ = ["DEFAULT_ALPHABET", "CharTokenizer", "HFTokenizer", "Tokenizer", "encode_prompt", "encode_sft_pair",
           "load_tokenizer"]


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
