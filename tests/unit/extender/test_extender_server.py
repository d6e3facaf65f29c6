"""The HTTP surface: routes, bad requests, readiness, metrics, the non-cache-capable form; the CLI's
flags and environment."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from builders import container, gpu, gpu_node, gpu_pod
from fake_kube import FakeKube
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import hamipy.extender.cli as cli
from hamipy.devcluster import wait_for
from hamipy.extender.server import ExtenderServer
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.kube.client import MAX_CONNECTIONS, NullKube
from hamipy.kube.errors import KubeError
from hamipy.kube.options import ProcessSettings
from hamipy.protocol import keys
from hamipy.protocol.config import Config
from hamipy.protocol.settings import settings_from

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
async def server() -> AsyncIterator[tuple[ExtenderServer, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.create(stream=io.StringIO(), processor=SimpleSpanProcessor(exporter))
    srv = ExtenderServer(
        config=Config(),
        settings=ExtenderSettings(cooperative=False, success_events=True),
        telemetry=telemetry,
        api=NullKube(),
    )
    await srv.start()
    yield srv, exporter
    await srv.stop()


async def post(srv: ExtenderServer, path: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
        session.post(srv.url + path, data=data) as resp,
    ):
        return resp.status, await resp.json()


async def get(srv: ExtenderServer, path: str) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
        session.get(srv.url + path) as resp,
    ):
        return resp.status, await resp.text()


async def test_readiness_follows_the_model_sync(server: Any) -> None:
    srv, _ = server
    assert (await get(srv, "/healthz"))[0] == 200
    assert await get(srv, "/readyz") == (503, "model not synced yet (listing nodes and pods)")
    srv.model.replace_nodes([])
    srv.model.replace_pods([])
    assert (await get(srv, "/readyz"))[0] == 200


async def test_readiness_waits_for_both_informers_to_list() -> None:
    kube = FakeKube()
    kube.fail(KubeError("GET /api/v1/nodes: HTTP 503: etcd", status=503), "GET", "/api/v1/nodes")
    srv = ExtenderServer(
        config=Config(),
        settings=ExtenderSettings(handshake_interval_s=0),
        telemetry=Telemetry.create(stream=io.StringIO()),
        api=kube,
    )
    async with srv:
        await wait_for(lambda: srv.informers["pods"].listed.is_set() or None, timeout=5, interval=0.01)
        assert await get(srv, "/readyz") == (503, "model not synced yet (listing nodes)")
        kube.heal()  # the API server recovers: the list is retried
        await srv.wait_synced(5)
        assert await get(srv, "/readyz") == (200, "ok")
        assert srv.supervisor.failure is None


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"{not json", id="not-json"),
        pytest.param([], id="not-object"),
        pytest.param({"Pod": None}, id="no-pod"),
        pytest.param({"Pod": {"metadata": {}}, "NodeNames": "n"}, id="bad-nodenames"),
    ],
)
async def test_bad_filter_requests_get_400_with_reason(server: Any, body: Any) -> None:
    srv, _ = server
    status, answer = await post(srv, "/filter", body)
    assert status == 400
    assert answer["Error"]


async def test_filter_chooses_reserves_and_traces(server: Any) -> None:
    srv, exporter = server
    srv.model.replace_nodes([gpu_node("a"), gpu_node("b")])
    p = gpu_pod("p", container(gpu=1, gpumem=1000), annotations={keys.TRACE_CONTEXT: TRACEPARENT})
    srv.model.apply_pod("ADDED", p)  # the watch delivered it: the filter reserves for it
    status, answer = await post(srv, "/filter", {"Pod": p, "NodeNames": ["a", "b"]})
    assert status == 200
    assert answer["NodeNames"] in (["a"], ["b"])
    assert srv.model.contributions["uid-ns-p"].source == "reserved"
    span = next(s for s in exporter.get_finished_spans() if s.name == "extender.filter")
    assert format(span.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert srv.events.recorded[-1].reason == "FilteringSucceed"


async def test_a_watched_pods_filter_decides_from_the_watch_whatever_the_pod_sent_asks(server: Any) -> None:
    srv, _ = server
    srv.model.replace_nodes([gpu_node("a", [gpu("A", 0, mem=1500)])])
    srv.model.replace_pods([])
    sent = gpu_pod("p", container(gpu=1, gpumem=1000))  # fits "a": the watch's copy is what counts
    srv.model.apply_pod("ADDED", gpu_pod("p", container(gpu=1, gpumem=2000)))  # asks more than "a" has
    status, answer = await post(srv, "/filter", {"Pod": sent, "NodeNames": ["a"]})
    assert status == 200
    assert answer["NodeNames"] == []
    assert answer["FailedAndUnresolvableNodes"] == {"a": "1/1 CardInsufficientMemory"}
    assert srv.events.recorded[-1].involved["name"] == "p"


async def test_filter_failure_explains_and_emits_event(server: Any) -> None:
    srv, _ = server
    srv.model.replace_nodes([gpu_node("a", [gpu("A", 0, mem=100)])])
    _, answer = await post(srv, "/filter", {"Pod": gpu_pod("p"), "NodeNames": ["a"]})
    assert answer["NodeNames"] == []
    assert answer["FailedAndUnresolvableNodes"] == {"a": "1/1 CardInsufficientMemory"}
    assert srv.events.recorded[-1].reason == "FilteringFailed"
    assert "CardInsufficientMemory" in srv.events.recorded[-1].message


async def test_not_cache_capable_form_returns_node_objects(server: Any) -> None:
    srv, _ = server
    items = [gpu_node("a"), gpu_node("b", [gpu("X", 0, mem=10)])]
    _, answer = await post(srv, "/filter", {"Pod": gpu_pod("p"), "Nodes": {"items": items}})
    assert [n["metadata"]["name"] for n in answer["Nodes"]["items"]] == ["a"]
    assert answer["NodeNames"] is None


async def test_pod_without_gpu_passes_every_node(server: Any) -> None:
    srv, _ = server
    _, answer = await post(srv, "/filter", {"Pod": gpu_pod("p", container()), "NodeNames": ["x", "y"]})
    assert answer["NodeNames"] == ["x", "y"]


async def test_prioritize_scores_by_policy(server: Any) -> None:
    srv, _ = server
    srv.model.replace_nodes([gpu_node("a"), gpu_node("b")])
    srv.model.apply_pod(
        "ADDED",
        gpu_pod(
            "q",
            node_name="a",
            phase="Running",
            annotations={keys.DEVICES_ALLOCATED: "GPU-a-0,NVIDIA,30000,100:;"},
        ),
    )
    _, answer = await post(srv, "/prioritize", {"Pod": gpu_pod("p"), "NodeNames": ["a", "b"]})
    scores = {h["Host"]: h["Score"] for h in answer}
    assert scores["a"] > scores["b"]  # binpack by default


async def test_metrics_expose_hami_gauges(server: Any) -> None:
    srv, _ = server
    srv.model.replace_nodes([gpu_node("a", [gpu("A", 0, mem=1000)])])
    srv.model.apply_pod(
        "ADDED",
        gpu_pod(
            "q", node_name="a", phase="Running", annotations={keys.DEVICES_ALLOCATED: "A,NVIDIA,250,30:;"}
        ),
    )
    _, text = await get(srv, "/metrics")
    assert (
        'hami_gpu_memory_allocated_bytes{device_index="0",device_type="NVIDIA-Tesla V100-PCIE-32GB"' in text
    )
    assert 'hami_node_gpu_memory_allocated_ratio{device_index="0"' in text
    assert "} 0.25" in text
    labels = 'container_index="0",device_uuid="A",namespace="ns",node="a",pod="q"'
    assert f"hami_vgpu_core_allocated_ratio{{{labels}}} 30.0" in text
    for name in ("hami_gpu_shared_count", "hami_gpu_core_limit_ratio", "hami_node_gpu_overview"):
        assert name in text


async def test_bind_without_api_reports_error(server: Any) -> None:
    srv, _ = server
    status, answer = await post(
        srv, "/bind", {"PodName": "p", "PodNamespace": "ns", "PodUID": "u", "Node": "a"}
    )
    assert status == 200
    assert answer["Error"]
    status, _ = await post(srv, "/bind", {"PodName": "p"})
    assert status == 400


def test_cli_help_lists_modes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--help"], env={})
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--cooperative" in out
    assert "--release-lock-after-bind" in out


def test_cli_settings_from_env() -> None:
    args = cli.build_parser(
        {"HAMIPY_EXTENDER_COOPERATIVE": "true", "HAMIPY_EXTENDER_BIND_TIMEOUT": "7"}
    ).parse_args(["serve", "--no-release-lock-after-bind"])
    settings = settings_from(ExtenderSettings, args)
    assert settings.cooperative
    assert not settings.release_lock_after_bind
    assert settings.bind_timeout_s == 7


def test_the_api_connections_come_from_the_flag_and_the_environment() -> None:
    args = cli.build_parser({"HAMIPY_EXTENDER_API_CONNECTIONS": "32"}).parse_args(["serve"])
    assert settings_from(ProcessSettings, args).api_connections == 32
    args = cli.build_parser({}).parse_args(["serve", "--api-connections", "100"])
    assert settings_from(ProcessSettings, args).api_connections == 100
    default = settings_from(ProcessSettings, cli.build_parser({}).parse_args(["serve"]))
    assert default.api_connections == MAX_CONNECTIONS == 64


def test_the_watch_wait_comes_from_the_flag_and_the_environment() -> None:
    args = cli.build_parser({"HAMIPY_EXTENDER_WATCH_WAIT": "0"}).parse_args(["serve"])
    assert settings_from(ExtenderSettings, args).watch_wait_s == 0
    args = cli.build_parser({}).parse_args(["serve", "--watch-wait", "2.5"])
    assert settings_from(ExtenderSettings, args).watch_wait_s == 2.5
    default = settings_from(ExtenderSettings, cli.build_parser({}).parse_args(["serve"]))
    assert default.watch_wait_s == ExtenderSettings().watch_wait_s


def test_serve_opens_its_api_client_with_that_many_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bind in flight holds an API connection for its Binding: the pool is the flag's."""
    asked: list[int] = []

    class Stop(Exception):
        pass

    async def connect(kubeconfig: str | None = None, *, max_connections: int) -> Any:
        asked.append(max_connections)
        raise Stop

    monkeypatch.setattr(cli, "connect", connect)
    with pytest.raises(Stop):
        cli.main(["serve", "--api-connections", "40"], env={})
    assert asked == [40]


def test_api_connections_below_one_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--api-connections", "0"], env={})
    assert exit_info.value.code == 2
    assert "--api-connections must be at least 1 (got 0)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        pytest.param("HAMIPY_EXTENDER_COOPERATIVE", "maybe", id="boolean"),
        pytest.param("HAMIPY_EXTENDER_RELEASE_LOCK_AFTER_BIND", "enabled", id="another-boolean"),
        pytest.param("HAMIPY_EXTENDER_BIND_TIMEOUT", "20s", id="number"),
        pytest.param("HAMIPY_EXTENDER_PORT", "http", id="integer"),
        pytest.param("HAMIPY_EXTENDER_LOG_LEVEL", "verbose", id="log-level"),
    ],
)
def test_cli_refuses_an_environment_value_it_cannot_read_naming_the_variable(
    variable: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["serve"], env={variable: value}) == 2
    err = capsys.readouterr().err
    assert f"{variable}={value!r}" in err


def test_cli_bad_config_exits_2(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("nodeSchedulerPolicy: sideways\n")
    assert cli.main(["serve", "--config", str(path)], env={}) == 2
