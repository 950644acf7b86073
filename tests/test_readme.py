"""README.md as a user meets it: every fenced ```python block runs as printed, on its own, and prints
exactly the ```text block that follows it (the values the README claims). A block whose preceding
line is `<!-- skip: REASON -->` is skipped with that reason (e.g. it needs a GPU or Transformer
Engine)."""
import contextlib
import io
import os
import re
from dataclasses import dataclass
from typing import Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = re.compile(r"^<!--\s*skip:\s*(.*?)\s*-->$")


@dataclass
class Block:
    lang: str
    line: int                       # 1-based line of the opening fence
    code: str
    skip: Optional[str] = None      # the reason of a preceding <!-- skip: ... --> line
    expected: Optional[str] = None  # the ```text block right after it (only blank lines between)


def python_blocks(markdown):
    """The ```python blocks of a markdown text, with their skip reasons and expected outputs."""
    lines = markdown.splitlines()
    blocks, i, prev, gap_blank = [], 0, "", False
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            if lines[i].strip():
                prev, gap_blank = lines[i].strip(), False
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"line {i + 1}: unclosed ``` fence"
        b = Block(fence[1], i + 1, "\n".join(lines[i + 1:end]))
        skip = SKIP.match(prev)
        b.skip = skip[1] if skip else None
        if b.lang == "text" and blocks and prev == "```" and blocks[-1].line == last_open:
            blocks[-1].expected = b.code
        if b.lang == "python":
            blocks.append(b)
        last_open, prev, i = b.line, "```", end + 1
    return [b for b in blocks if b.lang == "python"]


with open(os.path.join(ROOT, "README.md")) as f:
    BLOCKS = python_blocks(f.read())


def test_the_parser_reads_skips_and_expected_output():
    md = ("intro\n```python\nprint(1)\n```\n\n```text\n1\n```\n<!-- skip: needs a GPU -->\n"
          "```python\nimport cuda_only\n```\nprose\n```text\nnot an output\n```\n")
    a, b = python_blocks(md)
    assert (a.code, a.skip, a.expected) == ("print(1)", None, "1")
    assert (b.code, b.skip, b.expected) == ("import cuda_only", "needs a GPU", None)


def test_readme_has_checked_python_blocks():
    assert len(BLOCKS) >= 3
    unchecked = [b.line for b in BLOCKS if b.skip is None and b.expected is None]
    assert not unchecked, f"README.md python blocks at lines {unchecked} show no ```text output to check"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"README-line{b.line}")
def test_readme_block_runs_and_prints_what_the_readme_shows(block, monkeypatch):
    if block.skip is not None:
        pytest.skip(block.skip)
    monkeypatch.chdir(ROOT)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block.code, f"README.md:{block.line}", "exec"), {"__name__": "__main__"})
    assert out.getvalue().rstrip("\n") == block.expected.rstrip("\n")
