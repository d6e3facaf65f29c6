"""hami-py's local Kubernetes control plane (etcd, kube-apiserver, kube-scheduler) for tests and `make up`.

The public surface: `DevCluster` (processes), `SchedulerConfig`/`ExtenderConfig` (what the
kube-scheduler runs), `NodePool`/`SimulatedNode`/`NodeSpec` (nodes the scheduler binds to, with
`NodeAgent` as the plug-in point for a device plugin + kubelet stand-in), `KubeletStandIn` (the
kubelet's device-manager role over the real device plugin gRPC API, and what it allocated:
`ContainerAllocation`, `ResourceAllocation`, `ContainerKey`, `PluginDevice`, `StandInSettings`), the
namespace helpers and the wait helpers, the container images the nodes run (`ensure_images`:
OCI archives of the pause and GPU workload images) and the workload's report
(`parse_workload_log`). Heavy imports (kubernetes_asyncio, grpc) happen only when
a client is made or the stand-in is first named.

Importing the package is cheap (the pytest plugin loads it in every session): names are imported
from their modules on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hamipy.devcluster.binaries import (
        ETCD_VERSION,
        KUBERNETES_VERSION,
        ControlPlaneBinaries,
        ensure_binaries,
    )
    from hamipy.devcluster.cluster import ClusterAccess, ClusterSettings, DevCluster
    from hamipy.devcluster.config import (
        DEFAULT_SCHEDULER_NAME,
        HAMI_SCHEDULER_NAME,
        ExtenderConfig,
        ExtenderTLS,
        ManagedResource,
        SchedulerConfig,
        SchedulerLeaderElection,
    )
    from hamipy.devcluster.errors import (
        BinaryBuildError,
        ClusterStateError,
        DevClusterError,
        ImageBuildError,
        StartupError,
        WaitTimeout,
    )
    from hamipy.devcluster.images import (
        GPU_WORKLOAD_IMAGE,
        PAUSE_IMAGE,
        DevImages,
        ImageArchive,
        ensure_images,
    )
    from hamipy.devcluster.kubelet_admission import PluginDevice
    from hamipy.devcluster.kubelet_standin import (
        ContainerAllocation,
        ContainerKey,
        KubeletStandIn,
        ResourceAllocation,
        StandInSettings,
    )
    from hamipy.devcluster.kubeobjects import (
        API_TIMEOUT_S,
        create_namespace,
        delete_namespace,
        ensure_namespace,
        wait_for_default_service_account,
    )
    from hamipy.devcluster.nodes import NodeAgent, NodePool, NodeSpec, SimulatedNode
    from hamipy.devcluster.waiting import wait_annotation, wait_for, wait_pod_bound
    from hamipy.devcluster.workload_log import WorkloadLog, parse_workload_log

_EXPORTS: dict[str, str] = {
    "API_TIMEOUT_S": "hamipy.devcluster.kubeobjects",
    "BinaryBuildError": "hamipy.devcluster.errors",
    "ClusterAccess": "hamipy.devcluster.cluster",
    "ClusterSettings": "hamipy.devcluster.cluster",
    "ClusterStateError": "hamipy.devcluster.errors",
    "ContainerAllocation": "hamipy.devcluster.kubelet_standin",
    "ContainerKey": "hamipy.devcluster.kubelet_standin",
    "ControlPlaneBinaries": "hamipy.devcluster.binaries",
    "DEFAULT_SCHEDULER_NAME": "hamipy.devcluster.config",
    "DevCluster": "hamipy.devcluster.cluster",
    "DevClusterError": "hamipy.devcluster.errors",
    "DevImages": "hamipy.devcluster.images",
    "ETCD_VERSION": "hamipy.devcluster.binaries",
    "ExtenderConfig": "hamipy.devcluster.config",
    "ExtenderTLS": "hamipy.devcluster.config",
    "GPU_WORKLOAD_IMAGE": "hamipy.devcluster.images",
    "HAMI_SCHEDULER_NAME": "hamipy.devcluster.config",
    "ImageArchive": "hamipy.devcluster.images",
    "ImageBuildError": "hamipy.devcluster.errors",
    "KUBERNETES_VERSION": "hamipy.devcluster.binaries",
    "KubeletStandIn": "hamipy.devcluster.kubelet_standin",
    "ManagedResource": "hamipy.devcluster.config",
    "NodeAgent": "hamipy.devcluster.nodes",
    "NodePool": "hamipy.devcluster.nodes",
    "NodeSpec": "hamipy.devcluster.nodes",
    "PAUSE_IMAGE": "hamipy.devcluster.images",
    "PluginDevice": "hamipy.devcluster.kubelet_admission",
    "ResourceAllocation": "hamipy.devcluster.kubelet_standin",
    "SchedulerConfig": "hamipy.devcluster.config",
    "SchedulerLeaderElection": "hamipy.devcluster.config",
    "SimulatedNode": "hamipy.devcluster.nodes",
    "StandInSettings": "hamipy.devcluster.kubelet_standin",
    "StartupError": "hamipy.devcluster.errors",
    "WaitTimeout": "hamipy.devcluster.errors",
    "WorkloadLog": "hamipy.devcluster.workload_log",
    "create_namespace": "hamipy.devcluster.kubeobjects",
    "delete_namespace": "hamipy.devcluster.kubeobjects",
    "ensure_binaries": "hamipy.devcluster.binaries",
    "ensure_images": "hamipy.devcluster.images",
    "wait_for_default_service_account": "hamipy.devcluster.kubeobjects",
    "ensure_namespace": "hamipy.devcluster.kubeobjects",
    "parse_workload_log": "hamipy.devcluster.workload_log",
    "wait_annotation": "hamipy.devcluster.waiting",
    "wait_for": "hamipy.devcluster.waiting",
    "wait_pod_bound": "hamipy.devcluster.waiting",
}

__all__ = [
    "API_TIMEOUT_S",
    "DEFAULT_SCHEDULER_NAME",
    "ETCD_VERSION",
    "GPU_WORKLOAD_IMAGE",
    "HAMI_SCHEDULER_NAME",
    "KUBERNETES_VERSION",
    "PAUSE_IMAGE",
    "BinaryBuildError",
    "ClusterAccess",
    "ClusterSettings",
    "ClusterStateError",
    "ContainerAllocation",
    "ContainerKey",
    "ControlPlaneBinaries",
    "DevCluster",
    "DevClusterError",
    "DevImages",
    "ExtenderConfig",
    "ExtenderTLS",
    "ImageArchive",
    "ImageBuildError",
    "KubeletStandIn",
    "ManagedResource",
    "NodeAgent",
    "NodePool",
    "NodeSpec",
    "PluginDevice",
    "ResourceAllocation",
    "SchedulerConfig",
    "SchedulerLeaderElection",
    "SimulatedNode",
    "StandInSettings",
    "StartupError",
    "WaitTimeout",
    "WorkloadLog",
    "create_namespace",
    "delete_namespace",
    "ensure_binaries",
    "ensure_images",
    "ensure_namespace",
    "parse_workload_log",
    "wait_annotation",
    "wait_for",
    "wait_for_default_service_account",
    "wait_pod_bound",
]


if not TYPE_CHECKING:
    # Hidden from mypy: a module-level __getattr__ would let it accept any name imported from here
    # (a renamed export then went unnoticed in the benchmarks); the imports above type the real ones.

    def __getattr__(name: str) -> Any:
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module 'hamipy.devcluster' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
