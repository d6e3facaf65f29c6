"""The dashboard query reader shared with the unit tests (``tests/unit/monitor/dashboard_queries.py``)."""

from __future__ import annotations

from by_path import load

_queries = load("unit/monitor/dashboard_queries.py")
dashboards = _queries.dashboards
dashboard_metrics = _queries.dashboard_metrics
exported_names = _queries.exported_names
queries = _queries.queries
