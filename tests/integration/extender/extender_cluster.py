"""What the extender's integration tests share: pods for the ``hami-scheduler``, the `Cluster` a
test works in (its namespace, simulated nodes, the invariant), `round_robin_proxy`, several
replicas behind one URL as a Service balances them per request, and `replica_metric`."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import builders
from aiohttp import web
from builders import container
from extender_processes import ExtenderProcess
from kubernetes_asyncio.client import CoreV1Api
from stack_support import samples

from hamipy.devcluster import API_TIMEOUT_S, NodePool, NodeSpec, wait_for, wait_pod_bound
from hamipy.extender.invariant import check_cluster
from hamipy.kube.client import RawKube
from hamipy.protocol import keys
from hamipy.protocol.devices import DeviceInfo
from hamipy.protocol.pod_devices import decode_pod_devices


def pod_body(
    name: str,
    *containers: dict[str, Any],
    selector: str,
    init: Sequence[dict[str, Any]] = (),
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``builders.pod`` for the hami-scheduler, on the nodes labelled ``extender-test=<selector>``,
    deleted at once; with one container asking for a GPU and 1000 MiB unless ``containers`` are given."""
    return builders.pod(
        name,
        *(containers or [container(gpu=1, gpumem=1000)]),
        init=init,
        annotations=annotations,
        scheduler_name="hami-scheduler",
        nodeSelector={"extender-test": selector},
        terminationGracePeriodSeconds=0,
    )


class Cluster:
    """What a test works with: the API, its namespace, node pool and the extender URL."""

    def __init__(self, api: Any, namespace: str, pool: NodePool) -> None:
        self.api = api
        self.core = CoreV1Api(api)
        self.namespace = namespace
        self.pool = pool

    async def add_node(self, suffix: str, devices: Sequence[DeviceInfo], *, ours: bool = True) -> str:
        """A node registered as our device plugin registers it (``ours``), else as HAMi's does."""
        name = f"{self.namespace}-{suffix}"
        await self.pool.add(
            NodeSpec(
                name=name,
                labels={"extender-test": self.namespace},
                annotations=builders.plugin_registration(devices, ours=ours),
                capacity={keys.RESOURCE_COUNT: str(sum(d.count for d in devices))},
            )
        )
        return name

    async def create(self, body: dict[str, Any]) -> None:
        core: Any = self.core  # its hint asks for a V1Pod; the client sends a JSON body as it is
        await core.create_namespaced_pod(self.namespace, body, _request_timeout=API_TIMEOUT_S)

    async def bound(self, name: str, timeout: float = 30) -> tuple[str, list[list[str]]]:  # noqa: ASYNC109
        node = await wait_pod_bound(self.api, self.namespace, name, timeout=timeout)
        pod = await self.core.read_namespaced_pod(name, self.namespace, _request_timeout=API_TIMEOUT_S)
        value = (pod.metadata.annotations or {})[keys.DEVICES_ALLOCATED]
        slots = decode_pod_devices(value)
        return node, [[d.uuid for d in slot] for slot in slots]

    async def unschedulable(self, name: str, cause: str) -> str:
        """Wait for the pod's ``PodScheduled=False`` message to name ``cause``; the message."""

        async def reason() -> str:
            pod = await self.core.read_namespaced_pod(name, self.namespace, _request_timeout=API_TIMEOUT_S)
            for cond in (pod.status.conditions or []) if pod.status else []:
                if cond.type == "PodScheduled" and cond.status == "False" and cause in (cond.message or ""):
                    return str(cond.message)
            return ""

        return await wait_for(reason, timeout=30, what=f"FailedScheduling naming {cause}")

    async def assert_invariant(self) -> None:
        report = await check_cluster(RawKube(self.api))
        assert report.ok, report.violations


async def round_robin_proxy(targets: Sequence[str]) -> tuple[web.AppRunner, str]:
    """Replicas behind one URL: each request goes to the next replica. A replica that refuses the
    connection (killed) is skipped for the next, as a Service drops an endpoint whose pod is gone;
    a request it dropped mid-answer fails, as it would through kube-proxy."""
    turn = itertools.cycle(targets)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))

    async def forward(request: web.Request) -> web.Response:
        body = await request.read()
        for _ in targets:
            try:
                async with session.post(next(turn) + request.path, data=body) as resp:
                    return web.Response(
                        status=resp.status, body=await resp.read(), content_type="application/json"
                    )
            except aiohttp.ClientConnectorError:
                continue
            except aiohttp.ClientError as exc:  # the replica died mid-answer
                return web.Response(status=502, text=f"replica failed: {exc}")
        return web.Response(status=503, text="no replica answers")

    async def close(app: web.Application) -> AsyncIterator[None]:
        yield
        await session.close()

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/{verb}", forward)
    app.cleanup_ctx.append(close)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[-1][1]}"


async def replica_metric(extender: ExtenderProcess, name: str, **labels: str) -> float:
    """A replica's metric ``name`` from its ``/metrics``, summed over the series with ``labels``."""
    async with aiohttp.ClientSession() as session:
        text = await extender.metrics(session)
    want = set(labels.items())
    return sum(value for (sample, have), value in samples(text).items() if sample == name and want <= have)
