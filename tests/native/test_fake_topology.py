"""The fake libnvidia-ml.so.1 answers the topology queries (P2P levels, NVLink state, remote PCI
info and remote device type) from its configuration: per GPU links and per pair levels, or a
preset (hgx8, pcie-pairs8, none), with real NVML's return codes."""

from __future__ import annotations

from collections import Counter

import pytest
from native_support import GPU0_UUID, GPU1_UUID, ContainerFactory, expect_ok, run_python

pytestmark = pytest.mark.native

# What pynvml reads per GPU: its bus id, per enabled link (remote type, remote bus id), and the
# P2P level to every other GPU; NOT_SUPPORTED (no NVLink) reads as "none".
TOPOLOGY = """
import pynvml
pynvml.nvmlInit()
handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
for i, h in enumerate(handles):
    links = []
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(h, link) != pynvml.NVML_FEATURE_ENABLED:
                links.append("off")
                continue
        except pynvml.NVMLError_NotSupported:
            links.append("none")
            break
        except pynvml.NVMLError_InvalidArgument:
            break
        kind = pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(h, link)
        bus = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId
        links.append(("switch" if kind == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH else "gpu") + "@" + bus)
    levels = [pynvml.nvmlDeviceGetTopologyCommonAncestor(h, o) for j, o in enumerate(handles) if j != i]
    print(pynvml.nvmlDeviceGetPciInfo(h).busId, pynvml.nvmlDeviceGetNumaNodeId(h), ",".join(links),
          ",".join(map(str, levels)))
"""


def _read(make_container: ContainerFactory, config: str) -> list[tuple[str, int, list[str], list[int]]]:
    container = make_container(preload=False, gpus=config)
    rows = []
    for line in expect_ok(run_python(container, TOPOLOGY)).splitlines():
        bus, numa, links, levels = line.split(" ")
        rows.append((bus, int(numa), links.split(","), [int(v) for v in levels.split(",")]))
    return rows


def test_hgx8_joins_every_gpu_to_the_nvswitches(make_container: ContainerFactory) -> None:
    rows = _read(make_container, "topology = hgx8\n")
    assert len(rows) == 8
    for i, (_, numa, links, levels) in enumerate(rows):
        assert numa == i // 4
        assert len(links) == 18
        assert all(link.startswith("switch@00000000:E") for link in links)
        assert Counter(link.split(":")[1] for link in links) == {"E0": 5, "E1": 5, "E2": 4, "E3": 4}
        # NODE within a NUMA node, SYS across it (the defaults from the GPUs' NUMA nodes).
        others = [j for j in range(8) if j != i]
        assert levels == [40 if j // 4 == i // 4 else 50 for j in others]


def test_pcie_pairs8_bridges_each_pair_with_12_links(make_container: ContainerFactory) -> None:
    rows = _read(make_container, "topology = pcie-pairs8\n")
    assert len(rows) == 8
    for i, (_, _, links, levels) in enumerate(rows):
        peer_bus = rows[i ^ 1][0]
        assert links == [f"gpu@{peer_bus}"] * 12
        others = [j for j in range(8) if j != i]
        assert levels == [10 if j == i ^ 1 else 40 if j // 4 == i // 4 else 50 for j in others]


@pytest.mark.parametrize("config", ["topology = none\n", "gpu numa=0\ngpu numa=1\ngpu numa=0\n"])
def test_no_nvlink_answers_not_supported(make_container: ContainerFactory, config: str) -> None:
    rows = _read(make_container, config)
    assert len(rows) == (8 if config.startswith("topology") else 3)
    numa = [row[1] for row in rows]
    for i, (_, _, links, levels) in enumerate(rows):
        assert links == ["none"]
        assert levels == [40 if numa[j] == numa[i] else 50 for j in range(len(rows)) if j != i]


def test_explicit_links_and_levels_override_the_preset(make_container: ContainerFactory) -> None:
    """A GPU line's own nvlinks and a p2p line win over the preset; an `off` link is disabled; an
    asymmetric configuration (links one way only) is read as configured."""
    config = (
        "topology = pcie-pairs8\np2p_level = PHB\np2p 0 1 = PXB\n"
        f"gpu uuid={GPU0_UUID} pci=00000000:3B:00.0 nvlinks=off,00000000:86:00.0*2\n"
        f"gpu uuid={GPU1_UUID} pci=00000000:86:00.0 nvlinks=off\n"
        "gpu pci=00000000:C1:00.0\n"
    )
    rows = _read(make_container, config)
    assert [row[2] for row in rows] == [
        ["off", "gpu@00000000:86:00.0", "gpu@00000000:86:00.0"],
        ["off"],
        ["none"],
    ]
    assert [row[3] for row in rows] == [[20, 30], [20, 30], [30, 30]]


@pytest.mark.parametrize(
    ("config", "error"),
    [
        ("topology = dgx\n", "unknown topology (hgx8, pcie-pairs8, none): dgx"),
        ("gpu nvlinks=nvswitch*19\n", "bad nvlinks"),
        ("gpu nvlinks=00000000:3B:00\n", "bad nvlinks"),
        ("gpu\ngpu\np2p 0 1 = FAR\n", "bad p2p level: FAR"),
        ("gpu\ngpu\np2p 0 0 = PIX\n", "bad p2p pair"),
        ("gpu\ngpu\np2p 0 2 = PIX\n", "p2p 2 0 names a GPU past the last (2 GPUs)"),
    ],
)
def test_bad_topology_config_is_reported(make_container: ContainerFactory, config: str, error: str) -> None:
    container = make_container(preload=False, gpus=config)
    proc = run_python(container, "import pynvml; pynvml.nvmlInit()")
    assert proc.returncode != 0
    assert error in proc.stderr


def test_queries_return_nvml_codes(make_container: ContainerFactory) -> None:
    """The C program checks the return codes (past NVML_NVLINK_MAX_LINKS, past a GPU's links, a
    GPU without NVLink, a disabled link, NULL outputs, bad handles) and prints what it read."""
    container = make_container(
        preload=False, gpus="gpu\ngpu nvlinks=off,00000000:01:00.0,nvswitch\np2p 0 1 = PIX\n"
    )
    out = expect_ok(container.run("topology_queries_follow_config")).splitlines()
    assert out == [
        "nvlink 0 none",
        "p2p 0 1 10",
        "link 1 0 0 - -",
        "link 1 1 1 gpu 00000000:01:00.0",
        "link 1 2 1 switch 00000000:E2:00.0",
        "p2p 1 0 10",
    ]
    for preset in ("hgx8", "pcie-pairs8", "none"):
        expect_ok(
            make_container(preload=False, gpus=f"topology = {preset}\n").run("topology_queries_follow_config")
        )
