"""The rows of ``hami_mig_device_info``: which MIG instance each container's device is (pure).

Two sources, one row per container device on a MIG instance:

- dynamic MIG: the pod's ``hami.io/vgpu-mig-allocations`` records that are runtime-ready (the device
  plugin has recorded the MIG UUID and the GPU and compute instance ids; a record the scheduler has
  only reserved names no instance yet). The row is the record, as HAMi's monitor reports it:
  ``device_uuid`` the parent GPU, ``vdevice_index`` the record's device index, the container by the
  record's container index (init containers first), the profile the scheduler chose.
- static MIG: a device whose UUID is a MIG UUID (a pre-made instance registered as its own device)
  and that no record covers. The row has what NVML says of that instance on this node: its parent
  GPU, its profile (from its name) and its ids; a label NVML cannot fill is empty.

Finished pods and terminated containers have no rows, as in the usage rows (``usage``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from hamipy.monitor.gpu_samples import HostGpuSample, MigDeviceSample
from hamipy.monitor.pods import PodRecord, is_mig_uuid
from hamipy.protocol.mig_allocations import runtime_ready

__all__ = ["MigInfoRow", "mig_info_rows"]


@dataclasses.dataclass(frozen=True, slots=True)
class MigInfoRow:
    """One container device on a MIG instance; None where the id is not known."""

    namespace: str
    pod: str
    container: str
    vdevice_index: int
    device_uuid: str
    mig_uuid: str
    profile: str
    gpu_instance_id: int | None
    compute_instance_id: int | None


def _instances(host: Sequence[HostGpuSample] | None) -> dict[str, tuple[HostGpuSample, MigDeviceSample]]:
    return {mig.uuid: (gpu, mig) for gpu in host or () for mig in gpu.mig_devices}


def mig_info_rows(
    pods: Mapping[str, PodRecord], host: Sequence[HostGpuSample] | None
) -> tuple[MigInfoRow, ...]:
    """The rows of every running container on a MIG instance (module docstring has the rules);
    ``host`` is NVML's view of this node's GPUs, None when NVML is off or failed."""
    instances = _instances(host)
    rows: list[MigInfoRow] = []
    for pod in sorted(pods.values(), key=lambda p: (p.namespace, p.name, p.uid)):
        if pod.terminal:
            continue
        recorded = set()
        for a in pod.mig_allocations:
            recorded.add((a.container_index, a.device_index))
            container = pod.containers[a.container_index]  # the index is checked by ``pod_record``
            if container in pod.terminated or a.mig_uuid is None or not runtime_ready(a):
                continue
            rows.append(
                MigInfoRow(
                    namespace=pod.namespace,
                    pod=pod.name,
                    container=container,
                    vdevice_index=a.device_index,
                    device_uuid=a.gpu_uuid,
                    mig_uuid=a.mig_uuid,
                    profile=a.profile,
                    gpu_instance_id=a.gpu_instance_id,
                    compute_instance_id=a.compute_instance_id,
                )
            )
        for index, container in enumerate(pod.containers):
            if container in pod.terminated:
                continue
            for vdevice, dev in enumerate(pod.allocations.get(container, ())):
                if (index, vdevice) in recorded or not is_mig_uuid(dev.uuid):
                    continue
                gpu, mig = instances.get(dev.uuid, (None, None))
                rows.append(
                    MigInfoRow(
                        namespace=pod.namespace,
                        pod=pod.name,
                        container=container,
                        vdevice_index=vdevice,
                        device_uuid="" if gpu is None else gpu.uuid,
                        mig_uuid=dev.uuid,
                        profile="" if mig is None else mig.profile,
                        gpu_instance_id=None if mig is None else mig.gpu_instance_id,
                        compute_instance_id=None if mig is None else mig.compute_instance_id,
                    )
                )
    return tuple(rows)
