"""pytest imports each test module by its name from the first folder up without an ``__init__.py``
(the "prepend" import mode): two test files of one such name anywhere under tests/ stop the whole
suite at collection. Caught here, in the unit run, rather than only when the whole suite is
collected."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]


def import_name(path: Path) -> str:
    """``test_x`` for a file in a plain folder; ``pkg.test_x`` inside packages (``__init__.py``)."""
    parts = [path.stem]
    folder = path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts)


def test_every_test_module_has_an_import_name_of_its_own() -> None:
    by_name: defaultdict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        by_name[import_name(path)].append(str(path.relative_to(TESTS)))
    assert {name: sorted(paths) for name, paths in by_name.items() if len(paths) > 1} == {}
