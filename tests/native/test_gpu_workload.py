"""gpu-workload (the dev cluster's GPU pods' program) over the fake driver: under the interposer it
is granted its limit and refused past it with CUDA_ERROR_OUT_OF_MEMORY, as a CUDA application
is; without it, the whole fake GPU. It holds what it got until SIGTERM, and says so in lines that
``parse_workload_log`` reads."""

from __future__ import annotations

import queue
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from native_support import GPU0_UUID, GPU1_UUID, RUN_TIMEOUT_S, Container, ContainerFactory, GiB, MiB

from hamipy.devcluster.workload_log import WORKLOAD_LOG_PREFIX, WorkloadLog, parse_workload_log
from hamipy.protocol.region import parse_region

pytestmark = pytest.mark.native

OOM = 2
LIMIT_MIB = 700  # not a multiple of the chunk: the last chunk is what is left
CHUNK_MIB = 256


def command(container: Container, *args: str) -> list[str]:
    return [str(container.build / "gpu-workload"), *args]


def run(container: Container, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command(container, *args),
        env=container.env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )


def finished(container: Container, *args: str) -> WorkloadLog:
    proc = run(container, "--exit", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return parse_workload_log(proc.stdout)


def limited(make_container: ContainerFactory, how: str) -> Container:
    """A container whose device 0 is limited to LIMIT_MIB, by its environment or, as the device
    plugin sets it, by the limits file beside the interposer."""
    if how == "env":
        return make_container(limits={"CUDA_DEVICE_MEMORY_LIMIT_0": f"{LIMIT_MIB}m"})
    probe = make_container()
    region = probe.workdir / "served.cache"
    text = f"CUDA_DEVICE_MEMORY_LIMIT_0={LIMIT_MIB}m\nCUDA_DEVICE_MEMORY_SHARED_CACHE={region}\n"
    container = make_container(limits_file=text)
    container.env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(region)  # where the tests look for it
    return container


@pytest.mark.parametrize("how", ["env", "limits-file"])
def test_under_the_interposer_it_gets_its_limit_and_oom_past_it(
    make_container: ContainerFactory, how: str
) -> None:
    log = finished(limited(make_container, how), "--chunk-mib", str(CHUNK_MIB))

    device = log.one("device", index=0)
    assert (device["uuid"], device["name"]) == (GPU0_UUID, "NVIDIA A100-SXM4-80GB")
    assert device["total"] == device["free"] == LIMIT_MIB * MiB
    alloc = log.one("alloc", index=0)
    assert alloc["granted"] == LIMIT_MIB * MiB
    assert (alloc["refused_with"], alloc["refused_name"]) == (OOM, "CUDA_ERROR_OUT_OF_MEMORY")
    assert (alloc["total"], alloc["free"]) == (LIMIT_MIB * MiB, 0)
    # Device 1 has no limit of its own: the whole fake GPU.
    assert log.one("alloc", index=1)["granted"] == 2 * GiB


def test_without_the_interposer_it_gets_the_whole_fake_gpu(make_container: ContainerFactory) -> None:
    container = make_container(limits={"CUDA_DEVICE_MEMORY_LIMIT_0": f"{LIMIT_MIB}m"}, preload=False)
    log = finished(container, "--chunk-mib", str(CHUNK_MIB))

    assert log.one("driver") == {"event": "driver", "version": 12040, "devices": 2}
    assert [(d["uuid"], d["total"]) for d in log.of("device")] == [(GPU0_UUID, 1 * GiB), (GPU1_UUID, 2 * GiB)]
    for index, size in enumerate([1 * GiB, 2 * GiB]):
        alloc = log.one("alloc", index=index)
        assert (alloc["granted"], alloc["refused_with"]) == (size, OOM)
    assert [fact["event"] for fact in log.events][-2:] == ["ready", "exit"]


def test_max_mib_holds_that_much_and_tries_nothing_past_it(make_container: ContainerFactory) -> None:
    log = finished(limited(make_container, "env"), "--max-mib", "100", "--chunk-mib", "64")
    alloc = log.one("alloc", index=0)
    assert alloc["granted"] == 100 * MiB
    assert (alloc["refused_with"], alloc["refused_name"]) == (None, None)
    assert alloc["free"] == (LIMIT_MIB - 100) * MiB


def test_kernels_are_launched_on_every_device(make_container: ContainerFactory) -> None:
    log = finished(make_container(), "--kernel-seconds", "0.2", "--max-mib", "1")
    for index in (0, 1):
        kernels = log.one("kernels", index=index)
        assert kernels["launches"] > 0
        assert (kernels["result"], kernels["result_name"]) == (0, "CUDA_SUCCESS")


def lines(proc: subprocess.Popen[str]) -> Iterator[str]:
    """The process's stdout lines, each awaited for at most RUN_TIMEOUT_S."""
    received: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            received.put(line)
        received.put(None)

    threading.Thread(target=pump, name="gpu-workload-stdout", daemon=True).start()
    while (line := received.get(timeout=RUN_TIMEOUT_S)) is not None:
        yield line


def region_usage(path: Path) -> int:
    return parse_region(path.read_bytes()).devices[0].used_bytes


def test_it_holds_its_memory_until_sigterm(make_container: ContainerFactory) -> None:
    container = limited(make_container, "env")
    proc = subprocess.Popen(
        command(container, "--chunk-mib", str(CHUNK_MIB)),
        env=container.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        output = lines(proc)
        seen = ""
        for line in output:
            seen += line
            if line == WORKLOAD_LOG_PREFIX + '{"event":"ready"}\n':
                break
        granted = parse_workload_log(seen).one("alloc", index=0)["granted"]
        assert granted == LIMIT_MIB * MiB
        # Ready and still running: what it holds is in the region, where the monitor reads it.
        assert proc.poll() is None
        assert region_usage(container.region_path) == granted
        proc.send_signal(signal.SIGTERM)
        rest = parse_workload_log("".join(output))
        assert proc.wait(timeout=RUN_TIMEOUT_S) == 0
    finally:
        proc.kill()
        proc.communicate(timeout=RUN_TIMEOUT_S)
    assert rest.one("exit") == {"event": "exit", "signal": signal.SIGTERM}
    assert region_usage(container.region_path) == 0


def test_a_driver_that_cannot_start_is_an_error_event(make_container: ContainerFactory) -> None:
    container = make_container()
    container.env["HAMIPY_FAKE_GPU_CONFIG"] = str(container.workdir / "missing.conf")
    proc = run(container)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    error = parse_workload_log(proc.stdout).one("error")
    assert (error["call"], error["result"], error["result_name"]) == ("cuInit", 100, "CUDA_ERROR_NO_DEVICE")


@pytest.mark.parametrize(
    "args",
    [["--chunk-mib", "0"], ["--chunk-mib", "-1"], ["--kernel-seconds", "soon"], ["--max-mib"], ["--bogus"]],
    ids=["zero-chunk", "negative-chunk", "not-seconds", "missing-value", "unknown-flag"],
)
def test_bad_arguments_exit_2_with_usage(make_container: ContainerFactory, args: list[str]) -> None:
    proc = run(make_container(), *args)
    assert proc.returncode == 2
    assert "usage:" in proc.stderr
    assert proc.stdout == ""
