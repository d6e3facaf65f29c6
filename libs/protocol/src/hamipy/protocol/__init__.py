"""hami-py wire formats: the single owner of everything HAMi components exchange.

Pure Python with no I/O. The package root re-exports the codecs and records every service needs;
the rest lives in submodules named for what they define:

- ``devices``: the device records, with a dynamic MIG GPU's profiles and placements
- ``node_devices``: ``hami.io/node-nvidia-register`` (JSON and legacy colon form)
- ``mig_allocations``: ``hami.io/vgpu-mig-allocations``, the MIG instance of each device
- ``node_scores``: ``hami.io/node-nvidia-score`` (GPU pair scores) and their computation from NVML
- ``node_handshake`` / ``node_lock``: node liveness stamps and the bind -> Allocate node lock
- ``pod_devices``: the positional per-container device lists of pod annotations
- ``resources`` / ``quantities``: what a pod asks for, with HAMi's defaults and clamps
- ``pod_preferences``: the user annotations (selectors, NUMA, policies, scoring weights)
- ``allocation_env``: the Allocate environment and mounts of one container
- ``cdi``: the CDI device names and spec files of the ``cdi-cri`` strategy
- ``reserved_env`` / ``reserved_mounts`` / ``reserved_annotations``: what a pod's own spec may not set
- ``region``: the v1.2 shared-region layout the interposer writes and the monitor reads
- ``config``: the configuration schema (``load_config``)
- ``settings``: each service's settings, declared once, as flags and environment variables
- ``keys``: annotation, label and resource names
- ``cel``: the CEL literals and the GPU-pod test the API server evaluates (registration, policies)
- ``kube_objects``: the fields of Pods and Nodes read from a request body, typed for msgspec
- ``identifiers``: ``NodeName``, ``PodUid``, ``GpuUuid``, distinct to the type checker
"""

from __future__ import annotations

from hamipy.protocol.devices import ContainerDevice, DeviceInfo, PodDevices
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.node_devices import decode_node_devices, encode_node_devices
from hamipy.protocol.pod_devices import clear_container_slot, decode_pod_devices, encode_pod_devices

__all__ = [
    "ContainerDevice",
    "DeviceInfo",
    "PodDevices",
    "ProtocolError",
    "clear_container_slot",
    "decode_node_devices",
    "decode_pod_devices",
    "encode_node_devices",
    "encode_pod_devices",
]
