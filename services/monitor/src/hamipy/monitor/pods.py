"""This node's pods as the monitor needs them: names, containers and their allocated slices (pure).

A pod's ``hami.io/vgpu-devices-allocated`` annotation (decoded by ``hamipy.protocol``) is the
record of what each of its containers may use, whether or not the container has started CUDA yet:
that is how the monitor reports the limits of slices that have no region file (HAMi #1794). Its
slots are positional, one per container, init containers first (HAMi >= 2.9, and ours). HAMi's
scheduler drops the empty slots of containers without GPUs ahead of a GPU container: a shorter list
is matched by its non-empty slots to the containers that ask for GPUs (``slot_owners``). A list
with exactly one slot per regular container that matches no such reading is the layout of older
HAMi versions and is read that way; anything else does not match the pod, and the pod's annotation
is reported as malformed rather than guessed.

A pod on dynamic MIG also has ``hami.io/vgpu-mig-allocations``: one record per device on a MIG
GPU, naming the instance once the device plugin has made it. Such a device is the MIG instance the
container sees: its allocated device is named by the instance's MIG UUID (as its region file and
NVML inside the container name it) rather than by the parent GPU the device list carries. A record
whose container index names no container of the pod makes the annotation malformed.

Raw pod JSON is reduced to a ``PodRecord`` once per watch event, so a scrape reads small frozen
records and never decodes an annotation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Final

from hamipy.protocol import keys
from hamipy.protocol.devices import ContainerDevice
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.mig_allocations import MigAllocation, decode_mig_allocations, runtime_ready
from hamipy.protocol.pod_devices import decode_pod_devices, slot_owners
from hamipy.protocol.resources import container_request

__all__ = ["TERMINAL_PHASES", "PodRecord", "is_mig_uuid", "pod_record"]

TERMINAL_PHASES: Final = frozenset({"Succeeded", "Failed"})
_MIG_UUID_PREFIX: Final = "MIG-"


def is_mig_uuid(uuid: str) -> bool:
    """Whether a device UUID names a MIG instance (NVML's ``MIG-...``) rather than a GPU."""
    return uuid.startswith(_MIG_UUID_PREFIX)


@dataclasses.dataclass(frozen=True, slots=True)
class PodRecord:
    """One pod of this node.

    ``containers`` are init containers then regular ones, in spec order; ``allocations`` maps a
    container name to its devices (containers with no devices are left out); ``terminated`` names
    the containers whose status says they have stopped. ``allocation_error`` is the decoding error
    of the annotation (``allocations`` is then empty) and ``annotation`` its raw value;
    ``mig_allocations``, ``mig_allocation_error`` and ``mig_annotation`` the same for
    ``hami.io/vgpu-mig-allocations``.
    """

    uid: str
    namespace: str
    name: str
    phase: str = ""
    resource_version: str = ""
    containers: tuple[str, ...] = ()
    allocations: Mapping[str, tuple[ContainerDevice, ...]] = dataclasses.field(default_factory=dict)
    terminated: frozenset[str] = frozenset()
    annotation: str | None = None
    allocation_error: ProtocolError | None = None
    mig_allocations: tuple[MigAllocation, ...] = ()
    mig_annotation: str | None = None
    mig_allocation_error: ProtocolError | None = None

    @property
    def terminal(self) -> bool:
        """The pod has finished: none of its containers runs any more."""
        return self.phase in TERMINAL_PHASES


def _names(spec: Mapping[str, Any], key: str) -> list[str]:
    return [str(c.get("name", "")) for c in spec.get(key) or () if isinstance(c, Mapping)]


def _terminated(status: Mapping[str, Any]) -> frozenset[str]:
    stopped = set()
    for key in ("initContainerStatuses", "containerStatuses"):
        for s in status.get(key) or ():
            if isinstance(s, Mapping) and (s.get("state") or {}).get("terminated") is not None:
                stopped.add(str(s.get("name", "")))
    return frozenset(stopped)


def _allocations(value: str, spec: Mapping[str, Any]) -> dict[str, tuple[ContainerDevice, ...]]:
    """Container name -> devices from the annotation value; raises ``ProtocolError``."""
    init, regular = _names(spec, "initContainers"), _names(spec, "containers")
    names = init + regular
    slots = decode_pod_devices(value, field=keys.DEVICES_ALLOCATED)
    try:
        owners = slot_owners(slots, len(names), lambda: _asking(spec), field=keys.DEVICES_ALLOCATED)
    except ProtocolError:
        if len(slots) != len(regular):
            raise ProtocolError(
                keys.DEVICES_ALLOCATED,
                value,
                f"{len(slots)} container slots for {len(init)} init and {len(regular)} regular containers",
            ) from None
        owners = [len(init) + j for j in range(len(slots))]  # HAMi < 2.9: regular containers only
    return {names[i]: tuple(slots[j]) for j, i in enumerate(owners) if i is not None and slots[j]}


def _asking(spec: Mapping[str, Any]) -> list[bool]:
    """Per container in slot order, whether it asks for a GPU (the default resource names: the
    monitor is not told others); a quantity it cannot read counts as asking."""
    out = []
    for kind in ("initContainers", "containers"):
        for c in spec.get(kind) or ():
            if not isinstance(c, Mapping):
                continue
            try:
                out.append(container_request(c) is not None)
            except ProtocolError:
                out.append(True)
    return out


def _mig_allocations(value: str, containers: int) -> tuple[MigAllocation, ...]:
    """The records of the annotation value; raises ``ProtocolError``."""
    records = decode_mig_allocations(value)
    for i, a in enumerate(records):
        if a.container_index >= containers:
            raise ProtocolError(
                f"{keys.MIG_ALLOCATIONS}[{i}].containerIndex",
                a.container_index,
                f"the pod has {containers} containers (init containers included)",
            )
    return records


def _on_instances(
    allocations: dict[str, tuple[ContainerDevice, ...]], names: list[str], records: tuple[MigAllocation, ...]
) -> dict[str, tuple[ContainerDevice, ...]]:
    """``allocations`` with each device that a runtime-ready record places on its parent GPU named
    by the record's MIG UUID."""
    out = {name: list(devs) for name, devs in allocations.items()}
    for a in records:
        devs = out.get(names[a.container_index], [])
        on_parent = a.device_index < len(devs) and devs[a.device_index].uuid == a.gpu_uuid
        if on_parent and a.mig_uuid is not None and runtime_ready(a):
            devs[a.device_index] = dataclasses.replace(devs[a.device_index], uuid=a.mig_uuid)
    return {name: tuple(devs) for name, devs in out.items()}


def pod_record(pod: Mapping[str, Any]) -> PodRecord:
    """The record of one pod's JSON (as the API server sends it)."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    init, regular = _names(spec, "initContainers"), _names(spec, "containers")
    annotations = meta.get("annotations") or {}
    annotation = annotations.get(keys.DEVICES_ALLOCATED)
    allocations: dict[str, tuple[ContainerDevice, ...]] = {}
    error: ProtocolError | None = None
    if annotation is not None:
        try:
            allocations = _allocations(str(annotation), spec)
        except ProtocolError as exc:
            error = exc
    mig_annotation = annotations.get(keys.MIG_ALLOCATIONS)
    mig: tuple[MigAllocation, ...] = ()
    mig_error: ProtocolError | None = None
    if mig_annotation is not None:
        try:
            mig = _mig_allocations(str(mig_annotation), len(init) + len(regular))
        except ProtocolError as exc:
            mig_error = exc
    allocations = _on_instances(allocations, init + regular, mig)
    return PodRecord(
        uid=str(meta.get("uid", "")),
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        phase=str(status.get("phase", "")),
        resource_version=str(meta.get("resourceVersion", "")),
        containers=tuple(init + regular),
        allocations=allocations,
        terminated=_terminated(status),
        annotation=None if annotation is None else str(annotation),
        allocation_error=error,
        mig_allocations=mig,
        mig_annotation=None if mig_annotation is None else str(mig_annotation),
        mig_allocation_error=mig_error,
    )
