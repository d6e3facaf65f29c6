"""MIG in the monitor's /metrics: HAMi's ``hami_mig_device_info`` from the pods' MIG allocation
records and from static instances, per-MIG-instance host series, and container series named by the
instance the container sees."""

from __future__ import annotations

import json
from typing import Any

from builders import running_pod
from fake_kube import watch_event
from monitor_fakes import GPU_A, GPU_B, MIB, FakeHostGpus, log_lines, process, slice_, write_region
from prometheus_client.parser import text_string_to_metric_families
from running_monitor import NODE, PODS, Start, key, vgpu

from hamipy.devcluster import wait_for
from hamipy.monitor.gpu_samples import HostGpuSample, MigDeviceSample
from hamipy.monitor.mig_info import MigInfoRow, mig_info_rows
from hamipy.monitor.pods import pod_record
from hamipy.protocol import keys

# HAMi's cmd/vGPUmonitor/metrics.go: ctrDeviceMigInfo, in its order.
HAMI_NAME = "hami_mig_device_info"
HAMI_HELP = "MIG runtime identity for a container allocation"
HAMI_LABELS = (
    "namespace",
    "pod",
    "container",
    "vdevice_index",
    "device_uuid",
    "mig_uuid",
    "profile",
    "gpu_instance_id",
    "compute_instance_id",
)
MIG_1 = "MIG-11111111-2222-4333-8444-000000000001"
MIG_2 = "MIG-11111111-2222-4333-8444-000000000002"
MIG_STATIC = "MIG-57a71c00-0000-4000-8000-000000000001"
MIG_UNKNOWN = "MIG-57a71c00-0000-4000-8000-00000000dead"
A100 = "NVIDIA A100-SXM4-80GB"


def record(
    ctr: int, dev: int, gpu: str, profile: str, start: int, size: int, **runtime: Any
) -> dict[str, Any]:
    """One element of ``hami.io/vgpu-mig-allocations`` as HAMi's EncodeMigAllocations writes it."""
    return {
        "containerIndex": ctr,
        "deviceIndex": dev,
        "gpuUUID": gpu,
        "profile": profile,
        "placement": {"start": start, "size": size},
        **runtime,
    }


def mig_pod(name: str, records: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
    pod = running_pod(name, **kwargs)
    pod["metadata"]["annotations"][keys.MIG_ALLOCATIONS] = json.dumps(records, separators=(",", ":"))
    return pod


def three_containers(name: str = "mig") -> dict[str, Any]:
    """An init container on GPU A's 1g.10gb instance (GI 13), main-a on GPU B's 3g.40gb (GI 0, a
    valid id), main-b reserved a 2g.20gb the device plugin has not made yet."""
    return mig_pod(
        name,
        [
            record(0, 0, GPU_A, "1g.10gb", 6, 1, migUUID=MIG_1, gpuInstanceID=13, computeInstanceID=0),
            record(1, 0, GPU_B, "3g.40gb", 0, 4, migUUID=MIG_2, gpuInstanceID=0, computeInstanceID=0),
            record(2, 0, GPU_A, "2g.20gb", 0, 2),
        ],
        init=["init"],
        containers=["main-a", "main-b"],
        allocated=[[slice_(GPU_A, 9984, 15)], [slice_(GPU_B, 40320, 43)], [slice_(GPU_A, 19968, 29)]],
    )


def mig_info(pod: str, container: str, gpu: str, mig: str, profile: str, gi: str, ci: str) -> dict[str, str]:
    return {
        **vgpu(pod, container, uuid=gpu),
        "mig_uuid": mig,
        "profile": profile,
        "gpu_instance_id": gi,
        "compute_instance_id": ci,
    }


def exposed(labels: dict[str, str]) -> str:
    """The sample line of HAMi's metric with these labels: sorted by name, as client_golang writes
    them too (its value is written ``1``, this client's ``1.0``)."""
    assert tuple(labels) == HAMI_LABELS
    pairs = ",".join(f'{name}="{labels[name]}"' for name in sorted(labels))
    return f"{HAMI_NAME}{{{pairs}}} 1.0"


async def test_hami_mig_device_info_is_hamis_metric_one_series_per_runtime_ready_record(
    start_monitor: Start,
) -> None:
    m = await start_monitor([three_containers()])
    status, body = await m.get("/metrics")
    assert status == 200
    (family,) = [f for f in text_string_to_metric_families(body) if f.name == HAMI_NAME]
    assert (family.documentation, family.type) == (HAMI_HELP, "gauge")
    init = mig_info("mig", "init", GPU_A, MIG_1, "1g.10gb", "13", "0")
    main_a = mig_info("mig", "main-a", GPU_B, MIG_2, "3g.40gb", "0", "0")
    assert [s.labels for s in family.samples] == [init, main_a], "main-b's instance is reserved, not made"
    assert {s.value for s in family.samples} == {1}
    lines = sorted(line for line in body.splitlines() if line.startswith(HAMI_NAME))
    assert lines == [exposed(init), exposed(main_a)]
    assert f"# HELP {HAMI_NAME} {HAMI_HELP}\n# TYPE {HAMI_NAME} gauge\n" in body


async def test_a_container_on_a_dynamic_instance_is_reported_by_the_instance_uuid(
    start_monitor: Start,
) -> None:
    m = await start_monitor([three_containers()])
    # The container sees its instance: the interposer's region names the MIG UUID, and its own
    # copy of the limit is not what is reported.
    write_region(
        m.hook, "uid-ns-mig", "main-a", uuids=[MIG_2], limits=[MIB], processes=[process(0, [700 * MIB])]
    )
    s = await m.scrape()
    assert s[key("hami_vgpu_memory_limit_bytes", **vgpu("mig", "main-a", uuid=MIG_2))] == 40320 * MIB
    assert s[key("hami_vgpu_memory_used_bytes", **vgpu("mig", "main-a", uuid=MIG_2))] == 700 * MIB
    assert s[key("hami_vgpu_memory_used_bytes", **vgpu("mig", "init", uuid=MIG_1))] == 0, "no CUDA yet"
    assert s[key("hami_vgpu_memory_limit_bytes", **vgpu("mig", "main-b", uuid=GPU_A))] == 19968 * MIB, (
        "no instance yet: its GPU"
    )
    assert not [k for k in s if k[0] == "hami_vgpu_memory_limit_bytes" and dict(k[1])["device_uuid"] == GPU_B]


async def test_a_record_naming_no_container_is_logged_once_and_counted(start_monitor: Start) -> None:
    bad = mig_pod(
        "bad",
        [record(1, 0, GPU_A, "1g.10gb", 6, 1, migUUID=MIG_1, gpuInstanceID=13, computeInstanceID=0)],
        allocated=[[slice_(GPU_A, 9984, 15)]],
    )
    m = await start_monitor([bad, three_containers("good")])
    s = await m.scrape()
    (error,) = [e for e in log_lines(m.log) if e["event"].startswith("malformed annotation")]
    assert (error["namespace"], error["pod"], error["field"]) == (
        "ns",
        "bad",
        f"{keys.MIG_ALLOCATIONS}[0].containerIndex",
    )
    assert s[key("hamipy_monitor_malformed_annotations_total", field=keys.MIG_ALLOCATIONS)] == 1
    assert not [k for k in s if k[0] == HAMI_NAME and dict(k[1])["pod"] == "bad"]
    assert s[key("hami_vgpu_memory_limit_bytes", **vgpu("bad", "main"))] == 9984 * MIB, "its slice still is"
    assert s[key(HAMI_NAME, **mig_info("good", "init", GPU_A, MIG_1, "1g.10gb", "13", "0"))] == 1


STATIC_GPU = HostGpuSample(
    0,
    GPU_A,
    A100,
    memory_used_bytes=600 * MIB,
    memory_total_bytes=80 * 1024 * MIB,
    utilization_percent=None,  # NVML has none for a MIG-enabled GPU
    mig_enabled=True,
    mig_devices=(MigDeviceSample(MIG_STATIC, "1g.10gb", 9, 0, 13 * MIB, 9984 * MIB),),
)
PLAIN_GPU = HostGpuSample(1, GPU_B, A100, 5 * MIB, 80 * 1024 * MIB, 37)


async def test_mig_instances_are_reported_per_instance_with_their_gpu(start_monitor: Start) -> None:
    m = await start_monitor(gpus=FakeHostGpus([STATIC_GPU, PLAIN_GPU]))
    s = await m.scrape()
    gpu_a = {"node": NODE, "device_index": "0", "device_uuid": GPU_A, "device_type": A100}
    gpu_b = {"node": NODE, "device_index": "1", "device_uuid": GPU_B, "device_type": A100}
    instance = {
        **gpu_a,
        "mig_uuid": MIG_STATIC,
        "profile": "1g.10gb",
        "gpu_instance_id": "9",
        "compute_instance_id": "0",
    }
    assert s[key("hamipy_monitor_mig_device_memory_used_bytes", **instance)] == 13 * MIB
    assert s[key("hamipy_monitor_mig_device_memory_total_bytes", **instance)] == 9984 * MIB
    assert s[key("hamipy_monitor_host_gpu_mig_enabled", **gpu_a)] == 1
    assert s[key("hamipy_monitor_host_gpu_mig_enabled", **gpu_b)] == 0
    assert s[key("hami_host_gpu_memory_used_bytes", **gpu_a)] == 600 * MIB
    assert key("hami_host_gpu_utilization_ratio", **gpu_a) not in s, "not given: left out, not 0"
    assert s[key("hami_host_gpu_utilization_ratio", **gpu_b)] == 37
    assert len([k for k in s if k[0] == "hamipy_monitor_mig_device_memory_total_bytes"]) == 1


async def test_static_instances_are_reported_with_what_nvml_knows(start_monitor: Start) -> None:
    pods = [
        running_pod("static", allocated=[[slice_(MIG_STATIC, 9984, 15)]]),
        running_pod("elsewhere", allocated=[[slice_(GPU_B), slice_(MIG_UNKNOWN, 9984, 15)]]),
    ]
    m = await start_monitor(pods, gpus=FakeHostGpus([STATIC_GPU, PLAIN_GPU]), legacy_metrics=True)
    s = await m.scrape()
    assert s[key(HAMI_NAME, **mig_info("static", "main", GPU_A, MIG_STATIC, "1g.10gb", "9", "0"))] == 1
    unknown = {**mig_info("elsewhere", "main", "", MIG_UNKNOWN, "", "", ""), "vdevice_index": "1"}
    assert s[key(HAMI_NAME, **unknown)] == 1, "NVML does not know it: only what the pod says"
    assert len([k for k in s if k[0] == HAMI_NAME]) == 2
    legacy = {
        "podnamespace": "ns",
        "podname": "static",
        "ctrname": "main",
        "vdeviceid": "0",
        "deviceuuid": GPU_A,
    }
    assert s[key("MigInfo", **legacy, instanceid="9")] == 1, "HAMi's pre-2.9 name"
    assert s[key("hami_vgpu_memory_limit_bytes", **vgpu("static", "main", uuid=MIG_STATIC))] == 9984 * MIB


async def test_records_follow_the_watch(start_monitor: Start) -> None:
    """The device plugin records the instance after Allocate: the series appears with it."""
    reserved = mig_pod("late", [record(0, 0, GPU_A, "1g.10gb", 6, 1)], allocated=[[slice_(GPU_A, 9984, 15)]])
    m = await start_monitor([reserved])
    assert not [k for k in await m.scrape() if k[0] == HAMI_NAME]
    made = mig_pod(
        "late",
        [record(0, 0, GPU_A, "1g.10gb", 6, 1, migUUID=MIG_1, gpuInstanceID=13, computeInstanceID=0)],
        allocated=[[slice_(GPU_A, 9984, 15)]],
        resource_version="912",
    )

    m.api.send(PODS, watch_event("MODIFIED", made))
    await wait_for(lambda: m.monitor.pods.resource_version == "912", timeout=5)
    s = await m.scrape()
    assert s[key(HAMI_NAME, **mig_info("late", "main", GPU_A, MIG_1, "1g.10gb", "13", "0"))] == 1
    assert s[key("hami_vgpu_memory_limit_bytes", **vgpu("late", "main", uuid=MIG_1))] == 9984 * MIB


def test_finished_pods_and_stopped_containers_have_no_rows() -> None:
    pods = {
        p["metadata"]["uid"]: pod_record(p)
        for p in (
            three_containers("done") | {"status": {"phase": "Succeeded"}},
            mig_pod(
                "stopped",
                [record(0, 0, GPU_A, "1g.10gb", 6, 1, migUUID=MIG_1, gpuInstanceID=13, computeInstanceID=0)],
                containers=["main", "side"],
                allocated=[[slice_(GPU_A, 9984, 15)], [slice_(MIG_STATIC, 9984, 15)]],
                terminated=["main"],
            ),
        )
    }
    assert mig_info_rows(pods, [STATIC_GPU]) == (
        MigInfoRow("ns", "stopped", "side", 0, GPU_A, MIG_STATIC, "1g.10gb", 9, 0),
    )


def test_a_record_of_another_gpu_does_not_rename_the_device() -> None:
    pod = mig_pod(
        "p",
        [record(0, 0, GPU_B, "1g.10gb", 6, 1, migUUID=MIG_1, gpuInstanceID=13, computeInstanceID=0)],
        allocated=[[slice_(GPU_A, 9984, 15)]],
    )
    assert [d.uuid for d in pod_record(pod).allocations["main"]] == [GPU_A]
