"""The join of allocations and regions: every running GPU container gets rows, with its real use
where its region is readable, zero where it has not started CUDA, and no use where it is unknown."""

from __future__ import annotations

from pathlib import Path

from builders import running_pod
from monitor_fakes import GPU_A, GPU_B, MIB, process, slice_

from hamipy.monitor.pods import PodRecord, pod_record
from hamipy.monitor.region_dirs import RegionDir, RegionReading
from hamipy.monitor.usage import ContainerRow, DeviceRow, usage_report
from hamipy.protocol.region import build_region, parse_region

HOOK = Path("/hook/containers")
NOW = 1_750_000_000.0


def pods(*raw: dict[str, object]) -> dict[str, PodRecord]:
    records = [pod_record(p) for p in raw]
    return {r.uid: r for r in records}


def reading(uid: str, container: str, *, problem: str | None = None, **region: object) -> RegionReading:
    d = RegionDir(uid, container, HOOK / f"{uid}_{container}")
    if problem is not None:
        return RegionReading(d, file=d.path / "r.cache", problem=problem)  # type: ignore[arg-type]
    kwargs = {"uuids": [GPU_A], "limits": [3000 * MIB], "sm_limits": [30], **region}
    snap = parse_region(build_region(**kwargs))  # type: ignore[arg-type]
    return RegionReading(d, file=d.path / "r.cache", snapshot=snap)


def row(container: str, used: int | None, **changes: object) -> DeviceRow:
    base = {
        "namespace": "ns",
        "pod": "p",
        "container": container,
        "vdevice_index": 0,
        "device_uuid": GPU_A,
        "limit_bytes": 3000 * MIB,
        "core_limit_percent": 30,
        "used_bytes": used,
        "context_bytes": None if used is None else used // 10,
        "module_bytes": None if used is None else 0,
        "buffer_bytes": None if used is None else used - used // 10,
        "sm_util_percent": None if used is None else 0,
        "last_kernel_elapsed_s": None,
    }
    return DeviceRow(**{**base, **changes})  # type: ignore[arg-type]


def test_a_slice_that_has_not_started_cuda_shows_its_limit_with_zero_use() -> None:
    report = usage_report(pods(running_pod("p", allocated=[[slice_()]])), [], now_s=NOW)
    assert report.devices == (row("main", 0),)
    assert report.containers == (ContainerRow("ns", "p", "main", "missing"),)


def test_a_region_being_created_counts_as_not_started() -> None:
    report = usage_report(
        pods(running_pod("p", allocated=[[slice_()]])),
        [reading("uid-ns-p", "main", problem="uninitialised")],
        now_s=NOW,
    )
    assert report.devices == (row("main", 0),)


def test_a_readable_region_gives_the_container_its_use() -> None:
    report = usage_report(
        pods(running_pod("p", allocated=[[slice_()]])),
        [reading("uid-ns-p", "main", processes=[process(0, [500 * MIB], sm=[40])])],
        now_s=NOW,
    )
    assert report.devices == (row("main", 500 * MIB, sm_util_percent=40),)
    assert report.containers[0].state == "ok"


def test_the_limits_are_the_allocations_not_what_the_container_wrote_into_its_region() -> None:
    # Any process of the container can write its region file; the allocation is the system's.
    report = usage_report(
        pods(running_pod("p", allocated=[[slice_()]])),
        [
            reading(
                "uid-ns-p", "main", limits=[40960 * MIB], sm_limits=[100], processes=[process(0, [500 * MIB])]
            )
        ],
        now_s=NOW,
    )
    assert report.devices == (row("main", 500 * MIB),)


def test_each_container_of_a_multi_container_pod_has_its_own_rows() -> None:
    raw = running_pod(
        "p",
        containers=["a", "b", "c"],
        allocated=[[slice_(GPU_A, 1000)], [slice_(GPU_B, 2000, 50)], []],
    )
    report = usage_report(
        pods(raw),
        [reading("uid-ns-p", "a", limits=[1000 * MIB], processes=[process(0, [100 * MIB])])],
        now_s=NOW,
    )
    assert [(r.container, r.device_uuid, r.limit_bytes, r.used_bytes) for r in report.devices] == [
        ("a", GPU_A, 1000 * MIB, 100 * MIB),
        ("b", GPU_B, 2000 * MIB, 0),
    ]
    assert [(c.container, c.state) for c in report.containers] == [("a", "ok"), ("b", "missing")]


def test_an_unreadable_region_reports_the_limit_and_no_use() -> None:
    report = usage_report(
        pods(running_pod("p", allocated=[[slice_()]])),
        [reading("uid-ns-p", "main", problem="truncated")],
        now_s=NOW,
    )
    assert report.devices == (row("main", None),)
    assert report.containers == (ContainerRow("ns", "p", "main", "unreadable"),)


def test_devices_are_indexed_in_the_container_in_slot_order() -> None:
    report = usage_report(
        pods(running_pod("p", allocated=[[slice_(GPU_A, 1000), slice_(GPU_B, 1000)]])), [], now_s=NOW
    )
    assert [(r.vdevice_index, r.device_uuid) for r in report.devices] == [(0, GPU_A), (1, GPU_B)]


def test_terminated_containers_and_finished_pods_have_no_rows() -> None:
    raw_running = running_pod("p", init=["setup"], containers=["main"], allocated=[[slice_()], [slice_()]])
    raw_running["status"]["initContainerStatuses"] = [
        {"name": "setup", "state": {"terminated": {"exitCode": 0}}}
    ]
    done = running_pod("q", allocated=[[slice_()]], phase="Succeeded")
    report = usage_report(pods(raw_running, done), [reading("uid-ns-q", "main")], now_s=NOW)
    assert [(r.pod, r.container) for r in report.devices] == [("p", "main")]


def test_a_native_sidecar_has_rows_beside_the_app_once_the_init_container_before_it_is_done() -> None:
    raw = running_pod(
        "p", init=["setup", "proxy"], containers=["main"], allocated=[[slice_()], [slice_()], [slice_()]]
    )
    raw["spec"]["initContainers"][1]["restartPolicy"] = "Always"
    raw["status"]["initContainerStatuses"] = [
        {"name": "setup", "state": {"terminated": {"exitCode": 0}}},
        {"name": "proxy", "state": {"running": {}}},
    ]
    report = usage_report(pods(raw), [], now_s=NOW)
    assert [(r.pod, r.container) for r in report.devices] == [("p", "proxy"), ("p", "main")]


def test_regions_of_pods_or_containers_not_on_the_node_are_orphans() -> None:
    report = usage_report(
        pods(running_pod("p", allocated=[[slice_()]])),
        [reading("uid-ns-gone", "main"), reading("uid-ns-p", "renamed"), reading("uid-ns-p", "main")],
        now_s=NOW,
    )
    assert [(r.pod, r.container) for r in report.devices] == [("p", "main")]
    assert report.orphan_dirs == 2


def test_seconds_since_the_last_kernel_only_where_one_was_recorded() -> None:
    p = pods(running_pod("p", containers=["a", "b", "c"], allocated=[[slice_()], [slice_()], [slice_()]]))
    report = usage_report(
        p,
        [
            reading("uid-ns-p", "a", last_kernel_time=int(NOW) - 42),
            reading("uid-ns-p", "b", last_kernel_time=0),
            reading("uid-ns-p", "c", last_kernel_time=int(NOW) + 5),  # a clock ahead of ours
        ],
        now_s=NOW,
    )
    assert [(r.container, r.last_kernel_elapsed_s) for r in report.devices] == [
        ("a", 42.0),
        ("b", None),
        ("c", 0.0),
    ]
