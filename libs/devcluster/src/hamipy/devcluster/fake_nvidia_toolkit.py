"""The dev cluster's stand-in for the NVIDIA container toolkit on a real-runtime GPU node, with
native/'s fake driver in place of the real one: the ``nvidia`` runtime handler
(``fake_nvidia_runtime``, the driver put in from ``NVIDIA_VISIBLE_DEVICES``) and the node's
``nvidia.com/gpu`` CDI spec, written at node start into the directory containerd reads, as
``nvidia-ctk cdi generate --device-name-strategy=uuid`` writes it.

The spec is shaped as the toolkit's: one device per GPU, named by its UUID, and spec-level edits,
applied once before the first of its devices, that put the driver in and set
``NVIDIA_VISIBLE_DEVICES=void`` (so the runtime hands out nothing more). A real driver sees the
GPUs whose device nodes (``/dev/nvidia<N>``, each GPU's edit) it reaches; the fake driver sees the
GPU lines of its configuration. So each device's edit mounts that GPU's line, with the host's slot
(where its use is counted), as one file of the configuration directory the spec-level edits point
``HAMIPY_FAKE_GPU_CONFIG`` at: the container's driver sees exactly the GPUs named, numbered in the
host's order as a real driver numbers the nodes it finds. The spec-level edits mount the fake
``libcuda.so.1`` and ``libnvidia-ml.so.1``, the driver's settings and the node's shared state.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from hamipy.devcluster.fake_nvidia_runtime import (
    CONFIG_ENV,
    DRIVER_LIBS,
    LIB_DIR_IN_CONTAINER,
    STATE_IN_CONTAINER,
    VISIBLE_DEVICES,
    bind_options,
    driver_settings,
    gpu_lines,
    gpu_with_slot,
    host_state,
)
from hamipy.devcluster.gpu_nodes import FakeGpu, fake_gpu_config
from hamipy.protocol.cdi import (
    CDI_VERSION,
    GPU_KIND,
    CdiDevice,
    CdiMount,
    CdiSpec,
    ContainerEdits,
    encode_spec,
    gpu_device,
)

__all__ = ["CONFIG_DIR_IN_CONTAINER", "SPEC_FILE", "FakeNvidiaToolkit", "gpu_spec"]

SPEC_FILE: Final = "nvidia.json"
"""The toolkit's spec in the node's CDI directory."""
CONFIG_DIR_IN_CONTAINER: Final = "/etc/hamipy-fake-gpu/gpus.d"
"""The fake driver's configuration in a container given GPUs by CDI: one file per GPU, beside
``SETTINGS_FILE``."""
SETTINGS_FILE: Final = "driver.conf"


def _mount(host: Path, container: str, *, read_only: bool) -> CdiMount:
    options = tuple(bind_options(read_only=read_only))
    return CdiMount(host_path=str(host), container_path=container, type="bind", options=options)


def _gpu_file(index: int) -> str:
    # Zero-padded: the driver reads the directory in name order, which is then the host's order.
    return f"gpu{index:02d}.conf"


def gpu_spec(host_config: str, *, files: Path, libs: Path, state: Path) -> tuple[CdiSpec, dict[str, str]]:
    """The ``nvidia.com/gpu`` spec of a node whose fake driver is configured by ``host_config``
    (its state at ``state``, its libraries in ``libs``), and the files its edits mount from
    ``files`` (name: text)."""
    settings, gpus = gpu_lines(host_config)
    texts = {SETTINGS_FILE: driver_settings(settings)}
    devices = []
    for index, (uuid, line) in enumerate(gpus):
        name = _gpu_file(index)
        texts[name] = gpu_with_slot(line, index)
        mount = _mount(files / name, f"{CONFIG_DIR_IN_CONTAINER}/{name}", read_only=True)
        devices.append(
            CdiDevice(
                name=gpu_device(uuid).partition("=")[2], container_edits=ContainerEdits(mounts=(mount,))
            )
        )
    driver = ContainerEdits(
        env=(f"{VISIBLE_DEVICES}=void", f"{CONFIG_ENV}={CONFIG_DIR_IN_CONTAINER}"),
        mounts=(
            *(_mount(libs / lib, f"{LIB_DIR_IN_CONTAINER}/{lib}", read_only=True) for lib in DRIVER_LIBS),
            _mount(files / SETTINGS_FILE, f"{CONFIG_DIR_IN_CONTAINER}/{SETTINGS_FILE}", read_only=True),
            _mount(state, STATE_IN_CONTAINER, read_only=False),
        ),
    )
    spec = CdiSpec(cdi_version=CDI_VERSION, kind=GPU_KIND, devices=tuple(devices), container_edits=driver)
    return spec, texts


@dataclasses.dataclass(frozen=True)
class FakeNvidiaToolkit:
    """The toolkit stand-in of one node (a ``containerd_runtime.NvidiaToolkit``): its fake driver
    configured by ``driver_config`` (the device plugin's agent writes it; its state beside it) for
    ``gpus``, the driver's libraries in ``libs``."""

    driver_config: Path
    libs: Path
    gpus: Sequence[FakeGpu]

    def runtime_argv(self, runc: Path) -> list[str]:
        script = Path(__file__).with_name("fake_nvidia_runtime.py")
        return [
            sys.executable,
            str(script),
            f"--config={self.driver_config}",
            f"--libs={self.libs}",
            f"--runc={runc}",
            "--",
        ]

    def write_cdi_specs(self, cdi_dir: Path) -> None:
        files = self.driver_config.parent / "cdi"
        files.mkdir(parents=True, exist_ok=True)
        spec, texts = gpu_spec(
            fake_gpu_config(self.gpus), files=files, libs=self.libs, state=host_state(self.driver_config)
        )
        for name, text in texts.items():
            (files / name).write_text(text)
        (cdi_dir / SPEC_FILE).write_bytes(encode_spec(spec))
