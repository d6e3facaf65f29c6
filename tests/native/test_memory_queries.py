"""cuMemGetInfo_v2, cuDeviceTotalMem_v2 and NVML memory info agree: total = min(limit, physical),
free = total - used, never negative, for a tiny limit, a limit larger than the GPU and none."""

from __future__ import annotations

import pytest
from native_support import ContainerFactory, GiB, MiB, expect_ok, run_python

pytestmark = pytest.mark.native

PYNVML_MEMORY = """
import pynvml
pynvml.nvmlInit()
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    m = pynvml.nvmlDeviceGetMemoryInfo(h)
    m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    print(i, m.total, m.free, m.used, m2.total, m2.free)
"""


@pytest.mark.parametrize(
    ("limit", "expected_total"),
    [("64m", 64 * MiB), ("65536m", 1 * GiB), ("", 1 * GiB), (str(100 * MiB), 100 * MiB)],
    ids=["tiny-64MiB", "larger-than-gpu", "no-limit", "plain-bytes"],
)
def test_memory_queries_agree(make_container: ContainerFactory, limit: str, expected_total: int) -> None:
    container = make_container(limits={"CUDA_DEVICE_MEMORY_LIMIT_0": limit} if limit else {})
    expect_ok(container.run("meminfo_queries_agree", str(expected_total), "16"))


def test_context_footprint_past_the_limit_leaves_free_at_zero(make_container: ContainerFactory) -> None:
    # Each context takes 80 MiB of a 64 MiB slice: counted, free reads 0 (not negative), and the
    # allocation is what gets refused.
    container = make_container(
        limits={"CUDA_DEVICE_MEMORY_LIMIT_0": "64m"}, extra_config="context_memory = 80m\n"
    )
    out = expect_ok(container.run("meminfo_queries_agree", str(64 * MiB), "0"))
    assert f"free=0 total={64 * MiB}" in out
    assert f"container={80 * MiB}" in out
    proc = container.run("region_peer", "alloc", "1")
    assert proc.returncode == 2, proc.stderr


def test_pynvml_sees_the_limited_gpu(make_container: ContainerFactory) -> None:
    container = make_container(limits={"CUDA_DEVICE_MEMORY_LIMIT_0": "64m"})
    proc = run_python(container, PYNVML_MEMORY)
    lines = expect_ok(proc).splitlines()
    assert lines[0].split() == ["0", str(64 * MiB), str(64 * MiB), "0", str(64 * MiB), str(64 * MiB)]
    assert lines[1].split()[1] == str(2 * GiB)  # device 1 has no limit: the physical size
