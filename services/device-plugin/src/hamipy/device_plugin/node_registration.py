"""Keep this node's ``hami.io/node-nvidia-register``, ``hami.io/node-nvidia-score`` and
``hami.io/node-handshake`` current.

Written at start, whenever GPU health changes, and every ``register_interval_s`` even when nothing
changed: the handshake answers the scheduler's ``Requesting_`` stamp with ``Reported_<now>``, and
a scheduler that sees no answer for 60 s counts the node dead (docs/wire-format.md#handshake).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from hamipy.device_plugin.inventory import Inventory
from hamipy.device_plugin.kube import NodeKube
from hamipy.device_plugin.settings import PluginSettings
from hamipy.device_plugin.telemetry import Telemetry
from hamipy.kube.errors import KubeError
from hamipy.protocol import encode_node_devices, keys
from hamipy.protocol.node_handshake import plugin_report

__all__ = ["register_node_forever", "write_node_register"]

_RETRY_S = 2.0


async def write_node_register(api: NodeKube, inventory: Inventory) -> str:
    """One write of the register, the pair scores (removed where they could not be computed, so
    that none describe other GPUs), the handshake and our marker (equal to the handshake, so that a
    report by HAMi's plugin, which leaves the marker, is told apart); returns the register value."""
    value = encode_node_devices(inventory.register_devices())
    await api.patch_node_annotations(
        {keys.NODE_REGISTER: value, keys.NODE_SCORE: inventory.scores, **plugin_report(datetime.now(UTC))}
    )
    return value


async def register_node_forever(
    *,
    api: NodeKube,
    inventory: Inventory,
    settings: PluginSettings,
    telemetry: Telemetry,
    written: asyncio.Event,
) -> None:
    """Write on start, on every inventory change and on the interval; never returns (a failed
    write is retried; anything but a ``KubeError`` ends the task for the supervisor)."""
    last = ""
    while True:
        seen = inventory.version
        try:
            value = await write_node_register(api, inventory)
        except KubeError as exc:
            telemetry.metrics.register_writes.labels(result="failed").inc()
            telemetry.logger.error(
                "node register write failed; retrying", node=settings.node_name, error=str(exc)
            )
            await asyncio.sleep(_RETRY_S)
            continue
        telemetry.metrics.register_writes.labels(result="success").inc()
        if value != last:
            telemetry.logger.info("node devices registered", node=settings.node_name, devices=value)
            last = value
        written.set()
        await inventory.wait_changed(seen, timeout_s=settings.register_interval_s)
