"""The ``hamipy-device-plugin`` process over native/'s fake NVML and a fake API server: SIGTERM
stops it with status 0; a background task that dies ends it with status 1 and a log line naming
the task."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import builders
import pytest
from agent_process import AgentProcess, assert_dies_naming_the_task, assert_sigterm_stops_cleanly
from fake_kube import FakeKube, ServedKube, watch_event
from plugin_fakes import NODE

from hamipy.devcluster.gpu_nodes import FakeGpu, fake_gpu_config

pytestmark = pytest.mark.native

FAKE_DRIVER = Path(__file__).resolve().parents[3] / "native" / "build" / "fake"
MODULE = "hamipy.device_plugin.cli"
# Run the plugin's CLI with a broken handler on its pod informer: the first watch event raises
# TypeError in the informer's task, as a bug would. argv: module, then the CLI's arguments.
INJECT_BUG = """
import importlib, sys
from hamipy.device_plugin import pod_cache
class Broken:
    def listed(self, objects):
        pass
    def changed(self, kind, obj):
        raise TypeError("injected")
init = pod_cache.PodCache.__init__
def broken_init(self, informer):
    init(self, informer)
    informer.subscribe(Broken())
pod_cache.PodCache.__init__ = broken_init
sys.exit(importlib.import_module(sys.argv[1]).main(sys.argv[2:]))
"""


@pytest.fixture
async def api() -> AsyncIterator[ServedKube]:
    async with ServedKube(FakeKube(builders.node(NODE, annotations={}))) as server:
        yield server


def plugin(api: ServedKube, tmp_path: Path, *, python_args: list[str]) -> AgentProcess:
    if not (FAKE_DRIVER / "libnvidia-ml.so.1").is_file():
        pytest.skip("needs native/build/fake (make native)")
    gpus = tmp_path / "gpus.conf"
    gpus.write_text(fake_gpu_config([FakeGpu("GPU-aaaaaaaa-0000-4000-8000-000000000000")]))
    config = tmp_path / "hami-py.yaml"
    config.write_text(f"nvidia:\n  hookPath: {tmp_path}/vgpu\n")
    args = [
        "--node-name",
        NODE,
        "--kubeconfig",
        str(api.kubeconfig(tmp_path / "kubeconfig")),
        "--config",
        str(config),
        "--plugin-dir",
        str(tmp_path / "plugins"),
        "--metrics-host",
        "127.0.0.1",
        "--metrics-port",
        "0",
    ]
    env = {"LD_LIBRARY_PATH": str(FAKE_DRIVER), "HAMIPY_FAKE_GPU_CONFIG": str(gpus)}
    return AgentProcess([*python_args, *args], log=tmp_path / "plugin.log", env=env)


async def test_sigterm_stops_the_plugin_with_status_0(api: ServedKube, tmp_path: Path) -> None:
    await assert_sigterm_stops_cleanly(await plugin(api, tmp_path, python_args=["-m", MODULE]).start(), api)


async def test_a_task_that_dies_ends_the_plugin_with_status_1(api: ServedKube, tmp_path: Path) -> None:
    process = await plugin(api, tmp_path, python_args=["-c", INJECT_BUG, MODULE]).start()
    await assert_dies_naming_the_task(
        process,
        api,
        watch_event(
            "ADDED", builders.gpu_pod("other", builders.container(), node_name=NODE, resource_version="906")
        ),
        "device-plugin:pod-informer",
    )
