"""A monitor in this process over a fake API, a temporary hook directory and fake GPUs: what its
/metrics says, how it survives bad files, its feedback loop and its clean-up."""

from __future__ import annotations

import asyncio
import io
import struct
from pathlib import Path

import aiohttp
from builders import running_pod
from fake_kube import FakeKube, watch_event
from monitor_fakes import (
    GPU_A,
    MIB,
    FakeHostGpus,
    log_lines,
    process,
    region_dir,
    slice_,
    telemetry,
    write_region,
)
from running_monitor import NODE, PODS, Start, key, vgpu

from hamipy.devcluster import wait_for
from hamipy.kube.errors import KubeError
from hamipy.monitor.gpu_samples import HostGpuSample
from hamipy.monitor.monitor import Monitor
from hamipy.monitor.settings import MonitorSettings
from hamipy.protocol.region import OFFSET_RECENT_KERNEL, OFFSET_UTILIZATION_SWITCH, build_region, parse_region

HOST = HostGpuSample(0, GPU_A, "NVIDIA A100-SXM4-80GB", 5 * MIB, 80 * 1024 * MIB, 37)


async def test_metrics_report_limits_and_use_per_container_and_host_gpu(start_monitor: Start) -> None:
    pods = [
        running_pod("started", allocated=[[slice_(mem=3000, cores=30)]]),
        running_pod("idle", allocated=[[slice_(mem=2000, cores=20)]]),  # allocated, no CUDA yet (HAMi #1794)
        running_pod(
            "pair", containers=["a", "b"], allocated=[[slice_(mem=1000)], [slice_(mem=1500)]]
        ),  # HAMi #281
    ]
    m = await start_monitor(pods, gpus=FakeHostGpus([HOST]))
    write_region(
        m.hook,
        "uid-ns-started",
        "main",
        processes=[process(0, [700 * MIB], sm=[25])],
        last_kernel_time=1_750_000_000 - 9,
    )
    write_region(m.hook, "uid-ns-pair", "a", limits=[1000 * MIB], processes=[process(0, [10 * MIB])])
    write_region(m.hook, "uid-ns-pair", "b", limits=[1500 * MIB], processes=[process(0, [20 * MIB])])
    s = await m.scrape()

    assert s[key("hami_vgpu_memory_limit_bytes", **vgpu("started", "main"))] == 3000 * MIB
    assert s[key("hami_vgpu_memory_used_bytes", **vgpu("started", "main"))] == 700 * MIB
    assert s[key("hami_container_device_memory_bytes", **vgpu("started", "main"))] == 700 * MIB
    assert s[key("hami_vgpu_memory_context_bytes", **vgpu("started", "main"))] == 70 * MIB
    assert s[key("hami_vgpu_memory_module_bytes", **vgpu("started", "main"))] == 0
    assert s[key("hami_vgpu_memory_buffer_bytes", **vgpu("started", "main"))] == 630 * MIB
    assert s[key("hami_container_device_utilization_ratio", **vgpu("started", "main"))] == 25
    assert s[key("hami_container_last_kernel_elapsed_seconds", **vgpu("started", "main"))] == 9
    assert s[key("hamipy_monitor_vgpu_core_limit_ratio", **vgpu("started", "main"))] == 30

    assert s[key("hami_vgpu_memory_limit_bytes", **vgpu("idle", "main"))] == 2000 * MIB
    assert s[key("hami_vgpu_memory_used_bytes", **vgpu("idle", "main"))] == 0
    assert key("hami_container_last_kernel_elapsed_seconds", **vgpu("idle", "main")) not in s
    state = {"namespace": "ns", "pod": "idle", "container": "main"}
    assert s[key("hamipy_monitor_container_region_state", **state, state="missing")] == 1

    assert s[key("hami_vgpu_memory_used_bytes", **vgpu("pair", "a"))] == 10 * MIB
    assert s[key("hami_vgpu_memory_used_bytes", **vgpu("pair", "b"))] == 20 * MIB
    assert s[key("hami_vgpu_memory_limit_bytes", **vgpu("pair", "b"))] == 1500 * MIB

    host = {"node": NODE, "device_index": "0", "device_uuid": GPU_A, "device_type": "NVIDIA A100-SXM4-80GB"}
    assert s[key("hami_host_gpu_memory_used_bytes", **host)] == 5 * MIB
    assert s[key("hami_host_gpu_utilization_ratio", **host)] == 37
    assert s[key("hamipy_monitor_host_gpu_memory_total_bytes", **host)] == 80 * 1024 * MIB
    assert s[key("hamipy_monitor_nvml_up")] == 1
    assert not any(name.startswith(("vGPU_", "Host", "Device_")) for name, _ in s), "legacy names are opt-in"


async def test_use_drops_to_zero_when_the_container_frees(start_monitor: Start) -> None:
    m = await start_monitor([running_pod("p", allocated=[[slice_()]])])
    path = write_region(m.hook, "uid-ns-p", "main", processes=[process(0, [700 * MIB])])
    assert (await m.scrape())[key("hami_vgpu_memory_used_bytes", **vgpu("p", "main"))] == 700 * MIB
    path.write_bytes(build_region(uuids=[GPU_A], limits=[3000 * MIB], sm_limits=[30]))  # its process freed
    assert (await m.scrape())[key("hami_vgpu_memory_used_bytes", **vgpu("p", "main"))] == 0


async def test_corrupted_and_truncated_files_beside_good_ones(start_monitor: Start) -> None:
    pods = [running_pod(n, allocated=[[slice_()]]) for n in ("good", "cut", "junk", "other")]
    m = await start_monitor(pods)
    write_region(m.hook, "uid-ns-good", "main", processes=[process(0, [100 * MIB])])
    good = (region_dir(m.hook, "uid-ns-good", "main") / "0f3c.cache").read_bytes()
    (region_dir(m.hook, "uid-ns-cut", "main") / "a.cache").write_bytes(good[:5000])
    (region_dir(m.hook, "uid-ns-junk", "main") / "a.cache").write_bytes(b"\xde\xad\xbe\xef" * 600_000)
    (region_dir(m.hook, "uid-ns-other", "main") / "a.cache").write_bytes(
        struct.pack("<iII", 19920718, 9, 9) + good[12:]
    )

    for _ in range(2):
        s = await m.scrape()
        assert s[key("hami_vgpu_memory_used_bytes", **vgpu("good", "main"))] == 100 * MIB
        for pod in ("cut", "junk", "other"):
            assert key("hami_vgpu_memory_used_bytes", **vgpu(pod, "main")) not in s, (
                "unknown use is not a zero"
            )
            assert s[key("hami_vgpu_memory_limit_bytes", **vgpu(pod, "main"))] == 3000 * MIB
            state = {"namespace": "ns", "pod": pod, "container": "main", "state": "unreadable"}
            assert s[key("hamipy_monitor_container_region_state", **state)] == 1
    for reason in ("truncated", "foreign", "version"):
        assert s[key("hamipy_monitor_region_errors_total", reason=reason)] == 1
        assert s[key("hamipy_monitor_region_files", state=reason)] == 1
    assert s[key("hamipy_monitor_region_files", state="ok")] == 1
    assert await m.get("/healthz") == (200, "ok")
    warned = {e["file"] for e in log_lines(m.log) if e.get("event") == "region file skipped"}
    assert len(warned) == 3


async def test_legacy_metrics_add_hamis_old_names(start_monitor: Start) -> None:
    m = await start_monitor(
        [running_pod("p", allocated=[[slice_()]])], gpus=FakeHostGpus([HOST]), legacy_metrics=True
    )
    write_region(
        m.hook,
        "uid-ns-p",
        "main",
        processes=[process(0, [700 * MIB], sm=[5])],
        last_kernel_time=1_750_000_000 - 3,
    )
    s = await m.scrape()
    old = {"podnamespace": "ns", "podname": "p", "ctrname": "main", "vdeviceid": "0", "deviceuuid": GPU_A}
    assert s[key("vGPU_device_memory_usage_in_bytes", **old)] == 700 * MIB
    assert s[key("vGPU_device_memory_limit_in_bytes", **old)] == 3000 * MIB
    assert s[key("Device_utilization_desc_of_container", **old)] == 5
    assert s[key("Device_last_kernel_of_container", **old)] == 3
    sizes = {"context": str(70 * MIB), "module": "0", "data": str(630 * MIB), "offset": "0"}
    assert s[key("Device_memory_desc_of_container", **old, **sizes)] == 700 * MIB
    host = {"nodeid": NODE, "deviceidx": "0", "deviceuuid": GPU_A, "devicetype": "NVIDIA A100-SXM4-80GB"}
    assert s[key("HostGPUMemoryUsage", **host)] == 5 * MIB
    assert s[key("HostCoreUtilization", **host)] == 37
    assert s[key("hami_vgpu_memory_used_bytes", **vgpu("p", "main"))] == 700 * MIB, "new names stay"


async def test_without_nvml_the_container_metrics_still_come(start_monitor: Start) -> None:
    m = await start_monitor([running_pod("p", allocated=[[slice_()]])], gpus=None)
    s = await m.scrape()
    assert s[key("hamipy_monitor_nvml_up")] == 0
    assert not any(name == "hami_host_gpu_memory_used_bytes" for name, _ in s)
    assert s[key("hami_vgpu_memory_limit_bytes", **vgpu("p", "main"))] == 3000 * MIB


async def test_pods_follow_the_watch(start_monitor: Start) -> None:
    m = await start_monitor([running_pod("first", allocated=[[slice_()]])])
    m.api.send(
        PODS,
        watch_event("ADDED", running_pod("second", allocated=[[slice_(mem=1234)]], resource_version="911")),
        watch_event("DELETED", running_pod("first", resource_version="912")),
    )
    await wait_for(lambda: m.monitor.pods.resource_version == "912", timeout=5)
    s = await m.scrape()
    assert s[key("hami_vgpu_memory_limit_bytes", **vgpu("second", "main"))] == 1234 * MIB
    assert key("hami_vgpu_memory_limit_bytes", **vgpu("first", "main")) not in s
    m.api.send(PODS, {"type": "ERROR", "object": {"code": 410, "message": "too old"}})
    await wait_for(lambda: m.api.calls.count(("GET", PODS)) == 2, timeout=5)
    assert (
        m.telemetry.metrics.registry.get_sample_value(
            "hamipy_monitor_watch_restarts_total", {"cause": "gone"}
        )
        == 1
    )


async def test_a_malformed_annotation_is_logged_once_and_counted(start_monitor: Start) -> None:
    bad = running_pod("bad", allocated="GPU-A,NVIDIA,x,0:;")
    m = await start_monitor([bad])
    status = dict(bad, status={"phase": "Running", "containerStatuses": []})
    for version in ("911", "912"):  # status updates do not repeat the report
        status["metadata"] = dict(bad["metadata"], resourceVersion=version)
        m.api.send(PODS, watch_event("MODIFIED", status))
    await wait_for(lambda: m.monitor.pods.resource_version == "912", timeout=5)
    errors = [e for e in log_lines(m.log) if e["event"].startswith("malformed annotation")]
    assert [(e["namespace"], e["pod"], e["uid"]) for e in errors] == [("ns", "bad", "uid-ns-bad")]
    assert (
        m.telemetry.metrics.registry.get_sample_value(
            "hamipy_monitor_malformed_annotations_total", {"field": "hami.io/vgpu-devices-allocated"}
        )
        == 1
    )
    s = await m.scrape()
    assert not any(dict(labels).get("pod") == "bad" for _, labels in s), "nothing is guessed for it"


def _fields(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    return (
        struct.unpack_from("<i", data, OFFSET_RECENT_KERNEL)[0],
        struct.unpack_from("<i", data, OFFSET_UTILIZATION_SWITCH)[0],
    )


async def test_feedback_loop_with_two_priorities_on_one_gpu(start_monitor: Start, tmp_path: Path) -> None:
    """Both containers launched kernels (recent_kernel = 2, as the interposer marks it); the
    loop blocks the low-priority one and switches its compute limit on, leaves the high-priority
    one free, and releases the low one once the high one has been idle for a pass."""
    hook = tmp_path / "vgpu"  # both regions are there before the first pass
    serve = write_region(hook, "uid-ns-serve", "main", priority=0, recent_kernel=2, utilization_switch=1)
    train = write_region(hook, "uid-ns-train", "main", priority=1, recent_kernel=2, utilization_switch=1)
    pods = [running_pod("serve", allocated=[[slice_()]]), running_pod("train", allocated=[[slice_()]])]
    m = await start_monitor(pods)  # its loop makes one pass at start, the next an hour later
    await wait_for(lambda: m.monitor.housekeeping_passes == 1, timeout=10, what="the first pass")
    assert _fields(train) == (-1, 1), "low priority: blocked, compute limit on"
    assert _fields(serve) == (1, 0), "high priority: its kernel mark ages, no limit"
    await asyncio.to_thread(m.monitor.housekeeping_once)
    assert _fields(serve) == (0, 0)
    assert _fields(train) == (0, 0), "released once the high-priority one is idle"


async def test_feedback_can_be_switched_off(start_monitor: Start) -> None:
    m = await start_monitor([running_pod("a", allocated=[[slice_()]])], feedback=False)
    path = write_region(m.hook, "uid-ns-a", "main", priority=1, recent_kernel=2, utilization_switch=1)
    passes = m.monitor.housekeeping_passes
    await asyncio.to_thread(m.monitor.housekeeping_once)
    assert m.monitor.housekeeping_passes == passes + 1
    assert _fields(path) == (2, 1)


async def test_directories_of_pods_gone_are_removed_after_the_grace_period(start_monitor: Start) -> None:
    m = await start_monitor([running_pod("kept", allocated=[[slice_()]])], gone_grace_s=300)
    kept = write_region(m.hook, "uid-ns-kept", "main").parent
    gone = write_region(m.hook, "uid-ns-gone", "main").parent
    await asyncio.to_thread(m.monitor.housekeeping_once)
    m.clock[0] += 299
    await asyncio.to_thread(m.monitor.housekeeping_once)
    assert gone.exists(), "inside the grace period"
    m.clock[0] += 2
    await asyncio.to_thread(m.monitor.housekeeping_once)
    assert not gone.exists()
    assert kept.exists()
    assert m.telemetry.metrics.registry.get_sample_value("hamipy_monitor_region_dirs_removed_total") == 1


async def test_cdi_specs_of_pods_gone_are_removed_with_their_region_directories(
    start_monitor: Start, tmp_path: Path
) -> None:
    specs = tmp_path / "cdi"
    specs.mkdir()
    m = await start_monitor(
        [running_pod("kept", allocated=[[slice_()]])], gone_grace_s=300, cdi_spec_dir=specs
    )
    region = write_region(m.hook, "uid-ns-gone", "main").parent
    ours = {
        uid: specs / f"hami.io-vgpu_{uid}_main.json" for uid in ("uid-ns-kept", "uid-ns-gone", "uid-ns-stale")
    }
    # Not ours to remove: another vendor's spec, one being written, a link by our name.
    others = [specs / "nvidia.com-gpu.json", specs / ".hami.io-vgpu_uid-ns-gone_main.json.0a1b.tmp"]
    for path in (*ours.values(), *others):
        path.write_text("{}")
    link = specs / "hami.io-vgpu_uid-ns-link_main.json"
    link.symlink_to(others[0])
    await asyncio.to_thread(m.monitor.housekeeping_once)
    m.clock[0] += 299
    await asyncio.to_thread(m.monitor.housekeeping_once)
    assert all(path.exists() for path in ours.values()), "inside the grace period"
    m.clock[0] += 2
    await asyncio.to_thread(m.monitor.housekeeping_once)
    assert sorted(p.name for p in specs.iterdir()) == sorted(
        [ours["uid-ns-kept"].name, link.name, *(p.name for p in others)]
    ), "the spec of the pod gone with its region directory, and the one left without"
    assert not region.exists()
    assert m.telemetry.metrics.registry.get_sample_value("hamipy_monitor_cdi_specs_removed_total") == 2


async def test_nothing_is_removed_while_the_pod_view_is_not_fresh(start_monitor: Start) -> None:
    m = await start_monitor([], gone_grace_s=0)
    gone = write_region(m.hook, "uid-ns-new", "main").parent
    m.monitor.pods.informer.fresh = False  # as after a failed watch, until the next list
    await asyncio.to_thread(m.monitor.housekeeping_once)
    assert gone.exists()
    m.monitor.pods.informer.fresh = True
    await asyncio.to_thread(m.monitor.housekeeping_once)
    assert not gone.exists()


async def test_readiness_waits_for_the_pod_list(tmp_path: Path) -> None:
    t, _ = telemetry()
    api = FakeKube()
    api.fail(KubeError("GET /api/v1/pods: HTTP 500: boom", status=500), "GET", PODS)
    monitor = Monitor(
        settings=MonitorSettings(
            node_name=NODE, hook_path=tmp_path, metrics_host="127.0.0.1", metrics_port=0
        ),
        telemetry=t,
        api=api,
        host_gpus=None,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(monitor.run(stop), name="test:monitor")
    try:
        await wait_for(lambda: monitor.metrics_port is not None, timeout=10)
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{monitor.metrics_port}/readyz") as resp:
                assert resp.status == 503
            async with session.get(f"http://127.0.0.1:{monitor.metrics_port}/healthz") as resp:
                assert resp.status == 200
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)


def test_region_contents_written_by_the_fixture_are_what_the_tests_assume(tmp_path: Path) -> None:
    snap = parse_region(write_region(tmp_path, "u", "c", processes=[process(0, [700 * MIB])]).read_bytes())
    assert (snap.devices[0].context_bytes, snap.devices[0].data_bytes) == (70 * MIB, 630 * MIB)


DIED = "background task died; the service stops"


def bare_monitor(tmp_path: Path, api: FakeKube) -> tuple[Monitor, io.StringIO]:
    t, stream = telemetry()
    monitor = Monitor(
        settings=MonitorSettings(
            node_name=NODE, hook_path=tmp_path, metrics_host="127.0.0.1", metrics_port=0
        ),
        telemetry=t,
        api=api,
        host_gpus=None,
    )
    return monitor, stream


async def test_a_bug_in_the_pod_watch_fails_readiness_with_the_reason(tmp_path: Path) -> None:
    api = FakeKube(running_pod("p", allocated=[[slice_()]]))
    monitor, stream = bare_monitor(tmp_path, api)
    async with monitor.running():
        await wait_for(lambda: monitor.metrics_port is not None and monitor.not_ready() is None, timeout=10)
        api.send(PODS, TypeError("'NoneType' object is not subscriptable"))
        await asyncio.wait_for(monitor.supervisor.failed.wait(), timeout=10)
        url = f"http://127.0.0.1:{monitor.metrics_port}/readyz"
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            reason = "task monitor:pod-informer died: TypeError: 'NoneType' object is not subscriptable"
            assert (resp.status, await resp.text()) == (503, reason)
    (line,) = [e for e in log_lines(stream) if e["event"] == DIED]
    assert (line["level"], line["task"]) == ("error", "monitor:pod-informer")
    assert line["error"] == "TypeError: 'NoneType' object is not subscriptable"


async def test_a_failing_background_task_is_logged_and_ends_the_run(tmp_path: Path) -> None:
    monitor, stream = bare_monitor(tmp_path, FakeKube())

    def broken() -> None:
        raise RuntimeError("disk on fire")

    monitor.housekeeping_once = broken  # type: ignore[method-assign]
    failure = await asyncio.wait_for(monitor.run(asyncio.Event()), timeout=10)
    assert failure == "task monitor:housekeeping died: RuntimeError: disk on fire"
    (line,) = [e for e in log_lines(stream) if e["event"] == DIED]
    assert line["task"] == "monitor:housekeeping"
    assert line["exception"][0]["exc_value"] == "disk on fire"
    assert monitor.supervisor.tasks == {}, "the other tasks were stopped"
