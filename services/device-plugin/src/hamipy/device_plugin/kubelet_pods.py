"""Which pods the kubelet holds and which device IDs each container has, from its PodResources API.

The kubelet's Allocate names device IDs, never the pod. The kubelet itself knows: it adds a pod to
its pod manager right before admitting it, admits pods one at a time (its sync loop; a restarted
kubelet takes its whole batch in creation order, adding each pod just before its admission), and
records a container's device IDs once Allocate answered. So while the kubelet admits a pod, the
PodResources ``List`` (``/v1.PodResourcesLister/List`` on ``<kubelet root>/pod-resources/kubelet.sock``)
holds that pod, still without devices for the container being allocated, beside the pods admitted
before it; pods not yet reached, and pods it rejected (terminal), are not listed. That is what
``allocating.choose`` decides from: never the order pods were bound.

``List`` reports regular containers and restartable (sidecar) init containers; other init
containers are not listed (their devices go to the containers after them).

Every call has a timeout, within which a kubelet that is not listening yet (restarting) is waited
for. The kubelet rate-limits the API (100 calls a second, bursts of 10): a ``RESOURCE_EXHAUSTED``
answer is retried within the same timeout. Any other failure is a ``KubeletUnreachable`` naming
the socket, and the Allocate it was for is refused: a pod the plugin cannot identify is not
served.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import MappingProxyType
from typing import Final

import grpc
import grpc.aio

from hamipy.device_plugin.allocating import KubeletPod, KubeletPods
from hamipy.device_plugin.errors import KubeletUnreachable
from hamipy.kubelet_api.podresources_v1 import api_pb2, api_pb2_grpc

__all__ = ["PodResourcesClient", "kubelet_pods"]

_RATE_LIMITED_RETRY_S: Final = 0.02
_CHANNEL_OPTIONS: Final = (
    # A restarted kubelet serves again within seconds: reconnect in well under a second, not after
    # gRPC's default backoff (1 s growing to 120 s), during which every call would fail at once.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


def kubelet_pods(response: api_pb2.ListPodResourcesResponse, resource_name: str) -> KubeletPods:
    """The pods of a ``List`` answer, with ``resource_name``'s devices only."""
    pods: dict[tuple[str, str], KubeletPod] = {}
    for pod in response.pod_resources:
        devices = {
            container.name: frozenset(
                device_id
                for group in container.devices
                if group.resource_name == resource_name
                for device_id in group.device_ids
            )
            for container in pod.containers
        }
        pods[(pod.namespace, pod.name)] = KubeletPod(pod.namespace, pod.name, MappingProxyType(devices))
    return MappingProxyType(pods)


class PodResourcesClient:
    """The kubelet's PodResources ``List`` over its unix socket (one channel, reconnecting)."""

    def __init__(self, socket: Path, resource_name: str, *, timeout_s: float) -> None:
        self.socket = socket
        self.resource_name = resource_name
        self.timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None

    def _stub(self) -> api_pb2_grpc.PodResourcesListerAsyncStub:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(f"unix://{self.socket}", options=_CHANNEL_OPTIONS)
        return api_pb2_grpc.PodResourcesListerStub(self._channel)

    async def pods(self) -> KubeletPods:
        """The kubelet's active pods now; raises ``KubeletUnreachable``."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                # wait_for_ready: a kubelet restarting (its socket gone a moment) is waited for
                # within the timeout, not refused at once.
                response = await self._stub().List(
                    api_pb2.ListPodResourcesRequest(), timeout=max(left, 0.001), wait_for_ready=True
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and left > _RATE_LIMITED_RETRY_S:
                    await asyncio.sleep(_RATE_LIMITED_RETRY_S)  # the kubelet's rate limit refills
                    continue
                raise KubeletUnreachable(
                    f"the kubelet's PodResources API at {self.socket} did not answer: "
                    f"{exc.code().name}: {exc.details()}"
                ) from exc
            return kubelet_pods(response, self.resource_name)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
