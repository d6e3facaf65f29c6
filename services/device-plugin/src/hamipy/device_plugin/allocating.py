"""Which pod and container an Allocate request is for, decided from the node's pods (pure).

The kubelet's Allocate names only fake device IDs, not the pod; the scheduler's decision is in the
pod annotations (docs/wire-format.md#pod-annotations). The pod served is, among the pods bound to
this node with ``hami.io/bind-phase=allocating``, in the order they were bound (the kubelet admits
pods in the order it sees them bound), the first whose next unserved container (first non-empty slot of
``vgpu-devices-to-allocate``; slots are init containers first, then regular ones) asks for as many
devices as the request names. Serving empties that slot; a pod whose slots are all empty is fully
served.

Bind order comes from the caller (the order the plugin's watch saw the pods bound, which is the
kubelet's); without it, ``hami.io/bind-time`` (whole seconds) then name. HAMi's plugin serves the
node lock's owner first: right when the scheduler holds the lock until Allocate (one pod in flight
per node, so it is also the first bound), wrong when the lock is released at bind, as our extender
does by default: the owner is then often a pod bound after the one the kubelet is admitting, and
serving it would give a container another pod's GPUs. So the lock is not consulted.

A pod whose annotations are malformed is never guessed at: it is returned in ``broken`` so the
caller marks it failed (HAMi silently skips it, #2958).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from hamipy.protocol import ContainerDevice, ProtocolError, keys
from hamipy.protocol.pod_devices import clear_container_slot, decode_pod_devices, encode_pod_devices

__all__ = ["PHASE_ALLOCATING", "PHASE_FAILED", "PHASE_SUCCESS", "Choice", "Served", "choose", "pending_pods"]

PHASE_ALLOCATING: Final = "allocating"
PHASE_SUCCESS: Final = "success"
PHASE_FAILED: Final = "failed"


@dataclasses.dataclass(frozen=True, slots=True)
class Served:
    """One container's share of an Allocate."""

    namespace: str
    name: str
    uid: str
    slot: int
    container: str
    container_env: Sequence[Mapping[str, Any]] | None
    devices: list[ContainerDevice]
    to_allocate: str
    """The pod's ``vgpu-devices-to-allocate`` after this container's slot is emptied."""
    done: bool
    """Every slot is empty now: the pod is fully served."""


@dataclasses.dataclass(frozen=True, slots=True)
class Choice:
    served: Served | None
    broken: list[tuple[Mapping[str, Any], str]]
    """Pods that could not be considered, with why (malformed annotations, slot without container)."""


def _meta(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    meta: Mapping[str, Any] = pod.get("metadata") or {}
    return meta


def _annotations(pod: Mapping[str, Any]) -> Mapping[str, str]:
    annotations: Mapping[str, str] = _meta(pod).get("annotations") or {}
    return annotations


def _bind_time(pod: Mapping[str, Any]) -> int:
    text = _annotations(pod).get(keys.BIND_TIME, "")
    # ASCII only: str.isdigit() also accepts digits int() refuses ("²").
    return int(text) if text.isascii() and text.isdigit() else 2**63


def pending_pods(
    pods: Sequence[Mapping[str, Any]], node: str, bind_order: Callable[[Mapping[str, Any]], int] | None = None
) -> list[Mapping[str, Any]]:
    """This node's bound pods waiting for devices, in bind order (``bind_order``, else bind time)."""
    waiting = [
        pod
        for pod in pods
        if _annotations(pod).get(keys.BIND_PHASE) == PHASE_ALLOCATING
        and (pod.get("spec") or {}).get("nodeName") == node
        and not _meta(pod).get("deletionTimestamp")
        and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
    ]
    if bind_order is not None:
        return sorted(waiting, key=bind_order)
    return sorted(waiting, key=lambda p: (_bind_time(p), str(_meta(p).get("name"))))


def _containers(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    spec = pod.get("spec") or {}
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def _serve(pod: Mapping[str, Any], device_count: int) -> Served | None:
    """The pod's next unserved container if it asks for ``device_count`` devices; raises
    ``ProtocolError`` on a malformed annotation."""
    value = _annotations(pod).get(keys.DEVICES_TO_ALLOCATE)
    if value is None:
        raise ProtocolError(keys.DEVICES_TO_ALLOCATE, None, "missing on a pod in bind-phase allocating")
    slots = decode_pod_devices(value, field=keys.DEVICES_TO_ALLOCATE)
    slot = next((i for i, devices in enumerate(slots) if devices), None)
    if slot is None or len(slots[slot]) != device_count:
        return None
    containers = _containers(pod)
    if slot >= len(containers):
        raise ProtocolError(
            keys.DEVICES_TO_ALLOCATE, value, f"slot {slot} but the pod has {len(containers)} containers"
        )
    remaining = clear_container_slot(slots, slot, field=keys.DEVICES_TO_ALLOCATE)
    meta = _meta(pod)
    return Served(
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        uid=str(meta.get("uid", "")),
        slot=slot,
        container=str(containers[slot].get("name", "")),
        container_env=containers[slot].get("env"),
        devices=list(slots[slot]),
        to_allocate=encode_pod_devices(remaining, field=keys.DEVICES_TO_ALLOCATE),
        done=not any(remaining),
    )


def choose(
    pods: Sequence[Mapping[str, Any]],
    *,
    node: str,
    device_count: int,
    bind_order: Callable[[Mapping[str, Any]], int] | None = None,
) -> Choice:
    """The container an Allocate of ``device_count`` devices on ``node`` is for (module docstring)."""
    waiting = pending_pods(pods, node, bind_order)
    broken: list[tuple[Mapping[str, Any], str]] = []
    for pod in waiting:
        try:
            served = _serve(pod, device_count)
        except ProtocolError as exc:
            broken.append((pod, str(exc)))
            continue
        if served is not None:
            return Choice(served=served, broken=broken)
    return Choice(served=None, broken=broken)
