"""The monitor on a GPU node run by the real kubelet: real pods through the
webhook, the extender and the device plugin; real CUDA test programs under the interposer and the
fake driver in each served container's region directory, with the env the kubelet created the
container with; the real ``hamipy-monitor`` process reading them."""

from __future__ import annotations

import asyncio
import mmap
import os
import struct

import pytest
from builders import container
from monitor_support import (
    GPU,
    MIB,
    MonitorStack,
    SimContainer,
    release,
    sample_key,
    samples,
    scrape_text,
)
from stack_support import NEEDS_REAL_KUBELET

from hamipy.devcluster import wait_for
from hamipy.protocol.region import (
    OFFSET_RECENT_KERNEL,
    OFFSET_UTILIZATION_SWITCH,
    build_region,
    parse_region,
    write_recent_kernel,
)

pytestmark = [pytest.mark.integration, NEEDS_REAL_KUBELET]


def vgpu(stack: MonitorStack, pod: str, container: str = "main") -> dict[str, str]:
    return {
        "namespace": stack.namespace,
        "pod": pod,
        "container": container,
        "vdevice_index": "0",
        "device_uuid": GPU.uuid,
    }


def host(stack: MonitorStack) -> dict[str, str]:
    return {"node": stack.node, "device_index": "0", "device_uuid": GPU.uuid, "device_type": GPU.name}


async def metric(stack: MonitorStack, name: str, **labels: str) -> float | None:
    value: float | None = (await stack.monitor.scrape()).get(sample_key(name, **labels))
    return value


async def wait_metric(stack: MonitorStack, name: str, labels: dict[str, str], value: float) -> None:
    async def seen() -> bool:
        return await metric(stack, name, **labels) == value

    await wait_for(seen, timeout=30, interval=0.1, what=f"{name}{labels} == {value}")


async def test_a_cuda_program_shows_as_its_containers_use(monitor_stack: MonitorStack) -> None:
    """A container's held bytes appear under its namespace/pod/container from the apiserver and go
    back to zero when it frees; a pod that never starts CUDA shows its limit with zero use (HAMi
    #1794); each container of a multi-container pod has its own series (HAMi #281)."""
    s = monitor_stack
    await s.create("cuda", [container("main", gpu=1, gpumem=3000, gpucores=30)])
    await s.create("idle", [container("main", gpu=1, gpumem=2000)])
    await s.create("pair", [container("a", gpu=1, gpumem=1000), container("b", gpu=1, gpumem=1500)])
    for name in ("cuda", "idle", "pair"):
        await s.served(name)

    await wait_metric(s, "hami_vgpu_memory_limit_bytes", vgpu(s, "idle"), 2000 * MIB)
    await wait_metric(s, "hami_vgpu_memory_used_bytes", vgpu(s, "idle"), 0)
    await wait_metric(s, "hami_vgpu_memory_limit_bytes", vgpu(s, "cuda"), 3000 * MIB)

    cuda = await s.container("cuda", "main")
    a, b = await s.container("pair", "a"), await s.container("pair", "b")
    holders = [cuda.hold(100), a.hold(10), b.hold(20)]
    try:
        await wait_metric(s, "hami_vgpu_memory_used_bytes", vgpu(s, "cuda"), 100 * MIB)
        await wait_metric(s, "hami_vgpu_memory_used_bytes", vgpu(s, "pair", "a"), 10 * MIB)
        await wait_metric(s, "hami_vgpu_memory_used_bytes", vgpu(s, "pair", "b"), 20 * MIB)
        scraped = await s.monitor.scrape()
        assert scraped[sample_key("hami_vgpu_memory_limit_bytes", **vgpu(s, "cuda"))] == 3000 * MIB
        assert scraped[sample_key("hamipy_monitor_vgpu_core_limit_ratio", **vgpu(s, "cuda"))] == 30
        assert scraped[sample_key("hami_vgpu_memory_limit_bytes", **vgpu(s, "pair", "b"))] == 1500 * MIB
        assert scraped[sample_key("hami_vgpu_memory_used_bytes", **vgpu(s, "idle"))] == 0
        state = {"namespace": s.namespace, "pod": "cuda", "container": "main", "state": "ok"}
        assert scraped[sample_key("hamipy_monitor_container_region_state", **state)] == 1
        # NVML (the fake driver's, as the real one) sees every process's memory on the GPU.
        assert scraped[sample_key("hami_host_gpu_memory_used_bytes", **host(s))] == 130 * MIB
        legacy = {"podnamespace": s.namespace, "podname": "cuda", "ctrname": "main", "vdeviceid": "0"}
        assert (
            scraped[sample_key("vGPU_device_memory_usage_in_bytes", **legacy, deviceuuid=GPU.uuid)]
            == 100 * MIB
        )
    finally:
        for proc in holders:
            release(proc)
    await wait_metric(s, "hami_vgpu_memory_used_bytes", vgpu(s, "cuda"), 0)
    await wait_metric(s, "hami_host_gpu_memory_used_bytes", host(s), 0)
    assert await metric(s, "hami_vgpu_memory_limit_bytes", **vgpu(s, "cuda")) == 3000 * MIB


async def test_corrupted_and_truncated_regions_beside_good_ones(monitor_stack: MonitorStack) -> None:
    s = monitor_stack
    for name in ("good", "cut", "junk"):
        await s.create(name, [container("main", gpu=1, gpumem=1000)])
    for name in ("good", "cut", "junk"):
        await s.served(name)
    good = await s.container("good", "main")
    holder = good.hold(64)
    try:
        cut, junk = await s.container("cut", "main"), await s.container("junk", "main")
        cut.region_file.write_bytes(good.region_file.read_bytes()[:4096])
        junk.region_file.write_bytes(os.urandom(3 * MIB))
        stray = cut.host_region_dir / "older.cache"  # a second, older file is ignored, not read
        stray.write_bytes(b"\0" * 100)
        os.utime(stray, (1_000_000, 1_000_000))

        await wait_metric(s, "hami_vgpu_memory_used_bytes", vgpu(s, "good"), 64 * MIB)
        for _ in range(3):  # repeated scrapes: still up, counted once
            scraped = await s.monitor.scrape()
        for name in ("cut", "junk"):
            assert sample_key("hami_vgpu_memory_used_bytes", **vgpu(s, name)) not in scraped
            assert scraped[sample_key("hami_vgpu_memory_limit_bytes", **vgpu(s, name))] == 1000 * MIB
        assert scraped[sample_key("hamipy_monitor_region_errors_total", reason="truncated")] == 1
        assert scraped[sample_key("hamipy_monitor_region_errors_total", reason="foreign")] == 1
        assert scraped[sample_key("hamipy_monitor_region_files", state="ok")] == 1
        assert await s.monitor.healthz() == 200
        assert s.monitor.running()
        log = "\n".join(s.monitor.log_lines())
        assert str(cut.region_file) in log
        assert str(junk.region_file) in log
    finally:
        release(holder)


def _mark_kernel(container: SimContainer) -> None:
    """What HAMi-core does at a kernel launch: recent_kernel = 2 in the container's region."""
    with container.region_file.open("r+b") as f, mmap.mmap(f.fileno(), 0) as region:
        write_recent_kernel(region, 2)


def _fields(container: SimContainer) -> tuple[int, int]:
    data = container.region_file.read_bytes()
    return (
        struct.unpack_from("<i", data, OFFSET_RECENT_KERNEL)[0],
        struct.unpack_from("<i", data, OFFSET_UTILIZATION_SWITCH)[0],
    )


async def test_priority_feedback_between_two_containers_on_one_gpu(monitor_stack: MonitorStack) -> None:
    """A busy high-priority container blocks a low-priority one on the same GPU and turns its compute
    limit on; once the high-priority one is idle, the low one is released and runs unlimited."""
    s = monitor_stack
    await s.create("serve", [container("main", gpu=1, gpumem=1000, priority=0)])
    await s.create("train", [container("main", gpu=1, gpumem=1000)])  # low, the default
    await s.served("serve")
    await s.served("train")
    serve = await s.container("serve", "main")
    train = await s.container("train", "main")
    holders = [serve.hold(16), train.hold(16)]
    busy = asyncio.Event()

    async def serve_launches_kernels() -> None:
        while busy.is_set():
            await asyncio.to_thread(_mark_kernel, serve)
            await asyncio.sleep(0.05)

    try:
        regions = [parse_region(c.region_file.read_bytes()) for c in (serve, train)]
        assert [r.priority for r in regions] == [0, 1], "the interposer took the Allocate answer's priority"
        assert [r.uuids for r in regions] == [(GPU.uuid,), (GPU.uuid,)]
        busy.set()
        launcher = asyncio.create_task(serve_launches_kernels(), name="test:serve-kernels")
        try:
            await asyncio.to_thread(_mark_kernel, train)
            await wait_for(lambda: _fields(train) == (-1, 1), timeout=30, what="train blocked, limit on")
            await wait_for(lambda: _fields(serve)[1] == 0, timeout=30, what="serve alone at its priority")
            for _ in range(5):  # stays blocked while serve keeps launching
                await asyncio.sleep(0.3)
                assert _fields(train) == (-1, 1)
        finally:
            busy.clear()
            await launcher
        await wait_for(lambda: _fields(train) == (0, 0), timeout=30, what="train released, unlimited")
        await wait_for(lambda: _fields(serve) == (0, 0), timeout=30, what="serve idle")
    finally:
        for proc in holders:
            release(proc)


async def test_region_directories_of_deleted_pods_are_kept_through_the_grace_period(
    monitor_stack: MonitorStack,
) -> None:
    """The default grace period is 5 minutes: a deleted pod's directory stays, counted as an orphan,
    and its series disappear at once."""
    s = monitor_stack
    await s.create("short", [container("main", gpu=1, gpumem=500)])
    await s.served("short")
    short = await s.container("short", "main")
    short.region_file.write_bytes(build_region(uuids=[GPU.uuid], limits=[500 * MIB]))
    await wait_metric(s, "hami_vgpu_memory_used_bytes", vgpu(s, "short"), 0)
    await s.delete("short")
    await wait_metric(s, "hamipy_monitor_orphan_region_dirs", {}, 1)
    assert await metric(s, "hami_vgpu_memory_limit_bytes", **vgpu(s, "short")) is None
    assert await asyncio.to_thread(short.host_region_dir.is_dir), "kept through the grace period"


async def test_every_dashboard_metric_is_exported_by_a_live_service(monitor_stack: MonitorStack) -> None:
    """Parse the Grafana dashboards and scrape the extender, the device plugin and the monitor of
    this cluster: every metric a panel or variable queries must be exported by one of them."""
    from dashboard_support import dashboard_metrics, dashboards, exported_names

    s = monitor_stack
    await s.create("dash", [container("main", gpu=1, gpumem=1000)])
    await s.served("dash")
    holder = (await s.container("dash", "main")).hold(8)
    try:
        await wait_metric(s, "hami_vgpu_memory_used_bytes", vgpu(s, "dash"), 8 * MIB)
        texts = [
            await scrape_text(f"{s.extender.url}/metrics"),
            await scrape_text(f"http://127.0.0.1:{s.plugin.metrics_port}/metrics"),
            await scrape_text(f"{s.monitor.url}/metrics"),
        ]
    finally:
        release(holder)
    exported: set[str] = set()
    for text in texts:
        exported |= exported_names(text)
    with_samples = {name for text in texts for (name, _) in samples(text)}
    missing = {name: sorted(dashboard_metrics(board) - exported) for name, board in dashboards().items()}
    assert missing == {name: [] for name in dashboards()}
    # The core series are not only declared but carry data for this cluster.
    for name in (
        "hami_gpu_memory_limit_bytes",
        "hami_vgpu_memory_allocated_bytes",
        "hami_vgpu_memory_used_bytes",
        "hami_vgpu_memory_limit_bytes",
        "hami_host_gpu_memory_used_bytes",
        "hamipy_device_plugin_devices",
    ):
        assert name in with_samples, name
