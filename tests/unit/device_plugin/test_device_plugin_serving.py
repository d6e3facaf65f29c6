"""``serve_and_register`` cancelled at any step of its start (the supervisor stops every task when
one dies, often while the gRPC server is still starting): nothing of it is left running and its
socket is removed."""

from __future__ import annotations

import asyncio
import importlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from plugin_fakes import GPU_A, FakeKubelet

from hamipy.device_plugin.inventory import Inventory
from hamipy.device_plugin.servicer import DevicePluginServicer
from hamipy.device_plugin.serving import serve_and_register
from hamipy.device_plugin.settings import PluginSettings
from hamipy.device_plugin.telemetry import Telemetry
from hamipy.protocol.config import load_config


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    # Not tmp_path: a unix socket's path must stay under 108 bytes.
    path = Path(tempfile.mkdtemp(prefix="hdps-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("steps", range(6))
async def test_cancelled_while_the_grpc_server_starts_it_leaves_no_task_and_no_socket(
    plugin_dir: Path, steps: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Cancelled a few loop steps into grpc's Server.start: at two steps its main loop was left
    # running for ever (the leak CI caught once).
    server_class = importlib.import_module("grpc.aio._server").Server  # what grpc.aio.server() makes
    start = server_class.start
    loop = asyncio.get_running_loop()

    def cancel_after(task: asyncio.Task[None], steps: int) -> None:
        if steps:
            loop.call_soon(cancel_after, task, steps - 1)
        else:
            task.cancel()

    async def start_cancelled_after_steps(self: grpc.aio.Server) -> None:
        cancel_after(asyncio.current_task(), steps)  # type: ignore[arg-type]
        await start(self)

    monkeypatch.setattr(server_class, "start", start_cancelled_after_steps)
    before = asyncio.all_tasks()
    task, settings = _serve(plugin_dir)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _left(before) == []
    assert not (plugin_dir / settings.socket_name).exists()


async def test_cancelled_while_the_kubelet_has_not_answered_register_it_leaves_no_task(
    plugin_dir: Path,
) -> None:
    before = asyncio.all_tasks()
    async with FakeKubelet(plugin_dir) as kubelet:
        kubelet.registration.answer.clear()
        task, settings = _serve(plugin_dir)
        await asyncio.wait_for(kubelet.registration.received.wait(), timeout=10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert _left(before) == []
    assert not (plugin_dir / settings.socket_name).exists()


def _serve(plugin_dir: Path) -> tuple[asyncio.Task[None], PluginSettings]:
    settings = PluginSettings(node_name="n1", plugin_dir=plugin_dir, socket_check_interval_s=0.05)
    inventory = Inventory([GPU_A], load_config("{}").for_node("n1"))
    telemetry = Telemetry.create()
    servicer = DevicePluginServicer(inventory=inventory, allocator=None, telemetry=telemetry)  # type: ignore[arg-type]
    coro = serve_and_register(
        servicer=servicer,
        settings=settings,
        resource_name="nvidia.com/gpu",
        telemetry=telemetry,
        registered=asyncio.Event(),
    )
    return asyncio.create_task(coro, name="test:serve"), settings


def _left(before: set[asyncio.Task[object]]) -> list[str]:
    current = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() - before if t is not current and not t.done()]
    return [getattr(t.get_coro(), "__qualname__", t.get_name()) for t in left]
