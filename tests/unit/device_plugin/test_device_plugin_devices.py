"""What the plugin advertises: register entries, kubelet fake devices and their GPUs (the preferred
allocation: test_device_plugin_preferred.py)."""

from __future__ import annotations

from hamipy.device_plugin.devices import Gpu, gpu_of, kubelet_devices, register_devices
from hamipy.protocol import decode_node_devices, encode_node_devices
from hamipy.protocol.config import Config, load_config

A100 = Gpu(index=0, uuid="GPU-aaaa", name="NVIDIA A100-SXM4-80GB", memory_mib=81920, numa=1, pci_bus_id="3B")
V100 = Gpu(index=1, uuid="GPU-bbbb", name="Tesla V100-PCIE-32GB", memory_mib=32768, numa=0, pci_bus_id="86")


def test_register_entries_follow_hami() -> None:
    devices = register_devices([A100, V100], Config().for_node("n1"))
    assert [
        (d.id, d.index, d.count, d.devmem, d.devcore, d.type, d.numa, d.mode, d.health) for d in devices
    ] == [
        ("GPU-aaaa", 0, 10, 81920, 100, "NVIDIA A100-SXM4-80GB", 1, "hami-core", True),
        ("GPU-bbbb", 1, 10, 32768, 100, "NVIDIA-Tesla V100-PCIE-32GB", 0, "hami-core", True),
    ]
    # The annotation value round-trips through the protocol codec.
    assert decode_node_devices(encode_node_devices(devices)) == devices


def test_scaling_split_and_filters_come_from_the_node_config() -> None:
    config = load_config(
        """
nvidia:
  deviceSplitCount: 4
  deviceMemoryScaling: 1.5
nodeConfigs:
  - name: n1
    deviceCoreScaling: 2
    filterDevices: {uuid: [GPU-aaaa]}
"""
    )
    devices = register_devices([A100, V100], config.for_node("n1"))
    assert [(d.id, d.count, d.devmem, d.devcore) for d in devices] == [("GPU-bbbb", 4, 49152, 200)]
    fakes = kubelet_devices([A100, V100], config.for_node("n1"))
    assert [f.id for f in fakes] == [f"GPU-bbbb-{i}" for i in range(4)]
    # Another node keeps both GPUs.
    assert len(register_devices([A100, V100], config.for_node("n2"))) == 2


def test_unhealthy_gpu_is_reported_in_both_views() -> None:
    settings = Config().for_node("n1")
    assert [d.health for d in register_devices([A100, V100], settings, unhealthy={"GPU-bbbb"})] == [
        True,
        False,
    ]
    fakes = kubelet_devices([A100, V100], settings, unhealthy={"GPU-bbbb"})
    assert {f.healthy for f in fakes if f.id.startswith("GPU-bbbb")} == {False}
    assert {f.healthy for f in fakes if f.id.startswith("GPU-aaaa")} == {True}
    assert {f.numa for f in fakes if f.id.startswith("GPU-aaaa")} == {1}


def test_gpu_of_strips_the_replica_number() -> None:
    assert gpu_of("GPU-11111111-2222-4333-8444-555555555555-7") == "GPU-11111111-2222-4333-8444-555555555555"
    assert gpu_of("GPU-aaaa-²") == "GPU-aaaa-²", "only ASCII digits are a replica number"
