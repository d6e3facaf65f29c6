"""The node's GPUs, their health and pair scores, shared by ListAndWatch and the node registration loop.

One instance per plugin, owned by the event loop. ``version`` grows on every change; readers wait
for a version newer than the one they have (``wait_changed``), so ListAndWatch streams and the
register loop see every change without polling.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from hamipy.device_plugin.devices import Gpu, KubeletDevice, kubelet_devices, register_devices
from hamipy.protocol import DeviceInfo
from hamipy.protocol.config import NodeSettings

__all__ = ["Inventory"]


class Inventory:
    """GPUs, their health, and a change version."""

    def __init__(self, gpus: Sequence[Gpu], settings: NodeSettings) -> None:
        self.gpus = list(gpus)
        self.settings = settings
        self.unhealthy: dict[str, str] = {}
        self.version = 0
        self.scores: str | None = None
        """The ``hami.io/node-nvidia-score`` value; None where the topology could not be read."""
        self._changed = asyncio.Condition()

    @property
    def uuids(self) -> list[str]:
        return [gpu.uuid for gpu in self.gpus if not self.settings.filtered(gpu.uuid, gpu.index)]

    def kubelet_devices(self) -> list[KubeletDevice]:
        return kubelet_devices(self.gpus, self.settings, unhealthy=self.unhealthy)

    def register_devices(self) -> list[DeviceInfo]:
        return register_devices(self.gpus, self.settings, unhealthy=self.unhealthy)

    async def mark_unhealthy(self, uuid: str, reason: str) -> bool:
        """Record a sick GPU; True when that is news."""
        if uuid in self.unhealthy or uuid not in self.uuids:
            return False
        self.unhealthy[uuid] = reason
        async with self._changed:
            self.version += 1
            self._changed.notify_all()
        return True

    async def wait_changed(self, seen: int, *, timeout_s: float | None = None) -> int:
        """The current version once it is newer than ``seen`` (or when ``timeout_s`` passes)."""
        async with self._changed:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._changed.wait_for(lambda: self.version > seen)
            except TimeoutError:
                pass
            return self.version
