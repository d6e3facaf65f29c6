"""The MIG manager and MIG discovery over native/'s fake NVML, through real pynvml (each scenario in
a process of its own: ``mig_driver``): instances made exactly at the reserved placement, idempotent,
refused where NVML refuses them, destroyed when no pod holds them (also one a crashed plugin made),
adopted only when NVML shows the recorded instance, idle GPUs reset."""

from __future__ import annotations

from pathlib import Path

import pytest
from mig_driver import A100_80, GPU0, GPU1, TWO_A100, run

pytestmark = pytest.mark.native


def test_ensure_enables_mig_makes_the_instance_once_and_release_destroys_it(tmp_path: Path) -> None:
    out = run(tmp_path, f"gpu uuid={GPU0} {A100_80} mig=off\n", "ensure_is_idempotent_and_release_destroys")
    assert out["uuid"].startswith("MIG-")
    assert out["mode"] == [1, 1], "MIG mode enabled on demand"
    assert out["memory_mib"] == out["device_memory"] > 0, "the instance's memory is the profile's"
    assert out["live"] == [[4, 4]]
    assert out["after"] == []


def test_ensure_refuses_placements_nvml_does_not_allow_and_leaves_nothing(tmp_path: Path) -> None:
    out = run(tmp_path, TWO_A100, "ensure_refuses_bad_placements")
    bad_start, bad_profile, overlap = out["errors"]
    assert "placement 2+4 is not a possible placement of 3g.40gb" in bad_start
    assert "9g.99gb" in bad_profile
    assert "2g.20gb@4+2" in overlap
    assert out["live"] == [[4, 4]]
    assert out["managed"] == 1


def test_reconcile_destroys_unheld_instances_and_keeps_held_and_in_flight_ones(tmp_path: Path) -> None:
    out = run(tmp_path, TWO_A100, "reconcile_destroys_what_no_pod_holds")
    assert out["destroyed"] == ["LiveInstance", "MigInstance"], "one managed, one a crashed plugin made"
    assert out["failed"] == []
    assert out["again"] == 0
    assert out["gpu0"] == [[4, 4]]
    assert out["gpu1"] == [[5, 1]], "an instance at a reserved placement stays (its Allocate is in flight)"
    assert out["managed"] == [f"3g.40gb@4+4 on {GPU0}"]


def test_adopt_takes_only_the_recorded_live_instance(tmp_path: Path) -> None:
    out = run(tmp_path, TWO_A100, "adopt_checks_the_instance")
    wrong_uuid, wrong_gi, wrong_ci = out["refusals"]
    assert "not MIG-00000000-0000-4000-8000-000000000000" in wrong_uuid
    assert "GPU instance" in wrong_gi
    assert "no compute instance" in wrong_ci
    assert out["adopted"]
    assert out["reused"]


def test_reset_idle_destroys_the_idle_gpus_instances_only(tmp_path: Path) -> None:
    out = run(tmp_path, TWO_A100, "reset_idle_keeps_gpus_in_use")
    assert out["busy"] == [], "no process runs on the fake GPUs"
    assert out["reset"] == [GPU0]
    assert out["gpu0"] == []
    assert out["gpu1"] == [[0, 4]]


def test_discovery_reads_allowed_profiles_and_existing_instances(tmp_path: Path) -> None:
    config = (
        f"gpu uuid={GPU0} {A100_80} mig=on mig_instances=3g.40gb@4,1g.10gb@0\ngpu uuid={GPU1} {A100_80}\n"
    )
    out = run(tmp_path, config, "discovery_reads_profiles_and_instances")
    first = out["dynamic"][0]
    assert first["capacity"] == 7
    (one, three) = first["profiles"]
    assert [one[0], one[3], one[4]] == ["1g.10gb", 1, [[i, 1] for i in range(7)]]
    assert [three[0], three[3], three[4]] == ["3g.40gb", 3, [[0, 4], [4, 4]]]
    assert 0 < one[2] < three[2] < 100
    assert 0 < one[1] < three[1]
    static = out["static"]
    assert static[1] == {"uuid": GPU1, "enabled": False, "devices": []}
    assert static[0]["enabled"]
    assert sorted(d[1] for d in static[0]["devices"]) == ["1g.10gb", "3g.40gb"]
    assert all(d[0].startswith("MIG-") and d[2] > 0 and 0 < d[3] <= 100 for d in static[0]["devices"])
