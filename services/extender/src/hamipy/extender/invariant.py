"""The safety invariant, checked against the cluster itself: no GPU has more memory, cores or slots
allocated than it has (docs/design.md#5-bind-enforces-correctness).

Reads every node's ``hami.io/node-nvidia-register`` and every bound, not-finished pod's
``hami.io/vgpu-devices-allocated`` from the API (not from any extender's model) and adds the pods'
usage per GPU by the same peak rule the device plugin serves by (``model.pod_usage``: native
sidecars count as running beside the app containers). A GPU UUID several nodes register is one GPU:
the pods on it through every one of them are added up against the owning node's entry
(``gpu_claims``), besides each node's own. A pod that is
not bound holds nothing, as in the model: anyone may annotate their own pending pod, and only bound
pods are served GPUs. And no two MIG instances of a GPU share a slice: the placements of every
pod's ``hami.io/vgpu-mig-allocations`` on one GPU overlap none of the others. Used by tests and by
``hamipy-extender check``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from hamipy.extender.gpu_claims import Rank, rank_of
from hamipy.extender.mig_placement import overlaps
from hamipy.extender.model import pod_finished, pod_sidecars, pod_usage
from hamipy.kube.client import KubeApi
from hamipy.kube.resources import list_all, node_path, pod_path
from hamipy.protocol import keys
from hamipy.protocol.devices import MigPlacement
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.mig_allocations import decode_mig_allocations
from hamipy.protocol.node_devices import decode_node_devices
from hamipy.protocol.pod_devices import decode_pod_devices

__all__ = ["MIG_OVERLAP", "Report", "Violation", "check_cluster", "check_objects"]

MIG_OVERLAP = "MIG placements"


@dataclasses.dataclass(frozen=True, slots=True)
class Violation:
    """One GPU over capacity (``what`` slots/memory/cores), two MIG instances sharing slices of it
    (``what`` MIG placements, ``allocated`` and ``capacity`` their starts), or an unreadable
    annotation."""

    node: str
    device: str
    what: str
    allocated: int
    capacity: int
    pods: tuple[str, ...]

    def __str__(self) -> str:
        if self.what == MIG_OVERLAP:
            return (
                f"{self.node}/{self.device}: MIG instances at slices {self.allocated} and "
                f"{self.capacity} overlap (pods {', '.join(self.pods)})"
            )
        return (
            f"{self.node}/{self.device}: {self.what} {self.allocated} > {self.capacity} "
            f"(pods {', '.join(self.pods)})"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Report:
    violations: tuple[Violation, ...]
    nodes: int
    gpus: int
    pods: int
    """Pods holding an allocation."""

    @property
    def ok(self) -> bool:
        return not self.violations

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "nodes": self.nodes,
            "gpus": self.gpus,
            "pods": self.pods,
            "violations": [str(v) for v in self.violations],
        }


def check_objects(nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]) -> Report:
    """The invariant over given Node and Pod objects."""
    capacity: dict[tuple[str, str], tuple[int, int, int]] = {}
    claims: dict[str, list[tuple[Rank, str]]] = {}
    violations: list[Violation] = []
    node_count = 0
    for node_obj in nodes:
        meta = node_obj.get("metadata") or {}
        value = (meta.get("annotations") or {}).get(keys.NODE_REGISTER)
        if value is None:
            continue
        node_count += 1
        try:
            registered = decode_node_devices(value)
        except ProtocolError as exc:
            violations.append(Violation(meta.get("name", ""), "-", f"unreadable register: {exc}", 0, 0, ()))
            continue
        name = str(meta.get("name", ""))
        for dev in registered:
            capacity[(name, dev.id)] = (dev.count, dev.devmem, dev.devcore)
            if dev.devmem > 0:  # a 0 MiB entry claims nothing (``gpu_claims.ZERO_MEMORY``)
                claims.setdefault(dev.id, []).append(
                    (rank_of(str(meta.get("creationTimestamp") or ""), name), name)
                )
    used: dict[tuple[str, str], list[int]] = {}
    holders: dict[tuple[str, str], list[str]] = {}
    instances: dict[tuple[str, str], list[tuple[MigPlacement, str]]] = {}
    pod_count = 0
    for pod in pods:
        pod_meta = pod.get("metadata") or {}
        ann = pod_meta.get("annotations") or {}
        value = ann.get(keys.DEVICES_ALLOCATED)
        node_name = (pod.get("spec") or {}).get("nodeName")
        if not value or not node_name or pod_finished(pod):
            continue
        node = str(node_name)
        ident = f"{pod_meta.get('namespace')}/{pod_meta.get('name')}"
        try:
            devices = decode_pod_devices(value, field=keys.DEVICES_ALLOCATED)
            for allocation in decode_mig_allocations(ann.get(keys.MIG_ALLOCATIONS) or ""):
                instances.setdefault((node, allocation.gpu_uuid), []).append((allocation.placement, ident))
        except ProtocolError as exc:
            violations.append(
                Violation(node, "-", f"unreadable allocation of {ident}: {exc}", 0, 0, (ident,))
            )
            continue
        pod_count += 1
        n_init = len((pod.get("spec") or {}).get("initContainers") or [])
        for uuid, (slots, mem, cores) in pod_usage(devices, n_init, pod_sidecars(pod)).items():
            acc = used.setdefault((node, uuid), [0, 0, 0])
            acc[0] += slots
            acc[1] += mem
            acc[2] += cores
            holders.setdefault((node, uuid), []).append(ident)
    checks = [(key[0], key, [key]) for key in sorted(used)]
    for claimed, claimants in sorted(claims.items()):
        if len(claimants) > 1:
            ranked = [name for _, name in sorted(claimants)]
            checks.append(("+".join(ranked), (ranked[0], claimed), [(name, claimed) for name in ranked]))
    for label, owner, keys_ in checks:
        cap = capacity.get(owner)
        shared = [used[k] for k in keys_ if k in used]
        if cap is None or not shared:
            continue  # a GPU no longer registered, or unused: nothing to exceed
        idents = tuple(ident for k in keys_ for ident in holders.get(k, ()))
        for i, what in enumerate(("slots", "memory", "cores")):
            got = sum(u[i] for u in shared)
            if got > cap[i]:
                violations.append(Violation(label, owner[1], what, got, cap[i], idents))
    for (node, gpu_uuid), held in sorted(instances.items()):
        for i, (a, first) in enumerate(held):
            for b, second in held[i + 1 :]:
                if overlaps(a, b):
                    violations.append(
                        Violation(node, gpu_uuid, MIG_OVERLAP, a.start, b.start, (first, second))
                    )
    return Report(tuple(violations), node_count, len(capacity), pod_count)


async def check_cluster(api: KubeApi, *, timeout_s: float = 30.0) -> Report:
    """The invariant over the cluster as the API server has it now."""
    nodes, _ = await list_all(api, node_path(), timeout_s=timeout_s)
    pods, _ = await list_all(api, pod_path(), timeout_s=timeout_s)
    return check_objects(nodes, pods)
