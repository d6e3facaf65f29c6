"""This node's pods as the monitor needs them: names, containers and their allocated slices (pure).

A pod's ``hami.io/vgpu-devices-allocated`` annotation (decoded by ``hamipy.protocol``) is the
record of what each of its containers may use, whether or not the container has started CUDA yet:
that is how the monitor reports the limits of slices that have no region file (HAMi #1794). Its
slots are positional, one per container, init containers first (HAMi >= 2.9). A list with exactly
one slot per regular container is the layout of older HAMi versions and is read that way; any other
count does not match the pod, and the pod's annotation is reported as malformed rather than guessed.

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
from hamipy.protocol.pod_devices import decode_pod_devices

__all__ = ["TERMINAL_PHASES", "PodRecord", "pod_record"]

TERMINAL_PHASES: Final = frozenset({"Succeeded", "Failed"})


@dataclasses.dataclass(frozen=True, slots=True)
class PodRecord:
    """One pod of this node.

    ``containers`` are init containers then regular ones, in spec order; ``allocations`` maps a
    container name to its devices (containers with no devices are left out); ``terminated`` names
    the containers whose status says they have stopped. ``allocation_error`` is the decoding error
    of the annotation (``allocations`` is then empty) and ``annotation`` its raw value.
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


def _allocations(value: str, init: list[str], regular: list[str]) -> dict[str, tuple[ContainerDevice, ...]]:
    """Container name -> devices from the annotation value; raises ``ProtocolError``."""
    slots = decode_pod_devices(value, field=keys.DEVICES_ALLOCATED)
    if len(slots) == len(init) + len(regular):
        names = init + regular
    elif len(slots) == len(regular):  # HAMi < 2.9: regular containers only
        names = regular
    else:
        raise ProtocolError(
            keys.DEVICES_ALLOCATED,
            value,
            f"{len(slots)} container slots for {len(init)} init and {len(regular)} regular containers",
        )
    return {name: tuple(devices) for name, devices in zip(names, slots, strict=True) if devices}


def pod_record(pod: Mapping[str, Any]) -> PodRecord:
    """The record of one pod's JSON (as the API server sends it)."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    init, regular = _names(spec, "initContainers"), _names(spec, "containers")
    annotation = (meta.get("annotations") or {}).get(keys.DEVICES_ALLOCATED)
    allocations: dict[str, tuple[ContainerDevice, ...]] = {}
    error: ProtocolError | None = None
    if annotation is not None:
        try:
            allocations = _allocations(str(annotation), init, regular)
        except ProtocolError as exc:
            error = exc
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
    )
