"""What the Prometheus-backed tests share: the system they observe (``ObservedSystem``) and the
monitor tests' node support, loaded by path."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from stack_support import Webhook


def _load_monitor_support() -> ModuleType:
    """tests/integration/monitor/monitor_support.py, loaded by path (test folders are not packages)."""
    name = "hamipy_observability_monitor_support"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parents[1] / "monitor" / "monitor_support.py"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


monitor_support = _load_monitor_support()


@dataclass
class ObservedSystem:
    """What Prometheus scrapes, and the monitor stack's helpers to run a workload on the node."""

    stack: Any  # monitor_support.MonitorStack
    webhook: Webhook
