"""The monitor's integration stack (``monitor_support.running_monitor_stack``): the real control
plane, the webhook and one extender in this process, and one GPU node running the real kubelet
(over the fake runtime), the real device plugin and the real monitor as processes over the fake
driver."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from monitor_support import MonitorStack, running_monitor_stack

from hamipy.devcluster import DevCluster


@pytest.fixture
async def monitor_stack(
    devcluster: DevCluster,
    kube_client: Any,
    namespace: str,
    hami_scheduler: Callable[..., Any],
) -> AsyncIterator[MonitorStack]:
    async with running_monitor_stack(devcluster, kube_client, namespace, hami_scheduler) as (
        stack,
        _,
    ):
        yield stack
