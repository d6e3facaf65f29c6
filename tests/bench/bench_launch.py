"""Cost of a kernel launch through libvgpu.so when no compute limit applies.

Runs ``native/build/tests/launch_paths_are_throttled bench N`` (N launches of an empty kernel
through ``cuLaunchKernel``, timed in the program) over the fake driver:

- ``driver``: no interposer, the fake driver's own cost;
- ``no_limit``: the interposer, no SM limit (the fast path: two loads and a branch);
- ``limit_switch_off``: an SM limit of 30 % in the region, default policy, and the monitor's
  ``utilization_switch`` at 0 (GPU not shared), so the launch takes the slow path to find out
  that it is not limited;
- ``limit_policy_disable``: the same limit with ``GPU_CORE_UTILIZATION_POLICY=disable`` (fast path).

Target (docs/isolation.md, docs/design.md#performance-targets): at most 100 ns added per launch when
no limit applies.
Each figure is the median of REPEATS runs, the configurations interleaved. The same program runs
on a machine with a GPU (it loads a real empty kernel from PTX there): pass ``--real-driver`` to
leave the fake driver off the library path. Run as ``python tests/bench/bench_launch.py``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

from _results import record  # tests/bench is sys.path[0] when run as a script

from hamipy.protocol.region import build_region

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "native"
BUILD = NATIVE / "build"
LAUNCHES = 2_000_000
REPEATS = 7
TARGET_ADDED_NS = 100.0
GPU_UUID = "GPU-11111111-2222-4333-8444-555555555555"


def _run(env: dict[str, str], launches: int) -> float:
    proc = subprocess.run(
        [str(BUILD / "tests" / "launch_paths_are_throttled"), "bench", str(launches)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    m = re.search(r"ns_per_launch=(\S+)", proc.stdout)
    if m is None:
        raise RuntimeError(f"no figure in {proc.stdout!r} (stderr {proc.stderr!r})")
    return float(m[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real-driver", action="store_true", help="use the installed libcuda, not the fake")
    parser.add_argument("--launches", type=int, default=LAUNCHES)
    args = parser.parse_args()
    subprocess.run(["make", "-C", str(NATIVE)], check=True, capture_output=True)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        config = work / "gpus.conf"
        config.write_text(f"gpu uuid={GPU_UUID} memory=16g\n")
        base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HAMIPY_FAKE_GPU_CONFIG": str(config)}
        if not args.real_driver:
            base["LD_LIBRARY_PATH"] = str(BUILD / "fake")
        preload = {"LD_PRELOAD": str(BUILD / "libvgpu.so")}

        def region(name: str, *, sm_limit: int = 0, utilization_switch: int = 1) -> dict[str, str]:
            """A region file for a run; written ahead (as the monitor would have) when limited."""
            path = work / f"{name}.cache"
            if sm_limit:
                image = build_region(
                    uuids=[GPU_UUID],
                    sm_limits=[sm_limit],
                    utilization_switch=utilization_switch,
                    recent_kernel=2,
                )
                path.write_bytes(image)
            return {"CUDA_DEVICE_MEMORY_SHARED_CACHE": str(path)}

        configs = {
            "driver": base,
            "no_limit": {**base, **preload, **region("none")},
            "limit_switch_off": {**base, **preload, **region("off", sm_limit=30, utilization_switch=0)},
            "limit_policy_disable": {
                **base,
                **preload,
                **region("disabled"),
                "CUDA_DEVICE_SM_LIMIT": "30",
                "GPU_CORE_UTILIZATION_POLICY": "disable",
            },
        }
        # Interleaved, so that a change of load on a shared machine hits every configuration alike.
        samples: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(REPEATS):
            for name, env in configs.items():
                samples[name].append(_run(env, args.launches))
        ns = {name: round(statistics.median(values), 2) for name, values in samples.items()}
    driver, no_limit = ns["driver"], ns["no_limit"]
    switch_off, disabled = ns["limit_switch_off"], ns["limit_policy_disable"]

    added = round(no_limit - driver, 2)
    record(
        "launch_overhead" + ("_real_driver" if args.real_driver else ""),
        {
            "launches_per_run": args.launches,
            "driver_ns_per_launch": driver,
            "no_limit_ns_per_launch": no_limit,
            "limit_switch_off_ns_per_launch": switch_off,
            "limit_policy_disable_ns_per_launch": disabled,
            "added_ns_no_limit": added,
            "added_ns_limit_switch_off": round(switch_off - driver, 2),
            "added_ns_policy_disable": round(disabled - driver, 2),
            "target_added_ns": TARGET_ADDED_NS,
            "met": added <= TARGET_ADDED_NS,
        },
    )


if __name__ == "__main__":
    main()
