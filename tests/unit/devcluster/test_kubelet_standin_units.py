"""The kubelet stand-in's pure decisions: what containers ask, which devices are free and chosen,
what the node and the pods are told; its records; how it applies what its pod informer tells; and
what its PodResources API lists. No cluster."""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

import builders
import grpc
import grpc.aio
import pytest

from hamipy.devcluster.kubelet_admission import (
    AdmissionError,
    ContainerKind,
    ContainerRequest,
    NotEnoughDevices,
    PluginDevice,
    admission_message,
    begin_choice,
    container_requests,
    finish_choice,
    free_devices,
    grpc_error_text,
    is_extended_resource_name,
    node_resources,
    pod_is_deleting,
    pod_is_terminal,
    rejected_status,
    release_reusable,
    running_status,
    waiting_status,
)
from hamipy.devcluster.kubelet_standin import (
    ContainerAllocation,
    KubeletStandIn,
    Mount,
    ResourceAllocation,
    _PodFeed,
    _PodResources,
    _remove_sockets,
    _StdlibLogger,
    _write_json,
)
from hamipy.kubelet_api.podresources_v1 import api_pb2 as podresources_pb2
from hamipy.kubelet_api.podresources_v1 import api_pb2_grpc as podresources_pb2_grpc
from hamipy.kubelet_api.v1beta1 import api_pb2

GPU = "nvidia.com/gpu"
OTHER = "example.com/fpga"
NOW = datetime.datetime(2025, 3, 1, 12, 0, 0, tzinfo=datetime.UTC)

POD_SPEC: dict[str, Any] = {
    "initContainers": [
        {"name": "setup", "image": "img/setup", "resources": {"limits": {GPU: "1"}}},
        {
            "name": "proxy",
            "image": "img/proxy",
            "restartPolicy": "Always",
            "resources": {"requests": {GPU: "1"}},
        },
    ],
    "containers": [
        {"name": "main", "image": "img/main", "resources": {"limits": {GPU: "2", "cpu": "1", OTHER: "1"}}},
        {"name": "logger", "image": "img/logger"},
    ],
}


def _devices(*ids: str, unhealthy: tuple[str, ...] = ()) -> list[PluginDevice]:
    return [PluginDevice(i, healthy=i not in unhealthy) for i in ids]


class TestContainerRequests:
    def test_init_containers_come_first_and_sidecars_are_told_apart(self) -> None:
        got = container_requests(POD_SPEC, {GPU})
        assert [(c.name, c.kind) for c in got] == [
            ("setup", "init"),
            ("proxy", "sidecar"),
            ("main", "app"),
            ("logger", "app"),
        ]

    def test_limits_then_requests_and_only_registered_resources(self) -> None:
        got = {c.name: dict(c.resources) for c in container_requests(POD_SPEC, {GPU})}
        assert got == {"setup": {GPU: 1}, "proxy": {GPU: 1}, "main": {GPU: 2}, "logger": {}}

    def test_every_registered_resource_is_counted(self) -> None:
        main = container_requests(POD_SPEC, {GPU, OTHER})[2]
        assert dict(main.resources) == {GPU: 2, OTHER: 1}
        assert main.image == "img/main"

    @pytest.mark.parametrize(
        ("text", "count"), [("3", 3), ("1k", 1000), ("0", 0)], ids=["plain", "1k", "zero"]
    )
    def test_quantities_in_canonical_forms(self, text: str, count: int) -> None:
        spec = {"containers": [{"name": "c", "resources": {"limits": {GPU: text}}}]}
        assert dict(container_requests(spec, {GPU})[0].resources) == ({GPU: count} if count else {})

    def test_a_fraction_is_an_admission_error_naming_the_container(self) -> None:
        spec = {"containers": [{"name": "c", "resources": {"limits": {GPU: "1500m"}}}]}
        with pytest.raises(AdmissionError, match=r"containers\[0\] 'c' nvidia.com/gpu"):
            container_requests(spec, {GPU})


class TestChoosingDevices:
    def test_free_devices_are_healthy_and_unheld_in_id_order(self) -> None:
        devices = _devices("d3", "d1", "d2", "d0", unhealthy=("d2",))
        assert free_devices(devices, held={"d0"}) == ("d1", "d3")

    def test_not_enough_devices_says_so_as_the_kubelet_does(self) -> None:
        with pytest.raises(NotEnoughDevices) as err:
            begin_choice(GPU, 3, reusable=set(), free=("d0", "d1"))
        assert (
            str(err.value) == f"requested number of devices unavailable for {GPU}. Requested: 3, Available: 2"
        )

    def test_reused_devices_come_first_and_only_the_rest_must_be_free(self) -> None:
        choice = begin_choice(GPU, 2, reusable={"d3"}, free=("d0",))
        assert choice.chosen == ("d3",)
        assert choice.needed == 1
        assert choice.preference_request() == (("d0", "d3"), ("d3",), 2)
        assert finish_choice(choice) == ("d3", "d0")

    def test_reuse_alone_can_satisfy_a_request(self) -> None:
        choice = begin_choice(GPU, 1, reusable={"d2", "d1"}, free=())
        assert finish_choice(choice, ["d9"]) == ("d1",)

    def test_the_plugins_preference_is_followed(self) -> None:
        choice = begin_choice(GPU, 2, reusable=set(), free=("d0", "d1", "d2", "d3"))
        assert finish_choice(choice, ["d3", "d1"]) == ("d3", "d1")

    def test_a_bad_preference_only_loses_its_bad_entries(self) -> None:
        choice = begin_choice(GPU, 3, reusable=set(), free=("d0", "d1", "d2"))
        # unknown, repeated and held IDs are skipped; the rest is filled in ID order
        assert finish_choice(choice, ["nope", "d2", "d2", "held"]) == ("d2", "d0", "d1")

    def test_without_a_preference_the_lowest_ids_are_taken(self) -> None:
        choice = begin_choice(GPU, 2, reusable=set(), free=("d1", "d2", "d3"))
        assert finish_choice(choice) == ("d1", "d2")

    def test_an_inconsistent_choice_is_refused(self) -> None:
        from hamipy.devcluster.kubelet_admission import DeviceChoice

        with pytest.raises(AdmissionError, match=r"Requested: 2, Got: 1"):
            finish_choice(DeviceChoice(GPU, 2, (), ("d0",)))


class TestReusableDevices:
    def test_an_init_container_gives_its_devices_back(self) -> None:
        reusable: dict[str, set[str]] = {}
        release_reusable(reusable, "init", {GPU: ("d0", "d1")})
        assert reusable == {GPU: {"d0", "d1"}}

    @pytest.mark.parametrize("kind", ["app", "sidecar"])
    def test_app_containers_and_sidecars_keep_theirs(self, kind: Any) -> None:
        reusable: dict[str, set[str]] = {GPU: {"d0", "d1"}}
        release_reusable(reusable, kind, {GPU: ("d0", "d5")})
        assert reusable == {GPU: {"d1"}}


class TestNodeResources:
    def test_capacity_counts_all_and_allocatable_the_healthy(self) -> None:
        capacity, allocatable = node_resources(
            {GPU: _devices("a", "b", "c", unhealthy=("b",)), OTHER: _devices("x")}, connected={GPU, OTHER}
        )
        assert capacity == {GPU: "3", OTHER: "1"}
        assert allocatable == {GPU: "2", OTHER: "1"}

    def test_a_disconnected_plugin_has_nothing_allocatable(self) -> None:
        capacity, allocatable = node_resources({GPU: _devices("a", "b")}, connected=())
        assert (capacity, allocatable) == ({GPU: "2"}, {GPU: "0"})


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("nvidia.com/gpu", True),
        ("example.com/fpga_1", True),
        ("gpu", False),
        ("kubernetes.io/gpu", False),
        ("example.kubernetes.io/gpu", False),
        ("requests.example.com/gpu", False),
        ("example.com/", False),
        ("Example.com/gpu", False),
        ("example.com/-gpu", False),
    ],
    ids=lambda v: str(v),
)
def test_extended_resource_names(name: str, ok: bool) -> None:
    assert is_extended_resource_name(name) is ok


@pytest.mark.parametrize(
    ("code", "text"),
    [
        ("UNAVAILABLE", "rpc error: code = Unavailable desc = gone"),
        ("CANCELLED", "rpc error: code = Canceled desc = gone"),
        ("DEADLINE_EXCEEDED", "rpc error: code = DeadlineExceeded desc = gone"),
    ],
    ids=["unavailable", "cancelled", "deadline"],
)
def test_grpc_errors_read_as_go_prints_them(code: str, text: str) -> None:
    assert grpc_error_text(code, "gone") == text


class TestPodStatuses:
    def test_a_rejected_pod_fails_with_the_kubelets_reason_and_message(self) -> None:
        message = admission_message("rpc error: code = Internal desc = no")
        assert rejected_status(message) == {
            "status": {
                "phase": "Failed",
                "reason": "UnexpectedAdmissionError",
                "message": "Pod was rejected: Allocate failed due to rpc error: code = Internal desc = no, "
                "which is unexpected",
            }
        }

    def test_running_status_completes_init_containers_and_runs_the_rest(self) -> None:
        pod = {"metadata": {"uid": "u1"}, "spec": POD_SPEC}
        body = running_status(pod, container_requests(POD_SPEC, {GPU}), now=NOW, host_ip="127.0.0.1")[
            "status"
        ]
        assert body["phase"] == "Running"
        assert {c["type"]: c["status"] for c in body["conditions"]} == {
            "PodReadyToStartContainers": "True",
            "Initialized": "True",
            "Ready": "True",
            "ContainersReady": "True",
            "PodScheduled": "True",
        }
        assert body["hostIPs"] == [{"ip": body["hostIP"]}]
        init = {s["name"]: s for s in body["initContainerStatuses"]}
        assert init["setup"]["state"]["terminated"]["reason"] == "Completed"
        assert init["proxy"]["state"] == {"running": {"startedAt": "2025-03-01T12:00:00Z"}}
        assert [s["name"] for s in body["containerStatuses"]] == ["main", "logger"]
        assert all(s["ready"] and "running" in s["state"] for s in body["containerStatuses"])

    def test_a_container_that_cannot_start_waits(self) -> None:
        container = ContainerRequest("main", "app", "img", {GPU: 1})
        assert waiting_status(container, "boom")["status"]["containerStatuses"][0]["state"] == {
            "waiting": {"reason": "CreateContainerConfigError", "message": "boom"}
        }

    def test_terminal_and_deleting_pods(self) -> None:
        assert pod_is_terminal({"status": {"phase": "Succeeded"}})
        assert pod_is_terminal({"status": {"phase": "Failed"}})
        assert not pod_is_terminal({"status": {"phase": "Running"}})
        assert pod_is_deleting({"metadata": {"deletionTimestamp": "2025-03-01T12:00:00Z"}})
        assert not pod_is_deleting({"metadata": {}})


class TestRecords:
    def test_an_allocate_answer_becomes_a_record(self) -> None:
        response = api_pb2.ContainerAllocateResponse(
            envs={"GPUS": "d0,d1"},
            mounts=[api_pb2.Mount(container_path="/c", host_path="/h", read_only=True)],
            devices=[api_pb2.DeviceSpec(container_path="/dev/x", host_path="/dev/x", permissions="rw")],
            annotations={"a": "b"},
            cdi_devices=[api_pb2.CDIDevice(name="vendor.com/gpu=0")],
        )
        got = ResourceAllocation.from_response(GPU, ("d0", "d1"), response)
        assert got.envs == {"GPUS": "d0,d1"}
        assert got.mounts == (("/c", "/h", True),)
        assert got.devices[0].permissions == "rw"
        assert got.cdi_devices == ("vendor.com/gpu=0",)

    def test_a_container_record_merges_its_resources_and_writes_json(self, tmp_path: Path) -> None:
        gpu = ResourceAllocation(GPU, ("d0",), {"A": "1", "B": "gpu"}, (Mount("/c", "/h", False),))
        fpga = ResourceAllocation(OTHER, ("f0",), {"B": "fpga"})
        record = ContainerAllocation("ns", "pod", "uid-1", "main", "app", (gpu, fpga))
        assert record.key == ("ns", "pod", "main")
        assert record.device_ids == ("d0", "f0")
        assert record.envs == {"A": "1", "B": "fpga"}
        assert record.mounts == (("/c", "/h", False),)
        assert record.for_resource(OTHER) is fpga
        with pytest.raises(KeyError, match=r"example\.org/x"):
            record.for_resource("example.org/x")

        path = tmp_path / "r.json"
        _write_json(path, record.to_json())
        doc = json.loads(path.read_text())
        assert doc["resources"][0]["mounts"] == [
            {"container_path": "/c", "host_path": "/h", "read_only": False}
        ]
        assert doc["kind"] == "app"
        assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_only_sockets_are_removed_from_the_plugin_dir(tmp_path: Path) -> None:
    (tmp_path / "checkpoint").write_text("{}")
    (tmp_path / "sub").mkdir()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "plugin.sock"))
        assert _remove_sockets(tmp_path) == ["plugin.sock"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "sub"]


def test_a_plugin_dir_too_long_for_unix_sockets_is_refused_up_front() -> None:
    with pytest.raises(ValueError, match="too long for unix sockets"):
        KubeletStandIn(Path("/tmp") / ("d" * 100))
    assert KubeletStandIn(Path("/tmp/short")).socket_path == Path("/tmp/short/kubelet.sock")


def _pod(uid: str, created: str) -> dict[str, Any]:
    """A pending pod named ``uid``, created at ``created`` (the order the stand-in admits pods in)."""
    return builders.pod(uid, builders.container(), namespace="ns", uid=uid, phase="Pending", created=created)


async def _applied(standin: KubeletStandIn, feed: _PodFeed) -> None:
    """Run the stand-in's pod-event task until it has applied everything queued."""
    task = asyncio.create_task(standin._apply_pod_events_forever(feed), name="pods")
    try:
        await asyncio.wait_for(feed.events.join(), timeout=5)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _queued(standin: KubeletStandIn) -> list[str]:
    return [standin._queue.get_nowait() for _ in range(standin._queue.qsize())]


class TestPodEvents:
    async def test_a_list_queues_its_pods_in_creation_order(self) -> None:
        standin = KubeletStandIn(Path("/tmp/short"))
        feed = _PodFeed()
        feed.listed([_pod("b", "2025-03-01T12:00:02Z"), _pod("a", "2025-03-01T12:00:01Z")])
        feed.changed("ADDED", _pod("c", "2025-03-01T12:00:03Z"))
        feed.changed("MODIFIED", _pod("a", "2025-03-01T12:00:01Z"))  # seen already: not again

        await _applied(standin, feed)

        assert _queued(standin) == ["a", "b", "c"]
        assert sorted(standin._pods) == ["a", "b", "c"]

    async def test_pods_gone_while_nobody_watched_free_their_devices_on_the_next_list(self) -> None:
        standin = KubeletStandIn(Path("/tmp/short"))
        for uid in ("kept", "gone"):
            gpu = ResourceAllocation(GPU, (f"d-{uid}",), {})
            await standin._record(ContainerAllocation("ns", uid, uid, "main", "app", (gpu,)))
        feed = _PodFeed()
        feed.listed([_pod("kept", "2025-03-01T12:00:01Z")])

        await _applied(standin, feed)

        assert [key.pod for key in standin.allocations] == ["kept"]

    async def test_a_deleted_or_finished_pod_frees_its_devices(self) -> None:
        standin = KubeletStandIn(Path("/tmp/short"))
        for uid in ("deleted", "done"):
            gpu = ResourceAllocation(GPU, (f"d-{uid}",), {})
            await standin._record(ContainerAllocation("ns", uid, uid, "main", "app", (gpu,)))
        feed = _PodFeed()
        feed.changed("DELETED", _pod("deleted", "2025-03-01T12:00:01Z"))
        finished = _pod("done", "2025-03-01T12:00:01Z")
        finished["status"]["phase"] = "Succeeded"
        feed.changed("MODIFIED", finished)

        await _applied(standin, feed)

        assert not standin.allocations
        assert not standin._pods


def test_the_informers_log_lines_go_to_the_stdlib_logger(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="hamipy.devcluster.kubelet_standin"):
        _StdlibLogger("kubelet stand-in n1: pods").warning("list/watch failed; retrying", retry_s=0.2)
        _StdlibLogger("kubelet stand-in n1: pods").info("watch expired; listing again")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "kubelet stand-in n1: pods: list/watch failed; retrying (retry_s=0.2)"),
        ("INFO", "kubelet stand-in n1: pods: watch expired; listing again"),
    ]


class TestPodResources:
    async def test_lists_admitted_pods_and_the_one_being_admitted_with_their_devices(self) -> None:
        standin = KubeletStandIn(Path("/tmp/short"))
        spec = {
            **POD_SPEC,
            "initContainers": [*POD_SPEC["initContainers"], {"name": "late-init", "image": "img/x"}],
        }
        for uid in ("running", "rejected", "admitting", "queued", "other-running"):
            pod = builders.pod(uid, namespace="ns", uid=uid, phase="Pending")
            pod["spec"] = spec
            standin._pods[uid] = pod
        standin._served |= {"running", "rejected", "other-running"}
        standin._rejected.add("rejected")
        standin._admitting = "admitting"
        records: list[tuple[str, str, ContainerKind, dict[str, tuple[str, ...]]]] = [
            ("running", "setup", "init", {GPU: ("d0",)}),
            ("running", "proxy", "sidecar", {GPU: ("d1",)}),
            ("running", "main", "app", {GPU: ("d2", "d3"), OTHER: ("f0",)}),
            ("admitting", "setup", "init", {GPU: ("d4",)}),
            ("admitting", "proxy", "sidecar", {GPU: ("d5",)}),
            # A record of an earlier pod of this name (another uid) is not this pod's.
            ("other-running", "main", "app", {GPU: ("d9",)}),
        ]
        for uid, container, kind, parts in records:
            owner = "a-previous-uid" if uid == "other-running" else uid
            resources = tuple(ResourceAllocation(r, ids, {}) for r, ids in parts.items())
            await standin._record(ContainerAllocation("ns", uid, owner, container, kind, resources))

        listed = {
            (p.namespace, p.name): [
                (c.name, [(d.resource_name, list(d.device_ids)) for d in c.devices]) for c in p.containers
            ]
            for p in standin.pod_resources().pod_resources
        }

        # Sidecars, then the regular containers; a plain init container ("setup") is not listed.
        assert listed == {
            ("ns", "running"): [
                ("proxy", [(GPU, ["d1"])]),
                ("main", [(GPU, ["d2", "d3"]), (OTHER, ["f0"])]),
                ("logger", []),
            ],
            ("ns", "admitting"): [("proxy", [(GPU, ["d5"])]), ("main", []), ("logger", [])],
            ("ns", "other-running"): [("proxy", []), ("main", []), ("logger", [])],
        }

    async def test_served_over_grpc_on_its_socket(self) -> None:
        folder = Path(tempfile.mkdtemp(prefix="ksp-", dir="/tmp"))
        try:
            standin = KubeletStandIn(folder / "plugins", pod_resources_socket=folder / "pr" / "kubelet.sock")
            pod = builders.pod("p", builders.container("main", gpu=1), namespace="ns", uid="u1")
            standin._pods["u1"] = pod
            standin._admitting = "u1"
            server = grpc.aio.server()
            podresources_pb2_grpc.add_PodResourcesListerServicer_to_server(_PodResources(standin), server)
            standin._prepare_dir()
            server.add_insecure_port(f"unix://{standin.pod_resources_socket}")
            await server.start()
            try:
                async with grpc.aio.insecure_channel(f"unix://{standin.pod_resources_socket}") as channel:
                    answer = await podresources_pb2_grpc.PodResourcesListerStub(channel).List(
                        podresources_pb2.ListPodResourcesRequest(), timeout=10
                    )
            finally:
                await server.stop(None)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        assert [(p.namespace, p.name, [c.name for c in p.containers]) for p in answer.pod_resources] == [
            ("ns", "p", ["main"])
        ]
