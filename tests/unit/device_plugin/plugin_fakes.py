"""Fakes for the device plugin's unit tests: the API server of its node (a ``FakeKube``), GPUs, a
health watch, a kubelet that accepts ``Register``, and the kubelet's PodResources view."""

from __future__ import annotations

import asyncio
import io
import json
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

import builders
import grpc
from fake_kube import FakeKube

from hamipy.device_plugin.allocating import KubeletPod, KubeletPods
from hamipy.device_plugin.devices import Gpu
from hamipy.device_plugin.errors import KubeletUnreachable
from hamipy.kube.resources import pod_path
from hamipy.kubelet_api import KUBELET_SOCKET
from hamipy.kubelet_api.v1beta1 import api_pb2, api_pb2_grpc
from hamipy.protocol import ProtocolError, keys
from hamipy.protocol.pod_devices import decode_pod_devices

NODE = "n1"
PODS = pod_path()
"""The pods of every node: what the plugin lists and watches (narrowed to NODE)."""
GPU_A = Gpu(0, "GPU-aaaaaaaa-0000-4000-8000-000000000000", "NVIDIA A100", 81920, 0, "00000000:10:00.0")


def node_kube(*pods: dict[str, Any]) -> FakeKube:
    """An API server holding NODE (no annotations yet) and ``pods``."""
    return FakeKube(builders.node(NODE, annotations={}), *pods)


class FakeHealth:
    """A health watch without NVML: reports what ``sick`` names, then waits for ``stop``;
    ``fail`` makes ``run`` raise it instead."""

    def __init__(self, uuids: list[str], on_unhealthy: Callable[[str, str], None], *, poll_s: float) -> None:
        self.uuids = uuids
        self.on_unhealthy = on_unhealthy
        self.stopped = threading.Event()
        self.fail: BaseException | None = None

    def run(self) -> None:
        if self.fail is not None:
            raise self.fail
        self.stopped.wait()

    def stop(self) -> None:
        self.stopped.set()


class _Registration(api_pb2_grpc.RegistrationServicer):
    def __init__(self) -> None:
        self.requests: list[api_pb2.RegisterRequest] = []
        self.received = asyncio.Event()
        self.answer = asyncio.Event()
        """Cleared, ``Register`` waits for it (a kubelet that takes its time)."""
        self.answer.set()

    async def Register(
        self,
        request: api_pb2.RegisterRequest,
        context: grpc.aio.ServicerContext[api_pb2.RegisterRequest, api_pb2.Empty],
    ) -> api_pb2.Empty:
        self.requests.append(request)
        self.received.set()
        await self.answer.wait()
        return api_pb2.Empty()


class FakeKubelet:
    """``Registration/Register`` on ``<plugin_dir>/kubelet.sock``, answering yes (``async with``)."""

    def __init__(self, plugin_dir: Path) -> None:
        self.plugin_dir = plugin_dir
        self.registration = _Registration()
        self.server = grpc.aio.server()

    async def __aenter__(self) -> FakeKubelet:
        api_pb2_grpc.add_RegistrationServicer_to_server(self.registration, self.server)
        self.server.add_insecure_port(f"unix://{self.plugin_dir / KUBELET_SOCKET}")
        await self.server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.server.stop(None)


HELD = frozenset({"held-by-an-earlier-allocate"})
"""The device IDs the fake kubelet reports for a container it has allocated."""


def _bind_time(pod: dict[str, Any]) -> int:
    text = str(pod["metadata"].get("annotations", {}).get(keys.BIND_TIME, ""))
    return int(text) if text.isdigit() else 2**63


def _gpu_containers(pod: dict[str, Any]) -> list[str]:
    spec = pod.get("spec") or {}
    return [
        str(c["name"])
        for kind in ("initContainers", "containers")
        for c in spec.get(kind) or ()
        if keys.RESOURCE_COUNT in ((c.get("resources") or {}).get("limits") or {})
    ]


def kubelet_view(
    pods: Iterable[dict[str, Any]],
    *,
    node: str = NODE,
    order: Sequence[str] | None = None,
    also: Collection[str] = (),
) -> KubeletPods:
    """The kubelet's PodResources ``List`` over ``pods``, as a kubelet that admits pods one at a
    time sees them.

    By default the kubelet admits the node's pods in bind order (``hami.io/bind-time``, then name):
    each pod is listed once reached; the first one with a GPU container still to serve (its slot in
    ``vgpu-devices-to-allocate`` not empty) is the one being admitted, and the pods after it are not
    reached. A served GPU container holds ``HELD``. Pods bound elsewhere, failed (by the kubelet or
    the plugin) or done are not listed. ``order`` (pod names) replaces bind order and leaves out the
    pods it does not name; ``also`` (pod names) are listed as being admitted too (the kubelet's
    restart race)."""
    listed = [p for p in pods if _listed(p, node)]
    if order is not None:
        rank = {name: i for i, name in enumerate(order)}
        listed = sorted(
            (p for p in listed if p["metadata"]["name"] in rank), key=lambda p: rank[p["metadata"]["name"]]
        )
    else:
        listed.sort(key=lambda p: (_bind_time(p), p["metadata"]["name"]))
    out: dict[tuple[str, str], KubeletPod] = {}
    admitting = False
    for pod in listed:
        meta = pod["metadata"]
        if admitting and meta["name"] not in also:
            continue
        devices, unserved = _served(pod)
        out[(meta["namespace"], meta["name"])] = KubeletPod(meta["namespace"], meta["name"], devices)
        admitting = admitting or unserved
    return out


def _served(pod: dict[str, Any]) -> tuple[dict[str, frozenset[str]], bool]:
    """Each GPU container's devices (HELD once served), and whether one is still to serve."""
    annotations = pod["metadata"].get("annotations") or {}
    containers = _gpu_containers(pod)
    if annotations.get(keys.BIND_PHASE) != "allocating":
        return dict.fromkeys(containers, HELD), False
    try:
        allocated = [s for s in decode_pod_devices(annotations.get(keys.DEVICES_ALLOCATED, "")) if s]
        left = decode_pod_devices(annotations.get(keys.DEVICES_TO_ALLOCATE, ""))
    except ProtocolError:
        return dict.fromkeys(containers, frozenset()), True
    remaining = [s for s in left if s]
    served = len(allocated) - len(remaining)
    devices = {name: HELD if i < served else frozenset() for i, name in enumerate(containers)}
    return devices, bool(remaining) and bool(containers)


def _listed(pod: dict[str, Any], node: str) -> bool:
    status = (pod.get("status") or {}).get("phase")
    annotations = pod["metadata"].get("annotations") or {}
    return (
        (pod.get("spec") or {}).get("nodeName") == node
        and status not in ("Failed", "Succeeded")
        and annotations.get(keys.BIND_PHASE) != "failed"
    )


class FakePodResources:
    """``kubelet_view`` over NODE's pods in a ``FakeKube`` as they are at each call (``pods`` is the
    allocator's ``kubelet``); ``order`` and ``also`` as there; ``unreachable`` makes ``pods`` raise."""

    def __init__(self, api: FakeKube) -> None:
        self.api = api
        self.order: list[str] | None = None
        self.also: set[str] = set()
        self.unreachable = False
        self.calls = 0

    async def pods(self) -> KubeletPods:
        self.calls += 1
        if self.unreachable:
            raise KubeletUnreachable("the kubelet's PodResources API did not answer: UNAVAILABLE")
        return kubelet_view(self.api.items(pod_path()), node=NODE, order=self.order, also=self.also)


def log_lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]
