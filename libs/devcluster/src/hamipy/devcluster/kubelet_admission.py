"""The kubelet stand-in's decisions, as plain functions: no gRPC, no API calls, no clock.

What a kubelet's device manager decides when it admits a pod (``pkg/kubelet/cm/devicemanager``,
Kubernetes v1.34), taken apart from the I/O in `hamipy.devcluster.kubelet_standin`:

- what each container asks for (`container_requests`): init containers first, then app
  containers; for every registered device-plugin resource, the container's limit (else request);
- which devices are free (`free_devices`): healthy and held by no container of a live pod;
- which to hand out (`begin_choice` / `finish_choice`): first the devices an init container of
  the same pod used and gave back, then the plugin's preferred ones, then the rest in ID order;
  with the kubelet's error text when there are not enough;
- what the node reports (`node_resources`) and the pod statuses the kubelet posts
  (`running_status`, `rejected_status`, `waiting_status`).

Errors::

    Exception
     └── AdmissionError          the pod cannot be admitted; the message is the kubelet's error text
          └── NotEnoughDevices   fewer free healthy devices than a container asks for
"""

from __future__ import annotations

import dataclasses
import datetime
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Final, Literal

from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.quantities import parse_quantity

__all__ = [
    "REJECTED_REASON",
    "AdmissionError",
    "ContainerKind",
    "ContainerRequest",
    "DeviceChoice",
    "NotEnoughDevices",
    "PluginDevice",
    "admission_message",
    "begin_choice",
    "container_requests",
    "finish_choice",
    "free_devices",
    "grpc_error_text",
    "is_extended_resource_name",
    "node_resources",
    "pod_is_deleting",
    "pod_is_terminal",
    "rejected_status",
    "release_reusable",
    "running_status",
    "waiting_status",
]

# The reason a kubelet gives a pod it rejects at admission (``pkg/kubelet/cm/admission``).
REJECTED_REASON: Final = "UnexpectedAdmissionError"

ContainerKind = Literal["init", "sidecar", "app"]
"""``init``: runs to completion before the app containers; ``sidecar``: an init container with
``restartPolicy: Always``, which keeps running (and keeps its devices); ``app``: ``spec.containers``."""


class AdmissionError(Exception):
    """The kubelet refuses the pod; ``str(exc)`` is the error a kubelet would put in its message."""


class NotEnoughDevices(AdmissionError):
    """A container asks for more devices of a resource than are free and healthy."""


@dataclasses.dataclass(frozen=True)
class PluginDevice:
    """One device as the plugin's ``ListAndWatch`` last reported it."""

    id: str
    healthy: bool
    numa_nodes: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class ContainerRequest:
    """One container of a pod and the device-plugin resources it asks for (count > 0 only)."""

    name: str
    kind: ContainerKind
    image: str
    resources: Mapping[str, int]


def _wanted(container: Mapping[str, Any], resource: str, label: str) -> int:
    res = container.get("resources") or {}
    limits = res.get("limits") or {}
    requests = res.get("requests") or {}
    value = limits.get(resource, requests.get(resource))
    if value is None:
        return 0
    try:
        return parse_quantity(value, resource=resource, container=label)
    except ProtocolError as exc:
        raise AdmissionError(str(exc)) from exc


def container_requests(pod_spec: Mapping[str, Any], registered: Collection[str]) -> list[ContainerRequest]:
    """Every container of the pod in the order a kubelet allocates them (init containers first).

    Only resources in `registered` (ever registered by a device plugin) are counted, as the kubelet
    ignores the rest (cpu, memory, and extended resources no plugin serves). Raises
    `AdmissionError` for a quantity that is not a whole number.
    """
    out: list[ContainerRequest] = []
    groups: tuple[tuple[str, bool], ...] = (("initContainers", True), ("containers", False))
    for field, is_init in groups:
        for index, container in enumerate(pod_spec.get(field) or []):
            name = str(container.get("name", ""))
            kind: ContainerKind = "app"
            if is_init:
                kind = "sidecar" if container.get("restartPolicy") == "Always" else "init"
            label = f"{field}[{index}] {name!r}"
            wanted = {r: _wanted(container, r, label) for r in sorted(registered)}
            out.append(
                ContainerRequest(
                    name=name,
                    kind=kind,
                    image=str(container.get("image", "")),
                    resources={r: n for r, n in wanted.items() if n > 0},
                )
            )
    return out


def free_devices(devices: Iterable[PluginDevice], held: Collection[str]) -> tuple[str, ...]:
    """IDs of the healthy devices no live container holds, in ID order."""
    return tuple(sorted(d.id for d in devices if d.healthy and d.id not in held))


@dataclasses.dataclass(frozen=True)
class DeviceChoice:
    """A choice under way: `chosen` so far (reused devices), `available` to choose the rest from."""

    resource: str
    required: int
    chosen: tuple[str, ...]
    available: tuple[str, ...]

    @property
    def needed(self) -> int:
        return self.required - len(self.chosen)

    def preference_request(self) -> tuple[tuple[str, ...], tuple[str, ...], int]:
        """``(available_deviceIDs, must_include_deviceIDs, allocation_size)`` for
        ``GetPreferredAllocation``: the kubelet offers the free devices plus those already chosen."""
        return tuple(sorted({*self.available, *self.chosen})), self.chosen, self.required


def begin_choice(
    resource: str, required: int, *, reusable: Collection[str], free: Sequence[str]
) -> DeviceChoice:
    """Take what the pod's init containers gave back first, then check enough devices are free.

    `free` must not contain the `reusable` devices (they are held by the init container). Raises
    `NotEnoughDevices` with the kubelet's message when fewer than needed are free.
    """
    chosen = tuple(sorted(reusable)[:required])
    choice = DeviceChoice(resource, required, chosen, tuple(d for d in free if d not in chosen))
    if choice.needed > len(choice.available):
        raise NotEnoughDevices(
            f"requested number of devices unavailable for {resource}. "
            f"Requested: {choice.needed}, Available: {len(choice.available)}"
        )
    return choice


def finish_choice(choice: DeviceChoice, preferred: Sequence[str] = ()) -> tuple[str, ...]:
    """Complete `choice` from the plugin's `preferred` IDs (those that are available), then the rest.

    A preference naming unknown, held or repeated devices only loses those entries, as in the
    kubelet (it intersects the answer with the available set).
    """
    out = list(choice.chosen)
    available = set(choice.available)
    for device in (*preferred, *choice.available):
        if len(out) >= choice.required:
            break
        if device in available and device not in out:
            out.append(device)
    if len(out) < choice.required:
        raise AdmissionError(
            "unexpectedly allocated less resources than required. "
            f"Requested: {choice.required}, Got: {len(out)}"
        )
    return tuple(out)


def release_reusable(
    reusable: dict[str, set[str]], kind: ContainerKind, allocated: Mapping[str, Sequence[str]]
) -> None:
    """Update a pod's reusable devices after one container was allocated (in place).

    An init container's devices are free for the containers after it (it has finished when they
    start); a sidecar's or an app container's devices are theirs for the pod's life.
    """
    for resource, ids in allocated.items():
        pool = reusable.setdefault(resource, set())
        if kind == "init":
            pool.update(ids)
        else:
            pool.difference_update(ids)


def node_resources(
    devices: Mapping[str, Iterable[PluginDevice]], connected: Collection[str]
) -> tuple[dict[str, str], dict[str, str]]:
    """``(capacity, allocatable)`` for the Node: all devices, and the healthy ones of a resource
    whose plugin is connected (a disconnected plugin's devices count as unhealthy)."""
    capacity: dict[str, str] = {}
    allocatable: dict[str, str] = {}
    for resource, devs in devices.items():
        listed = list(devs)
        capacity[resource] = str(len(listed))
        healthy = sum(1 for d in listed if d.healthy) if resource in connected else 0
        allocatable[resource] = str(healthy)
    return capacity, allocatable


_NAME_PART: Final = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_DNS_SUBDOMAIN: Final = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def is_extended_resource_name(name: str) -> bool:
    """Whether a plugin may register `name`: ``domain/name``, not in ``kubernetes.io``, and a
    qualified name once prefixed with ``requests.`` (``v1helper.IsExtendedResourceName``)."""
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    prefix, _, part = f"requests.{name}".partition("/")
    return (
        len(prefix) <= 253
        and _DNS_SUBDOMAIN.fullmatch(prefix) is not None
        and _NAME_PART.fullmatch(part) is not None
    )


def pod_is_terminal(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def pod_is_deleting(pod: Mapping[str, Any]) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


_GO_CODE_NAMES: Final = {"OK": "OK", "CANCELLED": "Canceled"}


def grpc_error_text(code_name: str, details: str) -> str:
    """A gRPC error as Go prints it (``rpc error: code = Unavailable desc = ...``), which is how it
    appears in a kubelet's messages. `code_name` is the Python ``grpc.StatusCode`` name."""
    go = _GO_CODE_NAMES.get(code_name) or "".join(p.capitalize() for p in code_name.split("_"))
    return f"rpc error: code = {go} desc = {details}"


def admission_message(error: str) -> str:
    """The kubelet's wording for an admission failure of the device manager."""
    return f"Allocate failed due to {error}, which is unexpected"


def rejected_status(message: str) -> dict[str, Any]:
    """The status patch of a pod the kubelet rejects (``kl.rejectPod``): phase Failed, nothing else."""
    return {
        "status": {"phase": "Failed", "reason": REJECTED_REASON, "message": f"Pod was rejected: {message}"}
    }


def _stamp(now: datetime.datetime) -> str:
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def running_status(
    pod: Mapping[str, Any], containers: Sequence[ContainerRequest], *, now: datetime.datetime, host_ip: str
) -> dict[str, Any]:
    """The status patch of a pod whose containers all started: init containers completed,
    sidecars and app containers running and ready."""
    stamp = _stamp(now)
    uid = str((pod.get("metadata") or {}).get("uid", ""))

    def status(c: ContainerRequest) -> dict[str, Any]:
        state: dict[str, Any]
        if c.kind == "init":
            state = {
                "terminated": {"exitCode": 0, "reason": "Completed", "startedAt": stamp, "finishedAt": stamp}
            }
        else:
            state = {"running": {"startedAt": stamp}}
        return {
            "name": c.name,
            "image": c.image,
            "imageID": "",
            "containerID": f"simulated://{uid}/{c.name}",
            "ready": True,
            "started": c.kind != "init",
            "restartCount": 0,
            "state": state,
        }

    conditions = [
        {"type": kind, "status": "True", "lastTransitionTime": stamp}
        for kind in ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady", "PodScheduled")
    ]
    body: dict[str, Any] = {
        "phase": "Running",
        "conditions": conditions,
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "startTime": stamp,
        "containerStatuses": [status(c) for c in containers if c.kind == "app"],
    }
    init = [status(c) for c in containers if c.kind != "app"]
    if init:
        body["initContainerStatuses"] = init
    return {"status": body}


def waiting_status(container: ContainerRequest, message: str) -> dict[str, Any]:
    """The status patch for a container the kubelet could not start (its ``PreStartContainer``
    failed): the pod stays Pending with that container waiting."""
    entry = {
        "name": container.name,
        "image": container.image,
        "imageID": "",
        "ready": False,
        "started": False,
        "restartCount": 0,
        "state": {"waiting": {"reason": "CreateContainerConfigError", "message": message}},
    }
    field = "containerStatuses" if container.kind == "app" else "initContainerStatuses"
    return {"status": {field: [entry]}}
