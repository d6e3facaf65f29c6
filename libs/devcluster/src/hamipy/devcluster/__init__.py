"""hami-py's local Kubernetes control plane (etcd, kube-apiserver, kube-scheduler) for tests and `make up`.

The public surface: `DevCluster` (processes), `SchedulerConfig`/`ExtenderConfig` (what the
kube-scheduler runs), `NodePool`/`SimulatedNode`/`NodeSpec` (nodes the scheduler binds to, with
`NodeAgent` as the plug-in point for a device plugin + kubelet stand-in), the namespace helpers and
the wait helpers. Heavy imports (kubernetes_asyncio) happen only when a client is made.

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
    )
    from hamipy.devcluster.errors import (
        BinaryBuildError,
        ClusterStateError,
        DevClusterError,
        StartupError,
        WaitTimeout,
    )
    from hamipy.devcluster.kubeobjects import (
        API_TIMEOUT_S,
        create_namespace,
        delete_namespace,
        ensure_default_service_account,
        ensure_namespace,
    )
    from hamipy.devcluster.nodes import NodeAgent, NodePool, NodeSpec, SimulatedNode
    from hamipy.devcluster.waiting import wait_annotation, wait_for, wait_pod_bound

_EXPORTS: dict[str, str] = {
    "API_TIMEOUT_S": "hamipy.devcluster.kubeobjects",
    "BinaryBuildError": "hamipy.devcluster.errors",
    "ClusterAccess": "hamipy.devcluster.cluster",
    "ClusterSettings": "hamipy.devcluster.cluster",
    "ClusterStateError": "hamipy.devcluster.errors",
    "ControlPlaneBinaries": "hamipy.devcluster.binaries",
    "DEFAULT_SCHEDULER_NAME": "hamipy.devcluster.config",
    "DevCluster": "hamipy.devcluster.cluster",
    "DevClusterError": "hamipy.devcluster.errors",
    "ETCD_VERSION": "hamipy.devcluster.binaries",
    "ExtenderConfig": "hamipy.devcluster.config",
    "ExtenderTLS": "hamipy.devcluster.config",
    "HAMI_SCHEDULER_NAME": "hamipy.devcluster.config",
    "KUBERNETES_VERSION": "hamipy.devcluster.binaries",
    "ManagedResource": "hamipy.devcluster.config",
    "NodeAgent": "hamipy.devcluster.nodes",
    "NodePool": "hamipy.devcluster.nodes",
    "NodeSpec": "hamipy.devcluster.nodes",
    "SchedulerConfig": "hamipy.devcluster.config",
    "SimulatedNode": "hamipy.devcluster.nodes",
    "StartupError": "hamipy.devcluster.errors",
    "WaitTimeout": "hamipy.devcluster.errors",
    "create_namespace": "hamipy.devcluster.kubeobjects",
    "delete_namespace": "hamipy.devcluster.kubeobjects",
    "ensure_binaries": "hamipy.devcluster.binaries",
    "ensure_default_service_account": "hamipy.devcluster.kubeobjects",
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
    "ControlPlaneBinaries",
    "DevCluster",
    "DevClusterError",
    "ExtenderConfig",
    "ExtenderTLS",
    "ManagedResource",
    "NodeAgent",
    "NodePool",
    "NodeSpec",
    "SchedulerConfig",
    "SimulatedNode",
    "StartupError",
    "WaitTimeout",
    "create_namespace",
    "delete_namespace",
    "ensure_binaries",
    "ensure_default_service_account",
    "ensure_namespace",
    "wait_annotation",
    "wait_for",
    "wait_pod_bound",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hamipy.devcluster' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
