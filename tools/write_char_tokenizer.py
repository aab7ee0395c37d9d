"""Write the embedded model's character tokenizer as Hugging Face files into
``megatron_quads/assets/char_tokenizer/`` (``tests/test_tasks_tokenizer.py`` checks the shipped files
are what this writes)."""

from __future__ import annotations

from megatron_quads import embedded


def main() -> None:
    """Rewrite :data:`megatron_quads.embedded.TOKENIZER_DIR` from ``embedded.tokenizer()``."""
    print(embedded.tokenizer().save_pretrained(embedded.TOKENIZER_DIR))


if __name__ == "__main__":
    main()
