"""Which MIG instances the node's pods hold (pure): active pods only (a pod being deleted still
holds its own), a malformed record stops the reconcile, a container's records checked as HAMi's
plugin checks them; the serving rules on a dynamic MIG GPU (the device planned is a whole profile
covering the ask)."""

from __future__ import annotations

import json
from typing import Any

import builders
import pytest
from allocator_support import dev, waiting_pod

from hamipy.device_plugin.allocating import ServeRules, problems
from hamipy.device_plugin.mig_records import MigKey, active_records, container_records, desired_keys
from hamipy.protocol import ProtocolError, keys
from hamipy.protocol.devices import MigPlacement, MigProfile

GPU = "GPU-aaaa"


def _pod(name: str, value: object, *, phase: str | None = None, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "namespace": "ns",
        "name": name,
        "uid": f"uid-{name}",
        "annotations": {keys.MIG_ALLOCATIONS: value if isinstance(value, str) else json.dumps(value)},
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase} if phase else {}}


def _record(container: int, device: int, start: int, gpu: str = GPU) -> dict[str, Any]:
    return {
        "containerIndex": container,
        "deviceIndex": device,
        "gpuUUID": gpu,
        "profile": "1g.10gb",
        "placement": {"start": start, "size": 1},
    }


def test_active_pods_hold_their_instances_terminal_ones_do_not() -> None:
    pods = [
        _pod("running", [_record(0, 0, 0)], phase="Running"),
        _pod("deleting", [_record(0, 0, 1)], phase="Running", deleting=True),
        _pod("done", [_record(0, 0, 2)], phase="Succeeded"),
        _pod("failed", [_record(0, 0, 3)], phase="Failed"),
        _pod("other-gpu", [_record(0, 0, 4, gpu="GPU-bbbb")]),
    ]
    records = active_records(pods)
    assert [p.name for p in records] == ["running", "deleting", "other-gpu"]
    assert desired_keys(records, {GPU}) == {MigKey(GPU, "1g.10gb", 0, 1), MigKey(GPU, "1g.10gb", 1, 1)}


def test_a_malformed_record_names_the_pod() -> None:
    with pytest.raises(ProtocolError, match="pod ns/bad"):
        active_records([_pod("bad", [{"containerIndex": 0}])])


def test_a_containers_records_are_by_device_and_must_match_its_devices() -> None:
    (pod,) = active_records(
        [_pod("p", [_record(1, 1, 2), _record(0, 0, 0), _record(1, 0, 1, gpu="GPU-bbbb")])]
    )
    mine = container_records(pod.records, 1, ["GPU-bbbb", GPU])
    assert [(r.device_index, r.placement.start) for r in mine] == [(0, 1), (1, 2)]
    with pytest.raises(ProtocolError, match="container 1 has 2 MIG reservation"):
        container_records(pod.records, 1, [GPU])
    with pytest.raises(
        ProtocolError, match="MIG reservation on GPU GPU-bbbb, device allocated on GPU GPU-aaaa"
    ):
        container_records(pod.records, 1, [GPU, GPU])


# -- the serving rules on a dynamic MIG GPU: the planned device is a whole profile -------------------

PROFILES = (
    MigProfile("1g.10gb", 9856, 15, 1, (MigPlacement(0, 1),)),
    MigProfile("3g.40gb", 40192, 43, 3, (MigPlacement(0, 4),)),
)
MIG_RULES = ServeRules(devmem={GPU: 81920}, mig_profiles={GPU: PROFILES})


@pytest.mark.parametrize(
    ("container", "planned"),
    [
        (builders.container("main", gpu=1, gpumem=8000, gpucores=30), (9856, 15)),
        (builders.container("main", gpu=1, gpumem_percentage=25), (40192, 43)),
    ],
    ids=["memory", "percentage"],
)
def test_a_profile_covering_the_ask_is_served(container: dict[str, Any], planned: tuple[int, int]) -> None:
    pod = waiting_pod("p", container, slots=[[dev(GPU, *planned)]])
    assert problems(pod, MIG_RULES) == []


@pytest.mark.parametrize(
    ("planned", "why"),
    [((9856, 15), "no profile of 20000 MiB or more"), ((20000, 15), "no profile of 20000 MiB or more")],
    ids=["too-small", "not-a-profile"],
)
def test_a_mig_device_that_is_no_covering_profile_is_refused(planned: tuple[int, int], why: str) -> None:
    pod = waiting_pod("p", builders.container("main", gpu=1, gpumem=20000), slots=[[dev(GPU, *planned)]])
    (found,) = problems(pod, MIG_RULES)
    assert why in found
    assert GPU in found
