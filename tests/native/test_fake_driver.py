"""The fake libnvidia-ml.so.1 answers pynvml discovery from its configuration file, shows the fake
libcuda's allocations across processes, and reports unhealthy GPUs as XID events."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from native_support import (
    GPU0_UUID,
    GPU1_UUID,
    ContainerFactory,
    MiB,
    expect_ok,
    run_python,
    stop,
    wait_for_line,
)

pytestmark = pytest.mark.native

DISCOVERY = """
import pynvml
pynvml.nvmlInit()
print(pynvml.nvmlSystemGetDriverVersion(), pynvml.nvmlSystemGetCudaDriverVersion())
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    procs = [(p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
    name = pynvml.nvmlDeviceGetName(h).replace(" ", "_")
    print(pynvml.nvmlDeviceGetIndex(h), pynvml.nvmlDeviceGetUUID(h), name,
          pynvml.nvmlDeviceGetMemoryInfo(h).total, pynvml.nvmlDeviceGetMemoryInfo(h).used,
          pynvml.nvmlDeviceGetPciInfo(h).busId, pynvml.nvmlDeviceGetNumaNodeId(h),
          pynvml.nvmlDeviceGetMinorNumber(h), procs)
pynvml.nvmlShutdown()
"""

XID_WATCH = """
import pynvml
pynvml.nvmlInit()
events = pynvml.nvmlEventSetCreate()
for i in range(pynvml.nvmlDeviceGetCount()):
    handle = pynvml.nvmlDeviceGetHandleByIndex(i)
    pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, events)
data = pynvml.nvmlEventSetWait(events, 5000)
print(pynvml.nvmlDeviceGetUUID(data.device), data.eventType, data.eventData)
try:
    pynvml.nvmlEventSetWait(events, 100)
except pynvml.NVMLError_Timeout:
    print("timeout")
"""


def test_pynvml_discovery(make_container: ContainerFactory) -> None:
    versions = "driver_version = 535.104.05\ncuda_version = 12020\n"
    container = make_container(preload=False, extra_config=versions)
    lines = expect_ok(run_python(container, DISCOVERY)).splitlines()
    assert lines[0] == "535.104.05 12020"
    assert lines[1] == f"0 {GPU0_UUID} NVIDIA_A100-SXM4-80GB {1024 * MiB} 0 00000000:3B:00.0 1 0 []"
    assert lines[2] == f"1 {GPU1_UUID} NVIDIA_H100_80GB_HBM3 {2048 * MiB} 0 00000000:86:00.0 0 1 []"


def test_process_list_and_usage_cross_processes(make_container: ContainerFactory) -> None:
    container = make_container(preload=False)
    holder = container.popen("region_peer", "hold", "40")
    try:
        wait_for_line(holder, "held")
        lines = expect_ok(run_python(container, DISCOVERY)).splitlines()
        assert f"{1024 * MiB} {40 * MiB}" in lines[1]
        assert lines[1].endswith(f"[({holder.pid}, {40 * MiB})]")
    finally:
        stop(holder)


def test_unhealthy_gpu_raises_one_xid_event(make_container: ContainerFactory) -> None:
    gpus = f"gpu uuid={GPU0_UUID} memory=1g\ngpu uuid={GPU1_UUID} memory=1g healthy=false xid=48\n"
    container = make_container(preload=False, gpus=gpus)
    assert expect_ok(run_python(container, XID_WATCH)).splitlines() == [f"{GPU1_UUID} 8 48", "timeout"]


def test_bad_config_is_reported(make_container: ContainerFactory) -> None:
    container = make_container(preload=False, gpus="gpu memory=lots\n")
    proc = run_python(container, "import pynvml; pynvml.nvmlInit()")
    assert proc.returncode != 0
    assert "gpus.conf:1: bad memory: lots" in proc.stderr


def test_a_container_given_one_gpu_charges_the_hosts_gpu(make_container: ContainerFactory) -> None:
    """A container's configuration lists only its GPU (as its device 0), with the host's slot and
    the host's state: what it allocates shows on that GPU in the host's NVML, not on GPU 0."""
    host = make_container(preload=False)
    inside = make_container(
        preload=False,
        gpus=f"state = {host.env['HAMIPY_FAKE_GPU_CONFIG']}.state\ngpu uuid={GPU1_UUID} memory=2g slot=1\n",
    )
    holder = inside.popen("region_peer", "hold", "40")
    try:
        wait_for_line(holder, "held")
        lines = expect_ok(run_python(host, DISCOVERY)).splitlines()
        assert f"{1024 * MiB} 0 " in lines[1]
        assert f"{2048 * MiB} {40 * MiB} " in lines[2]
    finally:
        stop(holder)


def test_a_slot_past_the_last_gpu_is_refused(make_container: ContainerFactory) -> None:
    container = make_container(preload=False, gpus=f"gpu uuid={GPU0_UUID} slot=99\n")
    proc = run_python(container, DISCOVERY)
    assert proc.returncode != 0
    assert "bad slot: 99" in proc.stderr


def test_a_config_directory_is_read_as_one_file_in_name_order(make_container: ContainerFactory) -> None:
    """A container given GPUs by CDI gets its configuration as a directory: one file per GPU (its
    host slot kept) beside the driver's settings; files starting with '.' are left out."""
    host = make_container(preload=False)
    inside = make_container(preload=False, gpus="")
    config = inside.workdir / "gpus.d"
    config.mkdir()
    (config / "b.conf").write_text(f"gpu uuid={GPU0_UUID} memory=1g slot=0\n")
    (config / "a.conf").write_text(f"gpu uuid={GPU1_UUID} memory=2g slot=1\n")
    (config / "0-driver.conf").write_text(
        f"driver_version = 535.104.05\nstate = {host.env['HAMIPY_FAKE_GPU_CONFIG']}.state\n"
    )
    (config / ".c.conf.swp").write_text("not a configuration\n")
    inside.env["HAMIPY_FAKE_GPU_CONFIG"] = str(config)
    lines = expect_ok(run_python(inside, DISCOVERY)).splitlines()
    assert lines[0].startswith("535.104.05 ")
    assert [line.split()[1] for line in lines[1:]] == [GPU1_UUID, GPU0_UUID]
    # What its device 0 holds lands in the host's state, on the host's GPU 1.
    holder = inside.popen("region_peer", "hold", "40")
    try:
        wait_for_line(holder, "held")
        on_host = expect_ok(run_python(host, DISCOVERY)).splitlines()
        assert (f"{1024 * MiB} 0 " in on_host[1], f"{2048 * MiB} {40 * MiB} " in on_host[2]) == (True, True)
    finally:
        stop(holder)


def test_a_bad_file_in_a_config_directory_is_named(make_container: ContainerFactory) -> None:
    container = make_container(preload=False, gpus="")
    config = container.workdir / "gpus.d"
    config.mkdir()
    (config / "gpu00.conf").write_text(f"gpu uuid={GPU0_UUID}\n")
    (config / "gpu01.conf").write_text("gpu memory=lots\n")
    container.env["HAMIPY_FAKE_GPU_CONFIG"] = str(config)
    proc = run_python(container, "import pynvml; pynvml.nvmlInit()")
    assert proc.returncode != 0
    assert f"{config}/gpu01.conf:1: bad memory: lots" in proc.stderr


def _only_child(pid: int) -> int:
    (child,) = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return int(child)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_a_process_in_its_own_pid_namespace_is_seen_and_forgotten_by_the_hosts_nvml(
    make_container: ContainerFactory,
) -> None:
    """A container's process is pid 1 or so in its own PID namespace, which the host cannot find by
    that number: the host's NVML still counts its use, reports it under its host pid (as a real
    driver does), and forgets it once it is gone."""
    host = make_container(preload=False)
    holder = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", *host.command("region_peer", "hold", "40")],
        env=host.env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_line(holder, "held")
        inner = _only_child(holder.pid)
        lines = expect_ok(run_python(host, DISCOVERY)).splitlines()
        assert lines[1].endswith(f"[({inner}, {40 * MiB})]")
        assert f"{1024 * MiB} {40 * MiB} " in lines[1]
        os.kill(inner, signal.SIGKILL)  # no chance to give its memory back: the host must notice
        holder.wait(timeout=10)
    finally:
        holder.kill()
        holder.communicate(timeout=10)
    lines = expect_ok(run_python(host, DISCOVERY)).splitlines()
    assert lines[1].endswith(" 0 00000000:3B:00.0 1 0 []")
