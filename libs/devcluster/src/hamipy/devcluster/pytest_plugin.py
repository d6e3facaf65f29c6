"""pytest fixtures for tests against the real local control plane.

Loaded in every pytest session (entry point ``pytest11``), so importing it is cheap: nothing is
built or started until a test asks for a fixture.

- ``devcluster`` (session): a running `DevCluster` (binaries built at collection end, when an
  ``integration``-marked test is selected, so the build is not cut by the test timeout) with the
  ``default-scheduler``; ``HAMIPY_DEVCLUSTER_KEEP=1`` keeps its directory (logs) after the run.
- ``kube_client``: an admin kubernetes_asyncio ``ApiClient``, closed after the test.
- ``namespace``: a fresh namespace with its ``default`` ServiceAccount, deleted after the test.
- ``node_pool``: a `NodePool` for this test's simulated nodes, removed after the test.
- ``hami_scheduler``: a function that (re)starts the ``hami-scheduler`` kube-scheduler with an
  extender config; it is stopped after the test.
- ``prometheus_binaries`` (session): ``prometheus`` and ``promtool`` (`hamipy.devcluster.prometheus`:
  PATH or the cache, built once per machine at collection end); the test is skipped, with the
  reason, when they cannot be had.
- ``prometheus_server``: ``prometheus_server(targets, scrape_configs=..., kubernetes=...,
  rule_files=...)`` starts a ready Prometheus scraping `ScrapeTarget`s and raw scrape configs (those
  of the chart's ServiceMonitors); every one started is stopped after the test.

When a test that used ``devcluster`` fails, the tail of each control-plane log is attached to its
report, and so is each of its Prometheus servers' log.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from hamipy.devcluster.cluster import DevCluster
    from hamipy.devcluster.config import ExtenderConfig
    from hamipy.devcluster.nodes import NodePool
    from hamipy.devcluster.prometheus import PrometheusBinaries, PrometheusFactory

KEEP_ENV = "HAMIPY_DEVCLUSTER_KEEP"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "integration: needs the real local control plane (built on first use)")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the binaries (first run only) before any test runs: the control plane's if an
    integration test was selected, Prometheus if a selected test uses it.

    Here, outside every test, the build is not cut short by the per-test timeout, and its progress
    is shown (capture suspended). Where Prometheus cannot be built, its tests skip saying why.
    """
    control_plane = any(item.get_closest_marker("integration") for item in session.items)
    prometheus = any("prometheus_binaries" in getattr(item, "fixturenames", ()) for item in session.items)
    if not control_plane and not prometheus:
        return
    from hamipy.devcluster.binaries import ensure_binaries
    from hamipy.devcluster.errors import BinaryBuildError
    from hamipy.devcluster.prometheus import PrometheusUnavailable, ensure_prometheus

    capman = session.config.pluginmanager.getplugin("capturemanager")
    ctx = capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext()
    with ctx:
        if control_plane:
            try:
                ensure_binaries()
            except BinaryBuildError as exc:
                pytest.exit(f"integration tests need the control-plane binaries: {exc}", returncode=1)
        if prometheus:
            with contextlib.suppress(PrometheusUnavailable):
                ensure_prometheus()


@pytest.fixture(scope="session")
def devcluster() -> Iterator[DevCluster]:
    """A running control plane shared by the whole session."""
    from hamipy.devcluster.binaries import ensure_binaries
    from hamipy.devcluster.cluster import ClusterSettings, DevCluster

    binaries = ensure_binaries()
    keep = os.environ.get(KEEP_ENV, "") not in ("", "0")
    with DevCluster(
        ClusterSettings(percentage_of_nodes_to_score=100, keep_dir=keep), binaries=binaries
    ) as cluster:
        yield cluster
        if keep:
            print(f"\n[devcluster] kept {cluster.workdir} ({KEEP_ENV} set)")


@pytest.fixture
async def kube_client(devcluster: DevCluster) -> AsyncIterator[Any]:
    """An admin kubernetes_asyncio ApiClient on `devcluster`."""
    async with devcluster.api_client() as api:
        yield api


@pytest.fixture
async def namespace(kube_client: Any) -> AsyncIterator[str]:
    """A fresh namespace, ready for pods; it and its pods are deleted after the test."""
    from hamipy.devcluster.kubeobjects import create_namespace, delete_namespace

    name = await create_namespace(kube_client)
    yield name
    await delete_namespace(kube_client, name)


@pytest.fixture
async def node_pool(kube_client: Any) -> AsyncIterator[NodePool]:
    """This test's simulated nodes (add with ``await node_pool.add(NodeSpec(...))``); deleted after."""
    from hamipy.devcluster.nodes import NodePool

    async with NodePool(kube_client) as pool:
        yield pool


@pytest.fixture
def hami_scheduler(devcluster: DevCluster) -> Iterator[Callable[..., Any]]:
    """``hami_scheduler(extender, percentage_of_nodes_to_score=None)`` (re)starts the hami-scheduler."""
    from hamipy.devcluster.config import SchedulerConfig

    def start(extender: ExtenderConfig, *, percentage_of_nodes_to_score: int | None = 100) -> Any:
        config = SchedulerConfig.hami(extender, percentage_of_nodes_to_score=percentage_of_nodes_to_score)
        return devcluster.start_scheduler(config, name="hami")

    yield start
    devcluster.stop_scheduler("hami")


@pytest.fixture(scope="session")
def prometheus_binaries() -> PrometheusBinaries:
    """``prometheus`` and ``promtool``, fetched once per machine if need be; skips the test (saying
    which step failed) when they cannot be had."""
    from hamipy.devcluster.prometheus import PrometheusUnavailable, ensure_prometheus

    try:
        return ensure_prometheus()
    except PrometheusUnavailable as exc:
        pytest.skip(f"Prometheus cannot be installed here: {exc}")


@pytest.fixture
def prometheus_server(prometheus_binaries: PrometheusBinaries) -> Iterator[PrometheusFactory]:
    """``prometheus_server(targets, scrape_configs=..., kubernetes=..., rule_files=...)`` starts a
    ready `PrometheusServer`; all are stopped after the test. From an async test, call the server's
    API through ``asyncio.to_thread`` when a target is served by the test's own event loop."""
    from hamipy.devcluster.prometheus import PrometheusFactory

    factory = PrometheusFactory(prometheus_binaries)
    yield factory
    factory.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    funcargs = getattr(item, "funcargs", {})
    cluster = funcargs.get("devcluster")
    if report.failed and cluster is not None:
        from hamipy.devcluster.processes import tail

        for name in cluster.processes:
            report.sections.append((f"devcluster log: {name}", tail(cluster.log_path(name), 30)))
    prometheus = funcargs.get("prometheus_server")
    if report.failed and prometheus is not None:
        for i, server in enumerate(getattr(prometheus, "servers", [])):
            report.sections.append((f"prometheus log {i}", server.log_tail()))
    return report
