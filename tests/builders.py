"""The Kubernetes objects the tests build: pods and their containers, nodes with the GPUs they
register, and the allocation annotations the extender and the device plugin write on a pod.

Every builder returns plain JSON (``dict[str, Any]``), as the services read it from the API server.
``pod()`` and ``node()`` write only what they are given: a field left at ``None`` is absent, so they
make the body a test sends to the real API server (no uid, no resourceVersion, no status). The
``gpu_pod()``, ``allocating_pod()``, ``running_pod()`` and ``gpu_node()`` objects are as the API
server stores them (``stored``: uid ``uid-<namespace>-<name>``, resourceVersion 1), in the states the
services meet them in: waiting for our scheduler, being served by a device plugin, running under a
monitor. The wire formats come from ``hamipy.protocol``'s encoders, never written by hand here.

Any test imports it as ``builders``: ``tests/`` is on ``sys.path`` because ``tests/conftest.py``
lives there (pytest's "prepend" import mode).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from hamipy.protocol import ProtocolError, keys
from hamipy.protocol.config import Config
from hamipy.protocol.devices import ContainerDevice, DeviceInfo, MigPlacement, MigProfile
from hamipy.protocol.node_devices import encode_node_devices
from hamipy.protocol.node_handshake import plugin_report
from hamipy.protocol.pod_devices import decode_pod_devices, encode_pod_devices

__all__ = [
    "A100_MIG_PROFILES",
    "GPU_TYPE",
    "IMAGE",
    "NAMESPACE",
    "REPORT",
    "SCHEDULER",
    "allocating_pod",
    "allocation",
    "container",
    "deployment",
    "gpu",
    "gpu_node",
    "gpu_pod",
    "node",
    "plugin_registration",
    "pod",
    "running_pod",
    "stored",
]

IMAGE = "registry.k8s.io/pause:3.10"
"""The image of every container built here: the API server wants one, nothing ever pulls it."""
GPU_TYPE = "NVIDIA-Tesla V100-PCIE-32GB"
"""The type ``gpu()`` registers unless told otherwise."""
NAMESPACE = "ns"
"""The namespace of the stored pods built here unless told otherwise."""
SCHEDULER = Config().scheduler_name
"""The scheduler the webhook gives a GPU pod."""
REPORT = plugin_report(datetime(2026, 11, 24, 10, 0, tzinfo=UTC))
"""Our device plugin's last report on a node: a ``Reported_`` handshake and our marker."""
A100_MIG_PROFILES = (
    MigProfile("1g.5gb", 5120, 14, 1, tuple(MigPlacement(s, 1) for s in range(7))),
    MigProfile("2g.10gb", 10240, 28, 2, (MigPlacement(0, 2), MigPlacement(2, 2), MigPlacement(4, 2))),
    MigProfile("3g.20gb", 20480, 42, 3, (MigPlacement(0, 4), MigPlacement(4, 4))),
    MigProfile("7g.40gb", 40192, 100, 8, (MigPlacement(0, 8),)),
)
"""The MIG profiles of an A100 40GB: HAMi's test profiles (``mig_capability_test.go``) and the 7g."""

Quantity = int | str
"""A resource quantity: a number, or a string for one as written (``"0.5"``, ``"1500m"``, ``"lots"``)."""
Slots = Sequence[Sequence[ContainerDevice]]
"""A pod's devices, one slot per container, init containers first (``encode_pod_devices``)."""


def container(
    name: str = "main",
    *,
    gpu: Quantity | None = None,
    gpumem: Quantity | None = None,
    gpumem_percentage: Quantity | None = None,
    gpucores: Quantity | None = None,
    priority: Quantity | None = None,
    limits: Mapping[str, str] | None = None,
    requests: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
    image: str = IMAGE,
    **fields: Any,
) -> dict[str, Any]:
    """A container (or init container). The GPU keywords are the ``nvidia.com/`` limits of the same
    names (``gpumem`` in MiB); ``limits`` adds any others by their resource names. ``resources`` is
    there only when a limit or request is; ``fields`` are further container fields by their
    Kubernetes names (``securityContext=...``)."""
    asked = {
        keys.RESOURCE_COUNT: gpu,
        keys.RESOURCE_MEMORY: gpumem,
        keys.RESOURCE_MEMORY_PERCENTAGE: gpumem_percentage,
        keys.RESOURCE_CORES: gpucores,
        keys.RESOURCE_PRIORITY: priority,
    }
    all_limits = {**(limits or {}), **{k: str(v) for k, v in asked.items() if v is not None}}
    out: dict[str, Any] = {"name": name, "image": image}
    resources: dict[str, Any] = {}
    if all_limits:
        resources["limits"] = all_limits
    if requests is not None:
        resources["requests"] = dict(requests)
    if resources:
        out["resources"] = resources
    if env is not None:
        out["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return {**out, **fields}


def pod(
    name: str,
    *containers: dict[str, Any],
    init: Sequence[dict[str, Any]] = (),
    namespace: str | None = None,
    uid: str | None = None,
    resource_version: str | None = None,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    node_name: str | None = None,
    scheduler_name: str | None = None,
    phase: str | None = None,
    created: str | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """A pod of ``containers`` (none: an empty list) and ``init`` containers (none: no key).
    ``uid``, ``resource_version``, ``phase`` and ``created`` (its creationTimestamp) are what the
    API server sets: leave them out of a body to create. ``spec`` are further spec fields by their
    Kubernetes names (``nodeSelector=...``, ``terminationGracePeriodSeconds=0``)."""
    metadata: dict[str, Any] = {"name": name}
    for key, value in (
        ("namespace", namespace),
        ("uid", uid),
        ("resourceVersion", resource_version),
        ("creationTimestamp", created),
    ):
        if value is not None:
            metadata[key] = value
    if labels is not None:
        metadata["labels"] = dict(labels)
    if annotations is not None:
        metadata["annotations"] = dict(annotations)
    body: dict[str, Any] = {"containers": list(containers)}
    if init:
        body["initContainers"] = list(init)
    if node_name is not None:
        body["nodeName"] = node_name
    if scheduler_name is not None:
        body["schedulerName"] = scheduler_name
    out: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": {**body, **spec}}
    if phase is not None:
        out["status"] = {"phase": phase}
    return out


def deployment(name: str, replicas: int, pod_spec: Mapping[str, Any]) -> dict[str, Any]:
    """An apps/v1 Deployment of `replicas` pods labelled ``app=<name>`` with `pod_spec`."""
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": dict(pod_spec)},
        },
    }


def allocation(
    *,
    allocated: Slots | str | None = None,
    to_allocate: Slots | str | None = None,
    node: str | None = None,
    phase: str | None = None,
    bind_time: int | None = None,
) -> dict[str, str]:
    """The annotations the extender's bind writes on a pod (``vgpu-devices-*``, ``vgpu-node``,
    ``bind-phase``, ``bind-time``) and the device plugin then updates: only those given. A device
    list is encoded from its slots, or taken as written when a string (a malformed one, say)."""

    def encoded(devices: Slots | str) -> str:
        return devices if isinstance(devices, str) else encode_pod_devices(devices)

    out: dict[str, str] = {}
    if allocated is not None:
        out[keys.DEVICES_ALLOCATED] = encoded(allocated)
    if to_allocate is not None:
        out[keys.DEVICES_TO_ALLOCATE] = encoded(to_allocate)
    if node is not None:
        out[keys.VGPU_NODE] = node
    if phase is not None:
        out[keys.BIND_PHASE] = phase
    if bind_time is not None:
        out[keys.BIND_TIME] = str(bind_time)
    return out


def gpu(
    uuid: str,
    index: int = 0,
    *,
    count: int = 10,
    mem: int = 32768,
    core: int = 100,
    type_: str = GPU_TYPE,
    numa: int = 0,
    health: bool = True,
    mode: str = "hami-core",
) -> DeviceInfo:
    """One healthy GPU as a node registers it: split ``count`` ways, ``mem`` MiB, ``core`` percent."""
    return DeviceInfo(uuid, index, count, mem, core, type_, numa, mode, health)


def plugin_registration(devices: Sequence[DeviceInfo], *, ours: bool = True) -> dict[str, str]:
    """The node annotations a device plugin writes when it registers ``devices``: the register and a
    ``Reported_`` handshake, and with ``ours`` our marker (the extender then binds there without the
    node lock); without, as HAMi's plugin writes them."""
    report = plugin_report(datetime.now(UTC))
    if not ours:
        del report[keys.DEVICE_PLUGIN_MARKER]
    return {keys.NODE_REGISTER: encode_node_devices(devices), **report}


def node(
    name: str,
    devices: Sequence[DeviceInfo] | None = None,
    *,
    uid: str | None = None,
    resource_version: str | None = None,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    allocatable: Mapping[str, str] | None = None,
    created: str | None = None,
) -> dict[str, Any]:
    """A node; with ``devices``, registered as the device plugin registers them (the
    ``node-nvidia-register`` annotation, and ``nvidia.com/gpu`` allocatable: the sum of their split
    counts, unless ``allocatable`` says otherwise). ``annotations`` come on top of the register one;
    ``created`` is its creationTimestamp."""
    metadata: dict[str, Any] = {"name": name}
    for key, value in (("uid", uid), ("resourceVersion", resource_version), ("creationTimestamp", created)):
        if value is not None:
            metadata[key] = value
    if labels is not None:
        metadata["labels"] = dict(labels)
    registered = {keys.NODE_REGISTER: encode_node_devices(devices)} if devices is not None else {}
    if annotations is not None or devices is not None:
        metadata["annotations"] = {**registered, **(annotations or {})}
    if allocatable is None and devices is not None:
        allocatable = {keys.RESOURCE_COUNT: str(sum(d.count for d in devices))}
    out: dict[str, Any] = {"apiVersion": "v1", "kind": "Node", "metadata": metadata}
    if allocatable is not None:
        out["status"] = {"allocatable": dict(allocatable)}
    return out


def stored(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` as the API server holds it: where it has none, the uid ``uid-<namespace>-<name>``
    (``uid-<name>`` when cluster-scoped) and resourceVersion 1."""
    meta = obj["metadata"]
    scope = f"{meta['namespace']}-" if meta.get("namespace") else ""
    meta.setdefault("uid", f"uid-{scope}{meta['name']}")
    meta.setdefault("resourceVersion", "1")
    return obj


def gpu_pod(
    name: str,
    *containers: dict[str, Any],
    init: Sequence[dict[str, Any]] = (),
    namespace: str = NAMESPACE,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    node_name: str | None = None,
    phase: str | None = "Pending",
    scheduler_name: str | None = SCHEDULER,
    resource_version: str = "1",
) -> dict[str, Any]:
    """A stored pod for our scheduler (``schedulerName`` as the webhook sets it), in ``phase``, with
    one container asking a GPU and 1000 MiB unless ``containers`` are given."""
    return stored(
        pod(
            name,
            *(containers or [container(gpu=1, gpumem=1000)]),
            init=init,
            namespace=namespace,
            labels=labels,
            annotations=annotations or {},
            node_name=node_name,
            scheduler_name=scheduler_name,
            phase=phase,
            resource_version=resource_version,
        )
    )


def allocating_pod(
    name: str,
    *containers: dict[str, Any] | str,
    node: str,
    allocated: Slots | str | None = None,
    to_allocate: Slots | str | None = None,
    init: Sequence[dict[str, Any] | str] = (),
    phase: str = "allocating",
    bind_time: int = 1,
    scheduler_name: str | None = SCHEDULER,
) -> dict[str, Any]:
    """A stored pod a scheduler bound to ``node`` at ``bind_time``, its device plugin serving it:
    bind ``phase``, and the ``allocated`` and ``to_allocate`` devices (``allocation``) given.
    A container given by name asks for as many GPUs as its slot holds (init containers' slots
    first; none for a slot that is empty, absent or unreadable), as the scheduler planned it.
    ``scheduler_name`` None: no ``schedulerName`` (a body that named none)."""
    planned = to_allocate if to_allocate is not None else allocated
    try:
        slots = decode_pod_devices(planned or "") if planned is None or isinstance(planned, str) else planned
    except ProtocolError:
        slots = []

    def built(index: int, c: dict[str, Any] | str) -> dict[str, Any]:
        if not isinstance(c, str):
            return c
        return container(c, gpu=(len(slots[index]) or None) if index < len(slots) else None)

    return gpu_pod(
        name,
        *(built(len(init) + i, c) for i, c in enumerate(containers)),
        init=[built(i, c) for i, c in enumerate(init)],
        annotations=allocation(
            allocated=allocated, to_allocate=to_allocate, node=node, phase=phase, bind_time=bind_time
        ),
        node_name=node,
        phase=None,
        scheduler_name=scheduler_name,
    )


def running_pod(
    name: str,
    *,
    containers: Sequence[str] = ("main",),
    init: Sequence[str] = (),
    allocated: Slots | str | None = None,
    node: str = "gpu-node",
    phase: str = "Running",
    terminated: Sequence[str] = (),
    resource_version: str = "1",
) -> dict[str, Any]:
    """A stored pod on ``node`` as its monitor sees it: ``containers`` and ``init`` containers by
    name, the ``vgpu-devices-allocated`` annotation from ``allocated``, and the statuses of the
    ``terminated`` containers."""
    out = gpu_pod(
        name,
        *(container(c) for c in containers),
        init=[container(c) for c in init],
        annotations=allocation(allocated=allocated),
        node_name=node,
        phase=phase,
        scheduler_name=None,
        resource_version=resource_version,
    )
    out["status"]["containerStatuses"] = [
        {"name": c, "state": {"terminated": {"exitCode": 0}}} for c in terminated
    ]
    out["status"]["initContainerStatuses"] = []
    return out


def gpu_node(
    name: str,
    devices: Sequence[DeviceInfo] | None = None,
    *,
    ours: bool = False,
    annotations: Mapping[str, str] | None = None,
    created: str | None = None,
) -> dict[str, Any]:
    """A stored node registered with ``devices`` (two GPUs ``GPU-<name>-<i>`` unless given);
    ``ours``: its device plugin's last report is ours (``REPORT``)."""
    devices = devices if devices is not None else [gpu(f"GPU-{name}-{i}", i) for i in range(2)]
    report = REPORT if ours else {}
    return stored(node(name, devices, annotations={**report, **(annotations or {})} or None, created=created))
