"""A real kubelet (v1.34.4) over the fake container runtime joins the dev cluster and runs a pod,
and leaves the host as it found it: no mount, no kernel setting changed, none of the directories a
kubelet makes on its host (its device manager with our device plugin is tested on the whole path:
tests/integration/device_plugin)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any

import pytest

from hamipy.devcluster.binaries import KUBERNETES_VERSION
from hamipy.devcluster.cluster import DevCluster
from hamipy.devcluster.real_kubelet import (
    PROTECTED_SYSCTLS,
    SHADOWED_DIRS,
    RealKubelet,
    can_run_real_kubelets,
)
from hamipy.devcluster.waiting import wait_for
from hamipy.kube.client import RawKube
from hamipy.kube.errors import NotFound

NATIVE_BUILD = Path(__file__).resolve().parents[3] / "native" / "build"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(can_run_real_kubelets() is not None, reason=str(can_run_real_kubelets())),
]


# What a kubelet creates on a host of its own: none of it may appear here.
KUBELET_PATHS = ("/var/lib/kubelet", "/var/log/pods", "/var/log/containers")


def host_state(workdir: Path) -> tuple[dict[str, str], list[str], dict[str, bool]]:
    sysctls = {name: Path("/proc/sys", name).read_text() for name in PROTECTED_SYSCTLS}
    watched = (*SHADOWED_DIRS, str(workdir))
    mounts = [
        line for line in Path("/proc/mounts").read_text().splitlines() if any(w in line for w in watched)
    ]
    return sysctls, mounts, {path: Path(path).exists() for path in KUBELET_PATHS}


def in_working_directory(kubelet: RealKubelet) -> list[Path]:
    """What the running kubelet's working directory holds."""
    return list(Path(os.readlink(f"/proc/{kubelet.pids()[f'kubelet-{kubelet.node}']}/cwd")).iterdir())


async def test_a_real_kubelet_joins_and_runs_a_pod_and_leaves_the_host_alone(
    devcluster: DevCluster, kube_client: Any, namespace: str, tmp_path: Path
) -> None:
    before = host_state(tmp_path)
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
        assert host_state(tmp_path) == before
        # A path the kubelet resolves relative to its working directory finds nothing there of the
        # runtime's (its clean-up of a container's logs once removed the runtime's socket).
        assert in_working_directory(kubelet) == []
        assert kubelet.socket.exists()
        assert kubelet.record_path.exists()
    finally:
        await asyncio.to_thread(kubelet.stop)
        with contextlib.suppress(NotFound):
            await kube.request("DELETE", f"/api/v1/nodes/{node}")
    assert host_state(tmp_path) == before
