"""The character tokenizer of the tiny model: one token per character of a fixed alphabet after
``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2, built as a Hugging Face ``tokenizers.Tokenizer``
(word-level vocabulary, every character its own piece) so the same vocabulary saves as
``tokenizer.json`` and loads in ``transformers`` and vLLM, which then know ``<eos>`` and stop on it.

``tokenizers`` is imported when a tokenizer is first built.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tokenizers

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)  # ids 0, 1, 2
# ids 3.. in this order; never reorder (checkpoints depend on it), only append
DEFAULT_ALPHABET = "0123456789+-*/=;(). "

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
"""What :meth:`CharTokenizer.save_pretrained` writes."""


def build_char_tokenizer(alphabet: str) -> tokenizers.Tokenizer:
    """A ``tokenizers.Tokenizer`` whose ids are ``SPECIAL_TOKENS`` then ``alphabet`` in order; each
    character is one piece, the decoder joins pieces without spaces, and ``add_special_tokens=True``
    puts ``<bos>`` first (as :func:`megatron_quads.tasks.encode_prompt` does)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *alphabet])}
    tok = Tokenizer(models.WordLevel(vocab))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 1)])
    return tok


class CharTokenizer:
    """One token per character of a fixed alphabet, after ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2.

    The default alphabet ``"0123456789+-*/=;(). "`` gives 23 tokens; digit ``d`` is token ``d + 3``.
    Characters outside the alphabet raise ``ValueError``. ``backend`` is the ``tokenizers.Tokenizer``
    that encodes and decodes; :meth:`save_pretrained` writes it as Hugging Face tokenizer files.
    """

    def __init__(self, alphabet: str = DEFAULT_ALPHABET) -> None:
        if len(set(alphabet)) != len(alphabet):
            dupes = sorted({c for c in alphabet if alphabet.count(c) > 1})
            raise ValueError(f"alphabet has repeated characters {dupes}")
        if not alphabet:
            raise ValueError("alphabet must not be empty")
        self.alphabet = alphabet
        self.backend = build_char_tokenizer(alphabet)
        self._known = frozenset(alphabet)

    def __repr__(self) -> str:
        return f"CharTokenizer(alphabet={self.alphabet!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other.alphabet == self.alphabet

    def __hash__(self) -> int:
        return hash(self.alphabet)

    @property
    def vocab_size(self) -> int:
        return len(SPECIAL_TOKENS) + len(self.alphabet)

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
        # checked here: the backend would read "<eos>" in the text as the special token
        if not self._known.issuperset(text):
            pos, ch = next((i, c) for i, c in enumerate(text) if c not in self._known)
            raise ValueError(
                f"character {ch!r} at position {pos} of {text[:64]!r} is not in the tokenizer's alphabet "
                f"{self.alphabet!r}; remove it from the text or build CharTokenizer with an alphabet that has it"
            )
        ids = self.backend.encode(text, add_special_tokens=False).ids if text else []
        return [self.bos_id] * add_bos + ids + [self.eos_id] * add_eos

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if (bad := next((i for i in ids if not 0 <= i < self.vocab_size), None)) is not None:
            raise ValueError(f"token id {bad} is outside this tokenizer's vocabulary (0..{self.vocab_size - 1})")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

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

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write :data:`HF_TOKENIZER_FILES` into ``directory``: ``tokenizer.json`` (the backend) and the
        special tokens for ``transformers.AutoTokenizer`` (no clean-up of spaces on decode). vLLM
        serving a model directory holding them tokenizes a text prompt as ``encode_prompt`` does and
        stops on ``<eos>`` without being told; an engine started with ``skip_tokenizer_init`` reads
        none of them and stops only on the ``stop_token_ids`` it is given."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "clean_up_tokenization_spaces": False,
                  "add_bos_token": False, "add_eos_token": False}
        for name, content in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
            (directory / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        return directory
