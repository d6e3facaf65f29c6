"""A GPU node with the monitor on it, for the monitor's integration tests.

The node is the device plugin's (``stack_support.gpu_node``: the real kubelet over the fake runtime
and the real ``hamipy-device-plugin`` process over the fake driver); ``MonitorAgent`` adds the real
``hamipy-monitor`` process, with the fake ``libnvidia-ml.so.1`` on its library path and the node's
hook directory. ``SimContainer`` runs native/'s test programs as processes of one container the
kubelet created: the env it was created with, the interposer preloaded, and the region file at the
host path of the container's mount (what a container runtime would do).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import builders
from kubernetes_asyncio.client import CoreV1Api
from stack_support import (
    Samples,
    Webhook,
    gpu_node,
    sample_key,
    samples,
    scrape_text,
    start_extenders,
    start_webhook,
    stop_webhook,
    use_extender,
)

from hamipy.devcluster import API_TIMEOUT_S, DevCluster, gpu_nodes, wait_for
from hamipy.devcluster.gpu_nodes import DevicePluginAgent, FakeGpu
from hamipy.devcluster.kubelet_nodes import KubeletNode
from hamipy.devcluster.real_kubelet import ContainerConfig
from hamipy.extender.server import ExtenderServer
from hamipy.protocol import keys
from hamipy.protocol.allocation_env import ENV_SHARED_CACHE

ROOT = Path(__file__).resolve().parents[3]
NATIVE_BUILD = ROOT / "native" / "build"
PROGRAM_TIMEOUT_S = 30.0
MIB = 1 << 20

__all__ = ["Samples", "sample_key", "samples", "scrape_text"]  # the monitor tests read them here


class MonitorAgent(gpu_nodes.MonitorAgent):
    """devcluster's monitor agent, with what the tests read from it."""

    async def scrape(self) -> Samples:
        return samples(await scrape_text(f"{self.url}/metrics"))

    async def healthz(self) -> int:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
            session.get(f"{self.url}/healthz") as resp,
        ):
            return resp.status

    def log_lines(self) -> list[str]:
        return self.log_path.read_text().splitlines()


@dataclass
class SimContainer:
    """The processes of one served container: its Allocate env, the interposer, its region file at
    the host end of its mount."""

    allocation: ContainerConfig
    plugin: DevicePluginAgent
    extra_env: dict[str, str] | None = None

    @property
    def host_region_dir(self) -> Path:
        return Path(self.allocation.mount(str(self.plugin.hook_path)).host_path)

    @property
    def region_file(self) -> Path:
        return self.host_region_dir / Path(self.allocation.envs[ENV_SHARED_CACHE]).name

    def env(self) -> dict[str, str]:
        build = self.plugin.native_build
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            **self.allocation.envs,
            **(self.extra_env or {}),
            ENV_SHARED_CACHE: str(self.region_file),
            "HAMIPY_FAKE_GPU_CONFIG": str(self.plugin.gpu_config_path),
            "LD_LIBRARY_PATH": str(build / "fake"),
            "LD_PRELOAD": str(build / "libvgpu.so"),
        }

    def hold(self, mib: int) -> subprocess.Popen[str]:
        """Start ``region_peer hold <mib>``: it allocates and holds until its stdin closes."""
        proc = subprocess.Popen(
            [str(self.plugin.native_build / "tests" / "region_peer"), "hold", str(mib)],
            env=self.env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        (line,) = read_lines(proc, 1) or [""]
        if line != "held":
            proc.kill()
            _, err = proc.communicate(timeout=PROGRAM_TIMEOUT_S)
            raise AssertionError(f"region_peer did not hold {mib} MiB (got {line!r}); stderr:\n{err}")
        return proc


def read_lines(proc: subprocess.Popen[str], count: int, timeout_s: float = PROGRAM_TIMEOUT_S) -> list[str]:
    """Up to `count` lines of the program's stdout, fewer if it says no more within `timeout_s`.
    Raw reads of the pipe: ``select`` on a buffered reader misses lines the reader already took in
    (two lines written at once, the second waiting in its buffer while select sees an empty pipe)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    data = b""
    deadline = time.monotonic() + timeout_s
    while data.count(b"\n") < count:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return [line.strip() for line in data.decode().splitlines()[:count]]


def release(proc: subprocess.Popen[str]) -> None:
    """Close the holder's stdin: it frees what it holds and exits."""
    proc.communicate(timeout=PROGRAM_TIMEOUT_S)
    assert proc.returncode == 0, f"region_peer exited {proc.returncode}"


GPU = FakeGpu("GPU-cccccccc-0000-4000-8000-000000000000", "NVIDIA A100-SXM4-80GB", 81920)
RESOURCE = keys.RESOURCE_COUNT


class MonitorStack:
    """The node, its agents and helpers to create pods and run their containers."""

    def __init__(
        self,
        api: Any,
        namespace: str,
        node: str,
        kubelet_node: KubeletNode,
        plugin: DevicePluginAgent,
        monitor: MonitorAgent,
        extender: ExtenderServer,
    ) -> None:
        self.api = api
        self.core = CoreV1Api(api)
        self.namespace = namespace
        self.node = node
        self.kubelet_node = kubelet_node
        self.plugin = plugin
        self.monitor = monitor
        self.extender = extender

    async def create(
        self, name: str, containers: list[dict[str, Any]], *, init: list[dict[str, Any]] | None = None
    ) -> None:
        body = builders.pod(
            name,
            *containers,
            init=init or (),
            nodeSelector={"gpu-test": self.namespace},
            terminationGracePeriodSeconds=0,
        )
        core: Any = self.core  # its hint asks for a V1Pod; the client sends a JSON body as it is
        await core.create_namespaced_pod(self.namespace, body, _request_timeout=API_TIMEOUT_S)

    async def pod(self, name: str) -> dict[str, Any]:
        pod = await self.core.read_namespaced_pod(name, self.namespace, _request_timeout=API_TIMEOUT_S)
        out: dict[str, Any] = self.api.sanitize_for_serialization(pod)
        return out

    async def served(self, name: str) -> dict[str, Any]:
        """The pod once the device plugin marked it ``bind-phase=success``."""

        async def done() -> dict[str, Any] | None:
            pod = await self.pod(name)
            phase = (pod["metadata"].get("annotations") or {}).get(keys.BIND_PHASE)
            assert phase != "failed", f"pod {name} failed allocation: {pod['metadata'].get('annotations')}"
            return pod if phase == "success" else None

        pod: dict[str, Any] | None = await wait_for(done, timeout=60, interval=0.1, what=f"pod {name} served")
        assert pod is not None  # wait_for returns the first truthy value
        return pod

    async def delete(self, name: str) -> None:
        await self.core.delete_namespaced_pod(
            name, self.namespace, grace_period_seconds=0, _request_timeout=API_TIMEOUT_S
        )

    async def container(
        self, pod: str, container: str, extra_env: dict[str, str] | None = None
    ) -> SimContainer:
        config = await self.kubelet_node.wait_container(self.namespace, pod, container, timeout_s=60)
        return SimContainer(config, self.plugin, extra_env)


MONITOR_ARGS = ("--feedback-interval", "0.3", "--legacy-metrics")


@contextlib.asynccontextmanager
async def running_monitor_stack(
    devcluster: DevCluster,
    api: Any,
    namespace: str,
    hami_scheduler: Callable[..., Any],
    *,
    monitor_args: Sequence[str] = MONITOR_ARGS,
    webhook_metrics: bool = False,
) -> AsyncIterator[tuple[MonitorStack, Webhook]]:
    """The real control plane, the webhook (``webhook_metrics``: with its plain-HTTP metrics port)
    and one extender in this process, and one GPU node running the real kubelet, the real device
    plugin and the real monitor (``monitor_args``) as processes over the fake driver (one GPU, so
    that every pod shares it). On exit the monitor and the kubelet must still run."""
    # Unix socket paths must stay short (about 100 bytes): a directory under /tmp, not tmp_path.
    workdir = Path(tempfile.mkdtemp(prefix="hamipy-mon-", dir="/tmp"))
    webhook = await start_webhook(api, namespace, workdir / "webhook", metrics=webhook_metrics)
    try:
        (extender,) = await start_extenders(api)
        try:
            await use_extender(hami_scheduler, extender.url)
            monitors: list[MonitorAgent] = []

            def monitor_of(plugin: DevicePluginAgent) -> list[MonitorAgent]:
                monitors.append(MonitorAgent(plugin, extra_args=monitor_args))
                return monitors

            async with gpu_node(
                devcluster, api, namespace, workdir / "node", gpus=(GPU,), extra_agents=monitor_of
            ) as (node, plugin):
                (monitor,) = monitors
                yield MonitorStack(api, namespace, node.name, node, plugin, monitor, extender), webhook
                assert monitor.running(), (
                    f"the monitor exited; its log:\n{monitor.log_path.read_text()[-4000:]}"
                )
        finally:
            await extender.stop()
    finally:
        await stop_webhook(webhook)
        shutil.rmtree(workdir, ignore_errors=True)
