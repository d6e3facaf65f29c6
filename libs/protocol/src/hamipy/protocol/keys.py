"""Annotation, label and resource keys of the HAMi wire protocol (docs/wire-format.md#node-annotations,
#pod-annotations and #resources)."""

from __future__ import annotations

from typing import Final

__all__ = [
    "ALLOCATION_STATE_ANNOTATIONS",
    "ALLOCATION_STATE_LABELS",
    "BIND_PHASE",
    "BIND_TIME",
    "DEVICES_ALLOCATED",
    "DEVICES_TO_ALLOCATE",
    "DEVICE_CORDON",
    "DEVICE_PLUGIN_MARKER",
    "DEVICE_SCORING_WEIGHTS",
    "DEVICE_VENDOR_NVIDIA",
    "EXTENDER_ROLE",
    "GPU_SCHEDULER_POLICY",
    "MIG_ALLOCATIONS",
    "NODE_HANDSHAKE",
    "NODE_LOCK",
    "NODE_REGISTER",
    "NODE_SCHEDULER_POLICY",
    "NODE_SCORE",
    "NOUSE_GPU_TYPE",
    "NOUSE_GPU_UUID",
    "NUMA_BIND",
    "PLUGIN_WRITTEN_ANNOTATIONS",
    "REQUEUE",
    "RESOURCE_CORES",
    "RESOURCE_COUNT",
    "RESOURCE_COUNT_ALT",
    "RESOURCE_MEMORY",
    "RESOURCE_MEMORY_PERCENTAGE",
    "RESOURCE_PRIORITY",
    "TRACE_CONTEXT",
    "USE_GPU_TYPE",
    "USE_GPU_UUID",
    "VGPU_MODE",
    "VGPU_NODE",
    "VGPU_NODE_LABEL",
    "VGPU_TIME",
]

# Node annotations (docs/wire-format.md#node-annotations)
NODE_REGISTER: Final = "hami.io/node-nvidia-register"
NODE_HANDSHAKE: Final = "hami.io/node-handshake"
NODE_LOCK: Final = "hami.io/mutex.lock"
NODE_SCORE: Final = "hami.io/node-nvidia-score"
DEVICE_CORDON: Final = "hami.io/device-cordon"

# Pod annotations written by the scheduler and the device plugin (docs/wire-format.md#pod-annotations)
VGPU_NODE: Final = "hami.io/vgpu-node"
VGPU_TIME: Final = "hami.io/vgpu-time"
DEVICES_TO_ALLOCATE: Final = "hami.io/vgpu-devices-to-allocate"
DEVICES_ALLOCATED: Final = "hami.io/vgpu-devices-allocated"
BIND_PHASE: Final = "hami.io/bind-phase"
BIND_TIME: Final = "hami.io/bind-time"
MIG_ALLOCATIONS: Final = "hami.io/vgpu-mig-allocations"
"""The MIG profile and placement of each device on a dynamic MIG GPU (the scheduler writes them),
and the instance made for it (the device plugin adds it): ``hamipy.protocol.mig_allocations``."""

# Pod label mirroring VGPU_NODE (the monitor selects on it)
VGPU_NODE_LABEL: Final = VGPU_NODE

ALLOCATION_STATE_ANNOTATIONS: Final = (
    VGPU_NODE,
    VGPU_TIME,
    DEVICES_TO_ALLOCATE,
    DEVICES_ALLOCATED,
    BIND_PHASE,
    BIND_TIME,
    MIG_ALLOCATIONS,
)
"""The pod annotations that carry scheduling or allocation state: only the scheduler (our extender)
may set or change them, and the device plugin those in ``PLUGIN_WRITTEN_ANNOTATIONS`` (the admission
policy, docs/security.md; a tenant who could write them could pick their own slot)."""
ALLOCATION_STATE_LABELS: Final = (VGPU_NODE_LABEL,)
PLUGIN_WRITTEN_ANNOTATIONS: Final = (DEVICES_TO_ALLOCATE, BIND_PHASE, MIG_ALLOCATIONS)
"""What the device plugin writes while serving ``Allocate``: the slots left, the phase, and the
MIG instances it made."""

# Pod annotations set by users (docs/wire-format.md#user-annotations)
USE_GPU_TYPE: Final = "nvidia.com/use-gputype"
NOUSE_GPU_TYPE: Final = "nvidia.com/nouse-gputype"
USE_GPU_UUID: Final = "nvidia.com/use-gpuuuid"
NOUSE_GPU_UUID: Final = "nvidia.com/nouse-gpuuuid"
NUMA_BIND: Final = "nvidia.com/numa-bind"
VGPU_MODE: Final = "nvidia.com/vgpu-mode"
NODE_SCHEDULER_POLICY: Final = "hami.io/node-scheduler-policy"
GPU_SCHEDULER_POLICY: Final = "hami.io/gpu-scheduler-policy"
DEVICE_SCORING_WEIGHTS: Final = "hami.io/device-scoring-weights"

# Our own addition (new keys only, docs/design.md#6-wire-compatible-with-hami): W3C trace context of
# the pod's journey (docs/wire-format.md#trace-context).
TRACE_CONTEXT: Final = "hami-py.io/traceparent"
DEVICE_PLUGIN_MARKER: Final = "hami-py.io/device-plugin-handshake"
"""Node annotation our device plugin writes with every register, equal to the ``Reported_``
handshake written beside it: a node whose current report carries it is served by our device plugin
(which needs no node lock), one whose report does not (HAMi's plugin reported last) gets HAMi's
lock discipline (docs/extender.md#two-bind-paths)."""
EXTENDER_ROLE: Final = "hami-py.io/extender-role"
"""Label an extender replica keeps on its own pod: ``leader`` while it decides, else ``follower``;
the chart's Service selects ``leader`` (docs/extender.md#replicas)."""
REQUEUE: Final = "hami-py.io/requeue"
"""Node annotation the extender stamps (a time) when GPUs free up while pods it refused wait: the
node event makes kube-scheduler retry them (docs/extender.md#requeueing-refused-pods)."""

# Default resource names (docs/wire-format.md#resources; configurable)
RESOURCE_COUNT: Final = "nvidia.com/gpu"
RESOURCE_COUNT_ALT: Final = "nvidia.com/vgpu"
RESOURCE_MEMORY: Final = "nvidia.com/gpumem"
RESOURCE_MEMORY_PERCENTAGE: Final = "nvidia.com/gpumem-percentage"
RESOURCE_CORES: Final = "nvidia.com/gpucores"
RESOURCE_PRIORITY: Final = "nvidia.com/priority"

# Device vendor string in pod device lists
DEVICE_VENDOR_NVIDIA: Final = "NVIDIA"
