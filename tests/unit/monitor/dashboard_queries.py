"""The metric names a Grafana dashboard queries, read from its JSON (for the dashboard tests, unit and
integration).

PromQL is not parsed in full: strings, label matchers, ranges and label lists (``by``, ``without``,
``on``, ``ignoring``, ``group_left``, ``group_right``) are removed, and what remains of the names that
are not a function call, a keyword or a number are metric names. ``label_values(metric{...}, label)``
in template variables names ``metric``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

ROOT: Final = Path(__file__).resolve().parents[3]
DASHBOARD_DIR: Final = ROOT / "deploy" / "grafana"

_STRINGS: Final = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS: Final = re.compile(r"\{[^{}]*\}")
_RANGES: Final = re.compile(r"\[[^\[\]]*\]")
_LABEL_LISTS: Final = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_NAME: Final = re.compile(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")
_LABEL_VALUES: Final = re.compile(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*[{,]")
_KEYWORDS: Final = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan", "by", "without"})


def dashboards() -> dict[str, dict[str, Any]]:
    """Every dashboard JSON in deploy/grafana, by file name."""
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def metric_names(expr: str) -> set[str]:
    """The metric names one PromQL expression reads."""
    text = _STRINGS.sub('""', expr)
    text = _MATCHERS.sub("", text)
    text = _RANGES.sub("", text)
    text = _LABEL_LISTS.sub("", text)
    return {m.group(1) for m in _NAME.finditer(text) if m.group(2) is None and m.group(1) not in _KEYWORDS}


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels") or [])


def queries(dashboard: dict[str, Any]) -> Iterator[str]:
    """Every PromQL expression of the dashboard's panels."""
    for panel in _panels(dashboard.get("panels") or []):
        for target in panel.get("targets") or []:
            if target.get("expr"):
                yield str(target["expr"])


def variable_metrics(dashboard: dict[str, Any]) -> set[str]:
    """Metrics named by the template variables' ``label_values`` queries."""
    names: set[str] = set()
    for var in (dashboard.get("templating") or {}).get("list") or []:
        query = var.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        names.update(_LABEL_VALUES.findall(text))
    return names


def dashboard_metrics(dashboard: dict[str, Any]) -> set[str]:
    """Every metric name the dashboard reads, panels and variables."""
    names = variable_metrics(dashboard)
    for expr in queries(dashboard):
        names |= metric_names(expr)
    return names


def exported_names(exposition: str) -> set[str]:
    """The names a Prometheus text exposition makes queryable: every sample name, and each family's
    declared series names (a family without samples yet still counts as exported)."""
    from prometheus_client.parser import text_string_to_metric_families

    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("_sum", "_count", "_created"),
        "gauge": ("",),
        "untyped": ("",),
        "info": ("_info",),
    }
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
        names.update(s.name for s in family.samples)
    return names
