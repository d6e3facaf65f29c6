"""The monitor's NVML sampling over real pynvml and native/'s fake driver with MIG-enabled GPUs: each
instance is sampled with its own memory and ids, instances made and destroyed between scrapes come
and go, and what NVML does not give for a MIG-enabled GPU is left out with one log line, never an
error or a zero."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

FAKE_DRIVER = Path(__file__).resolve().parents[3] / "native" / "build" / "fake"
MIG_GPU = "GPU-fa4e0000-0000-4000-8000-00000000a100"
PLAIN_GPU = "GPU-fa4e0000-0000-4000-8000-00000000b100"
EMPTY_MIG_GPU = "GPU-fa4e0000-0000-4000-8000-00000000c100"
CONFIG = (
    f'gpu uuid={MIG_GPU} name="NVIDIA A100-SXM4-80GB" memory=80g mig=on mig_instances=1g.10gb@6,3g.40gb@0\n'
    f'gpu uuid={PLAIN_GPU} name="NVIDIA A100-SXM4-80GB" memory=80g\n'
    f'gpu uuid={EMPTY_MIG_GPU} name="NVIDIA H100 80GB HBM3" memory=80g mig=on\n'
)
# Samples the host GPUs three times: as configured, after making a 2g.20gb instance at start 4 on
# the first GPU (as the device plugin does at Allocate), and after destroying it; prints the
# samples, what pynvml itself says of each instance, the monitor's log and its NVML error count.
SAMPLE = """
import ctypes, dataclasses, io, json, pynvml
from hamipy.monitor.host_gpus import NvmlHostGpus
from hamipy.monitor.telemetry import Telemetry

log = io.StringIO()
telemetry = Telemetry.create(stream=log)
host = NvmlHostGpus(logger=telemetry.logger, metrics=telemetry.metrics)

def sample():
    return [dataclasses.asdict(gpu) for gpu in host.sample()]

def nvml_view():
    out = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        gpu = pynvml.nvmlDeviceGetHandleByIndex(i)
        if pynvml.nvmlDeviceGetMigMode(gpu)[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
            continue
        for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu)):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, slot)
            except pynvml.NVMLError_NotFound:
                continue
            uuid = pynvml.nvmlDeviceGetUUID(mig)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            out[uuid] = pynvml.nvmlDeviceGetMemoryInfo(mig).total
    return out

first = sample()
pynvml.nvmlInit()
gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu, pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE)
placement = pynvml.c_nvmlGpuInstancePlacement_t()
placement.start, placement.size = 4, 2
gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, info.id, ctypes.byref(placement))
ci_info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
    gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
)
ci = pynvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
view = nvml_view()
made = sample()
pynvml.nvmlComputeInstanceDestroy(ci)
pynvml.nvmlGpuInstanceDestroy(gi)
gone = sample()
host.close()
errors = sum(
    s.value for m in telemetry.metrics.registry.collect() if m.name == "hamipy_monitor_nvml_errors"
    for s in m.samples if s.name.endswith("_total")
)
out = {"first": first, "made": made, "gone": gone, "view": view}
print(json.dumps({**out, "errors": errors, "log": log.getvalue()}))
"""


@pytest.fixture
def sampled(tmp_path: Path) -> dict[str, Any]:
    if not (FAKE_DRIVER / "libnvidia-ml.so.1").is_file():
        pytest.skip("needs native/build/fake (make native)")
    (tmp_path / "gpus.conf").write_text(CONFIG)
    env = {
        "LD_LIBRARY_PATH": str(FAKE_DRIVER),
        "HAMIPY_FAKE_GPU_CONFIG": str(tmp_path / "gpus.conf"),
    }
    proc = subprocess.run(
        [sys.executable, "-c", SAMPLE], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout)
    out["log"] = [json.loads(line) for line in out["log"].splitlines() if line.strip()]
    return out


def _by_uuid(sample: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {gpu["uuid"]: gpu for gpu in sample}


@pytest.mark.native
def test_each_instance_is_sampled_with_its_own_memory_and_ids(sampled: dict[str, Any]) -> None:
    gpus = _by_uuid(sampled["first"])
    mig, plain, empty = gpus[MIG_GPU], gpus[PLAIN_GPU], gpus[EMPTY_MIG_GPU]
    assert (mig["mig_enabled"], plain["mig_enabled"], empty["mig_enabled"]) == (True, False, True)
    assert (plain["mig_devices"], empty["mig_devices"]) == ([], [])
    instances = {m["profile"]: m for m in mig["mig_devices"]}
    assert sorted(instances) == ["1g.10gb", "3g.40gb"]
    for m in instances.values():
        assert m["uuid"].startswith("MIG-")
        assert m["memory_total_bytes"] == sampled["view"][m["uuid"]], "the instance's own memory"
        assert m["memory_used_bytes"] is not None
        assert isinstance(m["gpu_instance_id"], int)
        assert m["compute_instance_id"] == 0
    assert instances["1g.10gb"]["memory_total_bytes"] < instances["3g.40gb"]["memory_total_bytes"]
    assert instances["1g.10gb"]["gpu_instance_id"] != instances["3g.40gb"]["gpu_instance_id"]
    assert mig["memory_total_bytes"] == plain["memory_total_bytes"] == 80 * 1024**3, "the whole GPU's"


@pytest.mark.native
def test_instances_made_and_destroyed_between_scrapes_come_and_go(sampled: dict[str, Any]) -> None:
    before = {m["uuid"] for m in _by_uuid(sampled["first"])[MIG_GPU]["mig_devices"]}
    made = {m["uuid"]: m for m in _by_uuid(sampled["made"])[MIG_GPU]["mig_devices"]}
    (new,) = set(made) - before
    assert made[new]["profile"] == "2g.20gb"
    assert made[new]["memory_total_bytes"] == sampled["view"][new]
    assert {m["uuid"] for m in _by_uuid(sampled["gone"])[MIG_GPU]["mig_devices"]} == before


@pytest.mark.native
def test_what_nvml_does_not_give_on_a_mig_gpu_is_left_out_and_said_once(sampled: dict[str, Any]) -> None:
    for sample in ("first", "made", "gone"):
        gpus = _by_uuid(sampled[sample])
        assert gpus[MIG_GPU]["utilization_percent"] is None, "NOT_SUPPORTED in MIG mode: no value, not 0"
        assert gpus[PLAIN_GPU]["utilization_percent"] is not None
    said = [
        (e["call"], e["device_uuid"])
        for e in sampled["log"]
        if e["event"] == "NVML does not give this value for the device; it is left out"
    ]
    assert sorted(said) == sorted(
        [("nvmlDeviceGetUtilizationRates", MIG_GPU), ("nvmlDeviceGetUtilizationRates", EMPTY_MIG_GPU)]
    ), "once per device and call over three samples"
    assert sampled["errors"] == 0, "not supported is not a failure"
