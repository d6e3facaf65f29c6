"""A running system for the Prometheus-backed tests: the monitor tests' stack
(``monitor_support.running_monitor_stack``: the real control plane, the webhook and one extender in
this process, one GPU node (the real kubelet over the fake runtime) with the real device plugin and
monitor as processes over the fake driver), with the webhook's plain-HTTP metrics port as the chart
runs it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from observability_support import ObservedSystem, monitor_support

from hamipy.devcluster import DevCluster

# The chart's monitor (no HAMi pre-2.9 names), with a short feedback pass so the workload's kernel
# launch is aged (and counted in hamipy_monitor_feedback_writes_total) within the test.
MONITOR_ARGS = ("--feedback-interval", "0.3")


@pytest.fixture
async def observed_system(
    devcluster: DevCluster,
    kube_client: Any,
    namespace: str,
    hami_scheduler: Callable[..., Any],
) -> AsyncIterator[ObservedSystem]:
    async with monitor_support.running_monitor_stack(
        devcluster,
        kube_client,
        namespace,
        hami_scheduler,
        monitor_args=MONITOR_ARGS,
        webhook_metrics=True,
    ) as (stack, webhook):
        yield ObservedSystem(stack, webhook)
