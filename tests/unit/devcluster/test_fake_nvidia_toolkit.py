"""The toolkit stand-in's ``nvidia.com/gpu`` CDI spec (``hamipy.devcluster.fake_nvidia_toolkit``):
shaped as ``nvidia-ctk cdi generate --device-name-strategy=uuid`` writes it, and giving a container
the same fake driver configuration the ``nvidia`` runtime writes for the same GPUs. What containerd
makes of it is tests/integration/real_runtime/test_cdi_in_containers.py's."""

from __future__ import annotations

import json
from pathlib import Path

from hamipy.devcluster.fake_nvidia_runtime import CONFIG_ENV, STATE_IN_CONTAINER, container_config
from hamipy.devcluster.fake_nvidia_toolkit import (
    CONFIG_DIR_IN_CONTAINER,
    SPEC_FILE,
    FakeNvidiaToolkit,
    gpu_spec,
)
from hamipy.devcluster.gpu_nodes import FakeGpu, fake_gpu_config
from hamipy.protocol.cdi import GPU_KIND, decode_spec, gpu_device

GPUS = tuple(FakeGpu(f"GPU-0fc3eda5-0000-4000-8000-00000000000{i}") for i in range(3))
FILES, LIBS, STATE = Path("/node/driver/cdi"), Path("/native/fake"), Path("/node/driver/gpus.conf.state")


def test_one_device_per_gpu_named_by_uuid_each_mounting_only_its_own_gpu() -> None:
    spec, texts = gpu_spec(fake_gpu_config(GPUS), files=FILES, libs=LIBS, state=STATE)
    assert spec.kind == GPU_KIND
    assert [f"{GPU_KIND}={d.name}" for d in spec.devices] == [gpu_device(g.uuid) for g in GPUS]
    for index, device in enumerate(spec.devices):
        # CDI refuses a device without edits; each one's is its GPU's file in the config directory.
        (mount,) = device.container_edits.mounts
        assert device.container_edits.env == ()
        assert mount.container_path == f"{CONFIG_DIR_IN_CONTAINER}/{Path(mount.host_path).name}"
        host_line = fake_gpu_config(GPUS).splitlines()[index]
        assert texts[Path(mount.host_path).name] == f"{host_line} slot={index}\n"


def test_the_spec_puts_the_driver_in_and_hands_out_nothing_by_env() -> None:
    spec, _ = gpu_spec(fake_gpu_config(GPUS), files=FILES, libs=LIBS, state=STATE)
    assert spec.container_edits is not None
    assert spec.container_edits.env == (
        "NVIDIA_VISIBLE_DEVICES=void",
        f"{CONFIG_ENV}={CONFIG_DIR_IN_CONTAINER}",
    )
    mounts = {m.container_path: (m.host_path, m.options[-1]) for m in spec.container_edits.mounts}
    assert mounts == {
        "/usr/lib/x86_64-linux-gnu/libcuda.so.1": (f"{LIBS}/libcuda.so.1", "ro"),
        "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1": (f"{LIBS}/libnvidia-ml.so.1", "ro"),
        f"{CONFIG_DIR_IN_CONTAINER}/driver.conf": (f"{FILES}/driver.conf", "ro"),
        STATE_IN_CONTAINER: (str(STATE), "rw"),
    }


def test_a_container_given_gpus_by_cdi_gets_the_configuration_the_runtime_writes_for_them() -> None:
    host = "driver_version = 535.104.05\n" + fake_gpu_config(GPUS)
    spec, texts = gpu_spec(host, files=FILES, libs=LIBS, state=STATE)
    chosen = [spec.devices[2], spec.devices[0]]
    # The driver reads the directory in name order: the settings, then the GPUs in the host's order.
    names = sorted(["driver.conf", *(Path(d.container_edits.mounts[0].host_path).name for d in chosen)])
    by_cdi = "".join(texts[name] for name in names)
    assert by_cdi == container_config(host, f"{GPUS[0].uuid},{GPUS[2].uuid}")


def test_written_at_node_start_into_the_nodes_cdi_dir(tmp_path: Path) -> None:
    driver_config = tmp_path / "plugin" / "driver" / "gpus.conf"
    toolkit = FakeNvidiaToolkit(driver_config, LIBS, GPUS)
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    toolkit.write_cdi_specs(cdi_dir)
    spec = decode_spec((cdi_dir / SPEC_FILE).read_bytes())
    assert (spec.kind, len(spec.devices)) == (GPU_KIND, len(GPUS))
    assert (
        json.loads((cdi_dir / SPEC_FILE).read_bytes())["containerEdits"]["env"][0]
        == "NVIDIA_VISIBLE_DEVICES=void"
    )
    for device in spec.devices:
        assert Path(device.container_edits.mounts[0].host_path).is_file()
    assert Path(f"{driver_config}.state").is_file()  # mounted: it must exist before the driver makes it
