"""Which MIG instances this node's pods hold, from their ``hami.io/vgpu-mig-allocations`` (pure).

The scheduler records each dynamic MIG device it gives a container: the GPU, the profile and the
placement (``hamipy.protocol.mig_allocations``); the plugin adds the MIG UUID and the GPU- and
compute-instance ids once it made the instance. A pod holds its instances until it is Succeeded or
Failed or gone: a pod being deleted still runs until the kubelet stopped it, and the scheduler
counts its placements occupied as long.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from hamipy.protocol import ProtocolError, keys
from hamipy.protocol.mig_allocations import MigAllocation, decode_mig_allocations, runtime_ready

__all__ = [
    "MigKey",
    "PodRecords",
    "active_records",
    "container_records",
    "desired_keys",
    "key_of",
    "pod_records",
]


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class MigKey:
    """What the scheduler reserved: a profile at a placement of one GPU."""

    gpu_uuid: str
    profile: str
    start: int
    size: int

    def __str__(self) -> str:
        return f"{self.profile}@{self.start}+{self.size} on {self.gpu_uuid}"


@dataclasses.dataclass(frozen=True, slots=True)
class PodRecords:
    """One active pod's MIG records."""

    namespace: str
    name: str
    uid: str
    records: tuple[MigAllocation, ...]

    @property
    def involved(self) -> dict[str, str]:
        """The pod as an Event's involved object."""
        return {"kind": "Pod", "namespace": self.namespace, "name": self.name, "uid": self.uid}

    def runtime_ready(self) -> list[MigAllocation]:
        return [r for r in self.records if runtime_ready(r)]


def key_of(record: MigAllocation) -> MigKey:
    return MigKey(record.gpu_uuid, record.profile, record.placement.start, record.placement.size)


def _active(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def pod_records(pod: Mapping[str, Any]) -> tuple[MigAllocation, ...]:
    """A pod's MIG records (none without the annotation). Raises ``ProtocolError`` naming the pod."""
    meta = pod.get("metadata") or {}
    value = (meta.get("annotations") or {}).get(keys.MIG_ALLOCATIONS)
    if not value:
        return ()
    try:
        return decode_mig_allocations(value)
    except ProtocolError as exc:
        where = f"pod {meta.get('namespace')}/{meta.get('name')}"
        raise ProtocolError(f"{where}: {exc.field}", exc.value, exc.reason) from exc


def active_records(pods: Iterable[Mapping[str, Any]]) -> list[PodRecords]:
    """The MIG records of each active pod that has any. Raises ``ProtocolError`` naming the pod
    whose annotation is malformed: its instances cannot be told, so the caller destroys nothing."""
    out = []
    for pod in pods:
        if not _active(pod):
            continue
        records = pod_records(pod)
        if records:
            meta = pod.get("metadata") or {}
            out.append(
                PodRecords(str(meta.get("namespace")), str(meta.get("name")), str(meta.get("uid")), records)
            )
    return out


def desired_keys(pods: Iterable[PodRecords], gpus: Collection[str]) -> set[MigKey]:
    """The instances the active pods hold on ``gpus``."""
    return {key_of(r) for pod in pods for r in pod.records if r.gpu_uuid in gpus}


def container_records(
    records: Iterable[MigAllocation], container_index: int, gpu_uuids: list[str]
) -> list[MigAllocation]:
    """The records of one container, by device index, checked against its devices as HAMi's plugin
    checks them: as many as it has devices, each on the device's GPU. Raises ``ProtocolError``."""
    mine = sorted((r for r in records if r.container_index == container_index), key=lambda r: r.device_index)
    if len(mine) != len(gpu_uuids):
        raise ProtocolError(
            keys.MIG_ALLOCATIONS,
            [(r.container_index, r.device_index) for r in mine],
            f"container {container_index} has {len(mine)} MIG reservation(s) for {len(gpu_uuids)} device(s)",
        )
    for record, gpu in zip(mine, gpu_uuids, strict=True):
        if record.gpu_uuid != gpu:
            raise ProtocolError(
                keys.MIG_ALLOCATIONS,
                record.gpu_uuid,
                f"container {container_index} device {record.device_index}: MIG reservation on GPU "
                f"{record.gpu_uuid}, device allocated on GPU {gpu}",
            )
    return mine
