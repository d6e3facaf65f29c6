"""An admin's day with the chart, on a dev cluster that deploys as a cluster does: GPU nodes on
containerd with a pod network (kube-proxy, CoreDNS), the images `make images` builds, and helm.

``helm install --wait``; a GPU pod from a tenant (a ServiceAccount with pod rights only) admitted,
placed, allocated and running in a real container held to its slice; ``helm upgrade`` to three
extender replicas and back to one while the tenant's pods keep arriving, none lost, refused for good
or double-booked; one pod's trace from admission to Allocate, exported by the service pods; a real
Prometheus scraping every service pod as the chart's ServiceMonitors select them, the chart's alert
rules loaded and healthy; ``helm uninstall`` leaving nothing that would judge or block a pod, and no
object of the release. What stays by design: the release's namespace (helm never deletes one it
created) and the operator's CRDs the test installed for the ServiceMonitors.

The first run on a machine builds the images (about 3 minutes on 2 cores)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from stack_support import allocated_slots

from hamipy.devcluster import wait_for
from hamipy.devcluster.chart_stack import CHART_NAMESPACE, RELEASE, ChartStack
from hamipy.devcluster.cluster import ClusterSettings, DevCluster
from hamipy.devcluster.errors import WaitTimeout
from hamipy.devcluster.identities import TENANT_POD_RULES, grant_role, issue_identity
from hamipy.devcluster.images import GPU_WORKLOAD_IMAGE
from hamipy.devcluster.kubeobjects import ensure_crds, ensure_namespace, wait_for_default_service_account
from hamipy.devcluster.otlp import OtlpReceiver
from hamipy.devcluster.prometheus import PrometheusFactory
from hamipy.devcluster.prometheus_operator import operator_crds, scrape_configs, write_rule_files
from hamipy.devcluster.real_kubelet import can_run_real_kubelets
from hamipy.devcluster.stack import GPU_NODE_MODELS
from hamipy.devcluster.workload_log import parse_workload_log
from hamipy.kube.client import RawKube
from hamipy.kube.errors import NotFound
from hamipy.protocol import keys

ROOT = Path(__file__).resolve().parents[3]
NATIVE_BUILD = ROOT / "native" / "build"
DAY_TIMEOUT_S = 1800
"""A first run builds the images; a warm one takes a few minutes."""
GPU_MODEL = GPU_NODE_MODELS[1]  # two H100s a node
NODES = 2
SPLIT = 10  # the chart's config.nvidia.deviceSplitCount
TENANT = "team-a"
SLICE_MIB = 4096
ARRIVALS = 24
"""Pods the tenant creates during the two rollouts: well within the nodes' slots (4 GPUs x 10)."""
ARRIVAL_GAP_S = 1.5
"""Pacing of the arrivals (load, not synchronisation: the test waits on conditions)."""
RUNNING_TIMEOUT_S = 240.0
OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
MiB = 1 << 20
MONITORING_VALUES = [
    arg
    for key in ("webhook", "extender", "devicePlugin", "monitor")
    for arg in (
        "--set",
        f"{key}.serviceMonitor.enabled=true",
        "--set",
        f"{key}.serviceMonitor.interval=2s",
    )
] + ["--set", "prometheusRule.enabled=true"]
RELEASE_KINDS = (
    ("/apis/apps/v1", "deployments"),
    ("/apis/apps/v1", "daemonsets"),
    ("/api/v1", "services"),
    ("/api/v1", "configmaps"),
    ("/api/v1", "serviceaccounts"),
    ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    ("/apis/rbac.authorization.k8s.io/v1", "clusterroles"),
    ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings"),
    ("/apis/policy/v1", "poddisruptionbudgets"),
    ("/apis/networking.k8s.io/v1", "networkpolicies"),
    ("/apis/admissionregistration.k8s.io/v1", "mutatingwebhookconfigurations"),
    ("/apis/admissionregistration.k8s.io/v1", "validatingadmissionpolicies"),
    ("/apis/admissionregistration.k8s.io/v1", "validatingadmissionpolicybindings"),
    ("/apis/monitoring.coreos.com/v1", "servicemonitors"),
    ("/apis/monitoring.coreos.com/v1", "prometheusrules"),
)
"""Every kind the chart renders (cluster-wide lists: the release's objects carry its instance label)."""

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(DAY_TIMEOUT_S),
    pytest.mark.skipif(
        os.geteuid() != 0 or can_run_real_kubelets() is not None,
        reason="skipped: real kubelets, containerd and the image builds need root",
    ),
]


@contextlib.asynccontextmanager
async def chart_cluster() -> AsyncIterator[tuple[DevCluster, Any, ChartStack, OtlpReceiver]]:
    """A cluster with a pod network, its ChartStack (nothing started yet) and a trace collector
    on the network's host address, where the service pods export."""
    cluster = DevCluster(ClusterSettings(pod_network=True))
    await asyncio.to_thread(cluster.start)
    try:
        assert cluster.network is not None
        receiver = OtlpReceiver(host=cluster.network.names.host_ip)
        await receiver.start()
        async with cluster.api_client() as api:
            stack = ChartStack(cluster, api, root=ROOT, native_build=NATIVE_BUILD, otlp_endpoint=receiver.url)
            try:
                yield cluster, api, stack, receiver
            finally:
                await stack.stop()
                await receiver.stop()
    finally:
        await asyncio.to_thread(cluster.stop)


def gpu_pod(name: str, *, gpumem: int, gpucores: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "main",
                    "image": GPU_WORKLOAD_IMAGE,
                    "imagePullPolicy": "Never",
                    "args": ["--chunk-mib", "512"],
                    "resources": {
                        "limits": {
                            "nvidia.com/gpu": "1",
                            "nvidia.com/gpumem": str(gpumem),
                            "nvidia.com/gpucores": str(gpucores),
                        }
                    },
                }
            ],
        },
    }


def kubectl(cluster: DevCluster, *args: str) -> str:
    done = subprocess.run(
        [str(cluster.binaries.kubectl), "--kubeconfig", str(cluster.access.kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
    return done.stdout


async def running(kube: RawKube, names: list[str]) -> dict[str, dict[str, Any]]:
    """The tenant's pods ``names`` once every one runs; a pod that failed or whose container the
    runtime refused fails the wait at once."""

    async def all_running() -> dict[str, dict[str, Any]] | None:
        pods = {}
        for name in names:
            pod = await kube.request("GET", f"/api/v1/namespaces/{TENANT}/pods/{name}")
            status = pod["status"]
            assert status.get("phase") not in ("Failed", "Succeeded"), f"{name} ended: {status}"
            pods[name] = pod
        return pods if all(p["status"].get("phase") == "Running" for p in pods.values()) else None

    found: dict[str, dict[str, Any]] | None = await wait_for(
        all_running, timeout=RUNNING_TIMEOUT_S, interval=1.0, what=f"{len(names)} pods Running"
    )
    assert found is not None
    return found


def never_double_booked(pods: dict[str, dict[str, Any]], gpu_mib: int) -> None:
    """No GPU holds more memory, cores or slots than it has."""
    mem: dict[str, int] = defaultdict(int)
    cores: dict[str, int] = defaultdict(int)
    slots: dict[str, int] = defaultdict(int)
    for pod in pods.values():
        for container in allocated_slots(pod):
            for device in container:
                mem[device.uuid] += device.usedmem
                cores[device.uuid] += device.usedcores
                slots[device.uuid] += 1
    for uuid in slots:
        assert mem[uuid] <= gpu_mib, f"{uuid}: {mem[uuid]} MiB booked of {gpu_mib}"
        assert cores[uuid] <= 100, f"{uuid}: {cores[uuid]}% of its cores booked"
        assert slots[uuid] <= SPLIT, f"{uuid}: {slots[uuid]} slots booked of {SPLIT}"


async def release_objects(kube: RawKube) -> list[str]:
    """Every object of the release left in the cluster (its instance label), as kind/namespace/name."""
    left = []
    for group, plural in RELEASE_KINDS:
        try:
            found = await kube.request(
                "GET", f"{group}/{plural}", query=[("labelSelector", f"app.kubernetes.io/instance={RELEASE}")]
            )
        except NotFound:
            continue  # a kind the cluster does not serve
        left += [
            f"{plural}/{o['metadata'].get('namespace', '')}/{o['metadata']['name']}" for o in found["items"]
        ]
    return left


BY_DESIGN = {"configmaps/kube-root-ca.crt", "serviceaccounts/default"}
"""What every namespace holds; the leader-election Leases of kube-scheduler and the extender stay
too (objects the pods made, gone with the namespace)."""


async def left_in_namespace(kube: RawKube) -> set[str]:
    """What the release's namespace holds besides ``BY_DESIGN``: once uninstalled, no pod still
    running and no Secret (the webhook's certificate goes with the configuration that trusted it)."""
    left = set()
    for plural in ("pods", "secrets", "configmaps", "serviceaccounts", "services", "jobs"):
        group = "/apis/batch/v1" if plural == "jobs" else "/api/v1"
        found = await kube.request("GET", f"{group}/namespaces/{CHART_NAMESPACE}/{plural}")
        left |= {f"{plural}/{o['metadata']['name']}" for o in found["items"]}
    return left - BY_DESIGN


async def test_an_admins_day(prometheus_server: PrometheusFactory, tmp_path: Path) -> None:
    async with chart_cluster() as (cluster, api, stack, receiver):
        kube = RawKube(api)
        await ensure_crds(api, operator_crds())

        # Install: one extender first, every service's ServiceMonitor and the alert rules on.
        began = time.monotonic()
        await stack.start(
            [GPU_MODEL] * NODES,
            values=["--set", "extender.replicas=1", *MONITORING_VALUES],
        )
        print(f"[admin] nodes up and the chart installed (--wait) in {time.monotonic() - began:.1f} s")

        # A tenant: pod rights in its own namespace, nothing else.
        await ensure_namespace(api, TENANT)
        await wait_for_default_service_account(api, TENANT)
        access = cluster.access
        tenant_id = await issue_identity(
            api, namespace=TENANT, name="tenant", server=access.server, ca_file=access.ca_file
        )
        await grant_role(api, namespace=TENANT, account="tenant", rules=TENANT_POD_RULES)
        async with tenant_id.api_client() as tenant_api:
            tenant = RawKube(tenant_api)

            async def create(name: str, gpumem: int, gpucores: int) -> None:
                await tenant.request(
                    "POST",
                    f"/api/v1/namespaces/{TENANT}/pods",
                    body=gpu_pod(name, gpumem=gpumem, gpucores=gpucores),
                )

            # Admitted (scheduler and runtime class given), placed, allocated, running in a real
            # container that sees its slice only.
            await create("first", SLICE_MIB, 30)
            first = (await running(kube, ["first"]))["first"]
            assert first["spec"]["schedulerName"] == "hami-scheduler"
            assert first["spec"]["runtimeClassName"] == "nvidia"
            await wait_for(
                lambda: parse_workload_log(kubectl(cluster, "logs", "-n", TENANT, "first")).ready,
                timeout=60,
                interval=0.5,
                what="first's workload to report ready",
            )
            log = parse_workload_log(kubectl(cluster, "logs", "-n", TENANT, "first"))
            device, alloc = log.one("device", index=0), log.one("alloc", index=0)
            assert device["total"] == SLICE_MIB * MiB
            assert alloc["refused_with"] == OUT_OF_MEMORY, alloc
            assert 0 < int(alloc["granted"]) <= SLICE_MIB * MiB

            # The trace of that pod from admission to Allocate, exported by the service pods.
            _, trace_id, _, _ = first["metadata"]["annotations"][keys.TRACE_CONTEXT].split("-")
            journey = ["webhook.admission", "extender.filter", "extender.bind", "device_plugin.allocate"]

            def traced() -> list[str] | None:
                names = [s.name for s in receiver.trace(trace_id)]
                return names if all(step in names for step in journey) else None

            await wait_for(traced, timeout=60, interval=0.5, what=f"the spans {journey} of trace {trace_id}")
            services = {s.service for s in receiver.trace(trace_id)}
            assert {"hamipy-webhook", "hamipy-extender", "hamipy-device-plugin"} <= services

            # Upgrades while pods keep arriving: 1 -> 3 extenders, then back to 1.
            arrived: list[str] = []
            done = asyncio.Event()

            async def arrivals() -> None:
                while len(arrived) < ARRIVALS and not (done.is_set() and len(arrived) >= ARRIVALS // 2):
                    name = f"arrival-{len(arrived)}"
                    await create(name, 1024, 5)
                    arrived.append(name)
                    await asyncio.sleep(ARRIVAL_GAP_S)

            arriving = asyncio.create_task(arrivals())
            for replicas in (3, 1):
                began = time.monotonic()
                await stack.deploy("--set", f"extender.replicas={replicas}", *MONITORING_VALUES)
                ready = await kube.request("GET", f"/apis/apps/v1/namespaces/{CHART_NAMESPACE}/deployments")
                (extender,) = [d for d in ready["items"] if d["metadata"]["name"].endswith("-extender")]
                assert extender["status"].get("readyReplicas") == replicas
                print(f"[admin] helm upgrade to {replicas} extenders in {time.monotonic() - began:.1f} s")
            done.set()
            await arriving
            pods = await running(kube, ["first", *arrived])
            never_double_booked(pods, GPU_MODEL.memory_mib)
            print(f"[admin] {len(arrived)} pods arrived during the rollouts; every one runs")

        # Prometheus as the operator would run it: the chart's ServiceMonitors and alert rules.
        monitors = await kube.request(
            "GET", f"/apis/monitoring.coreos.com/v1/namespaces/{CHART_NAMESPACE}/servicemonitors"
        )
        rules = await kube.request(
            "GET", f"/apis/monitoring.coreos.com/v1/namespaces/{CHART_NAMESPACE}/prometheusrules"
        )
        prometheus = prometheus_server(
            scrape_configs=scrape_configs(monitors["items"]),
            kubernetes=cluster.access,
            rule_files=write_rule_files(rules["items"], tmp_path / "rules"),
        )
        service_pods = {
            pod
            for component in ("webhook", "extender", "device-plugin", "monitor")
            for pod in await stack.metrics_urls(component)
        }

        def every_pod_up() -> set[str] | None:
            up = {t["labels"].get("pod", "") for t in prometheus.targets() if t["health"] == "up"}
            return up if service_pods <= up else None

        await asyncio.to_thread(
            prometheus.wait,
            every_pod_up,
            timeout_s=90,
            what=f"every service pod scraped: {sorted(service_pods)}",
        )
        await asyncio.to_thread(prometheus.wait_rules_healthy, timeout_s=60)
        assert await asyncio.to_thread(
            prometheus.query, 'hami_vgpu_memory_allocated_bytes{namespace="team-a"}'
        )

        # Uninstall: nothing of the release is left to judge or block a pod.
        await asyncio.to_thread(stack.helm.uninstall)
        assert await release_objects(kube) == []
        left: set[str] = set()

        async def only_by_design() -> bool:
            left.clear()
            left.update(await left_in_namespace(kube))
            return not left

        try:
            await wait_for(only_by_design, timeout=60, interval=0.5, what="the release's objects gone")
        except WaitTimeout:
            pytest.fail(f"left in {CHART_NAMESPACE} after helm uninstall: {sorted(left)}")
        policies = await kube.request(
            "GET", "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
        )
        assert not [p["metadata"]["name"] for p in policies["items"] if "hami" in p["metadata"]["name"]]
        hooks = await kube.request(
            "GET", "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
        )
        assert not [h["metadata"]["name"] for h in hooks["items"] if "hami" in h["metadata"]["name"]]
        # A pod (a GPU pod too) is created as if the chart had never been there.
        await kube.request(
            "POST", f"/api/v1/namespaces/{TENANT}/pods", body=gpu_pod("after", gpumem=1024, gpucores=5)
        )
        after = await kube.request("GET", f"/api/v1/namespaces/{TENANT}/pods/after")
        assert after["spec"].get("schedulerName") == "default-scheduler"
