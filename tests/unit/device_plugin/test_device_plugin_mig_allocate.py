"""Allocate for dynamic MIG GPUs, the reconcile after the pod and the startup adoption, over native/'s
fake NVML (real pynvml, the real manager) and a fake API server; each scenario in a process of its
own (``mig_driver``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mig_driver import GPU0, GPU1, TWO_A100, run

pytestmark = pytest.mark.native


def test_a_mig_container_gets_its_instance_recorded_and_the_reconcile_destroys_it_after_the_pod(
    tmp_path: Path,
) -> None:
    out = run(tmp_path, TWO_A100, "allocate_makes_records_and_reconcile_destroys")
    mig_uuid, gi, ci = out["record"]
    assert mig_uuid.startswith("MIG-")
    assert isinstance(gi, int)
    assert isinstance(ci, int)
    assert out["envs"]["NVIDIA_VISIBLE_DEVICES"] == mig_uuid, "the container sees its MIG device only"
    assert out["envs"]["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{out['memory']}m", "the profile's memory"
    assert out["envs"]["CUDA_DEVICE_SM_LIMIT"] == "100", "the instance is its own compute"
    assert out["phase"] == "success"
    assert out["live"] == out["kept"] == [[6, 1]], "held while the pod runs"
    assert out["after"] == [], "destroyed once the pod Succeeded"
    (event,) = [e for e in out["events"] if e[1] == "MigInstanceDestroyed"]
    assert event[0] == "n1"
    assert mig_uuid in event[2]


def test_a_failed_step_destroys_what_the_allocate_made_and_fails_the_pod(tmp_path: Path) -> None:
    out = run(tmp_path, TWO_A100, "allocate_rolls_back_what_it_made")
    assert "placement 2+4 is not a possible placement of 3g.40gb" in out["error"]
    assert out["phase"] == "failed"
    assert out["gpu0"] == [], "the first device's instance rolled back"
    assert out["gpu1"] == []
    assert out["unchanged"], "no runtime identity recorded"
    assert "container 0 has 1 MIG reservation(s) for 2 device(s)" in out["short"]


def test_startup_adopts_live_records_refuses_forged_ones_resets_idle_gpus_and_a_failed_list_keeps_all(
    tmp_path: Path,
) -> None:
    out = run(tmp_path, TWO_A100, "startup_adopts_resets_and_preserves")
    gpu0, gpu1, started = out["unlisted"]
    assert (gpu0, gpu1, started) == ([[0, 1], [4, 4]], [[0, 4]], False), "a failed pod list destroys nothing"
    assert out["gpu1"] == [], "a GPU no pod uses is reset"
    assert out["gpu0"] == [[0, 1], [4, 4]], "both held: one adopted, one at a placement a pod holds"
    assert out["managed"] == [out["adopted"]]
    (refused,) = [e for e in out["events"] if e[1] == "MigAllocationNotLive"]
    assert refused[0] == "q"
    assert "MIG-00000000-0000-4000-8000-000000000000" in refused[2]
    assert GPU0 in refused[2]
    assert GPU1 not in refused[2]
