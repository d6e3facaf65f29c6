from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from runtime_support import RuntimeStack, running_runtime_stack

from hamipy.devcluster import DevCluster


@pytest.fixture
async def runtime_stack(
    request: pytest.FixtureRequest,
    devcluster: DevCluster,
    kube_client: Any,
    namespace: str,
    hami_scheduler: Callable[..., Any],
) -> AsyncIterator[RuntimeStack]:
    gpus, nvidia = request.module.GPUS, getattr(request.module, "NVIDIA", None)
    node_config = getattr(request.module, "NODE_CONFIG", None)
    async with running_runtime_stack(
        devcluster, kube_client, namespace, hami_scheduler, gpus=gpus, nvidia=nvidia, node_config=node_config
    ) as stack:
        yield stack
