"""The README runs as written: its shell and Python blocks, in order, in a fresh directory.

A block the CPU cannot run (a GPU, a 30B model, a Megatron-LM checkout) or that this test must not
run (the test suite itself) carries a marker on the line before its fence:
``<!-- not-on-cpu: REASON -->`` or ``<!-- not-in-readme-test: REASON -->``. Every other ``bash`` and
``python`` block runs, shell blocks with ``bash -euo pipefail``, Python blocks as a script file
(so ``if __name__ == "__main__":`` guards work as a user's would), each in the same directory, which
holds a copy of ``examples/`` and ``.venv`` pointing at this interpreter's environment.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
COPIED = ("examples",)
"""What the README's blocks read from the repository, copied into the fresh directory."""
RUN_LANGUAGES = ("bash", "python")
SKIP_KINDS = ("not-on-cpu", "not-in-readme-test")
SKIP_MARKER = re.compile(r"^<!--\s*(not-on-cpu|not-in-readme-test):\s*(\S.*?)\s*-->$")
BLOCK_TIMEOUT_S = 240.0
"""One block's limit: a train command starts Ray and a vLLM engine (about a minute on 2 cores)."""


@dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown file."""

    language: str
    code: str
    line: int  # 1-based line of the opening fence
    skip: str | None  # the marker's kind and reason, e.g. "not-on-cpu: needs a GPU"; None: it runs

    @property
    def name(self) -> str:
        first = next((s for s in self.code.splitlines() if s.strip() and not s.startswith("#")), "")
        return f"README.md:{self.line} ({self.language}: {first.strip()[:60]})"


def markdown_blocks(text: str) -> list[Block]:
    """Every fenced block of ``text`` in order; a skip marker is the last non-blank line before the
    opening fence. A marker without its reason is an error (its block would run by accident)."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^(```+)\s*(\S*)", lines[i])
        if not fence:
            i += 1
            continue
        start, ticks, language = i, fence.group(1), fence.group(2).lower()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == ticks), None)
        if end is None:
            raise ValueError(f"README.md:{start + 1}: the code block is never closed")
        before = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = SKIP_MARKER.match(before)
        if not marker and before.startswith("<!--") and any(kind in before for kind in SKIP_KINDS):
            raise ValueError(f"README.md:{start + 1}: write the marker as <!-- KIND: REASON --> (KIND: {SKIP_KINDS})")
        skip = f"{marker.group(1)}: {marker.group(2)}" if marker else None
        blocks.append(Block(language, "\n".join(lines[start + 1:end]) + "\n", start + 1, skip))
        i = end + 1
    return blocks


def runnable_blocks(text: str) -> list[Block]:
    """The ``bash`` and ``python`` blocks without a skip marker, in README order."""
    return [b for b in markdown_blocks(text) if b.language in RUN_LANGUAGES and b.skip is None]


def block_command(block: Block, directory: Path, index: int) -> list[str]:
    """Write ``block`` as a script in ``directory`` and return the command that runs it there."""
    suffix = {"bash": "sh", "python": "py"}[block.language]
    script = directory / f"readme_block_{index:02d}_line_{block.line}.{suffix}"
    script.write_text(block.code)
    if block.language == "bash":
        return ["bash", "-euo", "pipefail", script.name]
    return [sys.executable, script.name]


def fresh_directory(root: Path) -> Path:
    """A directory holding what the README's blocks read: a copy of ``examples/`` and ``.venv``
    linked to this interpreter's environment (the package installed in it)."""
    for name in COPIED:
        shutil.copytree(REPO / name, root / name)
    (root / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    return root


# ----------------------------------------------------------------------------------------------
# The extraction itself
# ----------------------------------------------------------------------------------------------
SAMPLE = """\
Intro.

```bash
echo one
```

<!-- not-on-cpu: needs a GPU -->
```bash
nvidia-smi
```

<!-- not-in-readme-test: the test suite itself -->

```bash
make test
```

```python
print("two")
```

```
a layout block
```
"""


def test_blocks_and_markers_are_read_in_order() -> None:
    blocks = markdown_blocks(SAMPLE)
    assert [(b.language, b.line, b.skip) for b in blocks] == [
        ("bash", 3, None),
        ("bash", 8, "not-on-cpu: needs a GPU"),
        ("bash", 14, "not-in-readme-test: the test suite itself"),
        ("python", 18, None),
        ("", 22, None),
    ]
    assert blocks[1].code == "nvidia-smi\n"
    assert [b.code for b in runnable_blocks(SAMPLE)] == ["echo one\n", 'print("two")\n']


def test_an_unclosed_block_is_an_error() -> None:
    with pytest.raises(ValueError, match="README.md:1: the code block is never closed"):
        markdown_blocks("```bash\necho one\n")


def test_a_marker_without_its_reason_is_an_error() -> None:
    with pytest.raises(ValueError, match="README.md:2: write the marker as"):
        markdown_blocks("<!-- not-on-cpu -->\n```bash\nnvidia-smi\n```\n")


def test_the_readme_marks_its_gpu_blocks_and_keeps_cpu_ones() -> None:
    blocks = markdown_blocks(README.read_text())  # a malformed marker raises here
    skipped = [b.skip for b in blocks if b.skip]
    assert any(s.startswith("not-on-cpu") for s in skipped), "the GPU and 30B blocks carry not-on-cpu markers"
    languages = {b.language for b in runnable_blocks(README.read_text())}
    assert languages == set(RUN_LANGUAGES), f"the CPU quick start has shell and Python blocks, got {languages}"


# ----------------------------------------------------------------------------------------------
# The README's blocks, run
# ----------------------------------------------------------------------------------------------
def test_readme_quick_start_runs_in_order(tmp_path: Path) -> None:
    directory = fresh_directory(tmp_path)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for index, block in enumerate(runnable_blocks(README.read_text())):
        started = time.monotonic()
        try:
            done = subprocess.run(block_command(block, directory, index), cwd=directory, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired as timeout:
            output = timeout.output.decode(errors="replace") if isinstance(timeout.output, bytes) else timeout.output or ""
            pytest.fail(f"{block.name} ran past {BLOCK_TIMEOUT_S:.0f} s:\n{output[-4000:]}")
        elapsed = time.monotonic() - started
        print(f"{block.name}: exit {done.returncode} in {elapsed:.1f} s")
        assert done.returncode == 0, f"{block.name} failed (exit {done.returncode}):\n{done.stdout[-4000:]}"
