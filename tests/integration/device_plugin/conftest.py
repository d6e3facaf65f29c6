"""The GPU stack of this directory's tests (``stack_support.running_gpu_stack``): the webhook and one
extender in this process, and one GPU node run by the real kubelet with the device plugin process,
over the GPUs the test module lists in its ``GPUS``, with the plugin's ``nvidia`` settings its
``NVIDIA`` names, and the monitor when it names ``MONITOR_ARGS``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from stack_support import GpuStack, running_gpu_stack

from hamipy.devcluster import DevCluster


@pytest.fixture
async def gpu_stack(
    request: pytest.FixtureRequest,
    devcluster: DevCluster,
    kube_client: Any,
    namespace: str,
    hami_scheduler: Callable[..., Any],
) -> AsyncIterator[GpuStack]:
    module = request.module
    async with running_gpu_stack(
        devcluster,
        kube_client,
        namespace,
        hami_scheduler,
        gpus=module.GPUS,
        nvidia=getattr(module, "NVIDIA", None),
        monitor_args=getattr(module, "MONITOR_ARGS", None),
    ) as stack:
        yield stack
