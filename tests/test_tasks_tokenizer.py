"""Character tokenizer and the Hugging Face wrapper (on a tokenizer built here, nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_quads.tasks import (
    DEFAULT_ALPHABET,
    ArithmeticConfig,
    ArithmeticTask,
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    encode_prompt,
    encode_sft_pair,
    load_tokenizer,
)


def test_char_tokenizer_layout() -> None:
    tok = CharTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 3 + len(DEFAULT_ALPHABET) == 23
    assert tok.encode("0123456789") == list(range(3, 13))
    assert tok.encode("1+2=3;", add_bos=True, add_eos=True) == [1, 4, 13, 5, 17, 6, 18, 2]


def test_char_tokenizer_round_trip_on_task_text() -> None:
    tok = CharTokenizer()
    task = ArithmeticTask(ArithmeticConfig.level(5, allow_negative=True))
    for prompt, completion in task.sft_pairs(100, seed=0):
        text = prompt + completion
        ids = tok.encode(text, add_bos=True, add_eos=True)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=False) == f"<bos>{text}<eos>"
    assert tok.decode([tok.pad_id, *tok.encode("7;"), tok.eos_id, tok.pad_id]) == "7;"


def test_char_tokenizer_errors() -> None:
    tok = CharTokenizer()
    with pytest.raises(ValueError, match=r"character 'x' at position 2 of '12x' is not in the tokenizer's alphabet"):
        tok.encode("12x")
    with pytest.raises(ValueError, match="outside"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="repeated"):
        CharTokenizer("0012")


def test_char_tokenizer_save_load(tmp_path: Path) -> None:
    tok = CharTokenizer("0123456789+=;")
    tok.save(tmp_path / "tok.json")
    assert load_tokenizer(tmp_path / "tok.json") == tok
    assert load_tokenizer("char") == CharTokenizer()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny word-level tokenizer trained on a few strings, saved as a Hugging Face tokenizer."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    trainer = trainers.WordLevelTrainer(special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"])
    raw.train_from_iterator(["what is one plus two", "the answer is three", "one two three"], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=raw, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    path = tmp_path_factory.mktemp("hf_tok")
    fast.save_pretrained(path)
    return path


def test_hf_wrapper(hf_dir: Path) -> None:
    tok = HFTokenizer(hf_dir)
    assert isinstance(tok, Tokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 4 + len({"what", "is", "one", "plus", "two", "the", "answer", "three"})
    ids = tok.encode("the answer is three")
    assert len(ids) == 4 and tok.decode(ids) == "the answer is three"
    full = tok.encode("one plus two", add_bos=True, add_eos=True)
    assert full[0] == tok.bos_id and full[-1] == tok.eos_id
    assert tok.decode(full) == "one plus two"
    assert "<eos>" in tok.decode(full, skip_special_tokens=False)
    assert tok.chat_prompt("hi") == "hi"  # no chat template: unchanged
    ids, mask = encode_sft_pair(tok, "what is one plus two", "three")
    assert ids == encode_prompt(tok, "what is one plus two") + [tok.encode("three")[0], tok.eos_id]
    assert mask == [0] * 6 + [1, 1]
    assert isinstance(load_tokenizer(hf_dir), HFTokenizer)


def test_hf_wrapper_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer directory .*missing.* does not exist"):
        HFTokenizer(tmp_path / "missing")


LEGACY_IDS = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{c: 3 + i for i, c in enumerate("0123456789+-*/=;(). ")}}
"""The embedded checkpoint's vocabulary, written out: the shipped model's embedding rows mean these."""


def test_every_character_keeps_the_embedded_checkpoint_s_token_id() -> None:
    tok = CharTokenizer()
    assert tok.backend.get_vocab() == LEGACY_IDS
    for token, token_id in LEGACY_IDS.items():
        if token.startswith("<"):
            assert tok.decode([token_id], skip_special_tokens=False) == token
            assert tok.decode([token_id]) == ""
        else:
            assert tok.encode(token) == [token_id]
            assert tok.decode([token_id]) == token
    everything = "".join(t for t in LEGACY_IDS if not t.startswith("<"))
    assert tok.encode(everything * 2, add_bos=True, add_eos=True) == [1, *range(3, 23), *range(3, 23), 2]


def test_the_shipped_tokenizer_files_are_the_built_tokenizer(tmp_path: Path) -> None:
    from megatron_quads import embedded

    written = CharTokenizer().save_pretrained(tmp_path)
    shipped = sorted(p.name for p in embedded.TOKENIZER_DIR.iterdir())
    assert shipped == sorted(p.name for p in written.iterdir())
    for name in shipped:  # regenerate with tools/write_char_tokenizer.py
        assert (embedded.TOKENIZER_DIR / name).read_text() == (written / name).read_text(), name


def test_transformers_reads_the_shipped_files_with_the_same_ids_and_eos() -> None:
    pytest.importorskip("transformers")
    import json

    from megatron_quads import embedded

    hf, char = HFTokenizer(embedded.TOKENIZER_DIR), CharTokenizer()
    assert (hf.pad_id, hf.bos_id, hf.eos_id, hf.vocab_size) == (0, 1, 2, 23)
    assert hf.tokenizer.eos_token == "<eos>"
    assert json.loads((embedded.TOKENIZER_DIR / "tokenizer_config.json").read_text())["eos_token"] == "<eos>"
    for token, token_id in LEGACY_IDS.items():
        if not token.startswith("<"):
            assert hf.encode(token) == [token_id]
    text = "(12 + 3) * 4 = 60;"
    assert hf.encode(text, add_bos=True, add_eos=True) == char.encode(text, add_bos=True, add_eos=True)
    assert hf.tokenizer.encode(text) == encode_prompt(char, text)  # add_special_tokens puts <bos> first
    assert hf.decode(char.encode(text, add_eos=True)) == text == char.decode(hf.encode(text))
