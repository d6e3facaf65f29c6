"""What the Prometheus-backed tests share: the system they observe (``ObservedSystem``) and the
monitor tests' node support, loaded by path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from by_path import load
from stack_support import Webhook

monitor_support = load("integration/monitor/monitor_support.py")


@dataclass
class ObservedSystem:
    """What Prometheus scrapes, and the monitor stack's helpers to run a workload on the node."""

    stack: Any  # monitor_support.MonitorStack
    webhook: Webhook
