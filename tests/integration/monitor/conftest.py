"""The monitor's integration stack: the real control plane, the webhook and one extender in this
process, and one simulated GPU node running the kubelet stand-in, the real device plugin and the
real monitor as processes over the fake driver (one GPU, so that every pod shares it)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from monitor_support import GPU, MONITOR_ARGS, NATIVE_BUILD, RESOURCE, MonitorAgent, MonitorStack
from stack_support import start_extenders, start_webhook, stop_webhook, use_extender

from hamipy.devcluster import DevCluster, NodePool, NodeSpec
from hamipy.devcluster.gpu_nodes import gpu_node_agents


@pytest.fixture
async def monitor_stack(
    devcluster: DevCluster,
    kube_client: Any,
    namespace: str,
    node_pool: NodePool,
    hami_scheduler: Callable[..., Any],
) -> AsyncIterator[MonitorStack]:
    # Unix socket paths must stay short (about 100 bytes): a directory under /tmp, not tmp_path.
    workdir = Path(tempfile.mkdtemp(prefix="hamipy-mon-", dir="/tmp"))
    webhook = await start_webhook(kube_client, namespace, workdir / "webhook")
    (extender,) = await start_extenders(kube_client)
    try:
        await use_extender(hami_scheduler, extender.url)
        standin, plugin = gpu_node_agents(
            workdir=workdir / "node",
            gpus=(GPU,),
            kubeconfig=Path(devcluster.access.kubeconfig),
            native_build=NATIVE_BUILD,
        )
        monitor = MonitorAgent(plugin, extra_args=MONITOR_ARGS)
        node = f"{namespace}-gpu"
        await node_pool.add(
            NodeSpec(name=node, labels={"gpu-test": namespace}), agents=(standin, plugin, monitor)
        )
        await standin.wait_registered(RESOURCE)
        yield MonitorStack(kube_client, namespace, node, standin, plugin, monitor, extender)
        assert monitor.running(), f"the monitor exited; its log:\n{monitor.log_path.read_text()[-4000:]}"
        assert not standin.errors, standin.errors
    finally:
        await extender.stop()
        await stop_webhook(webhook)
        shutil.rmtree(workdir, ignore_errors=True)
