"""hami-py's local Kubernetes control plane (etcd, kube-apiserver, kube-scheduler) for tests and `make up`.

The public surface: `DevCluster` (processes), `SchedulerConfig`/`ExtenderConfig` (what the
kube-scheduler runs), `NodePool`/`SimulatedNode`/`NodeSpec` (nodes the scheduler binds to, with
`NodeAgent` as the plug-in point for a device plugin + kubelet stand-in), `KubeletStandIn` (the
kubelet's device-manager role over the real device plugin gRPC API, and what it allocated:
`ContainerAllocation`, `ResourceAllocation`, `ContainerKey`, `PluginDevice`, `StandInSettings`), the
namespace helpers and the wait helpers. Heavy imports (kubernetes_asyncio, grpc) happen only when
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
        StartupError,
        WaitTimeout,
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
    "ETCD_VERSION": "hamipy.devcluster.binaries",
    "ExtenderConfig": "hamipy.devcluster.config",
    "ExtenderTLS": "hamipy.devcluster.config",
    "HAMI_SCHEDULER_NAME": "hamipy.devcluster.config",
    "KUBERNETES_VERSION": "hamipy.devcluster.binaries",
    "KubeletStandIn": "hamipy.devcluster.kubelet_standin",
    "ManagedResource": "hamipy.devcluster.config",
    "NodeAgent": "hamipy.devcluster.nodes",
    "NodePool": "hamipy.devcluster.nodes",
    "NodeSpec": "hamipy.devcluster.nodes",
    "PluginDevice": "hamipy.devcluster.kubelet_admission",
    "ResourceAllocation": "hamipy.devcluster.kubelet_standin",
    "SchedulerConfig": "hamipy.devcluster.config",
    "SchedulerLeaderElection": "hamipy.devcluster.config",
    "SimulatedNode": "hamipy.devcluster.nodes",
    "StandInSettings": "hamipy.devcluster.kubelet_standin",
    "StartupError": "hamipy.devcluster.errors",
    "WaitTimeout": "hamipy.devcluster.errors",
    "create_namespace": "hamipy.devcluster.kubeobjects",
    "delete_namespace": "hamipy.devcluster.kubeobjects",
    "ensure_binaries": "hamipy.devcluster.binaries",
    "wait_for_default_service_account": "hamipy.devcluster.kubeobjects",
    "ensure_namespace": "hamipy.devcluster.kubeobjects",
    "wait_annotation": "hamipy.devcluster.waiting",
    "wait_for": "hamipy.devcluster.waiting",
    "wait_pod_bound": "hamipy.devcluster.waiting",
}

__all__ = [
    "API_TIMEOUT_S",
    "DEFAULT_SCHEDULER_NAME",
    "ETCD_VERSION",
    "HAMI_SCHEDULER_NAME",
    "KUBERNETES_VERSION",
    "BinaryBuildError",
    "ClusterAccess",
    "ClusterSettings",
    "ClusterStateError",
    "ContainerAllocation",
    "ContainerKey",
    "ControlPlaneBinaries",
    "DevCluster",
    "DevClusterError",
    "ExtenderConfig",
    "ExtenderTLS",
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
    "create_namespace",
    "delete_namespace",
    "ensure_binaries",
    "ensure_namespace",
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
