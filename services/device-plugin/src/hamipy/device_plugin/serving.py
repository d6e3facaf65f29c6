"""Serve the plugin's gRPC socket and register with the kubelet; do both again when needed.

The kubelet's contract (docs/wire-format.md#device-plugin-api): the plugin must be serving before it
registers, and a restarted kubelet deletes every socket in the device-plugin directory, so a plugin
whose socket vanished (or whose ``kubelet.sock`` was replaced) serves a new socket and registers again.
``serve_and_register`` does that until cancelled; ``registered`` is set while registered.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import grpc

from hamipy.device_plugin.servicer import OPTIONS, DevicePluginServicer
from hamipy.device_plugin.settings import PluginSettings
from hamipy.device_plugin.telemetry import Telemetry
from hamipy.kubelet_api import KUBELET_SOCKET, VERSION
from hamipy.kubelet_api.v1beta1 import api_pb2, api_pb2_grpc

__all__ = ["register_with_kubelet", "serve_and_register"]

_RETRY_MIN_S = 0.2
_RETRY_MAX_S = 5.0
_STOP_GRACE_S = 1.0


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


async def _until_replaced(socket: Path, kubelet: Path, *, interval_s: float) -> None:
    """Return once our socket or ``kubelet.sock`` is gone or another file (polled: a kubelet
    restart gives no other sign)."""
    ours, theirs = _inode(socket), _inode(kubelet)
    while True:
        await asyncio.sleep(interval_s)
        if _inode(socket) != ours or _inode(kubelet) != theirs:
            return


async def register_with_kubelet(settings: PluginSettings, resource_name: str) -> None:
    """One ``Registration/Register`` call on ``kubelet.sock`` (raises ``grpc.aio.AioRpcError``)."""
    target = f"unix://{settings.plugin_dir / KUBELET_SOCKET}"
    async with grpc.aio.insecure_channel(target) as channel:
        await api_pb2_grpc.RegistrationStub(channel).Register(
            api_pb2.RegisterRequest(
                version=VERSION, endpoint=settings.socket_name, resource_name=resource_name, options=OPTIONS
            ),
            timeout=settings.grpc_timeout_s,
        )


async def _new_server(servicer: DevicePluginServicer, socket: Path) -> grpc.aio.Server:
    """A server bound to a fresh ``socket``, not started: started inside the caller's ``try``, so
    that a cancellation part-way through ``start`` (which has launched grpc's main loop by then)
    still reaches ``stop``."""
    await asyncio.to_thread(socket.unlink, missing_ok=True)
    server = grpc.aio.server()
    api_pb2_grpc.add_DevicePluginServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix://{socket}")
    return server


async def _stop(server: grpc.aio.Server) -> None:
    # grpc (1.85) stopping a server whose start was cancelled sets a result on the start's
    # cancelled future and raises this; its tasks have ended all the same (the test checks).
    with contextlib.suppress(asyncio.InvalidStateError):
        await server.stop(_STOP_GRACE_S)


async def _register_until_done(settings: PluginSettings, resource_name: str, telemetry: Telemetry) -> None:
    """Register, retrying with backoff while the kubelet is not there."""
    delay = _RETRY_MIN_S
    while True:
        try:
            await register_with_kubelet(settings, resource_name)
        except grpc.aio.AioRpcError as exc:
            telemetry.metrics.registrations.labels(result="failed").inc()
            telemetry.logger.warning(
                "kubelet registration failed; retrying", error=exc.details(), retry_s=delay
            )
        else:
            telemetry.metrics.registrations.labels(result="success").inc()
            telemetry.logger.info(
                "registered with the kubelet", resource=resource_name, endpoint=settings.socket_name
            )
            return
        await asyncio.sleep(delay)
        delay = min(delay * 2, _RETRY_MAX_S)


async def serve_and_register(
    *,
    servicer: DevicePluginServicer,
    settings: PluginSettings,
    resource_name: str,
    telemetry: Telemetry,
    registered: asyncio.Event,
) -> None:
    """Serve and register; again whenever our socket vanishes or kubelet.sock is replaced. Runs
    until cancelled, then stops serving and removes the socket."""
    socket = settings.plugin_dir / settings.socket_name
    kubelet = settings.plugin_dir / KUBELET_SOCKET
    await asyncio.to_thread(settings.plugin_dir.mkdir, parents=True, exist_ok=True)
    try:
        while True:
            server = await _new_server(servicer, socket)
            try:
                await server.start()
                telemetry.logger.info("serving", socket=str(socket))
                await _register_until_done(settings, resource_name, telemetry)
                registered.set()
                await _until_replaced(socket, kubelet, interval_s=settings.socket_check_interval_s)
                telemetry.logger.warning("kubelet restarted (socket removed or replaced); serving again")
            finally:
                registered.clear()
                await _stop(server)
    finally:
        await asyncio.to_thread(socket.unlink, missing_ok=True)
