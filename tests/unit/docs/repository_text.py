"""The repository's own text files, as the docs tests scan them: code, tests, native sources, the
chart and the docs; not the virtual environment, build outputs or caches, which live in dot folders
or the folders skipped below."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[3]

SCANNED: Final = (
    "README.md",
    "Makefile",
    "pyproject.toml",
    "docs",
    "libs",
    "services",
    "native",
    "tests",
    "deploy",
)
SUFFIXES: Final = frozenset(
    {".py", ".pyi", ".md", ".c", ".h", ".def", ".proto", ".yaml", ".yml", ".tpl", ".toml", ".txt", ".sh"}
)
NAMES: Final = frozenset({"Makefile"})
SKIPPED_DIRS: Final = frozenset({"__pycache__", "node_modules", "build", "build-asan", "results"})


def joined(*parts: str) -> str:
    """A string a scanning test's own file must not hold whole (it is scanned too): a planted
    example of what the test catches."""
    return "".join(parts)


def relative(source: Path) -> str:
    """``source`` as a repository path (its name alone when it is outside the repository)."""
    return source.relative_to(ROOT).as_posix() if source.is_relative_to(ROOT) else source.name


def scanned_files() -> Iterator[Path]:
    for top in SCANNED:
        path = ROOT / top
        if path.is_file():
            yield path
        elif path.is_dir():
            yield from _walk(path)


def _walk(folder: Path) -> Iterator[Path]:
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith(".") or entry.name.endswith(".egg-info"):
            continue
        if entry.is_dir():
            if entry.name not in SKIPPED_DIRS:
                yield from _walk(entry)
        elif entry.suffix in SUFFIXES or entry.name in NAMES or entry.name.endswith(".Dockerfile"):
            yield entry
