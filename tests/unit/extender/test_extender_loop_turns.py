"""Work that arrives in a burst goes on one task a loop turn, so what became ready meanwhile (a
filter's request) runs in between, not after the whole burst: filters are not starved by
binds."""

from __future__ import annotations

import asyncio
from typing import Any

from builders import gpu, gpu_node, gpu_pod
from extender_fakes import BIND_SETTINGS, bind_args, bind_rig

from hamipy.extender.loop_turns import OnePerTurn


async def test_a_callback_made_ready_during_a_burst_runs_after_at_most_one_more_of_it() -> None:
    turns = OnePerTurn()
    loop = asyncio.get_running_loop()
    order: list[Any] = []

    async def finish(i: int) -> None:
        await turns.turn()
        order.append(i)
        if i == 0:  # a request arrives while the burst is being worked off
            loop.call_soon(order.append, "arrived")

    await asyncio.gather(*(finish(i) for i in range(5)))
    assert [x for x in order if x != "arrived"] == [0, 1, 2, 3, 4]  # first come, first served
    assert order.index("arrived") == 1
    assert len(turns) == 0


async def test_a_waiter_cancelled_in_line_gives_up_its_place() -> None:
    turns = OnePerTurn()
    order: list[int] = []

    async def finish(i: int) -> None:
        await turns.turn()
        order.append(i)

    tasks = [asyncio.create_task(finish(i)) for i in range(3)]
    await asyncio.sleep(0)  # all three wait in line now
    assert len(turns) == 3
    tasks[1].cancel()
    assert len(turns) == 2
    await asyncio.gather(*tasks, return_exceptions=True)
    assert order == [0, 2]
    assert tasks[1].cancelled()
    assert len(turns) == 0
    # And the line works again afterwards.
    await asyncio.wait_for(turns.turn(), timeout=5)


async def test_binds_answered_together_by_the_apiserver_let_a_filter_in_before_their_answers() -> None:
    r = bind_rig(BIND_SETTINGS, gpu_node("n", [gpu("A", 0, count=10)], ours=True))
    names = [f"p{i}" for i in range(4)]
    for name in names:
        r.add_watched_pod(gpu_pod(name))
    apiserver = asyncio.Event()  # answers every Binding at once, as one etcd commit does
    all_sent = asyncio.Event()
    sent: list[str] = []

    def hold_bindings(method: str, path: str, body: Any) -> Any:
        if not path.endswith("/binding"):
            return None
        sent.append(path)
        if len(sent) == len(names):
            all_sent.set()
        return apiserver.wait()

    r.kube.on_request = hold_bindings
    order: list[str] = []

    async def bind(name: str) -> None:
        result = await r.scheduler.bind(bind_args(gpu_pod(name)))
        assert result["Error"] == ""
        order.append(name)

    binds = [asyncio.create_task(bind(name)) for name in names]
    await asyncio.wait_for(all_sent.wait(), timeout=5)
    apiserver.set()
    asyncio.get_running_loop().call_soon(order.append, "filter")  # readable as the burst lands
    await asyncio.wait_for(asyncio.gather(*binds), timeout=5)
    assert order == ["filter", *names]
    assert all(r.kube.pod("ns", name)["spec"]["nodeName"] == "n" for name in names)
