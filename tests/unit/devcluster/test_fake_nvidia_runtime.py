"""The dev cluster's stand-in for nvidia-container-runtime: which containers get the fake driver,
and what their driver configuration lists."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hamipy.devcluster.fake_nvidia_runtime import (
    CONFIG_IN_CONTAINER,
    STATE_IN_CONTAINER,
    container_config,
    inject,
    runc_command,
)

HOST = (
    "context_memory = 300m\n"
    "state = /somewhere/else.state\n"
    'gpu uuid=GPU-a name="NVIDIA A100" memory=40g\n'
    'gpu uuid=GPU-b name="NVIDIA A100" memory=40g\n'
    'gpu uuid=GPU-c name="NVIDIA A100" memory=40g\n'
)


def test_a_container_sees_only_its_gpus_in_its_order_each_on_the_hosts_slot() -> None:
    lines = container_config(HOST, "GPU-c,GPU-a").splitlines()
    assert lines == [
        "context_memory = 300m",
        f"state = {STATE_IN_CONTAINER}",
        'gpu uuid=GPU-c name="NVIDIA A100" memory=40g slot=2',
        'gpu uuid=GPU-a name="NVIDIA A100" memory=40g slot=0',
    ]
    assert container_config(HOST, "all").count("gpu uuid=") == 3
    assert "slot=1" in container_config(HOST, "1")


def test_a_mig_instance_is_listed_by_its_uuid_for_the_driver_to_find_in_the_nodes_state() -> None:
    lines = container_config(HOST, "MIG-4f3a0000-0000-4000-8000-000000000001,GPU-b").splitlines()
    assert lines[2:] == [
        "gpu uuid=MIG-4f3a0000-0000-4000-8000-000000000001",
        'gpu uuid=GPU-b name="NVIDIA A100" memory=40g slot=1',
    ]


def test_an_unknown_gpu_is_refused() -> None:
    with pytest.raises(SystemExit, match="GPU-z"):
        container_config(HOST, "GPU-z")


def spec(*env: str) -> dict[str, Any]:
    return {"process": {"env": list(env)}, "mounts": []}


@pytest.mark.parametrize("env", [(), ("NVIDIA_VISIBLE_DEVICES=void",), ("NVIDIA_VISIBLE_DEVICES=none",)])
def test_containers_that_ask_no_gpu_are_left_alone(tmp_path: Path, env: tuple[str, ...]) -> None:
    config = tmp_path / "gpus.conf"
    config.write_text(HOST)
    s = spec(*env)
    assert not inject(s, host_config=config, libs=tmp_path, container_conf=tmp_path / "c" / "x.conf")
    assert s == spec(*env)


def test_a_gpu_container_gets_the_driver_its_config_and_the_hosts_state(tmp_path: Path) -> None:
    config = tmp_path / "gpus.conf"
    config.write_text(HOST)
    s = spec("NVIDIA_VISIBLE_DEVICES=GPU-a", "NVIDIA_VISIBLE_DEVICES=GPU-b")  # the last one wins
    own = tmp_path / "containers" / "x.conf"
    assert inject(s, host_config=config, libs=tmp_path / "fake", container_conf=own)
    mounts = {m["destination"]: m for m in s["mounts"]}
    assert mounts["/usr/lib/x86_64-linux-gnu/libcuda.so.1"]["source"] == str(
        tmp_path / "fake" / "libcuda.so.1"
    )
    assert "ro" in mounts["/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"]["options"]
    assert mounts[CONFIG_IN_CONTAINER]["source"] == str(own)
    assert mounts[STATE_IN_CONTAINER]["source"] == f"{config}.state"
    assert "rw" in mounts[STATE_IN_CONTAINER]["options"]
    assert f"HAMIPY_FAKE_GPU_CONFIG={CONFIG_IN_CONTAINER}" in s["process"]["env"]
    assert "uuid=GPU-b" in own.read_text()
    assert "uuid=GPU-a" not in own.read_text()


def test_runc_command_lines_are_read_past_runcs_global_flags() -> None:
    argv = ["--root", "/run/r", "--log", "/l.json", "--log-format", "json", "create", "--bundle", "/b", "id1"]
    assert runc_command(argv) == ("create", "/b", "id1")
    assert runc_command(["--systemd-cgroup", "delete", "--force", "id2"]) == ("delete", ".", "id2")
    assert runc_command(["--version"]) == (None, ".", None)
