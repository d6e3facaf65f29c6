"""A real Prometheus finding its targets as the chart's ServiceMonitors select them, on the real test
apiserver: the chart's monitor ServiceMonitor (rendered by the pinned helm into the test's namespace,
at a 1 s interval) translated by ``hamipy.devcluster.prometheus_operator``, Kubernetes service
discovery with the dev cluster's client certificate, and the chart's PrometheusRule as a rule file.

The monitor's Service is created as the chart renders it less its pod selector, so the EndpointSlice
controller leaves it alone, and an EndpointSlice made by hand points its ``metrics`` port at a
``/metrics`` this test serves, with a Pod as the endpoint's target (a Pod object bound to a node
name; no kubelet runs it). The address is the host's own non-loopback one: the API refuses an
EndpointSlice address in 127.0.0.0/8. Prometheus must scrape it with the operator's target labels,
the chart's ``node``, and ``honorLabels`` keeping a series' own ``namespace`` and ``pod``; and every
rule of the chart's alerts must evaluate healthy.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_values import helm_template
from kubernetes_asyncio import client

from hamipy.devcluster import API_TIMEOUT_S, DevCluster
from hamipy.devcluster.prometheus import PrometheusFactory
from hamipy.devcluster.prometheus_operator import job_name, scrape_configs, write_rule_files

pytestmark = pytest.mark.integration

SERVICE = "hami-py-monitor"
CONTAINER = "monitor"
NODE = "sd-node-1"
DISCOVERY_TIMEOUT_S = 60.0
# A series of a tenant's pod, as the monitor exports them: honorLabels keeps its namespace and pod.
METRICS = (
    b"# HELP hamipy_sd_test_info A tenant container.\n"
    b"# TYPE hamipy_sd_test_info gauge\n"
    b'hamipy_sd_test_info{namespace="tenant",pod="tenant-pod"} 1\n'
)


def host_address() -> str:
    """This machine's first global-scope IPv4 address (an EndpointSlice takes no loopback one)."""
    out = subprocess.run(
        ["ip", "-j", "-4", "addr", "show", "scope", "global"],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout
    for link in json.loads(out):
        for addr in link.get("addr_info", []):
            return str(addr["local"])
    pytest.skip("this machine has no global IPv4 address for an EndpointSlice to point at")


class _Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path != "/metrics":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(METRICS)))
        self.end_headers()
        self.wfile.write(METRICS)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def metrics_server() -> Iterator[tuple[str, int]]:
    """``/metrics`` on the host's address, served from a thread (the scrapes need no event loop)."""
    server = http.server.ThreadingHTTPServer((host_address(), 0), _Metrics)
    thread = threading.Thread(target=server.serve_forever, name="sd-test-metrics", daemon=True)
    thread.start()
    yield str(server.server_address[0]), int(server.server_address[1])
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def render(namespace: str) -> list[dict[str, Any]]:
    proc = helm_template(
        "--set",
        "monitor.serviceMonitor.enabled=true",
        "--set",
        "monitor.serviceMonitor.interval=1s",
        "--set",
        "prometheusRule.enabled=true",
        namespace=namespace,
    )
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


async def create_endpoint(api: Any, namespace: str, service: dict[str, Any], address: str, port: int) -> None:
    """The Service (selectorless), a Pod bound to ``NODE`` with the port, and the EndpointSlice."""
    # Any: the API classes take the plain dicts the API server reads.
    core: Any = client.CoreV1Api(api)
    discovery: Any = client.DiscoveryV1Api(api)
    body = {**service, "spec": {k: v for k, v in service["spec"].items() if k != "selector"}}
    await core.create_namespaced_service(namespace, body, _request_timeout=API_TIMEOUT_S)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "monitor-0"},
        "spec": {
            "nodeName": NODE,
            "containers": [
                {"name": CONTAINER, "image": "monitor", "ports": [{"name": "metrics", "containerPort": port}]}
            ],
        },
    }
    await core.create_namespaced_pod(namespace, pod, _request_timeout=API_TIMEOUT_S)
    slice_ = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{SERVICE}-test",
            "labels": {
                "kubernetes.io/service-name": SERVICE,
                "endpointslice.kubernetes.io/managed-by": "hamipy-tests",
            },
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [address],
                "conditions": {"ready": True},
                "nodeName": NODE,
                "targetRef": {"kind": "Pod", "name": "monitor-0", "namespace": namespace},
            }
        ],
        "ports": [{"name": "metrics", "port": port, "protocol": "TCP"}],
    }
    await discovery.create_namespaced_endpoint_slice(namespace, slice_, _request_timeout=API_TIMEOUT_S)


async def test_the_monitor_service_monitor_discovers_and_scrapes_its_endpoint(
    devcluster: DevCluster,
    kube_client: Any,
    namespace: str,
    metrics_server: tuple[str, int],
    prometheus_server: PrometheusFactory,
    tmp_path: Path,
) -> None:
    address, port = metrics_server
    docs = render(namespace)
    (service,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == SERVICE]
    await create_endpoint(kube_client, namespace, service, address, port)
    prom = prometheus_server(
        scrape_configs=scrape_configs(docs),
        kubernetes=devcluster.access,
        rule_files=write_rule_files(docs, tmp_path),
    )
    job = job_name(namespace, SERVICE, 0)

    def scraped() -> list[dict[str, Any]]:
        return [t for t in prom.targets() if t["scrapePool"] == job and t["health"] == "up"]

    (target,) = await asyncio.to_thread(
        prom.wait, scraped, timeout_s=DISCOVERY_TIMEOUT_S, what=f"a healthy target of {job}"
    )
    assert target["labels"] == {
        "instance": f"{address}:{port}",
        "job": SERVICE,
        "namespace": namespace,
        "service": SERVICE,
        "pod": "monitor-0",
        "container": CONTAINER,
        "endpoint": "metrics",
        "node": NODE,
    }
    assert target["scrapeUrl"] == f"http://{address}:{port}/metrics"
    assert target["scrapeInterval"] == "1s"
    (series,) = (await asyncio.to_thread(prom.query, "hamipy_sd_test_info")).series
    assert series["metric"]["namespace"] == "tenant"
    assert series["metric"]["pod"] == "tenant-pod"
    assert series["metric"]["node"] == NODE
    await asyncio.to_thread(prom.wait_rules_healthy, timeout_s=DISCOVERY_TIMEOUT_S)
    assert {g["name"] for g in await asyncio.to_thread(prom.rules)} == {"hami-py"}
