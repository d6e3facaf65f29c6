"""Parse time of shared regions, as the monitor scrapes them.

One region with 8 live processes on 2 devices (proc_num 8), parsed alone and as a scrape of 100
such regions; and one with proc_num 1024 of which 8 are live (the exited-slot
skip path). Target: 100 regions in at most 50 ms (so one well under 0.5 ms). Run as
``python tests/bench/bench_region.py``.
"""

from __future__ import annotations

from _results import percentiles_us, record, time_calls  # tests/bench is sys.path[0] when run as a script

from hamipy.protocol.region import MemoryUsage, ProcessUsage, build_region, parse_region

MIB = 1 << 20
REGIONS = 100
TARGET_SCRAPE_MS = 50.0


def _region(seed: int, *, proc_num: int | None = None) -> bytearray:
    procs = [
        ProcessUsage(
            slot=slot,
            pid=100 + slot,
            hostpid=10_000 * seed + slot,
            status=1,
            used=(
                MemoryUsage(300 * MIB, 10 * MIB, 512 * MIB * (slot + 1), 0, (822 + 512 * slot) * MIB),
                MemoryUsage(300 * MIB, 10 * MIB, 64 * MIB, 0, 374 * MIB),
            ),
            monitorused_bytes=(900 * MIB, 400 * MIB),
            sm_util=(7, 3),
        )
        for slot in range(8)
    ]
    return build_region(
        uuids=[f"GPU-{seed:08x}-0000-0000-0000-000000000000", f"GPU-{seed:08x}-1111-1111-1111-111111111111"],
        limits=[16 << 30, 16 << 30],
        sm_limits=[50, 50],
        processes=procs,
        priority=1,
        proc_num=proc_num,
    )


def main() -> None:
    regions = [_region(seed) for seed in range(REGIONS)]
    one = regions[0]
    assert len(parse_region(one).processes) == 8

    single = percentiles_us(time_calls(lambda: parse_region(one), iterations=5000, warmup=200))

    def scrape() -> None:
        for buf in regions:
            parse_region(buf)

    # Worst case for the skip path: every slot in use, all but 8 exited.
    full = _region(0, proc_num=1024)
    full_us = percentiles_us(time_calls(lambda: parse_region(full), iterations=1000, warmup=20))

    scrape_us = percentiles_us(time_calls(scrape, iterations=200, warmup=5))
    scrape_ms = scrape_us["p50_us"] / 1000
    record(
        "region_parse",
        {
            "one_region_8_procs_2_devices": single,
            "one_region_proc_num_1024_8_live": full_us,
            f"scrape_{REGIONS}_regions": scrape_us,
            "scrape_p50_ms": round(scrape_ms, 3),
            "target_scrape_ms": TARGET_SCRAPE_MS,
            "met": scrape_us["p99_us"] / 1000 <= TARGET_SCRAPE_MS,
        },
    )


if __name__ == "__main__":
    main()
