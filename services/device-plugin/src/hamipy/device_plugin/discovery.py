"""GPU discovery and health with NVML through ``pynvml`` (docs/design.md#3-real-nvml-or-a-fake-driver).

The same code runs over the real ``libnvidia-ml.so.1`` on a GPU node and over native/'s fake one
elsewhere. NVML calls block, so the async callers run them in a thread (``asyncio.to_thread``).

MIG (docs/device-plugin.md#mig): each GPU's MIG mode; on a ``mig`` node the allowed profiles as NVML
gives them (HAMi's ``discoverMigProfiles``: memory, SM share of the largest profile's SMs, slice count,
possible placements, and the most instances any allows); on a GPU in MIG mode its MIG devices (UUID,
profile from the name, memory, SM share).

Health follows NVIDIA's device plugin: a GPU turns Unhealthy on an XID critical-error event,
except the XIDs an application causes (13, 31, 43, 45, 68, 109: a bad kernel, not a bad GPU).
Where a GPU does not support events, it is polled instead: a GPU whose memory query fails is
Unhealthy. An Unhealthy GPU stays so until the plugin restarts, as upstream.

Topology (``read_node_scores``) is read as upstream's plugin reads it: the P2P level of every
ordered pair, and per GPU its enabled NVLinks' remote PCI bus ids and how many end at an NVSwitch;
a link whose query answers NOT_SUPPORTED or INVALID_ARGUMENT is skipped, any other error fails the
read (``hamipy.protocol.node_scores`` turns the facts into scores).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import pynvml

from hamipy.device_plugin.devices import Gpu, MigDevice
from hamipy.device_plugin.errors import NvmlError
from hamipy.device_plugin.mig_manager import (
    GI_PROFILES,
    mig_devices,
    nvml_session,
    nvml_text,
    possible_placements,
    slice_prefix,
)
from hamipy.protocol.devices import MigPlacement, MigProfile
from hamipy.protocol.node_scores import NVLINK_MAX_LINKS, GpuLinks, NodeScores, node_scores

__all__ = ["APPLICATION_XIDS", "AllowedProfiles", "HealthWatch", "Nvml", "discover_gpus", "read_node_scores"]

APPLICATION_XIDS: Final = frozenset({13, 31, 43, 45, 68, 109})
_MIB: Final = 1024 * 1024
_LINK_SKIPPED: Final = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument)


AllowedProfiles = Callable[[str], Sequence[str]]
"""The MIG profile names a GPU model (its NVML name) may publish (the node's allow-list)."""


def _mig_enabled(handle: Any) -> bool:
    """MIG mode is on now (False where the GPU has no MIG)."""
    try:
        current, _ = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError_NotSupported:
        return False
    return bool(current == pynvml.NVML_DEVICE_MIG_ENABLE)


def _full_sm(handle: Any) -> int:
    """The SMs of the whole GPU: the most any GPU-instance profile has (HAMi's rule); 0 without MIG."""
    counts = [0]
    for profile_id in GI_PROFILES.values():
        with contextlib.suppress(pynvml.NVMLError):
            counts.append(
                int(pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile_id).multiprocessorCount)
            )
    return max(counts)


def _share(sm: int, full: int) -> int:
    return math.ceil(sm * 100 / full) if full else 0


def _mig_profiles(handle: Any, names: Sequence[str], full: int) -> tuple[tuple[MigProfile, ...], int]:
    """The allowed profiles as NVML reports them (SM shares of ``full``, the whole GPU's SMs), and
    the most instances any of them allows (HAMi's ``discoverMigProfiles``). A profile whose slice
    prefix is unknown, or whose info or placements NVML does not give, is left out."""
    profiles = []
    capacity = 0
    for name in names:
        profile_id = GI_PROFILES.get(slice_prefix(name))
        if profile_id is None:
            continue
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile_id)
            placements = possible_placements(handle, info.id)
        except pynvml.NVMLError:
            continue
        profiles.append(
            MigProfile(
                name=name,
                memory_mb=int(info.memorySizeMB),
                core=_share(int(info.multiprocessorCount), full),
                slice_count=int(info.sliceCount),
                placements=tuple(MigPlacement(start=s, size=n) for s, n in placements),
            )
        )
        capacity = max(capacity, int(info.instanceCount))
    return tuple(profiles), capacity


def _mig_instances(handle: Any, full: int) -> tuple[MigDevice, ...]:
    """The MIG devices that exist on a MIG-enabled GPU (SM shares of ``full``)."""
    out = []
    for device in mig_devices(handle):
        name = nvml_text(pynvml.nvmlDeviceGetName(device))
        out.append(
            MigDevice(
                uuid=nvml_text(pynvml.nvmlDeviceGetUUID(device)),
                profile=name.rpartition(" MIG ")[2],
                memory_mib=int(pynvml.nvmlDeviceGetMemoryInfo(device).total) // _MIB,
                core=_share(int(pynvml.nvmlDeviceGetAttributes(device).multiprocessorCount), full),
            )
        )
    return tuple(out)


class Nvml(nvml_session):
    """An initialised NVML (``with Nvml() as nvml``); every method translates NVML errors."""

    def gpus(self, allowed: AllowedProfiles | None = None) -> list[Gpu]:
        """Every GPU, in NVML index order; with ``allowed`` (a ``mig`` node) each GPU's allowed
        MIG profiles."""
        try:
            return [self._gpu(i, allowed) for i in range(pynvml.nvmlDeviceGetCount())]
        except pynvml.NVMLError as exc:
            raise NvmlError(f"NVML device query failed: {exc}") from exc

    @staticmethod
    def _gpu(index: int, allowed: AllowedProfiles | None) -> Gpu:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = nvml_text(pynvml.nvmlDeviceGetName(handle))
        enabled = _mig_enabled(handle)
        full = _full_sm(handle) if enabled or allowed is not None else 0
        profiles, capacity = _mig_profiles(handle, allowed(name), full) if allowed is not None else ((), 0)
        try:
            numa = int(pynvml.nvmlDeviceGetNumaNodeId(handle))
        except pynvml.NVMLError:
            numa = 0
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return Gpu(
            index=index,
            uuid=nvml_text(pynvml.nvmlDeviceGetUUID(handle)),
            name=name,
            memory_mib=int(memory.total) // _MIB,
            numa=max(numa, 0),
            pci_bus_id=nvml_text(pynvml.nvmlDeviceGetPciInfo(handle).busId),
            mig_enabled=enabled,
            mig_profiles=profiles,
            mig_capacity=capacity,
            mig_devices=_mig_instances(handle, full) if enabled else (),
        )

    def topology(self, uuids: Sequence[str]) -> tuple[list[GpuLinks], dict[tuple[str, str], int]]:
        """The NVLinks of the GPUs ``uuids`` (in that order) and the P2P level of each ordered pair."""
        try:
            handles = {uuid: pynvml.nvmlDeviceGetHandleByUUID(uuid) for uuid in uuids}
            links = [_links(uuid, handle) for uuid, handle in handles.items()]
            levels = {
                (a, b): int(pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[a], handles[b]))
                for a in uuids
                for b in uuids
                if a != b
            }
        except pynvml.NVMLError as exc:
            raise NvmlError(f"NVML topology query failed: {exc}") from exc
        return links, levels


def _links(uuid: str, handle: object) -> GpuLinks:
    remote: list[str] = []
    switches = 0
    for link in range(NVLINK_MAX_LINKS):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                continue
        except _LINK_SKIPPED:
            continue
        with contextlib.suppress(*_LINK_SKIPPED):
            remote.append(nvml_text(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId))
        with contextlib.suppress(*_LINK_SKIPPED):
            kind = pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
            switches += kind == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
    bus = nvml_text(pynvml.nvmlDeviceGetPciInfo(handle).busId)
    return GpuLinks(uuid=uuid, bus_id=bus, remote_bus_ids=tuple(remote), switch_links=switches)


def read_node_scores(uuids: Sequence[str]) -> tuple[NodeScores, list[tuple[str, str]]]:
    """The pair scores of the GPUs ``uuids`` (registration order) and the asymmetric pairs
    (blocking). ``NvmlError`` when NVML fails, ``ProtocolError`` for a P2P level NVML does not define."""
    with Nvml() as nvml:
        links, levels = nvml.topology(uuids)
    return node_scores(links, levels)


def discover_gpus(allowed: AllowedProfiles | None = None) -> list[Gpu]:
    """Every GPU of this node, in NVML index order, with the MIG profiles ``allowed`` gives for its
    model (a ``mig`` node) and its MIG devices (blocking)."""
    with Nvml() as nvml:
        return nvml.gpus(allowed)


class HealthWatch:
    """Watches GPUs for XID critical errors; calls ``on_unhealthy(uuid, reason)``.

    ``run()`` blocks (run it in a thread: the plugin runs it as a supervised task) until
    ``stop()``; ``on_unhealthy`` is called from that thread, so the caller hands it over to its
    event loop (``loop.call_soon_threadsafe``). Where NVML cannot be used every GPU is reported
    Unhealthy once and ``run()`` waits for ``stop()`` (as when NVML fails mid-watch: upstream's
    rule, the driver is gone); any other error ends ``run()`` with it.
    ``stop()`` ends ``run()`` within one ``poll_s``.
    """

    def __init__(self, uuids: list[str], on_unhealthy: Callable[[str, str], None], *, poll_s: float) -> None:
        self.uuids = uuids
        self.on_unhealthy = on_unhealthy
        self.poll_ms = max(1, int(poll_s * 1000))
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        try:
            with Nvml():
                self._watch()
        except NvmlError as exc:
            self._all_unhealthy(f"NVML unavailable: {exc}")
        except pynvml.NVMLError as exc:
            self._all_unhealthy(f"NVML health watch failed: {exc}")

    def _all_unhealthy(self, reason: str) -> None:
        for uuid in self.uuids:
            self.on_unhealthy(uuid, reason)
        self._stop.wait()

    def _watch(self) -> None:
        events = pynvml.nvmlEventSetCreate()
        polled: list[str] = []
        try:
            for uuid in self.uuids:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                try:
                    supported = pynvml.nvmlDeviceGetSupportedEventTypes(handle)
                    if not supported & pynvml.nvmlEventTypeXidCriticalError:
                        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
                    pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, events)
                except pynvml.NVMLError:
                    polled.append(uuid)
            for uuid, reason in self._events(events, polled):
                self.on_unhealthy(uuid, reason)
        finally:
            pynvml.nvmlEventSetFree(events)

    def _events(self, events: object, polled: list[str]) -> Iterator[tuple[str, str]]:
        sick: set[str] = set()
        while not self._stop.is_set():
            try:
                data = pynvml.nvmlEventSetWait(events, self.poll_ms)
            except pynvml.NVMLError_Timeout:
                data = None
            except pynvml.NVMLError as exc:
                if self._stop.wait(self.poll_ms / 1000):
                    return
                data = None
                if isinstance(exc, pynvml.NVMLError_Unknown):
                    # The driver is gone: every GPU is unusable (NVIDIA's plugin does the same).
                    for uuid in self.uuids:
                        if uuid not in sick:
                            sick.add(uuid)
                            yield uuid, f"NVML event wait failed: {exc}"
            if data is not None and data.eventType == pynvml.nvmlEventTypeXidCriticalError:
                xid = int(data.eventData)
                uuid = nvml_text(pynvml.nvmlDeviceGetUUID(data.device))
                if xid not in APPLICATION_XIDS and uuid not in sick:
                    sick.add(uuid)
                    yield uuid, f"XID {xid} critical error"
            for uuid in polled:
                if uuid in sick:
                    continue
                try:
                    pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByUUID(uuid))
                except pynvml.NVMLError as exc:
                    sick.add(uuid)
                    yield uuid, f"NVML query failed: {exc}"
