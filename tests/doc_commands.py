"""The shell commands the docs show a user: found in Markdown, Python docstrings and comments, and shell headers.

A command is a line of a fenced ``bash`` block (continuation lines joined, comments
dropped, ``a && b`` split into ``a`` and ``b``), a line of an indented block or of a
docstring or comment that starts with a program in PROGRAMS, or, where inline code
counts, a single-line code span that starts with one. A program followed by bare
words only (`hpcddp bench`) names a subcommand in prose and is not a command.
"""

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

from .conftest import ROOT

# The programs whose lines are commands outside fenced blocks.
PROGRAMS = ("pip", "python", "python3", "mpirun", "hpcddp", "sbatch", "srun", "torchrun")

# Where commands are read from, and how: inline code counts on the pages a user starts from.
SOURCES = {
    "README.md": "markdown+inline",
    "docs/getting-started.md": "markdown+inline",
    "docs/slurm.md": "markdown",
    "docs/multi-node.md": "markdown",
    "slurm/README.md": "markdown",
    "examples/train.py": "python",
    "examples/train_horovod.py": "python",
    "examples/post_local_sgd.py": "python",
    "examples/async_train.py": "python",
    "slurm/train.sh": "shell-header",
}

FENCED = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"`([^`\n]+)`")
ENV_PREFIX = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*")


def documented_commands() -> dict[str, list[str]]:
    """Every command in SOURCES, whitespace normalized, mapped to where it appears (``file:line``)."""
    found: dict[str, list[str]] = {}
    for name, kind in SOURCES.items():
        text = (Path(ROOT) / name).read_text()
        if kind.startswith("markdown"):
            lines = _markdown(text, inline=kind.endswith("+inline"))
        elif kind == "python":
            lines = _python(text)
        else:
            lines = _shell_header(text)
        for line_number, command in lines:
            found.setdefault(" ".join(command.split()), []).append(f"{name}:{line_number}")
    return found


def starts_with_program(text: str) -> bool:
    """Whether ``text`` (after ``NAME=value`` prefixes) runs a program in PROGRAMS with real arguments."""
    words = ENV_PREFIX.sub("", text.strip()).split()
    if not words or words[0] not in PROGRAMS:
        return False
    return any(not re.fullmatch(r"[a-z]+", word) for word in words[1:])


def _strip_comment(line: str) -> str:
    return re.sub(r"(^|\s)#.*$", "", line).strip()


def _markdown(text: str, inline: bool) -> Iterator[tuple[int, str]]:
    def line_of(offset: int) -> int:
        return text.count("\n", 0, offset) + 1

    for block in FENCED.finditer(text):
        if block.group(1) not in ("bash", "sh", "shell"):
            continue
        first = line_of(block.start(2))
        joined = block.group(2).replace("\\\n", " ")
        for i, line in enumerate(joined.splitlines()):
            for part in _strip_comment(line).split(" && "):
                if part.strip():
                    yield first + i, part.strip()
    prose = FENCED.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for number, line in enumerate(prose.splitlines(), start=1):
        if line.startswith("    ") and starts_with_program(line):  # an indented code block
            yield number, _strip_comment(line)
        elif inline:
            for span in INLINE.finditer(line):
                if starts_with_program(span.group(1)):
                    yield number, span.group(1).strip()


def _python(text: str) -> Iterator[tuple[int, str]]:
    docstring = ast.get_docstring(ast.parse(text), clean=False) or ""
    offset = text.index(docstring.splitlines()[0]) if docstring else 0
    first = text.count("\n", 0, offset) + 1
    for i, line in enumerate(docstring.splitlines()):
        if starts_with_program(line):
            yield first + i, _strip_comment(line)
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT and starts_with_program(token.string.lstrip("#")):
            yield token.start[0], _strip_comment(token.string.lstrip("#"))


def _shell_header(text: str) -> Iterator[tuple[int, str]]:
    for number, line in enumerate(text.splitlines(), start=1):
        if number == 1:
            continue  # the #! line
        if not line.startswith("#") or line.startswith("#SBATCH"):
            break
        if starts_with_program(line.lstrip("#")):
            yield number, _strip_comment(line.lstrip("#"))
