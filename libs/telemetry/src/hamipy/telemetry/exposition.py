"""Gauge families written straight to Prometheus text (exposition format 0.0.4), for metrics with a
sample per GPU or per container of a whole cluster.

prometheus_client builds every sample as objects (a ``Sample`` tuple, a label dict, then sorting,
escaping and float formatting for each). The extender exports 7 samples per GPU and 2 per
container, 76,000 at 1,000 nodes of 8 GPUs: rendered that way, a scrape would hold its event loop
long enough to stall filters and binds (docs/benchmarks.md#metrics-at-1000-nodes measures this
module's). Here a row's label text is built once for all the families it appears
in, and the values' text (a few memory sizes and percentages, repeated thousands of times) is
memoised. The text is what ``generate_latest`` writes for the same samples (the tests compare them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Final

from prometheus_client.utils import floatToGoString

__all__ = ["GaugeText", "label_text", "value_text"]

value_text: Final[Callable[[float], str]] = floatToGoString
"""How prometheus_client writes a value (Go's notation: ``3.4359738368e+10``); untyped there."""


def _escape(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


def label_text(labels: Iterable[tuple[str, str]]) -> str:
    """``{name="value",...}`` sorted by name as prometheus_client writes it, values escaped (a label
    value may come from a node's or a pod's annotations)."""
    return "{" + ",".join(f'{name}="{_escape(value)}"' for name, value in sorted(labels)) + "}"


class GaugeText:
    """One gauge family's text for one scrape: ``add`` a sample per row, then ``text``."""

    def __init__(self, name: str, documentation: str) -> None:
        doc = documentation.replace("\\", r"\\").replace("\n", r"\n")
        self.name = name
        self._lines = [f"# HELP {name} {doc}\n# TYPE {name} gauge\n"]
        self._values: dict[float, str] = {}

    def add(self, labels: str, value: float) -> None:
        """One sample; ``labels`` from ``label_text``."""
        text = self._values.get(value)
        if text is None:
            text = self._values[value] = value_text(value)
        self._lines.append(f"{self.name}{labels} {text}\n")

    def text(self) -> str:
        return "".join(self._lines)

    def pieces(self, lines: int) -> Iterator[str]:
        """``text`` in pieces of at most ``lines`` lines (the header counts as one), so that a caller
        on an event loop can yield between them: at 5,000 nodes a family is 5 MB of text."""
        for start in range(0, len(self._lines), lines):
            yield "".join(self._lines[start : start + lines])
