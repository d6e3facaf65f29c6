"""Every reference to a file of the repository points at something that is there.

Code, tests, native sources, the chart and the docs name repository files in prose: paths such as
``docs/extender.md``, ``deploy/webhook/mutatingwebhookconfiguration.yaml`` or ``tests/bench``,
with an optional ``#anchor`` (``docs/wire-format.md#metrics``), and the Markdown documents link to
each other (``[configuration](configuration.md#tracing-and-logs)``). Here every such reference
must name a file or folder that exists and, with an anchor into a Markdown file, a heading of that
file with that anchor (GitHub's rules). Nothing may point to the design notes or the wire reference
that used to live outside the repository: their content is ``docs/design.md`` and
``docs/wire-format.md``.

What counts as a path reference is narrow on purpose, so prose is not flagged: a word starting
with one of the repository's top folders and a ``/``, not preceded by another path character (so
``tests/unit/docs/test_references.py`` is one reference and a URL's ``.../docs/...`` none). Placeholders and
globs (``deploy/docker/<service>.Dockerfile``, ``libs/*/pyproject.toml``) are checked up to the
first segment that holds one; build outputs (``native/build``, ``tests/bench/results``) are not
checked. A file under ``native/`` (or a ``libs``/``services`` package) may also name paths
relative to that folder, as its Makefile and C comments do.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Final

import pytest
from repository_text import ROOT, joined, relative, scanned_files

# Made by builds and benchmarks, ignored by git: named in the docs, absent from a fresh checkout.
GENERATED: Final = (
    "native/build",
    "native/build-asan",
    "tests/bench/results",
    "tests/gpu/results",
    "tests/mutation/results",
    ".hamipy",
    ".venv",
)
TOP_FOLDERS: Final = ("docs", "deploy", "tests", "native", "libs", "services")
# References made on purpose to files that do not exist (a test's planted bad command).
PLANTED: Final = frozenset(
    {("tests/unit/docs/test_documented_commands.py", joined("tests/bench/", "bench_nothing.py"))}
)

FORBIDDEN: Final = re.compile(joined("DESIGN", r"\.md|hami", "-wire|shared/", "reference"))
PATH_REF: Final = re.compile(
    r"(?<![\w./@$-])((?:" + "|".join(TOP_FOLDERS) + r")/[\w./*<>{}\[\]-]*)(#[\w-]+)?"
)
MD_LINK: Final = re.compile(r"\[[^\]\n]*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
PLACEHOLDER: Final = re.compile(r"[*<>{}\[\]]")
HEADING: Final = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
FENCE: Final = re.compile(r"^\s*(```|~~~)")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading's text: code and link markup dropped, lower case,
    punctuation removed (letters, digits, ``_``, ``-`` and spaces kept), spaces as ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _outside_fences(text: str) -> Iterator[str]:
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            yield line


@cache
def anchors(document: Path) -> frozenset[str]:
    """Every heading anchor of a Markdown file, repeats numbered ``-1``, ``-2`` as GitHub does."""
    found: list[str] = []
    seen: dict[str, int] = {}
    for line in _outside_fences(document.read_text()):
        match = HEADING.match(line)
        if match is None:
            continue
        anchor = github_anchor(match.group(2))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.append(anchor if count == 0 else f"{anchor}-{count}")
    return frozenset(found)


def _bases(source: Path) -> list[Path]:
    """Where a repository path named in ``source`` may start: the root, and for a file of
    ``native/`` or of one ``libs``/``services`` package, that folder too."""
    parts = Path(relative(source)).parts
    bases = [ROOT]
    if parts[:1] == ("native",):
        bases.append(ROOT / "native")
    elif parts[:1] in (("libs",), ("services",)) and len(parts) > 2:
        bases.append(ROOT / parts[0] / parts[1])
    return bases


def _check_target(target: Path, anchor: str, shown: str) -> str | None:
    if not target.exists():
        return f"{shown}: no such file or folder"
    if anchor and target.suffix == ".md" and anchor not in anchors(target):
        return f"{shown}: {target.relative_to(ROOT).as_posix()} has no heading with anchor #{anchor}"
    return None


def _check_path(path: str, anchor: str, source: Path) -> str | None:
    path = path.rstrip(".").rstrip("/") or path
    if path.startswith(GENERATED) or (relative(source), path) in PLANTED:
        return None
    placeholder = PLACEHOLDER.search(path)
    if placeholder is not None:
        # Check the folders before the placeholder: deploy/docker/<service>.Dockerfile -> deploy/docker.
        path, anchor = path[: placeholder.start()].rpartition("/")[0], ""
        if not path or path.startswith(GENERATED):
            return None
    problems = []
    for base in _bases(source):
        problem = _check_target(base / path, anchor.lstrip("#"), path + anchor)
        if problem is None:
            return None
        problems.append(problem)
    return problems[0]


def _check_link(link: str, source: Path) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
        return None
    path, _, anchor = link.partition("#")
    target = (source.parent / path).resolve() if path else source
    if not target.is_relative_to(ROOT):
        return f"[...]({link}): points outside the repository"
    return _check_target(target, anchor, f"[...]({link})")


def check_text(text: str, source: Path) -> list[str]:
    """Every broken reference in ``text``, the content of the repository file ``source``."""
    problems = [
        f"names {match.group(0)!r}, which is not in the repository (docs/design.md, docs/wire-format.md)"
        for match in FORBIDDEN.finditer(text)
    ]
    for match in PATH_REF.finditer(text):
        problem = _check_path(match.group(1), match.group(2) or "", source)
        if problem is not None:
            problems.append(problem)
    if source.suffix == ".md":
        for line in _outside_fences(text):
            for match in MD_LINK.finditer(line):
                problem = _check_link(match.group(1), source)
                if problem is not None:
                    problems.append(problem)
    return problems


FILES: Final = sorted(scanned_files())


def test_the_scan_covers_code_tests_native_and_docs() -> None:
    names = {relative(f) for f in FILES}
    assert {
        "README.md",
        "docs/design.md",
        "docs/wire-format.md",
        "libs/protocol/src/hamipy/protocol/region.py",
        "native/include/hamipy/region.h",
        "native/src/env.c",
        "tests/unit/docs/test_references.py",
        "deploy/helm/hami-py/values.yaml",
    } <= names
    assert not any(name.startswith(GENERATED) for name in names)


@pytest.mark.parametrize("source", FILES, ids=[relative(f) for f in FILES])
def test_every_reference_resolves(source: Path) -> None:
    assert check_text(source.read_text(errors="replace"), source) == []


def test_readme_and_architecture_link_the_design_and_the_wire_formats() -> None:
    for document, prefix in (("README.md", "docs/"), ("docs/architecture.md", "")):
        text = (ROOT / document).read_text()
        assert f"]({prefix}design.md" in text, document
        assert f"]({prefix}wire-format.md" in text, document


# -- the checker itself, on planted references ------------------------------------------------------

IN_CODE: Final = ROOT / "services" / "extender" / "src" / "hamipy" / "extender" / "scoring.py"
IN_NATIVE: Final = ROOT / "native" / "src" / "launch.c"
IN_DOCS: Final = ROOT / "docs" / "extender.md"


@pytest.mark.parametrize(
    ("text", "source", "problem"),
    [
        pytest.param(joined("see docs/", "no-such-page.md"), IN_CODE, "no such file", id="missing-doc"),
        pytest.param(
            joined("docs/design.md#", "no-such-heading"), IN_CODE, "no heading with anchor", id="bad-anchor"
        ),
        pytest.param(
            joined("(deploy/helm/", "missing.yaml)"), IN_CODE, "no such file", id="missing-deploy-file"
        ),
        pytest.param(joined("`tests/unit/", "nothing_here.py`"), IN_CODE, "no such file", id="missing-test"),
        pytest.param(
            joined("tests/native/", "test_exports.py"), IN_NATIVE, "no such file", id="missing-from-native"
        ),
        pytest.param(
            joined("[x](wire-format.md#", "nope)"), IN_DOCS, "no heading with anchor", id="bad-link-anchor"
        ),
        pytest.param(joined("[x](../deploy/", "nothing.yaml)"), IN_DOCS, "no such file", id="bad-link"),
        pytest.param(
            joined("[x](#no-such-", "section)"), IN_DOCS, "no heading with anchor", id="bad-local-anchor"
        ),
        pytest.param(
            joined("[x](../../", "outside.md)"), IN_DOCS, "outside the repository", id="link-outside"
        ),
        pytest.param(
            joined("(", "DESIGN", ".md decision 8)"), IN_CODE, "not in the repository", id="design-notes"
        ),
        pytest.param(
            joined("hami", "-wire.md section 7"), IN_CODE, "not in the repository", id="wire-reference"
        ),
        pytest.param(
            joined("`shared/", "reference/x.md`"), IN_DOCS, "not in the repository", id="shared-reference"
        ),
        pytest.param(
            joined("deploy/", "nowhere/<service>.Dockerfile"),
            IN_CODE,
            "no such file",
            id="placeholder-parent",
        ),
    ],
)
def test_a_broken_reference_is_caught(text: str, source: Path, problem: str) -> None:
    found = check_text(text, source)
    assert len(found) == 1, found
    assert problem in found[0]


@pytest.mark.parametrize(
    ("text", "source"),
    [
        pytest.param(
            "docs/wire-format.md#metrics and docs/design.md#8-observable-by-default", IN_CODE, id="anchors"
        ),
        pytest.param("docs/development.md#make-up--make-down", IN_CODE, id="anchor-of-code-heading"),
        pytest.param("the docs/ folder, tests/unit and deploy/.", IN_CODE, id="folders"),
        pytest.param("tests/unit/docs/test_references.py", IN_CODE, id="nested-docs-folder"),
        pytest.param("https://opentelemetry.io/docs/specs/otel/", IN_DOCS, id="url"),
        pytest.param("[spec](https://example.com/docs/x.md#y)", IN_DOCS, id="external-link"),
        pytest.param(
            "deploy/docker/<service>.Dockerfile and libs/*/pyproject.toml", IN_CODE, id="placeholders"
        ),
        pytest.param(
            "tests/bench/results/extender_filter.json, native/build/libvgpu.so", IN_CODE, id="generated"
        ),
        pytest.param(
            joined("tests/", "common.c (see tests/", "hook_table_consistency.c)"),
            IN_NATIVE,
            id="native-relative",
        ),
        pytest.param(
            "[wire](wire-format.md#pod-annotations), [here](#bind-and-the-node-lock)", IN_DOCS, id="links"
        ),
        pytest.param("the docs and the tests, design notes in the wire format", IN_CODE, id="prose"),
        pytest.param("```\n[x](nowhere.md)\n```", IN_DOCS, id="link-in-code-block"),
    ],
)
def test_a_good_reference_passes(text: str, source: Path) -> None:
    assert check_text(text, source) == []


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("`make up` / `make down`", "make-up--make-down"),
        ("8. Observable by default", "8-observable-by-default"),
        ("Lock lifetime: two modes", "lock-lifetime-two-modes"),
        ("Fail closed, for GPU pods only", "fail-closed-for-gpu-pods-only"),
        (
            "The device plugin (`services/device-plugin`, `hamipy.device_plugin`)",
            "the-device-plugin-servicesdevice-plugin-hamipydevice_plugin",
        ),
    ],
)
def test_github_anchor(heading: str, anchor: str) -> None:
    assert github_anchor(heading) == anchor


def test_repeated_headings_are_numbered(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A\n## Notes\n```\n# not a heading\n```\n## Notes\n")
    assert anchors(page) == {"a", "notes", "notes-1"}
