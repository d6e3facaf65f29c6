"""``make up``'s example workloads and the tables it prints: where each example pod landed, and
the allocation of every GPU (``hamipy-devcluster gpus``).

The examples are plain manifests in ``deploy/examples/`` (Namespaces, PriorityClasses,
ResourceQuotas and Pods), applied in file name order, one file after the other: a file's pods have
settled (placed, or Pending with a reason) before the next file goes in, so an example can build on
those before it (the preemption example fills GPUs, then asks for one); a ResourceQuota is in force
(``quota_enforced``) before the next document goes in, so the pods after it are counted against
it. A pod preempted meanwhile shows as ``Preempted``, with the Event that says by whom.

Everything shown is read from the cluster: the pods' ``hami.io/vgpu-devices-allocated`` and the
nodes' ``hami.io/node-nvidia-register`` annotations, decoded by ``hamipy.protocol``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Final

import yaml

from hamipy.devcluster.errors import DevClusterError
from hamipy.devcluster.kubeobjects import API_TIMEOUT_S, wait_for_default_service_account
from hamipy.devcluster.waiting import wait_for
from hamipy.kube.client import RawKube
from hamipy.kube.errors import Conflict, KubeError
from hamipy.kube.resources import pod_path
from hamipy.protocol import ProtocolError, decode_node_devices, decode_pod_devices, keys
from hamipy.protocol.mig_allocations import decode_mig_allocations

__all__ = ["apply_examples", "format_table", "gpu_rows", "pod_rows", "wait_settled"]

SETTLE_TIMEOUT_S: Final = 90.0
QUOTA_TIMEOUT_S: Final = 30.0
_KINDS: Final = ("Namespace", "PriorityClass", "ResourceQuota", "Pod")
_PREEMPTING: Final = "Preempting"
"""The extender's reason on a pod a preemption is making room for (it will be placed)."""


def _load(directory: Path) -> list[list[dict[str, Any]]]:
    """The documents of each file, files in name order."""
    files: list[list[dict[str, Any]]] = []
    if not directory.is_dir():
        return files
    for path in sorted(directory.glob("*.yaml")):
        docs = []
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                if doc.get("kind") not in _KINDS:
                    raise DevClusterError(
                        f"{path}: example kind {doc.get('kind')!r} is not one of {', '.join(_KINDS)}"
                    )
                docs.append(doc)
        files.append(docs)
    return files


def _collection(doc: dict[str, Any]) -> str:
    namespace = doc["metadata"].get("namespace", "default")
    return {
        "Namespace": "/api/v1/namespaces",
        "PriorityClass": "/apis/scheduling.k8s.io/v1/priorityclasses",
        "ResourceQuota": f"/api/v1/namespaces/{namespace}/resourcequotas",
    }.get(doc["kind"], pod_path(namespace))


async def apply_examples(
    api: Any, directory: Path, *, quota_enforced: Callable[[str], Awaitable[bool]] | None = None
) -> list[tuple[str, str]]:
    """Create the example Namespaces, PriorityClasses, ResourceQuotas and Pods (existing ones are
    kept), file by file (the module docstring); the Pods' (namespace, name). After a ResourceQuota,
    wait until ``quota_enforced(namespace)`` (the extender counts it). A directory that does not
    exist has no examples."""
    kube = RawKube(api)
    pods: list[tuple[str, str]] = []
    for docs in await asyncio.to_thread(_load, directory):
        if pods:
            await wait_settled(api, pods)
        for doc in docs:
            namespace = doc["metadata"].get("namespace", "default")
            try:
                if doc["kind"] == "Pod":
                    await wait_for_default_service_account(api, namespace)
                await kube.request("POST", _collection(doc), body=doc)
            except Conflict:
                pass  # there already
            except KubeError as exc:
                raise DevClusterError(f"example {doc['kind']} {doc['metadata']['name']}: {exc}") from exc
            if doc["kind"] == "ResourceQuota" and quota_enforced is not None:
                await wait_for(
                    functools.partial(quota_enforced, namespace),
                    timeout=QUOTA_TIMEOUT_S,
                    interval=0.2,
                    what=f"the extender enforcing example quota {namespace}/{doc['metadata']['name']}",
                )
            if doc["kind"] == "Pod":
                pods.append((namespace, doc["metadata"]["name"]))
    return pods


def _settled(pod: Any) -> bool:
    annotations = pod.metadata.annotations or {}
    if annotations.get(keys.BIND_PHASE) in ("success", "failed") and pod.status.phase in (
        "Running",
        "Failed",
    ):
        return True
    conditions = pod.status.conditions or []
    return any(
        c.type == "PodScheduled" and c.reason == "Unschedulable" and _PREEMPTING not in (c.message or "")
        for c in conditions
    )


async def wait_settled(
    api: Any, pods: Sequence[tuple[str, str]], *, timeout_s: float = SETTLE_TIMEOUT_S
) -> None:
    """Wait until every pod is either allocated and Running (or failed), unschedulable (not waiting
    for a preemption made for it), or gone (preempted)."""
    from kubernetes_asyncio.client import CoreV1Api

    core = CoreV1Api(api)
    for namespace, name in pods:

        async def settled(namespace: str = namespace, name: str = name) -> bool:
            pod = await _read_pod(core, namespace, name)
            return pod is None or _settled(pod)

        await wait_for(
            settled, timeout=timeout_s, interval=0.2, what=f"example pod {namespace}/{name} settled"
        )


@dataclasses.dataclass(frozen=True)
class _Gpu:
    node: str
    index: int
    type: str
    devmem: int
    devcore: int
    count: int


async def _gpus(core: Any) -> dict[str, _Gpu]:
    gpus = {}
    for node in (await core.list_node(_request_timeout=API_TIMEOUT_S)).items:
        value = (node.metadata.annotations or {}).get(keys.NODE_REGISTER)
        if not value:
            continue
        try:
            devices = decode_node_devices(value)
        except ProtocolError:
            continue
        for d in devices:
            gpus[d.id] = _Gpu(node.metadata.name, d.index, d.type, d.devmem, d.devcore, d.count)
    return gpus


def _short_type(type_: str) -> str:
    return type_.removeprefix("NVIDIA-").removeprefix("NVIDIA ")


async def pod_rows(api: Any, pods: Sequence[tuple[str, str]]) -> list[list[str]]:
    """POD, STATUS, NODE, GPUS, MEMORY, CORES, WHY (the scheduler's reason for a pending pod; who
    preempted a preempted one)."""
    from kubernetes_asyncio.client import CoreV1Api

    core = CoreV1Api(api)
    gpus = await _gpus(core)
    rows = []
    for namespace, name in pods:
        pod = await _read_pod(core, namespace, name)
        if pod is None:
            rows.append(await _gone_row(core, namespace, name))
            continue
        annotations = pod.metadata.annotations or {}
        status = pod.status.phase or ""
        unschedulable = [c for c in pod.status.conditions or [] if c.reason == "Unschedulable"]
        why = (unschedulable[0].message or "").split(". ")[0] if unschedulable else ""
        devices = [d for slot in _allocated(annotations) for d in slot]
        profiles = _mig_profiles(annotations)
        rows.append(
            [
                f"{namespace}/{name}",
                status,
                pod.spec.node_name or "-",
                ", ".join(_device_label(gpus, d.uuid, profiles) for d in devices) or "-",
                ", ".join(f"{d.usedmem} MiB" for d in devices) or "-",
                ", ".join(f"{d.usedcores}%" for d in devices) or "-",
                why,
            ]
        )
    return rows


async def _read_pod(core: Any, namespace: str, name: str) -> Any:
    """The pod, or None once it is gone (an example pod preempted, or deleted)."""
    from kubernetes_asyncio.client import ApiException

    try:
        return await core.read_namespaced_pod(name, namespace, _request_timeout=API_TIMEOUT_S)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


async def _gone_row(core: Any, namespace: str, name: str) -> list[str]:
    """The row of an example pod that no longer exists: ``Preempted`` with the Event naming the
    preemptor, else ``Deleted``."""
    events = await core.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name}", _request_timeout=API_TIMEOUT_S
    )
    preempted = [e.message or "" for e in events.items if e.reason == "Preempted"]
    status = "Preempted" if preempted else "Deleted"
    why = preempted[-1].split(": ")[0] if preempted else ""
    return [f"{namespace}/{name}", status, "-", "-", "-", "-", why]


def _device_label(gpus: dict[str, _Gpu], uuid: str, profiles: dict[str, str]) -> str:
    """``<index>:<type>`` of a GPU a pod holds, with the MIG instance made for the pod on it
    (``0:A100-SXM4-40GB MIG 2g.10gb@0``); the UUID of one that no node registers."""
    gpu = gpus.get(uuid)
    if gpu is None:
        return uuid
    label = f"{gpu.index}:{_short_type(gpu.type)}"
    return f"{label} MIG {profiles[uuid]}" if uuid in profiles else label


def _mig_profiles(annotations: dict[str, str]) -> dict[str, str]:
    """GPU UUID -> ``<profile>@<first slice>`` of the pod's dynamic MIG instances."""
    value = annotations.get(keys.MIG_ALLOCATIONS)
    if not value:
        return {}
    try:
        records = decode_mig_allocations(value)
    except ProtocolError:
        return {}
    return {r.gpu_uuid: f"{r.profile}@{r.placement.start}" for r in records}


def _allocated(annotations: dict[str, str]) -> list[list[Any]]:
    value = annotations.get(keys.DEVICES_ALLOCATED)
    if not value:
        return []
    try:
        return [list(slot) for slot in decode_pod_devices(value)]
    except ProtocolError:
        return []


async def gpu_rows(api: Any) -> list[list[str]]:
    """NODE, GPU, TYPE, MEMORY, CORES, SLOTS, PODS: what each GPU has allocated of what it has."""
    from kubernetes_asyncio.client import CoreV1Api

    core = CoreV1Api(api)
    gpus = await _gpus(core)
    used: dict[str, list[tuple[str, int, int]]] = {uuid: [] for uuid in gpus}
    for pod in (await core.list_pod_for_all_namespaces(_request_timeout=API_TIMEOUT_S)).items:
        if pod.status.phase in ("Succeeded", "Failed") or pod.metadata.deletion_timestamp:
            continue
        annotations = pod.metadata.annotations or {}
        profiles = _mig_profiles(annotations)
        for slot in _allocated(annotations):
            for d in slot:
                if d.uuid in used:
                    holder = f"{pod.metadata.namespace}/{pod.metadata.name}"
                    if d.uuid in profiles:  # the MIG instance made for it on this GPU
                        holder += f" ({profiles[d.uuid]})"
                    used[d.uuid].append((holder, d.usedmem, d.usedcores))
    rows = []
    for uuid, gpu in sorted(gpus.items(), key=lambda item: (item[1].node, item[1].index)):
        holders = used[uuid]
        rows.append(
            [
                gpu.node,
                str(gpu.index),
                _short_type(gpu.type),
                f"{sum(m for _, m, _ in holders)}/{gpu.devmem} MiB",
                f"{sum(c for _, _, c in holders)}/{gpu.devcore}%",
                f"{len(holders)}/{gpu.count}",
                ", ".join(sorted({p for p, _, _ in holders})) or "-",
            ]
        )
    return rows


def format_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A plain-text table, columns padded to their widest cell."""
    body = [list(headers), *(list(r) for r in rows)]
    widths = [max(len(row[i]) for row in body) for i in range(len(headers))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in body
    )
