"""Docs, code and tests say what the system is and why, not how it got there.

- No reference to an issue of the project's tracker by its number: the tracker is not in the
  repository, so the number tells a reader nothing; the constraint it stood for belongs in the
  text. Upstream's bugs cited by their project (``HAMi #2958``) stay: they say why a rule exists.
- No rounds of work (a numbered session) anywhere, and ``docs/benchmarks.md`` is one current table
  per benchmark, not a diary of runs (the sixteenth this, the ninth's that). Earlier figures are in
  git's history of that page.

What is caught, and what is not, is shown on planted text at the end.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

import pytest
from repository_text import ROOT, joined, relative, scanned_files

_ORDINALS: Final = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth"
    "|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth"
)
ORDINAL: Final = rf"(?:{_ORDINALS}|\d+(?:st|nd|rd|th))"
LATER_ORDINAL: Final = rf"(?:{_ORDINALS.split('|', 2)[2]}|\d+th)"
"""From "third" on: "the third" is a diary's entry where "the first" may be a step of a method."""

ISSUE_REF: Final = re.compile(r"(?<!HAMi )(?<!HAMi-core )(?<!upstream )\bissues?\s+#?\d+", re.IGNORECASE)
ROUND_OF_WORK: Final = re.compile(rf"\b{ORDINAL}\s+sessions?\b|\bsessions? of issue\b", re.IGNORECASE)
DIARY: Final = re.compile(
    rf"\bsessions?\b(?!\s+tickets?)|\b{LATER_ORDINAL}(?:'s)?\s+(?:runs?|rounds?|pairs?)\b|\bthe\s+{LATER_ORDINAL}(?:'s)?\b",
    re.IGNORECASE,
)
BENCHMARKS: Final = ROOT / "docs" / "benchmarks.md"


def history(text: str, source: Path) -> list[str]:
    """Each place ``text``, the content of repository file ``source``, tells history: line and match."""
    patterns = [ISSUE_REF, ROUND_OF_WORK] + ([DIARY] if source == BENCHMARKS else [])
    return [
        f"{relative(source)}:{text.count(chr(10), 0, match.start()) + 1}: {match.group(0)!r}"
        for pattern in patterns
        for match in pattern.finditer(text)
    ]


def test_no_file_tells_history() -> None:
    files = list(scanned_files())
    assert BENCHMARKS in files
    found = [place for source in files for place in history(source.read_text(errors="replace"), source)]
    assert found == []


# -- the checker itself, on planted text ----------------------------------------------------------

IN_CODE: Final = ROOT / "services" / "extender" / "src" / "hamipy" / "extender" / "binding.py"
IN_DOCS: Final = ROOT / "docs" / "extender.md"


@pytest.mark.parametrize(
    ("text", "source"),
    [
        pytest.param(joined("(iss", "ue 12)"), IN_CODE, id="issue"),
        pytest.param(joined("The Helm chart (iss", "ues 10 and 14)"), IN_CODE, id="issues"),
        pytest.param(joined("# Iss", "ue 16's hijack"), IN_CODE, id="possessive"),
        pytest.param(joined("on the real GPU (iss", "ue #20, item 3)"), IN_DOCS, id="hash"),
        pytest.param(joined("were measured after iss", "ue\n15 added tests"), IN_DOCS, id="across-lines"),
        pytest.param(joined("the twel", "fth session"), IN_CODE, id="session"),
        pytest.param(joined("the 12", "th session"), IN_DOCS, id="numbered-session"),
        pytest.param(joined("the six", "teenth run, two rounds"), BENCHMARKS, id="diary-run"),
        pytest.param(joined("alternated with the nin", "th's code"), BENCHMARKS, id="diary-ordinal"),
        pytest.param(joined("Two more alternated pairs (this ses", "sion)"), BENCHMARKS, id="diary-session"),
        pytest.param(joined("Four", "th run, one round"), BENCHMARKS, id="diary-run-of-a-series"),
    ],
)
def test_history_is_caught(text: str, source: Path) -> None:
    assert len(history(text, source)) == 1, history(text, source)


@pytest.mark.parametrize(
    ("text", "source"),
    [
        pytest.param("a pod whose annotation it could not parse (HAMi #2958)", IN_DOCS, id="upstream-hash"),
        pytest.param(joined("counters that underflow (HAMi iss", "ue 1181)"), IN_DOCS, id="upstream-issue"),
        pytest.param("known issues with the driver; an issue 'tracker'", IN_DOCS, id="the-word"),
        pytest.param(
            "the kubelet's PodResources API and its sessions", IN_CODE, id="sessions-outside-benchmarks"
        ),
        pytest.param(
            "round 1, round 2; a third of its CPU; the first run on a machine; 2 session tickets",
            BENCHMARKS,
            id="method",
        ),
    ],
)
def test_what_is_not_history_passes(text: str, source: Path) -> None:
    assert history(text, source) == []
