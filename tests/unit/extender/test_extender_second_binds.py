"""A second bind of a pod this replica counts already: kube-scheduler retrying after its timeout
while the first bind runs, or unelected kube-schedulers each binding the pod. What the pod holds
(its allocation) or the first bind's GPUs in flight stay counted while the second bind runs and
after it fails, so a filter meanwhile never hands them to another pod."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any

import pytest
from builders import allocation, container, gpu, gpu_node, gpu_pod
from extender_fakes import BIND_SETTINGS, BindRig, bind_rig, filter_args, shared_rig

from hamipy.extender.errors import BindRefused, LockTimeout
from hamipy.extender.invariant import check_cluster
from hamipy.extender.model import PodUid
from hamipy.kube.errors import KubeError
from hamipy.protocol import encode_pod_devices
from hamipy.protocol.devices import ContainerDevice
from hamipy.protocol.identifiers import NodeName

P = PodUid("uid-ns-p")


def exclusive(name: str) -> dict[str, Any]:
    """A pod asking one whole GPU (all its cores): no other pod may share that GPU."""
    return gpu_pod(name, container(gpu=1, gpumem=1000, gpucores=100))


def two_nodes() -> BindRig:
    """Nodes ``n`` (GPU ``A``) and ``m`` (GPU ``B``), our device plugin's: binds decide from the model."""
    return bind_rig(
        BIND_SETTINGS, gpu_node("n", [gpu("A", 0)], ours=True), gpu_node("m", [gpu("B", 0)], ours=True)
    )


def held_on(r: BindRig) -> tuple[str, str, list[str]]:
    """(source, node, GPUs) of what the model counts for ``p``."""
    c = r.model.contributions[P]
    return c.source, c.node, [d.uuid for slot in c.devices for d in slot]


def filter_chooses(r: BindRig, name: str) -> str:
    """The node a filter of the watched, exclusive pod ``name`` chooses among ``n`` and ``m``."""
    r.add_watched_pod(exclusive(name))
    result = r.scheduler.filter(filter_args(exclusive(name), ["n", "m"]))
    (chosen,) = result["NodeNames"]
    return str(chosen)


class Bindings:
    """Holds each Binding of ``p`` sent until the test lets it go (``release``), after which it is
    answered as the API server would, or the first one fails with ``fail`` when set."""

    def __init__(self, r: BindRig) -> None:
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()
        self.sent = 0
        self.fail: KubeError | None = None
        r.kube.on_request = self.hook

    async def hook(self, method: str, path: str, body: Any) -> None:
        if method == "POST" and path.endswith("/p/binding"):
            self.sent += 1
            self.arrived.set()
            await self.release.wait()
            fail, self.fail = self.fail, None
            if fail is not None:
                raise fail


async def run_until_blocked(task: asyncio.Task[None]) -> None:
    """Let ``task`` run as far as it goes: the fake API server answers at once, so it ends, or
    waits on something only the test lets go, within a few turns of the loop."""
    for _ in range(50):
        if task.done():
            return
        await asyncio.sleep(0)


async def test_a_second_bind_of_a_bound_pod_leaves_its_gpus_counted() -> None:
    """``p`` is bound to ``n`` by this replica; its watch event has not come yet, and a second bind
    of it (to ``m``) arrives. ``p``'s GPU stays counted throughout, so a filter meanwhile does not
    choose it, and the second bind is refused naming where ``p`` is."""
    r = two_nodes()
    r.add_watched_pod(exclusive("p"))
    await r.binder.bind(namespace="ns", name="p", uid=P, node=NodeName("n"))
    assert held_on(r) == ("allocated", "n", ["A"])

    bindings = Bindings(r)
    second = asyncio.create_task(r.binder.bind(namespace="ns", name="p", uid=P, node=NodeName("m")))
    await run_until_blocked(second)
    assert held_on(r) == ("allocated", "n", ["A"])
    assert filter_chooses(r, "q") == "m"
    bindings.release.set()
    with pytest.raises(BindRefused, match="already bound to n"):
        await second
    assert held_on(r) == ("allocated", "n", ["A"])
    assert bindings.sent == 0, "a pod the model counts as bound was written again"
    assert (await check_cluster(r.kube)).ok


async def test_a_second_bind_waits_for_the_first_in_flight_and_takes_its_outcome() -> None:
    """The first bind's Binding (to ``n``) is in flight when a second bind of ``p`` (to ``m``)
    arrives: the first one's GPU stays counted, the second waits for it, and finds ``p`` bound."""
    r = two_nodes()
    r.add_watched_pod(exclusive("p"))
    bindings = Bindings(r)
    first = asyncio.create_task(r.binder.bind(namespace="ns", name="p", uid=P, node=NodeName("n")))
    await asyncio.wait_for(bindings.arrived.wait(), 5)
    assert held_on(r) == ("binding", "n", ["A"])

    second = asyncio.create_task(r.binder.bind(namespace="ns", name="p", uid=P, node=NodeName("m")))
    await run_until_blocked(second)
    assert held_on(r) == ("binding", "n", ["A"])
    assert filter_chooses(r, "q") == "m"
    assert bindings.sent == 1

    bindings.release.set()
    await first
    with pytest.raises(BindRefused, match="already bound to n"):
        await second
    assert held_on(r) == ("allocated", "n", ["A"])
    assert bindings.sent == 1
    assert r.kube.pod("ns", "p")["spec"]["nodeName"] == "n"
    assert (await check_cluster(r.kube)).ok


async def test_a_second_bind_to_the_same_node_succeeds_once_the_first_has_bound() -> None:
    r = two_nodes()
    r.add_watched_pod(exclusive("p"))
    bindings = Bindings(r)
    first = asyncio.create_task(r.binder.bind(namespace="ns", name="p", uid=P, node=NodeName("n")))
    await asyncio.wait_for(bindings.arrived.wait(), 5)
    second = asyncio.create_task(r.binder.bind(namespace="ns", name="p", uid=P, node=NodeName("n")))
    bindings.release.set()
    await asyncio.gather(first, second)
    assert bindings.sent == 1
    assert held_on(r) == ("allocated", "n", ["A"])


async def test_a_second_bind_goes_ahead_when_the_first_failed() -> None:
    r = two_nodes()
    r.add_watched_pod(exclusive("p"))
    bindings = Bindings(r)
    bindings.fail = KubeError("etcd timed out", status=500)
    first = asyncio.create_task(r.binder.bind(namespace="ns", name="p", uid=P, node=NodeName("n")))
    await asyncio.wait_for(bindings.arrived.wait(), 5)
    second = asyncio.create_task(r.binder.bind(namespace="ns", name="p", uid=P, node=NodeName("m")))
    bindings.release.set()
    with pytest.raises(KubeError):
        await first
    await second
    assert r.kube.pod("ns", "p")["spec"]["nodeName"] == "m"
    assert held_on(r) == ("allocated", "m", ["B"])


async def test_a_second_bind_that_waits_too_long_is_refused_and_frees_nothing() -> None:
    r = two_nodes()
    r.add_watched_pod(exclusive("p"))
    bindings = Bindings(r)
    first = asyncio.create_task(r.binder.bind(namespace="ns", name="p", uid=P, node=NodeName("n")))
    await asyncio.wait_for(bindings.arrived.wait(), 5)
    with pytest.raises(BindRefused, match="another bind of pod ns/p is in flight"):
        await r.binder.bind(namespace="ns", name="p", uid=P, node=NodeName("m"))
    assert held_on(r) == ("binding", "n", ["A"])
    bindings.release.set()
    await first
    assert held_on(r) == ("allocated", "n", ["A"])
    assert len(r.binder._turns) == 0, "a pod's turn outlived its binds"


async def test_a_failed_bind_leaves_the_allocation_the_watch_reported_meanwhile() -> None:
    """A bind of ``p`` on the locked path waits for ``n``'s lock, held by another pod; meanwhile the
    watch reports ``p`` bound to ``m`` (another replica bound it). The bind times out: ``p``'s
    allocation on ``m`` stays counted."""
    r = shared_rig(
        BIND_SETTINGS, gpu_node("n", [gpu("A", 0)], ours=True), gpu_node("m", [gpu("B", 0)], ours=True)
    )
    r.add_watched_pod(exclusive("p"))
    r.locked_by("ns", "other", datetime.now(UTC))
    r.kube.add(gpu_pod("other"))
    on_m = encode_pod_devices([[ContainerDevice("B", "NVIDIA", 1000, 100)]])
    bound = exclusive("p")
    bound["spec"]["nodeName"] = "m"
    bound["metadata"]["annotations"] = allocation(allocated=on_m, to_allocate=on_m, node="m")

    async def report_bound(method: str, path: str, body: Any) -> None:
        if method == "GET" and path == "/api/v1/nodes/n":
            r.model.apply_pod("MODIFIED", bound)

    r.kube.on_request = report_bound
    with pytest.raises(LockTimeout):
        await r.binder.bind(namespace="ns", name="p", uid=P, node=NodeName("n"))
    assert held_on(r) == ("allocated", "m", ["B"])
    assert r.model.nodes[NodeName("m")].gpus[0].used_cores == 100


def lose_binding_answers(r: BindRig, *, written: bool) -> None:
    """``p``'s next Binding gets no answer (a timeout); with ``written`` the API server stored it."""

    async def lose_answer(method: str, path: str, body: Any) -> None:
        if method == "POST" and path.endswith("/p/binding"):
            r.kube.on_request = None
            if written:
                await r.kube.request(method, path, body=body)
            raise KubeError("POST binding: TimeoutError", status=0)

    r.kube.on_request = lose_answer


@pytest.mark.parametrize("written", [True, False])
async def test_a_binding_whose_answer_is_lost_keeps_its_gpus_counted_until_the_api_says(
    written: bool,
) -> None:
    """The Binding's answer never comes (a timeout): it may have been written. ``p``'s GPU stays
    counted, as a reservation: the watch event of ``p`` bound makes it an allocation; if ``p`` was
    not bound, the reservation expires."""
    r = two_nodes()
    r.add_watched_pod(exclusive("p"))
    lose_binding_answers(r, written=written)
    with pytest.raises(KubeError, match="TimeoutError"):
        await r.binder.bind(namespace="ns", name="p", uid=P, node=NodeName("n"))
    assert held_on(r) == ("reserved", "n", ["A"])
    assert filter_chooses(r, "q") == "m"
    if written:
        r.model.apply_pod("MODIFIED", r.kube.pod("ns", "p"))
        assert held_on(r) == ("allocated", "n", ["A"])
    else:
        r.model.expire(time.monotonic() + BIND_SETTINGS.reservation_ttl_s)
        assert P not in r.model.contributions


async def test_a_binding_in_doubt_on_the_locked_path_stays_counted() -> None:
    """On a node HAMi's device plugin serves, binds take the node lock and decide from fresh API
    state; this replica still decides alone, so a Binding whose answer was lost keeps its GPUs
    counted there too."""
    r = bind_rig(BIND_SETTINGS, gpu_node("n", [gpu("A", 0)]))
    r.add_watched_pod(exclusive("p"))
    r.kube.fail(KubeError("timeout", status=0), "POST", "/api/v1/namespaces/ns/pods/p/binding")
    with pytest.raises(KubeError, match="timeout"):
        await r.binder.bind(namespace="ns", name="p", uid=P, node=NodeName("n"))
    assert held_on(r) == ("reserved", "n", ["A"])
    assert r.model.in_doubt(P)


async def test_the_pods_next_filter_leaves_a_binding_in_doubt_counted() -> None:
    """``p``'s Binding to ``n`` is written but its answer lost, and an API stall keeps the watch from
    reporting ``p`` bound. kube-scheduler filters ``p`` again (it retries after a second): ``p``'s
    GPU on ``n`` stays counted, so ``q`` is never placed on it."""
    r = two_nodes()
    r.add_watched_pod(exclusive("p"))
    lose_binding_answers(r, written=True)
    with pytest.raises(KubeError, match="TimeoutError"):
        await r.binder.bind(namespace="ns", name="p", uid=P, node=NodeName("n"))
    assert r.scheduler.filter(filter_args(exclusive("p"), ["n", "m"]))["NodeNames"] == ["m"]
    assert held_on(r) == ("reserved", "n", ["A"]), "the filter replaced the hold in doubt"
    assert filter_chooses(r, "q") == "m", "p's GPU on n was offered to q"
    with pytest.raises(BindRefused, match="no longer fits node n"):
        await r.binder.bind(namespace="ns", name="q", uid=PodUid("uid-ns-q"), node=NodeName("n"))
    assert (await check_cluster(r.kube)).ok


@pytest.mark.parametrize("written", [True, False])
async def test_a_retried_bind_reads_whether_the_binding_in_doubt_was_written(written: bool) -> None:
    """kube-scheduler binds ``p`` again (to ``m``, as its filter now answers) while its first Binding
    (to ``n``) is in doubt: one read of ``p`` settles it. Written: ``p`` is bound to ``n``, counted
    there, and the retry is refused naming ``n``. Not written: the hold goes and ``p`` is bound to ``m``."""
    r = two_nodes()
    r.add_watched_pod(exclusive("p"))
    lose_binding_answers(r, written=written)
    with pytest.raises(KubeError, match="TimeoutError"):
        await r.binder.bind(namespace="ns", name="p", uid=P, node=NodeName("n"))
    first = len(r.kube.calls)
    if written:
        with pytest.raises(BindRefused, match="already bound to n"):
            await r.binder.bind(namespace="ns", name="p", uid=P, node=NodeName("m"))
        assert held_on(r) == ("allocated", "n", ["A"])
        assert r.kube.calls[first:] == [("GET", "/api/v1/namespaces/ns/pods/p")], "not just one read"
    else:
        await r.binder.bind(namespace="ns", name="p", uid=P, node=NodeName("m"))
        assert held_on(r) == ("allocated", "m", ["B"])
        assert r.model.nodes[NodeName("n")].gpus[0].used_cores == 0
    assert r.kube.pod("ns", "p")["spec"]["nodeName"] == ("n" if written else "m")
    assert (await check_cluster(r.kube)).ok


async def test_a_pod_whose_binding_is_in_doubt_preempts_nothing() -> None:
    """``p`` may already run on ``n``; a filter of it that fits nowhere neither evicts pods for it
    nor moves its hold to the preemption's node."""
    r = two_nodes()
    low = gpu_pod("low", container(gpu=1, gpumem=1000, gpucores=100), node_name="m", phase="Running")
    low["metadata"]["annotations"] = allocation(allocated="B,NVIDIA,1000,100:;", node="m")
    r.add_watched_pod(low)
    important = exclusive("p")
    important["spec"]["priority"] = 1000
    r.add_watched_pod(important)
    lose_binding_answers(r, written=True)
    with pytest.raises(KubeError, match="TimeoutError"):
        await r.binder.bind(namespace="ns", name="p", uid=P, node=NodeName("n"))
    assert r.scheduler.filter(filter_args(important, ["n", "m"]))["NodeNames"] == []
    assert r.evictor is not None
    await r.evictor.idle()
    assert [call for call in r.kube.calls if call[0] == "DELETE"] == []
    assert held_on(r) == ("reserved", "n", ["A"])
    assert P not in r.model.nominations


async def test_a_replica_whose_binds_read_fresh_state_holds_nothing_in_doubt() -> None:
    """Where binds take the locked path (another replica may write), the next bind on the node counts
    the API's state under the lock, so a Binding whose answer was lost keeps nothing reserved."""
    r = shared_rig(BIND_SETTINGS, gpu_node("n", [gpu("A", 0)], ours=True))
    r.add_watched_pod(exclusive("p"))
    r.kube.fail(KubeError("timeout", status=0), "POST", "/api/v1/namespaces/ns/pods/p/binding")
    with pytest.raises(KubeError, match="timeout"):
        await r.binder.bind(namespace="ns", name="p", uid=P, node=NodeName("n"))
    assert P not in r.model.contributions
    assert r.lock() is None
