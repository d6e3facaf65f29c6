"""Compute isolation on the real GPU: the work-kernel loop under
CUDA_DEVICE_SM_LIMIT gets its share of the unlimited rate, as work done per second and as NVML's
per-process utilization; two containers at 30 and 70 split the GPU about 3:7, also with several
processes per container, different block sizes, CUDA graphs and cooperative launches. Settle time
and mean error per target go to the results file (docs/isolation.md, "Measured on a real GPU")."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from gpu_support import Container, Results, finish, steady_rate, tracking

SECONDS = 12.0
TOLERANCE = 10.0  # points of the GPU: the mean share after settling
SPLIT_TOLERANCE = 0.1  # of the GPU: a 30/70 pair's split, 0.3 +/- 0.1

Make = Callable[..., Container]


def loop_args(*, block: int = 256, how: str = "plain", seconds: float = SECONDS) -> list[str]:
    return ["loop", "--seconds", str(seconds), "--block", str(block), "--how", how]


@pytest.fixture(scope="module")
def unlimited(tmp_path_factory: pytest.TempPathFactory, native_build: Any) -> dict[tuple[int, str], float]:
    """Kernels per second with the interposer and no limit, per (block, how): the 100 % mark."""
    rates: dict[tuple[int, str], float] = {}
    for block, how in (
        (256, "plain"),
        (64, "plain"),
        (1024, "plain"),
        (256, "ex"),
        (256, "coop"),
        (256, "graph"),
    ):
        workdir = tmp_path_factory.mktemp(f"unlimited-{block}-{how}")
        result = Container(workdir).run("probe.py", *loop_args(block=block, how=how, seconds=6.0))
        rates[(block, how)] = steady_rate(result["samples"])
    return rates


class NvmlSampler:
    """NVML per-process SM utilization of some pids, polled in a thread while they run."""

    def __init__(self) -> None:
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.samples: dict[int, list[float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> NvmlSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.nvml.nvmlShutdown()

    def _poll(self) -> None:
        seen = 0
        while not self._stop.wait(0.5):
            try:
                batch = self.nvml.nvmlDeviceGetProcessUtilization(self.handle, seen)
            except self.nvml.NVMLError:
                continue  # no new samples yet
            for sample in batch:
                seen = max(seen, int(sample.timeStamp))
                self.samples.setdefault(int(sample.pid), []).append(float(sample.smUtil))

    def mean(self, pids: Sequence[int], skip: int = 4) -> float | None:
        """Mean summed utilization of `pids` (their samples after the first `skip` each)."""
        means = [statistics.fmean(s[skip:]) for pid in pids if len(s := self.samples.get(pid, [])) > skip]
        return sum(means) if means else None


def run_together(
    groups: Sequence[tuple[Container, Sequence[str], int]],
) -> list[tuple[list[dict[str, Any]], float | None]]:
    """Starts every (container, probe args, processes) at once; per group, the answers and the
    NVML utilization of its processes together."""
    with NvmlSampler() as nvml:
        started = [[c.start("probe.py", *args) for _ in range(n)] for c, args, n in groups]
        answers = [[finish(p, "loop") for p in procs] for procs in started]
    return [(group, nvml.mean([p.pid for p in procs])) for group, procs in zip(answers, started, strict=True)]


def rate_of(answers: Sequence[dict[str, Any]]) -> float:
    return sum(steady_rate(a["samples"], skip_s=3.0) for a in answers)


@pytest.mark.parametrize("target", [10, 30, 50, 70, 90])
def test_one_container_gets_its_share(
    target: int, container: Make, unlimited: dict[tuple[int, str], float], gpu_results: Results
) -> None:
    """Work per second and NVML utilization at the target, within TOLERANCE points."""
    c = container({"CUDA_DEVICE_SM_LIMIT": str(target)})
    ((answers, nvml_share),) = run_together([(c, loop_args(), 1)])
    track = tracking(answers[0]["samples"], unlimited[(256, "plain")], target)
    gpu_results.record("compute", {f"sm_{target}": {**track.as_dict(), "nvml_util": nvml_share}})
    assert abs(track.mean_share - target) <= TOLERANCE, track
    assert nvml_share is None or abs(nvml_share - target) <= TOLERANCE + 5, nvml_share


@pytest.mark.parametrize(
    ("how", "block"), [("plain", 64), ("plain", 1024), ("ex", 256), ("coop", 256), ("graph", 256)]
)
def test_every_launch_path_and_block_size_is_limited(
    how: str, block: int, container: Make, unlimited: dict[tuple[int, str], float], gpu_results: Results
) -> None:
    """At 30 %: small and large blocks, cuLaunchKernelEx, cooperative launches and CUDA graphs."""
    c = container({"CUDA_DEVICE_SM_LIMIT": "30"})
    result = c.run("probe.py", *loop_args(block=block, how=how))
    track = tracking(result["samples"], unlimited[(block, how)], 30)
    gpu_results.record("compute", {f"path_{how}_{block}": track.as_dict()})
    assert abs(track.mean_share - 30) <= TOLERANCE, track


@pytest.mark.parametrize(
    ("name", "processes", "blocks"),
    [("one_each", 1, (256, 256)), ("two_each", 2, (256, 256)), ("mixed_blocks", 1, (64, 1024))],
)
def test_two_containers_split_3_to_7(
    name: str,
    processes: int,
    blocks: tuple[int, int],
    container: Make,
    unlimited: dict[tuple[int, str], float],
    gpu_results: Results,
) -> None:
    """Containers at 30 % and 70 % running together split the work about 3:7 (as a fraction of
    the two's total) and each stays near its share of the unlimited rate."""
    low = container({"CUDA_DEVICE_SM_LIMIT": "30"})
    high = container({"CUDA_DEVICE_SM_LIMIT": "70"})
    start = time.monotonic()
    groups = run_together(
        [(low, loop_args(block=blocks[0]), processes), (high, loop_args(block=blocks[1]), processes)]
    )
    shares = [
        100.0 * rate_of(answers) / unlimited[(block, "plain")]
        for (answers, _), block in zip(groups, blocks, strict=True)
    ]
    split = shares[0] / (shares[0] + shares[1])
    nvml_shares = [nvml for _, nvml in groups]
    gpu_results.record(
        "compute",
        {
            f"pair_{name}": {
                "shares": [round(s, 1) for s in shares],
                "split_low": round(split, 3),
                "nvml_util": nvml_shares,
                "wall_s": round(time.monotonic() - start, 1),
            }
        },
    )
    assert abs(split - 0.3) <= SPLIT_TOLERANCE, shares
    assert abs(shares[0] - 30) <= TOLERANCE, shares
    assert abs(shares[1] - 70) <= TOLERANCE + 5, shares


def test_no_limit_runs_at_full_rate(
    container: Make, unlimited: dict[tuple[int, str], float], gpu_results: Results
) -> None:
    """The interposer with no limit against no interposer: the same rate (the reference for
    every share above is itself unthrottled)."""
    bare = container(preload=False).run("probe.py", *loop_args(seconds=6.0))
    ratio = unlimited[(256, "plain")] / steady_rate(bare["samples"])
    gpu_results.record("compute", {"unlimited_vs_bare": round(ratio, 3)})
    assert 0.9 <= ratio <= 1.1, ratio
