"""The extender against clients that are not kube-scheduler: malformed arguments get HTTP 400 with
the reason (never a 500), slow clients are cut while ``/healthz`` keeps answering, and the limits
come from flags and the environment."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import io
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from builders import container, gpu_node, gpu_pod

import hamipy.extender.cli as cli
from hamipy.devcluster import wait_for
from hamipy.extender.server import ExtenderServer
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.kube.client import NullKube
from hamipy.protocol.config import Config
from hamipy.protocol.settings import settings_from
from hamipy.serving.http_limits import HttpLimits

LIMITS = HttpLimits(header_timeout_s=0.5, body_timeout_s=0.5, keepalive_timeout_s=5, max_connections=4)


@pytest.fixture
async def server() -> AsyncIterator[ExtenderServer]:
    srv = ExtenderServer(
        config=Config(),
        settings=ExtenderSettings(),
        telemetry=Telemetry.create(stream=io.StringIO()),
        api=NullKube(),
        limits=LIMITS,
    )
    async with srv:
        srv.model.replace_nodes([gpu_node("a"), gpu_node("b")])
        srv.model.replace_pods([])
        yield srv


async def post(srv: ExtenderServer, path: str, body: bytes) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.post(srv.url + path, data=body) as resp,
    ):
        return resp.status, await resp.json()


async def healthz(srv: ExtenderServer) -> int:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.get(srv.url + "/healthz") as resp,
    ):
        return resp.status


def args_with(path: tuple[str | int, ...], value: object) -> bytes:
    """ExtenderArgs for a GPU pod and two nodes, with the field at ``path`` set to ``value``."""
    args: dict[str, Any] = {
        "Pod": gpu_pod("p", container(gpu=1, gpumem=1000), annotations={"team": "ml"}),
        "NodeNames": ["a", "b"],
    }
    target: Any = args
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return json.dumps(args).encode()


def nodes_form(item: object) -> bytes:
    """ExtenderArgs as a scheduler that is not node-cache-capable sends them, with one node item."""
    return json.dumps({"Pod": gpu_pod("p"), "Nodes": {"items": [item]}}).encode()


def node_with(path: tuple[str, ...], value: object) -> dict[str, Any]:
    item = copy.deepcopy(gpu_node("c"))
    target: Any = item
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return item


# -- malformed arguments: HTTP 400 ------------------------------------------------------------------------

MALFORMED = [
    pytest.param(b"[" * 100_000, "Expected `object`, got `array`", id="deep-array"),
    pytest.param(b'{"Pod":' * 5_000 + b"1" + b"}" * 5_000, "nested too deeply", id="deep-object"),
    pytest.param(
        b'{"Pod": {"metadata": {}, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
        "nested too deeply",
        id="deep-unread-field",
    ),
    pytest.param(
        args_with(("Pod", "metadata", "annotations"), ["team=ml"]),
        "Expected `object | null`, got `array` - at `$.Pod.metadata.annotations`",
        id="annotations-array",
    ),
    pytest.param(
        args_with(("Pod", "metadata", "annotations"), "team=ml"),
        "Expected `object | null`, got `str` - at `$.Pod.metadata.annotations`",
        id="annotations-string",
    ),
    pytest.param(
        args_with(("Pod", "metadata", "annotations", "team"), {"x": 1}),
        "Expected `str`, got `object` - at `$.Pod.metadata.annotations[...]`",
        id="annotation-value-object",
    ),
    pytest.param(
        args_with(("Pod", "metadata", "uid"), ["u"]),
        "Expected `str | null`, got `array` - at `$.Pod.metadata.uid`",
        id="uid-array",
    ),
    pytest.param(
        args_with(("Pod", "spec", "containers"), {"name": "c"}),
        "Expected `array | null`, got `object` - at `$.Pod.spec.containers`",
        id="containers-object",
    ),
    pytest.param(
        args_with(("Pod", "spec", "containers", 0), "c"),
        "Expected `object`, got `str` - at `$.Pod.spec.containers[0]`",
        id="container-string",
    ),
    pytest.param(args_with(("Pod", "spec"), 3), "got `int` - at `$.Pod.spec`", id="spec-number"),
    pytest.param(
        nodes_form(node_with(("metadata",), ["c"])),
        "Expected `object`, got `array` - at `$.Nodes.items[0].metadata`",
        id="node-metadata-array",
    ),
    pytest.param(
        nodes_form(node_with(("metadata", "annotations"), "x")),
        "got `str` - at `$.Nodes.items[0].metadata.annotations`",
        id="node-annotations-string",
    ),
    pytest.param(nodes_form("c"), "Expected `object`, got `str` - at `$.Nodes.items[0]`", id="node-string"),
]


@pytest.mark.parametrize("verb", ["/filter", "/prioritize"])
@pytest.mark.parametrize(("body", "says"), MALFORMED)
async def test_malformed_arguments_get_400_with_the_reason(
    server: ExtenderServer, verb: str, body: bytes, says: str
) -> None:
    status, answer = await post(server, verb, body)
    assert status == 400
    assert says in answer["Error"]
    assert len(answer["Error"]) < 300  # the client's value is named, not echoed back
    verb_label = verb.strip("/")
    sample = {"verb": verb_label, "result": "bad-request", "reason": "BadRequest"}
    metrics = server.telemetry.metrics.registry
    assert metrics.get_sample_value("hamipy_extender_decisions_total", sample) == 1
    assert not server.model.contributions  # nothing was reserved from a refused argument


@pytest.mark.parametrize(
    ("args", "says"),
    [
        pytest.param(
            {"PodName": ["p"], "PodNamespace": "ns", "Node": "a"},
            "Expected `str`, got `array` - at `$.PodName`",
            id="name",
        ),
        pytest.param(
            {"PodName": "p", "PodNamespace": "ns", "Node": {"n": 1}},
            "Expected `str`, got `object` - at `$.Node`",
            id="node",
        ),
        pytest.param(
            {"PodName": "p", "PodNamespace": "ns", "Node": "a", "PodUID": 5},
            "Expected `str`, got `int` - at `$.PodUID`",
            id="uid",
        ),
        pytest.param([], "Expected `object`, got `array`", id="array"),
    ],
)
async def test_malformed_binding_arguments_get_400(server: ExtenderServer, args: object, says: str) -> None:
    status, answer = await post(server, "/bind", json.dumps(args).encode())
    assert status == 400
    assert says in answer["Error"]


async def test_well_formed_arguments_with_nulls_are_still_decided(server: ExtenderServer) -> None:
    args = json.loads(args_with(("Pod", "metadata", "annotations"), None))
    args["Pod"]["spec"]["initContainers"] = None
    args["Pod"]["metadata"]["creationTimestamp"] = None
    status, answer = await post(server, "/filter", json.dumps(args).encode())
    assert status == 200
    assert answer["NodeNames"] in (["a"], ["b"])


# -- slow clients -----------------------------------------------------------------------------------------


async def test_slow_clients_are_cut_and_healthz_keeps_answering(server: ExtenderServer) -> None:
    silent = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(6)]  # over the cap
    started = time.monotonic()
    assert await healthz(server) == 200  # gets in by evicting the longest waiter
    for reader, writer in silent:
        assert await asyncio.wait_for(reader.read(), 5) == b""  # hung up on, without an answer
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    assert time.monotonic() - started < 3  # the 0.5 s header timeout
    assert await healthz(server) == 200
    # The operator sees it: at the cap of 4, the 5th, 6th and /healthz evicted one each; the other
    # 3 were cut by the header timeout.
    closed = {
        line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in (await server.telemetry.metrics.render()).decode().splitlines()
        if line.startswith("hamipy_extender_http_connections_closed_total{") and 'server="api"' in line
    }
    assert closed == {
        "header_timeout": 3,
        "body_timeout": 0,
        "idle_timeout": 0,
        "evicted": 3,
        "refused": 0,
        "queue_timeout": 0,
        "client_gone": 0,
    }


async def test_a_trickled_body_is_cut(server: ExtenderServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
    started = time.monotonic()

    async def trickle() -> None:
        with contextlib.suppress(ConnectionError):
            for _ in range(999):
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(0.2)

    sender = asyncio.create_task(trickle())
    assert await asyncio.wait_for(reader.read(), 5) == b""
    sender.cancel()
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()
    assert 0.4 <= time.monotonic() - started < 3
    assert await healthz(server) == 200


async def test_a_client_that_leaves_mid_body_is_one_log_line_naming_it() -> None:
    log = io.StringIO()
    srv = ExtenderServer(
        config=Config(),
        settings=ExtenderSettings(),
        telemetry=Telemetry.create(stream=log),
        api=NullKube(),
        limits=LIMITS,
    )
    async with srv:
        _, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        await writer.drain()
        peer = "127.0.0.1:{}".format(writer.get_extra_info("sockname")[1])

        def gone() -> list[dict[str, Any]]:
            lines = [json.loads(line) for line in log.getvalue().splitlines()]
            return [line for line in lines if line["event"] == "client left mid-request"]

        writer.transport.abort()
        await wait_for(gone, timeout=5, interval=0.02, what="the client-left line")
        (line,) = gone()
        assert (line["server"], line["peer"], line["path"]) == ("api", peer, "/filter")
        assert "Traceback" not in log.getvalue()


# -- settings ---------------------------------------------------------------------------------------------


def test_the_limits_come_from_flags_and_the_environment() -> None:
    env = {
        "HAMIPY_EXTENDER_HEADER_TIMEOUT": "3",
        "HAMIPY_EXTENDER_MAX_CONNECTIONS": "50",
        "HAMIPY_EXTENDER_MAX_QUEUED_CONNECTIONS": "7",
    }
    args = cli.build_parser(env).parse_args(["serve", "--body-timeout", "4", "--keepalive-timeout", "30"])
    limits = settings_from(HttpLimits, args)
    assert (limits.header_timeout_s, limits.body_timeout_s) == (3, 4)
    assert (limits.keepalive_timeout_s, limits.max_connections, limits.max_queued) == (30, 50, 7)
    defaults = settings_from(HttpLimits, cli.build_parser({}).parse_args(["serve"]))
    assert (defaults.header_timeout_s, defaults.body_timeout_s, defaults.keepalive_timeout_s) == (10, 10, 75)
    assert (defaults.max_connections, defaults.max_queued) == (256, 512)


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--body-timeout", "-1"], id="negative-timeout"),
        pytest.param(["--max-connections", "0"], id="zero-connections"),
    ],
)
def test_a_limit_out_of_range_is_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", *argv], env={})
    assert exit_info.value.code == 2
    assert "must be" in capsys.readouterr().err
