"""Every command the README and docs show can be typed as written on a fresh machine after the two
set-up commands: ``make`` targets that exist, tools under ``.venv/bin`` that the set-up installs,
files that are there; nothing that needs ``uv`` on the PATH (``make`` installs it into
``.hamipy/tools`` only) or a console script that is not on the PATH.

Commands meant for a real cluster or an image build (``docker``, ``helm``, ``kubectl``) are only
checked for their local paths. The README's block after ``make up`` is also run as written, by
``tests/integration/devcluster/test_devcluster_lifecycle.py``.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

ROOT: Final = Path(__file__).resolve().parents[3]
DOCUMENTS: Final = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGUAGES: Final = {"bash", "sh", "shell", "console"}
# Programs a reader runs in their own environment (a real cluster, an image registry), and shell
# syntax: not checked beyond the repository paths they name.
# Written by `make up` (hamipy.devcluster.cli.KUBECTL_FILE in its default state directory).
MADE_BY_UP: Final = {".hamipy/kubectl"}
FOREIGN: Final = {"docker", "helm", "kubectl", "export", "for", "done", "do", "cd", "curl"}
INLINE_COMMAND: Final = re.compile(r"`((?:make |uv |\.venv/bin/)[^`]*)`")
_FENCE: Final = re.compile(r"^```(\w*)\s*$")
_ASSIGNMENT: Final = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def fenced_blocks(text: str) -> Iterator[tuple[str, list[str]]]:
    """Each fenced block's language and its lines."""
    language: str | None = None
    lines: list[str] = []
    for line in text.splitlines():
        fence = _FENCE.match(line.strip())
        if fence and language is None:
            language, lines = fence.group(1), []
        elif fence and language is not None:
            yield language, lines
            language = None
        elif language is not None:
            lines.append(line)


def shell_commands(lines: list[str]) -> Iterator[str]:
    """Shell lines as commands: comments dropped, continuations joined."""
    pending = ""
    for line in lines:
        code = "" if line.lstrip().startswith("#") else line.split(" #", 1)[0].rstrip()
        if code.endswith("\\"):
            pending += code[:-1] + " "
            continue
        if (pending + code).strip():
            yield (pending + code).strip()
        pending = ""


def shell_blocks(text: str) -> Iterator[str]:
    """The commands of every fenced shell block of ``text``."""
    for language, lines in fenced_blocks(text):
        if language in SHELL_LANGUAGES:
            yield from shell_commands(lines)


def commands() -> Iterator[tuple[str, str]]:
    for document in DOCUMENTS:
        text = document.read_text()
        name = str(document.relative_to(ROOT))
        for line in shell_blocks(text):
            yield name, line
        for match in INLINE_COMMAND.finditer(text):
            yield name, match.group(1)


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z0-9-]*):", text, re.MULTILINE))


def problems(line: str, targets: set[str]) -> list[str]:
    """What stops ``line`` from working as written after ``make up`` and ``make test``."""
    try:
        words = shlex.split(line.replace("...", ""))
    except ValueError as exc:
        return [f"not a shell command: {exc}"]
    while words and _ASSIGNMENT.match(words[0]):
        words.pop(0)
    if not words:
        return []
    program, args = words[0], words[1:]
    found: list[str] = []
    if program == "make":
        found += [
            f"make has no target {word!r}"
            for word in args
            if not word.startswith("-") and "=" not in word and word not in targets
        ]
    elif program.startswith(".venv/bin/"):
        tool = program.removeprefix(".venv/bin/")
        if not (ROOT / ".venv" / "bin" / tool).exists():
            found.append(f"{program} is not installed by the set-up")
    elif program in MADE_BY_UP:
        pass
    elif program == "uv":
        found.append("uv is not on the PATH after `make` (it lives in .hamipy/tools); use a make target")
    elif program not in FOREIGN:
        found.append(f"{program!r} is not on the PATH after the set-up; use make or .venv/bin/{program}")
    for arg in args:
        local = re.match(r"^(tests|deploy|docs|libs|services|native)/[\w./-]+$", arg)
        if local and not (ROOT / arg).exists():
            found.append(f"{arg} does not exist")
    return found


DOCUMENTED: Final = sorted(set(commands()))


def test_the_docs_show_commands() -> None:
    """The reader (README, development, install, benchmarks) is told what to type."""
    assert len(DOCUMENTED) > 20
    assert {doc for doc, _ in DOCUMENTED} >= {"README.md", "docs/development.md", "docs/benchmarks.md"}


@pytest.mark.parametrize(
    ("document", "line"),
    DOCUMENTED,
    ids=[f"{d}:{c[:60]}".translate(str.maketrans("[]", "()")) for d, c in DOCUMENTED],
)
def test_every_documented_command_works_as_written(document: str, line: str) -> None:
    assert problems(line, make_targets()) == []


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        pytest.param("uv run hamipy-devcluster gpus", "uv is not on the PATH", id="uv-run"),
        pytest.param("hamipy-devcluster gpus", "is not on the PATH", id="console-script"),
        pytest.param("make gpu", "make has no target 'gpu'", id="misspelt-target"),
        pytest.param(".venv/bin/no-such-tool", "is not installed", id="missing-tool"),
        pytest.param(".venv/bin/python tests/bench/bench_nothing.py", "does not exist", id="missing-file"),
    ],
)
def test_a_command_that_would_fail_is_caught(line: str, problem: str) -> None:
    assert any(problem in p for p in problems(line, make_targets()))


def test_the_readme_runs_its_follow_up_commands_through_make_and_ups_kubectl() -> None:
    from hamipy.devcluster import cli

    block = readme_after_up()
    assert {f"{Path(cli.DEFAULT_STATE_DIR)}/{cli.KUBECTL_FILE}"} == MADE_BY_UP
    kubectl = [line for line in block if line.startswith(".hamipy/kubectl ")]
    assert kubectl[0] == ".hamipy/kubectl get nodes -o wide"
    assert "make gpus" in block
    assert any(line.startswith("make trace POD=") for line in block)
    assert block[-1] == "make down"
    assert block.index("make gpus") > block.index(kubectl[-1])


def readme_after_up() -> list[str]:
    """The README's block of commands to type once ``make up`` has finished (the first fenced
    block after its marker comment)."""
    text = (ROOT / "README.md").read_text()
    after = text[text.index("<!-- after make up:") :]
    _, lines = next(fenced_blocks(after))
    return list(shell_commands(lines))
