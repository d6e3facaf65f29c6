"""Which pod and container an Allocate request is for, decided from what the kubelet holds (pure).

The kubelet's Allocate names only fake device IDs, not the pod; the scheduler's decision is in the
pod annotations (docs/wire-format.md#pod-annotations). The kubelet says which pod it is admitting:
its PodResources API lists the pods it holds as active, with each listed container's device IDs
(``hamipy.device_plugin.kubelet_pods``). While it admits a pod, that pod is listed and the
container being allocated has no devices yet; pods it has not reached yet, and pods it rejected,
are not listed. So the pod *in line* for a request of n devices is, among the pods bound to this
node with ``hami.io/bind-phase=allocating`` that the kubelet lists, the one whose next unserved
container (first non-empty slot of ``vgpu-devices-to-allocate``; slots are init containers first,
then regular ones, one per container as we write them, or without the empty slots ahead of a GPU
container as HAMi's scheduler writes them, matched to the containers that ask for GPUs by
``slot_owners``) asks for n of the GPU resource and, when the kubelet lists that container, holds
no devices yet. Serving empties that slot; a pod whose slots are all empty is fully served. The
order pods were bound or created never decides: when two pods could be in line (the kubelet
allocates from more than one goroutine only in its restart race), nobody is served
(``ambiguous``) and the kubelet's admission fails with that reason.

Anyone who may create pods can bind one to a node (``spec.nodeName``) and write these annotations,
where the admission policies do not stop it, so a waiting pod is served only if it is what our
scheduler would have written (``ServeRules``, ``problems``): its ``schedulerName`` is ours, and
every unserved slot belongs to a container that asks for that many GPUs, on distinct GPUs, with the
memory and cores it asks for where it names them. A pod in line that breaks a rule is ``refused``
(the caller fails it and the Allocate); a GPU pod the kubelet admits that carries no allocation is
not waiting, so no pod is in line and the Allocate is refused: it never takes another pod's slot.

A pod whose annotations are malformed is never guessed at: it is returned in ``broken`` so the
caller marks it failed (HAMi silently skips it, #2958).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Final, TypeAlias

from hamipy.protocol import ContainerDevice, ProtocolError, keys
from hamipy.protocol.devices import MigProfile
from hamipy.protocol.pod_devices import (
    clear_container_slot,
    decode_pod_devices,
    encode_pod_devices,
    slot_owners,
)
from hamipy.protocol.resources import FULL_PERCENT, ResourceNames, container_label, container_request

__all__ = [
    "DEFAULT_SCHEDULER",
    "PHASE_ALLOCATING",
    "PHASE_FAILED",
    "PHASE_SUCCESS",
    "Choice",
    "KubeletPod",
    "KubeletPods",
    "ServeRules",
    "Served",
    "choose",
    "pending_pods",
    "pod_key",
    "problems",
]

PHASE_ALLOCATING: Final = "allocating"
PHASE_SUCCESS: Final = "success"
PHASE_FAILED: Final = "failed"
DEFAULT_SCHEDULER: Final = "hami-scheduler"
"""``Config.scheduler_name``'s default: HAMi's name, which HAMi's scheduler uses too."""
_API_DEFAULT_SCHEDULER: Final = "default-scheduler"
"""What the API server fills in for a pod that names no scheduler."""


@dataclasses.dataclass(frozen=True, slots=True)
class KubeletPod:
    """One pod the kubelet holds as active, with the device IDs of one resource per container."""

    namespace: str
    name: str
    devices: Mapping[str, frozenset[str]]
    """Listed container name -> its device IDs of the resource (empty: none yet)."""


KubeletPods: TypeAlias = Mapping[tuple[str, str], KubeletPod]
"""The kubelet's active pods by (namespace, name), as its PodResources API lists them."""


@dataclasses.dataclass(frozen=True, slots=True)
class ServeRules:
    """What a waiting pod must be to be served (``problems``)."""

    scheduler_name: str = DEFAULT_SCHEDULER
    """The ``spec.schedulerName`` of pods our scheduler (or HAMi's) placed."""
    names: ResourceNames = dataclasses.field(default_factory=ResourceNames)
    """The resource names a container asks through (``nvidia.resource*Name``)."""
    devmem: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """This node's registered memory (MiB, scaled) per GPU UUID: what a memory percentage resolves
    against. A GPU not named here gets no percentage check."""
    mig_profiles: Mapping[str, Sequence[MigProfile]] = dataclasses.field(default_factory=dict)
    """The profiles of this node's dynamic MIG GPUs: a device planned there is a whole profile whose
    memory covers the ask (its cores are the profile's, whatever the container asks)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Served:
    """One container's share of an Allocate."""

    namespace: str
    name: str
    uid: str
    slot: int
    container: str
    devices: list[ContainerDevice]
    priority: int | None
    """The container's ``nvidia.com/priority`` (``CUDA_TASK_PRIORITY``), or None when it names none."""
    to_allocate: str
    """The pod's ``vgpu-devices-to-allocate`` after this container's slot is emptied."""
    done: bool
    """Every slot is empty now: the pod is fully served."""


@dataclasses.dataclass(frozen=True, slots=True)
class Choice:
    served: Served | None
    broken: list[tuple[Mapping[str, Any], str]]
    """Pods that could not be considered, with why (malformed annotations, slot without container)."""
    skipped: list[tuple[Mapping[str, Any], str]] = dataclasses.field(default_factory=list)
    """Pods that break a ``ServeRules`` rule but are not in line for this request, with why."""
    refused: tuple[Mapping[str, Any], str] | None = None
    """The pod in line for this request, which breaks a rule (why): nobody is served."""
    ambiguous: list[Mapping[str, Any]] = dataclasses.field(default_factory=list)
    """More than one pod could be in line for this request: nobody is served, nobody failed."""


def _meta(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    meta: Mapping[str, Any] = pod.get("metadata") or {}
    return meta


def _annotations(pod: Mapping[str, Any]) -> Mapping[str, str]:
    annotations: Mapping[str, str] = _meta(pod).get("annotations") or {}
    return annotations


def pod_key(pod: Mapping[str, Any]) -> tuple[str, str]:
    """(namespace, name): how the kubelet's PodResources API names a pod."""
    meta = _meta(pod)
    return str(meta.get("namespace", "")), str(meta.get("name", ""))


def pending_pods(pods: Sequence[Mapping[str, Any]], node: str) -> list[Mapping[str, Any]]:
    """This node's bound pods waiting for devices, by namespace and name."""
    waiting = [
        pod
        for pod in pods
        if _annotations(pod).get(keys.BIND_PHASE) == PHASE_ALLOCATING
        and (pod.get("spec") or {}).get("nodeName") == node
        and not _meta(pod).get("deletionTimestamp")
        and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
    ]
    return sorted(waiting, key=pod_key)


def _containers(pod: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """Every container in slot order, with how errors name it (``initContainers[0] 'setup'``)."""
    spec = pod.get("spec") or {}
    return [
        (container_label(kind, i, c), c)
        for kind in ("initContainers", "containers")
        for i, c in enumerate(spec.get(kind) or [])
    ]


def _slots(
    pod: Mapping[str, Any], names: ResourceNames
) -> tuple[list[list[ContainerDevice]], list[int | None]]:
    """The pod's unserved slots, and the container each belongs to (``slot_owners``: one slot per
    container, or HAMi's list without the empty slots ahead of a GPU container, matched through
    ``vgpu-devices-allocated``, which keeps every slot); raises ``ProtocolError`` when missing,
    malformed, or not matching the pod's containers."""
    value = _annotations(pod).get(keys.DEVICES_TO_ALLOCATE)
    if value is None:
        raise ProtocolError(keys.DEVICES_TO_ALLOCATE, None, "missing on a pod in bind-phase allocating")
    slots = decode_pod_devices(value, field=keys.DEVICES_TO_ALLOCATE)
    containers = _containers(pod)
    allocated = _annotations(pod).get(keys.DEVICES_ALLOCATED)
    whole = slots if allocated is None else decode_pod_devices(allocated, field=keys.DEVICES_ALLOCATED)
    if len(whole) != len(slots):
        raise ProtocolError(
            keys.DEVICES_TO_ALLOCATE,
            value,
            f"{len(slots)} slots but {len(whole)} in {keys.DEVICES_ALLOCATED}",
        )
    field = keys.DEVICES_TO_ALLOCATE if allocated is None else keys.DEVICES_ALLOCATED
    owners = slot_owners(
        whole,
        len(containers),
        lambda: [_asked_count(label, c, names) > 0 for label, c in containers],
        field=field,
    )
    unowned = [j for j, devices in enumerate(slots) if devices and owners[j] is None]
    if unowned:
        raise ProtocolError(keys.DEVICES_TO_ALLOCATE, value, f"slot {unowned[0]} belongs to no container")
    return slots, owners


def _asks(container: Mapping[str, Any], name: str) -> bool:
    resources = container.get("resources") or {}
    return any(name in (resources.get(section) or {}) for section in ("limits", "requests"))


def _asked_count(label: str, container: Mapping[str, Any], names: ResourceNames) -> int:
    """How many GPUs the container asks for (0: none); raises ``ProtocolError`` on a bad quantity."""
    request = container_request(container, names=names, label=label)
    return 0 if request is None else request.count


def _slot_problems(
    label: str, container: Mapping[str, Any], devices: Sequence[ContainerDevice], rules: ServeRules
) -> list[str]:
    """Where one unserved slot is not what the container asks for (explicit asks only: defaults
    are the scheduler's configuration, not ours to second-guess)."""
    names = rules.names
    request = container_request(container, names=names, label=label)
    if request is None:
        return [f"{label} asks for no {names.count} but is planned {len(devices)} device(s)"]
    found = []
    if len(devices) != request.count:
        found.append(f"{label} asks for {request.count} {names.count} but is planned {len(devices)}")
    uuids = [d.uuid for d in devices]
    if len(set(uuids)) != len(uuids):
        found.append(f"{label} is planned one GPU twice ({', '.join(uuids)})")
    mem_mib = request.memory_mib if _asks(container, names.memory) else None
    percent = (
        request.memory_percentage if mem_mib is None and _asks(container, names.memory_percentage) else None
    )
    cores = request.cores if _asks(container, names.cores) else None
    for d in devices:
        wanted = mem_mib
        if percent is not None and d.uuid in rules.devmem:
            wanted = rules.devmem[d.uuid] * percent // FULL_PERCENT  # percent is at most 100
        if d.uuid in rules.mig_profiles:
            if not any(
                (p.memory_mb, p.core) == (d.usedmem, d.usedcores) and p.memory_mb >= (wanted or 0)
                for p in rules.mig_profiles[d.uuid]
            ):
                found.append(
                    f"{label} is planned {d.usedmem} MiB, {d.usedcores} % cores on MIG GPU {d.uuid}: no "
                    f"profile of {wanted or 0} MiB or more has them"
                )
            continue
        if wanted is not None and d.usedmem != wanted:
            found.append(f"{label} asks for {wanted} MiB on {d.uuid} but is planned {d.usedmem}")
        if cores is not None and d.usedcores != cores:
            found.append(f"{label} asks for {cores} % cores on {d.uuid} but is planned {d.usedcores}")
    return found


def problems(pod: Mapping[str, Any], rules: ServeRules = ServeRules()) -> list[str]:
    """Why this waiting pod must not be served (empty: it may be): not placed by our scheduler, or
    an unserved slot that is not what its container asks for. Raises ``ProtocolError`` when its
    annotation or a quantity cannot be read."""
    found = []
    scheduler = (pod.get("spec") or {}).get("schedulerName") or _API_DEFAULT_SCHEDULER
    if scheduler != rules.scheduler_name:
        found.append(f"schedulerName is {scheduler!r}, not {rules.scheduler_name!r}")
    containers = _containers(pod)
    slots, owners = _slots(pod, rules.names)
    for j, devices in enumerate(slots):
        owner = owners[j]
        if devices and owner is not None:
            label, container = containers[owner]
            found.extend(_slot_problems(label, container, devices, rules))
    return found


def _served(
    pod: Mapping[str, Any], slots: list[list[ContainerDevice]], slot: int, owner: int, names: ResourceNames
) -> Served:
    remaining = clear_container_slot(slots, slot, field=keys.DEVICES_TO_ALLOCATE)
    label, container = _containers(pod)[owner]
    request = container_request(container, names=names, label=label)
    meta = _meta(pod)
    return Served(
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        uid=str(meta.get("uid", "")),
        slot=slot,
        container=str(container.get("name", "")),
        devices=list(slots[slot]),
        priority=None if request is None else request.priority,
        to_allocate=encode_pod_devices(remaining, field=keys.DEVICES_TO_ALLOCATE),
        done=not any(remaining),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class _InLine:
    pod: Mapping[str, Any]
    slots: list[list[ContainerDevice]]
    slot: int
    owner: int
    why: str


def choose(
    pods: Sequence[Mapping[str, Any]],
    *,
    node: str,
    device_count: int,
    kubelet: KubeletPods,
    rules: ServeRules = ServeRules(),
) -> Choice:
    """The container an Allocate of ``device_count`` devices on ``node`` is for, among the pods
    the kubelet holds (``kubelet``: its PodResources view; module docstring)."""
    broken: list[tuple[Mapping[str, Any], str]] = []
    skipped: list[tuple[Mapping[str, Any], str]] = []
    in_line: list[_InLine] = []
    for pod in pending_pods(pods, node):
        held = kubelet.get(pod_key(pod))
        if held is None:  # not reached yet, rejected, or gone: the kubelet is not admitting it
            continue
        try:
            slots, owners = _slots(pod, rules.names)
            slot = next((i for i, devices in enumerate(slots) if devices), None)
            if slot is None:
                continue
            owner = owners[slot]
            assert owner is not None  # _slots refuses a non-empty slot without a container
            label, container = _containers(pod)[owner]
            if held.devices.get(str(container.get("name", ""))):
                continue  # the kubelet holds this container's devices already: not allocating it
            asked = _asked_count(label, container, rules.names)
            why = "; ".join(problems(pod, rules))
        except ProtocolError as exc:
            broken.append((pod, str(exc)))
            continue
        if asked != device_count:  # the kubelet cannot be allocating this container now
            if why:
                skipped.append((pod, why))
            continue
        in_line.append(_InLine(pod, slots, slot, owner, why))
    if len(in_line) > 1:
        return Choice(served=None, broken=broken, skipped=skipped, ambiguous=[c.pod for c in in_line])
    if not in_line:
        return Choice(served=None, broken=broken, skipped=skipped)
    chosen = in_line[0]
    if chosen.why:
        return Choice(served=None, broken=broken, skipped=skipped, refused=(chosen.pod, chosen.why))
    served = _served(chosen.pod, chosen.slots, chosen.slot, chosen.owner, rules.names)
    return Choice(served=served, broken=broken, skipped=skipped)
