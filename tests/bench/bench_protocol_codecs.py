"""Decode cost of the two hottest wire formats: the extender reads them on every node/pod event.

- ``hami.io/node-nvidia-register`` of a 16-GPU node, JSON form, as upstream's device plugin writes it;
- a 10-container pod device list (init container without GPU, nine containers with one or two GPUs).

Target: <= 20 us per decode (p50). The stdlib ``json.loads`` of the register value is timed too:
it is the floor of that decode, so the figures can be read on a slow or busy machine.
Run: ``python tests/bench/bench_protocol_codecs.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import percentiles_us, record, time_calls

from hamipy.protocol.devices import ContainerDevice, DeviceInfo
from hamipy.protocol.node_devices import decode_node_devices, encode_node_devices
from hamipy.protocol.pod_devices import decode_pod_devices, encode_pod_devices

TARGET_US = 20.0
ITERATIONS = 20_000


def _uuid(i: int) -> str:
    return f"GPU-0fc3eda5-e98b-a25b-5b0d-cf5c855d{i:04x}"


REGISTER_16 = encode_node_devices(
    [
        DeviceInfo(
            id=_uuid(i),
            index=i,
            count=10,
            devmem=81559,
            devcore=100,
            type="NVIDIA-NVIDIA H100 80GB HBM3",
            numa=i // 8,
            mode="hami-core",
            health=True,
        )
        for i in range(16)
    ]
)
POD_10 = encode_pod_devices(
    [[]]
    + [
        [ContainerDevice(_uuid(c), "NVIDIA", 4096, 25)]
        + ([ContainerDevice(_uuid(c + 8), "NVIDIA", 4096, 25)] if c % 3 == 0 else [])
        for c in range(1, 10)
    ]
)


def main() -> None:
    assert len(decode_node_devices(REGISTER_16)) == 16
    assert len(decode_pod_devices(POD_10)) == 10
    register = percentiles_us(time_calls(lambda: decode_node_devices(REGISTER_16), iterations=ITERATIONS))
    pod = percentiles_us(time_calls(lambda: decode_pod_devices(POD_10), iterations=ITERATIONS))
    # The floor of the JSON decode: the stdlib parser alone, without validation or records.
    loads_only = percentiles_us(time_calls(lambda: json.loads(REGISTER_16), iterations=ITERATIONS))
    record(
        "protocol_codecs",
        {
            "target_us": TARGET_US,
            "register_16gpu_json_bytes": len(REGISTER_16),
            "register_16gpu_decode": register,
            "register_16gpu_met": register["p50_us"] <= TARGET_US,
            "register_16gpu_json_loads_only": loads_only,
            "pod_10_containers_bytes": len(POD_10),
            "pod_10_containers_decode": pod,
            "pod_10_containers_met": pod["p50_us"] <= TARGET_US,
            "iterations": ITERATIONS,
        },
    )


if __name__ == "__main__":
    main()
