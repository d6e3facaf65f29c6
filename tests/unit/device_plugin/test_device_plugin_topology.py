"""The plugin reads the GPUs' topology over pynvml (native/'s fake NVML and its presets) and
always publishes the pair scores in ``hami.io/node-nvidia-score``; an asymmetric pair scores 0 and
is a Warning Event on the node; a topology it cannot read publishes no scores."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fake_kube import FakeKube
from plugin_fakes import GPU_A, NODE, FakeHealth, log_lines, node_kube

from hamipy.devcluster import wait_for
from hamipy.device_plugin.errors import NvmlError
from hamipy.device_plugin.plugin import DevicePlugin, ScoreReader
from hamipy.device_plugin.settings import PluginSettings
from hamipy.device_plugin.telemetry import Telemetry
from hamipy.protocol import keys
from hamipy.protocol.config import load_config
from hamipy.protocol.node_scores import ASYMMETRIC_MESSAGE, NodeScores, decode_node_scores

FAKE_DRIVER = Path(__file__).resolve().parents[3] / "native" / "build" / "fake"
EVENTS = "/api/v1/namespaces/default/events"
# Prints read_node_scores of every GPU the fake configuration has, as JSON.
READ = """
import json, pynvml
from hamipy.device_plugin.discovery import discover_gpus, read_node_scores
scores, asymmetric = read_node_scores([gpu.uuid for gpu in discover_gpus()])
print(json.dumps([list(scores.values()), asymmetric]))
"""


def _read(tmp_path: Path, config: str) -> tuple[list[dict[str, int]], list[list[str]]]:
    if not (FAKE_DRIVER / "libnvidia-ml.so.1").is_file():
        pytest.skip("needs native/build/fake (make native)")
    (tmp_path / "gpus.conf").write_text(config)
    env = {"LD_LIBRARY_PATH": str(FAKE_DRIVER), "HAMIPY_FAKE_GPU_CONFIG": str(tmp_path / "gpus.conf")}
    proc = subprocess.run(
        [sys.executable, "-c", READ], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    rows, asymmetric = json.loads(proc.stdout)
    return [dict(sorted(row.items())) for row in rows], asymmetric


def _uuid(i: int) -> str:
    return f"GPU-fa4e0000-0000-4000-8000-{i:012x}"  # the fake's default UUIDs


def _expected(score: Callable[[int, int], int]) -> list[dict[str, int]]:
    return [{_uuid(j): score(i, j) for j in range(8) if j != i} for i in range(8)]


def _pcie(i: int, j: int) -> int:
    """NODE (20) within a NUMA node (GPUs 0-3, 4-7), SYS (10) across."""
    return 20 if i // 4 == j // 4 else 10


@pytest.mark.native
@pytest.mark.parametrize(
    ("preset", "score"),
    [
        ("hgx8", lambda i, j: 18 * 100 + _pcie(i, j)),  # 18 links into the NVSwitches, both sides
        ("pcie-pairs8", lambda i, j: 12 * 100 + 50 if j == i ^ 1 else _pcie(i, j)),  # bridged, PIX
        ("none", _pcie),
    ],
)
def test_presets_score_as_upstream(tmp_path: Path, preset: str, score: Callable[[int, int], int]) -> None:
    assert _read(tmp_path, f"topology = {preset}\n") == (_expected(score), [])


@pytest.mark.native
def test_links_one_way_only_score_0_and_are_reported(tmp_path: Path) -> None:
    config = "gpu pci=00000000:01:00.0 nvlinks=00000000:02:00.0*2\ngpu pci=00000000:02:00.0\n"
    assert _read(tmp_path, config) == ([{_uuid(1): 0}, {_uuid(0): 0}], [[_uuid(0), _uuid(1)]])


# -- publishing --------------------------------------------------------------------------------------


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="hdp-", dir="/tmp"))  # a unix socket's path stays short
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _plugin(
    plugin_dir: Path, tmp_path: Path, read_scores: ScoreReader
) -> tuple[DevicePlugin, FakeKube, io.StringIO]:
    log = io.StringIO()
    api = node_kube()
    plugin = DevicePlugin(
        config=load_config(f"nvidia:\n  hookPath: {tmp_path}/vgpu\n"),
        settings=PluginSettings(
            node_name=NODE, plugin_dir=plugin_dir, metrics_host="127.0.0.1", metrics_port=0
        ),
        telemetry=Telemetry.create(stream=log),
        api=api,
        discover=lambda: [GPU_A],
        health_watch=FakeHealth,
        read_scores=read_scores,
    )
    return plugin, api, log


async def test_scores_are_published_with_the_register(plugin_dir: Path, tmp_path: Path) -> None:
    seen: list[list[str]] = []

    def read(uuids: list[str]) -> tuple[NodeScores, list[tuple[str, str]]]:
        seen.append(uuids)
        return {GPU_A.uuid: {}}, []

    plugin, api, _ = _plugin(plugin_dir, tmp_path, read)
    async with plugin.running():
        await wait_for(plugin.node_written.is_set, timeout=10)
    annotations = api.node(NODE)["metadata"]["annotations"]
    assert annotations[keys.NODE_SCORE] == f'[{{"uuid":"{GPU_A.uuid}","score":{{}}}}]'
    assert decode_node_scores(annotations[keys.NODE_SCORE], node=NODE) == {GPU_A.uuid: {}}
    assert seen == [[GPU_A.uuid]]
    assert api.items(EVENTS) == []


async def test_an_asymmetric_pair_is_a_warning_event_on_the_node(plugin_dir: Path, tmp_path: Path) -> None:
    def read(uuids: list[str]) -> tuple[NodeScores, list[tuple[str, str]]]:
        return {"GPU-a": {"GPU-b": 0}, "GPU-b": {"GPU-a": 0}}, [("GPU-a", "GPU-b")]

    plugin, api, log = _plugin(plugin_dir, tmp_path, read)
    async with plugin.running():
        await wait_for(lambda: api.items(EVENTS) != [], timeout=10)
        await wait_for(plugin.node_written.is_set, timeout=10)
    (event,) = api.items(EVENTS)
    assert (event["type"], event["reason"], event["message"]) == (
        "Warning",
        "AsymmetricGPUP2PLink",
        ASYMMETRIC_MESSAGE,
    )
    assert (event["involvedObject"]["kind"], event["involvedObject"]["name"]) == ("Node", NODE)
    assert '"GPU-b":0' in api.node(NODE)["metadata"]["annotations"][keys.NODE_SCORE]
    (line,) = [e for e in log_lines(log) if e["event"] == "asymmetric GPU P2P links scored 0"]
    assert line["pairs"] == [["GPU-a", "GPU-b"]]


async def test_an_unreadable_topology_publishes_no_scores(plugin_dir: Path, tmp_path: Path) -> None:
    def read(uuids: list[str]) -> tuple[NodeScores, list[tuple[str, str]]]:
        raise NvmlError("NVML topology query failed: Unknown Error")

    plugin, api, log = _plugin(plugin_dir, tmp_path, read)
    api.write(f"/api/v1/nodes/{NODE}", {"metadata": {"annotations": {keys.NODE_SCORE: "[]"}}})
    async with plugin.running():
        await wait_for(plugin.node_written.is_set, timeout=10)
    annotations = api.node(NODE)["metadata"]["annotations"]
    assert keys.NODE_REGISTER in annotations
    assert keys.NODE_SCORE not in annotations, "stale scores would describe other GPUs"
    (line,) = [e for e in log_lines(log) if e["event"].startswith("GPU pair scores not published")]
    assert (line["level"], line["error"]) == ("error", "NVML topology query failed: Unknown Error")
