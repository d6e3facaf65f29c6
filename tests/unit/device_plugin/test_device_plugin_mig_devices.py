"""What a node with MIG GPUs advertises, per strategy: dynamic (``operatingmode: mig``) GPUs with
their profiles and instance capacity, static instances under ``single``/``mixed``, MIG GPUs left
out under ``none``; and the kubelet's fake IDs per registered device."""

from __future__ import annotations

import pytest

from hamipy.device_plugin.devices import (
    MIG_GPU_SKIPPED,
    MIG_NO_PROFILE,
    MIG_SINGLE_UNSPLIT,
    Gpu,
    MigDevice,
    dynamic_mig_gpus,
    gpu_of,
    kubelet_devices,
    mig_findings,
    register_devices,
)
from hamipy.protocol import decode_node_devices, encode_node_devices
from hamipy.protocol.config import load_config
from hamipy.protocol.devices import MigPlacement, MigProfile

PROFILE_1G = MigProfile("1g.10gb", 9984, 15, 1, tuple(MigPlacement(i, 1) for i in range(7)))
PROFILE_3G = MigProfile("3g.40gb", 40192, 43, 4, (MigPlacement(0, 4), MigPlacement(4, 4)))
MIG_A = "MIG-aaaaaaaa-0000-4000-8000-000000000001"
MIG_B = "MIG-aaaaaaaa-0000-4000-8000-000000000002"
DYNAMIC = Gpu(
    0,
    "GPU-aaaa",
    "NVIDIA A100-SXM4-80GB",
    81920,
    1,
    "3B",
    mig_profiles=(PROFILE_1G, PROFILE_3G),
    mig_capacity=7,
)
NO_PROFILE = Gpu(1, "GPU-bbbb", "Tesla V100-PCIE-32GB", 32768, 0, "86")
SPLIT = Gpu(
    2,
    "GPU-cccc",
    "NVIDIA A100-SXM4-80GB",
    81920,
    1,
    "3C",
    mig_enabled=True,
    mig_devices=(MigDevice(MIG_A, "3g.40gb", 40192, 43), MigDevice(MIG_B, "1g.10gb", 9984, 15)),
)
PLAIN = Gpu(3, "GPU-dddd", "NVIDIA A100-SXM4-80GB", 81920, 0, "3D")


def _settings(node: str) -> str:
    return f"nodeConfigs:\n  - name: n1\n    {node}\n"


def test_a_mig_node_registers_each_gpu_with_its_profiles_and_capacity() -> None:
    settings = load_config(_settings("operatingmode: mig")).for_node("n1")
    devices = register_devices([DYNAMIC, NO_PROFILE], settings)
    assert [(d.id, d.count, d.devmem, d.devcore, d.mode, d.mig_profiles) for d in devices] == [
        ("GPU-aaaa", 7, 81920, 100, "mig", (PROFILE_1G, PROFILE_3G))
    ]
    assert decode_node_devices(encode_node_devices(devices)) == devices
    assert [d.id for d in kubelet_devices([DYNAMIC, NO_PROFILE], settings)] == [
        f"GPU-aaaa-{i}" for i in range(7)
    ]
    assert [g.uuid for g in dynamic_mig_gpus([DYNAMIC, NO_PROFILE], settings)] == ["GPU-aaaa"]
    (finding,) = mig_findings([DYNAMIC, NO_PROFILE], settings)
    assert (finding.gpu.uuid, finding.reason) == ("GPU-bbbb", MIG_NO_PROFILE)
    assert "GPU-bbbb" in finding.message


@pytest.mark.parametrize("strategy", ["single", "mixed"])
def test_static_instances_register_one_exclusive_device_each(strategy: str) -> None:
    settings = load_config(_settings(f"migstrategy: {strategy}")).for_node("n1")
    devices = register_devices([SPLIT], settings)
    assert [
        (d.id, d.index, d.count, d.devmem, d.devcore, d.type, d.numa, d.mode, d.mig_profiles) for d in devices
    ] == [
        (MIG_A, 2, 1, 40192, 43, "NVIDIA A100-SXM4-80GB MIG 3g.40gb", 1, "mig", ()),
        (MIG_B, 2, 1, 9984, 15, "NVIDIA A100-SXM4-80GB MIG 1g.10gb", 1, "mig", ()),
    ]
    ids = [d.id for d in kubelet_devices([SPLIT], settings)]
    assert ids == [f"{MIG_A}-0", f"{MIG_B}-0"]
    assert [gpu_of(i) for i in ids] == [MIG_A, MIG_B]
    assert dynamic_mig_gpus([SPLIT], settings) == []
    assert mig_findings([SPLIT], settings) == []


def test_mixed_serves_instances_and_shared_gpus_side_by_side() -> None:
    settings = load_config(_settings("migstrategy: mixed")).for_node("n1")
    devices = register_devices([SPLIT, PLAIN], settings)
    assert [(d.id, d.mode, d.count) for d in devices] == [
        (MIG_A, "mig", 1),
        (MIG_B, "mig", 1),
        ("GPU-dddd", "hami-core", 10),
    ]


def test_single_refuses_a_gpu_that_is_not_split() -> None:
    settings = load_config(_settings("migstrategy: single")).for_node("n1")
    (finding,) = mig_findings([SPLIT, PLAIN], settings)
    assert (finding.gpu.uuid, finding.reason) == ("GPU-dddd", MIG_SINGLE_UNSPLIT)
    assert "GPU-dddd" in finding.message
    assert "not in MIG mode" in finding.message


def test_none_leaves_a_mig_enabled_gpu_out_and_says_so() -> None:
    settings = load_config("nodeConfigs: []\n").for_node("n1")
    assert [d.id for d in register_devices([SPLIT, PLAIN], settings)] == ["GPU-dddd"]
    assert [d.id for d in kubelet_devices([SPLIT, PLAIN], settings)] == [f"GPU-dddd-{i}" for i in range(10)]
    (finding,) = mig_findings([SPLIT, PLAIN], settings)
    assert (finding.gpu.uuid, finding.reason) == ("GPU-cccc", MIG_GPU_SKIPPED)


def test_an_unhealthy_parent_makes_its_instances_unhealthy() -> None:
    settings = load_config(_settings("migstrategy: mixed")).for_node("n1")
    assert {d.health for d in register_devices([SPLIT], settings, unhealthy={"GPU-cccc"})} == {False}
    assert {d.healthy for d in kubelet_devices([SPLIT], settings, unhealthy={"GPU-cccc"})} == {False}
