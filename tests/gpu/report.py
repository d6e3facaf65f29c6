"""The short table of a tests/gpu results file: `python3 tests/gpu/report.py [results.json] [--markdown]`.

Plain text for the terminal (run.sh prints it), or Markdown for docs/isolation.md's "Measured on a
real GPU" section. Sections the run did not reach are left out, not shown as zero.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DEFAULT = Path(__file__).resolve().parent / "results" / "gpu.json"


def rows(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(what, figure) pairs in reading order."""
    m = doc.get("machine", {})
    out = [
        ("device", f"{m.get('gpu', '?')} ({m.get('gpu_memory_mib', '?')} MiB)"),
        (
            "driver / CUDA",
            f"{m.get('driver', '?')} / {m.get('cuda_driver_api', '?')}; {m.get('nvcc') or 'no nvcc'}",
        ),
        ("frameworks", f"torch {m.get('torch', '?')}, cupy {m.get('cupy', '?')}"),
    ]
    s = doc.get("sections", {})
    memory = s.get("memory", {})
    paths = sorted(
        k for k in memory if k.startswith(("driver_", "cupy_", "torch_")) and "allocated_mib" in memory[k]
    )
    for key in paths:
        r = memory[key]
        out.append((f"memory 4096m: {key}", f"{r['allocated_mib']} MiB then {r.get('error') or 'no error'}"))
    if "meminfo_4096m" in memory:
        d = memory["meminfo_4096m"]["driver"]
        out.append(
            ("memory 4096m: seen total", f"CUDA {d['cu_total'] >> 20} MiB, NVML {d['nvml_total'] >> 20} MiB")
        )
    compute = s.get("compute", {})
    for key in sorted(compute, key=_target_order):
        r = compute[key]
        if isinstance(r, dict) and "target" in r:
            settle = "never" if r["settle_s"] is None else f"{r['settle_s']} s"
            nvml = f", NVML {r['nvml_util']:.0f} %" if isinstance(r.get("nvml_util"), int | float) else ""
            out.append(
                (
                    f"compute {key}",
                    f"share {r['mean_share']} % (error {r['mean_error']}), settle {settle}{nvml}",
                )
            )
        elif isinstance(r, dict) and "split_low" in r:
            out.append((f"compute {key} (30/70)", f"shares {r['shares']}, low's part {r['split_low']}"))
    if "unlimited_vs_bare" in compute:
        out.append(("compute: no limit / bare", str(compute["unlimited_vs_bare"])))
    cost = s.get("cost", {})
    if "driver" in cost:
        added = cost["driver"]["added"]
        out.append(
            (
                "cost per launch / alloc+free",
                f"+{added['ns_per_launch']} ns / +{added['ns_per_alloc_free']} ns",
            )
        )
    if "pytorch" in cost:
        p = cost["pytorch"]
        for name in ("interposer", "limit_100"):
            if name in p:
                out.append(
                    (
                        f"cost {name}",
                        f"matmul x{p[name]['matmul_slowdown']}, train step x{p[name]['train_slowdown']}",
                    )
                )
    nvml = s.get("nvml", {})
    if nvml:
        out.append(
            (
                "real NVML",
                ", ".join(f"{k}={v}" for k, v in sorted(nvml.items()) if not isinstance(v, dict | list)),
            )
        )
    return out


def _target_order(key: str) -> tuple[int, str]:
    digits = "".join(ch for ch in key if ch.isdigit())
    return (int(digits) if key.startswith("sm_") and digits else 1000, key)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", nargs="?", type=Path, default=DEFAULT)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    try:
        doc = json.loads(args.results.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"report: cannot read {args.results}: {exc}", file=sys.stderr)
        return 2
    table = rows(doc)
    if args.markdown:
        print(f"Run of {doc.get('when', '?')}.\n\n| what | measured |\n|---|---|")
        for what, figure in table:
            print(f"| {what} | {figure} |")
    else:
        width = max(len(what) for what, _ in table)
        for what, figure in table:
            print(f"{what:<{width}}  {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
