"""The dashboard query reader shared with the unit tests (``tests/unit/monitor/dashboard_queries.py``),
loaded by path: test directories are not packages, so one cannot import the other by name."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def _load() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "unit" / "monitor" / "dashboard_queries.py"
    spec = importlib.util.spec_from_file_location("hamipy_monitor_dashboard_queries", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_queries = _load()
dashboards = _queries.dashboards
dashboard_metrics = _queries.dashboard_metrics
exported_names = _queries.exported_names
