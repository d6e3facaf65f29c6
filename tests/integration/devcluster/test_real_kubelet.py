"""A real kubelet (v1.34.4) over the fake container runtime joins the dev cluster and runs a pod,
and leaves the host as it found it: no mount, no kernel setting changed; its device manager
registers our device plugin (issue 17, first part)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from hamipy.devcluster.binaries import KUBERNETES_VERSION
from hamipy.devcluster.cluster import DevCluster
from hamipy.devcluster.gpu_nodes import DevicePluginAgent, FakeGpu
from hamipy.devcluster.real_kubelet import KUBELET_DIR, PROTECTED_SYSCTLS, RealKubelet, can_run_real_kubelets
from hamipy.devcluster.waiting import wait_for
from hamipy.kube.client import RawKube
from hamipy.kube.errors import NotFound
from hamipy.protocol import keys

NATIVE_BUILD = Path(__file__).resolve().parents[3] / "native" / "build"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(can_run_real_kubelets() is not None, reason=str(can_run_real_kubelets())),
]


def host_state() -> tuple[dict[str, str], list[str]]:
    sysctls = {name: Path("/proc/sys", name).read_text() for name in PROTECTED_SYSCTLS}
    mounts = [line for line in Path("/proc/mounts").read_text().splitlines() if str(KUBELET_DIR) in line]
    return sysctls, mounts


async def test_a_real_kubelet_joins_and_runs_a_pod_and_leaves_the_host_alone(
    devcluster: DevCluster, kube_client: Any, namespace: str, tmp_path: Path
) -> None:
    before = host_state()
    kube = RawKube(kube_client)
    node = f"{namespace}-kubelet"
    kubelet = RealKubelet(devcluster, node, tmp_path / "node")
    try:
        await asyncio.to_thread(kubelet.start)

        async def ready() -> dict[str, Any] | None:
            try:
                found: dict[str, Any] = await kube.request("GET", f"/api/v1/nodes/{node}")
            except NotFound:
                return None
            conditions = {c["type"]: c["status"] for c in found["status"].get("conditions", [])}
            return found if conditions.get("Ready") == "True" else None

        registered = await wait_for(ready, timeout=60, what=f"node {node} Ready")
        assert registered["status"]["nodeInfo"]["kubeletVersion"] == KUBERNETES_VERSION
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p"},
            "spec": {"nodeName": node, "containers": [{"name": "main", "image": "registry.invalid/app:1"}]},
        }
        await kube.request("POST", f"/api/v1/namespaces/{namespace}/pods", body=pod)

        async def running() -> bool:
            got = await kube.request("GET", f"/api/v1/namespaces/{namespace}/pods/p")
            return bool(got["status"].get("phase") == "Running")

        await wait_for(running, timeout=60, what="the pod Running on the real kubelet")
        # The kubelet's own namespace shadows the kernel settings and the directory.
        assert host_state() == before
    finally:
        await asyncio.to_thread(kubelet.stop)
        with contextlib.suppress(NotFound):
            await kube.request("DELETE", f"/api/v1/nodes/{node}")
    assert host_state() == before


async def test_the_real_kubelets_device_manager_registers_our_device_plugin(
    devcluster: DevCluster, kube_client: Any, namespace: str, tmp_path: Path
) -> None:
    # The plugin's socket directory is the node's, which the kubelet sees at
    # /var/lib/kubelet/device-plugins in its own mount namespace.
    kube = RawKube(kube_client)
    node = f"{namespace}-gpu"
    # Unix socket paths are limited to 107 bytes: the node's directory is a short one of its own.
    short = Path(tempfile.mkdtemp(prefix="hamipy-rk-", dir="/tmp"))
    kubelet = RealKubelet(devcluster, node, short)
    plugin = DevicePluginAgent(
        workdir=tmp_path / "plugin",
        gpus=[FakeGpu(uuid="GPU-aaaaaaaa-0000-4000-8000-000000000001", memory_mib=40960)],
        kubeconfig=devcluster.access.kubeconfig,
        native_build=NATIVE_BUILD,
        plugin_dir=short / "root" / "device-plugins",
    )
    try:
        await asyncio.to_thread(kubelet.start)
        await plugin.start(cast(Any, SimpleNamespace(name=node)))

        async def advertised() -> str | None:
            found = await kube.request("GET", f"/api/v1/nodes/{node}")
            count: str | None = found["status"].get("capacity", {}).get(keys.RESOURCE_COUNT)
            return count if count not in (None, "0") else None

        # One GPU split 10 ways (the plugin's default split count): ten device IDs.
        assert await wait_for(advertised, timeout=60, what="the kubelet advertising nvidia.com/gpu") == "10"
        registered = await kube.request("GET", f"/api/v1/nodes/{node}")
        assert keys.NODE_REGISTER in registered["metadata"]["annotations"]
    finally:
        await plugin.stop()
        await asyncio.to_thread(kubelet.stop)
        shutil.rmtree(short, ignore_errors=True)
        with contextlib.suppress(NotFound):
            await kube.request("DELETE", f"/api/v1/nodes/{node}")
