"""Allocate in the ``cdi-cri`` strategy (docs/device-plugin.md#cdi): the answer names the slot's
and its GPUs' CDI devices and carries no env or mounts; the slot's spec file, written whole
before the answer, holds exactly what the ``envvar`` answer gives the same slot."""

from __future__ import annotations

import stat
from pathlib import Path

import grpc
import pytest
from allocator_support import (
    UUID_B,
    UUID_C,
    allocate_request,
    dev,
    legit_pod,
    make_allocator,
    phase_of,
    plugin_stub,
    recording_pod_patches,
    refused_over_grpc,
    waiting_pod,
)
from builders import container
from plugin_fakes import node_kube

from hamipy.device_plugin.cdi_specs import SPEC_FILE_MODE
from hamipy.protocol.allocation_env import Mount
from hamipy.protocol.cdi import decode_spec

SPEC = "hami.io-vgpu_uid-ns-legit_main.json"


async def test_the_answer_names_the_slot_and_its_gpus_and_nothing_else(tmp_path: Path) -> None:
    pair = waiting_pod(
        "pair", container("main", gpu=2, gpumem=1000, gpucores=10), slots=[[dev(UUID_B), dev(UUID_C)]]
    )
    allocator = await make_allocator(node_kube(pair), tmp_path, strategy="cdi-cri")
    async with plugin_stub(allocator) as stub:
        response = await stub.Allocate(allocate_request(f"{UUID_B}-0", f"{UUID_C}-1"), timeout=10)
    (answer,) = response.container_responses
    assert [d.name for d in answer.cdi_devices] == [
        "hami.io/vgpu=uid-ns-pair_main",
        f"nvidia.com/gpu={UUID_B}",
        f"nvidia.com/gpu={UUID_C}",
    ]
    assert (dict(answer.envs), list(answer.mounts), list(answer.devices)) == ({}, [], [])
    assert dict(answer.annotations) == {}


async def test_the_spec_is_written_whole_before_the_answer(tmp_path: Path) -> None:
    path = tmp_path / "cdi" / SPEC
    api = node_kube(legit_pod())
    written_first = recording_pod_patches(api, path)
    allocator = await make_allocator(api, tmp_path, strategy="cdi-cri")
    (answer,) = await allocator.allocate([[f"{UUID_B}-0"]])
    assert answer.cdi_devices == ("hami.io/vgpu=uid-ns-legit_main", f"nvidia.com/gpu={UUID_B}")
    assert written_first == [True], "written before the pod is marked served"
    assert stat.S_IMODE(path.stat().st_mode) == SPEC_FILE_MODE == 0o644
    assert sorted(p.name for p in path.parent.iterdir()) == [SPEC], "nothing staged is left"
    assert phase_of(api, "legit") == "success"
    # The limits file the spec mounts is written as in the envvar strategy.
    limits = tmp_path / "vgpu" / "containers" / "uid-ns-legit_main" / "limits"
    assert answer.limits_path == str(limits)
    assert limits.read_text().startswith("CUDA_DEVICE_MEMORY_LIMIT_0=30000m\n")


async def test_the_spec_holds_the_env_and_mounts_the_envvar_answer_gives(tmp_path: Path) -> None:
    envvar_dir, cdi_dir = tmp_path / "envvar", tmp_path / "cdi-run"
    (envvar,) = await (await make_allocator(node_kube(legit_pod()), envvar_dir)).allocate([[f"{UUID_B}-0"]])
    await (await make_allocator(node_kube(legit_pod()), cdi_dir, strategy="cdi-cri")).allocate(
        [[f"{UUID_B}-0"]]
    )
    spec = decode_spec((cdi_dir / "cdi" / SPEC).read_bytes())
    (device,) = spec.devices
    assert (spec.kind, device.name) == ("hami.io/vgpu", "uid-ns-legit_main")
    edits = device.container_edits
    # Same slot, same cache id: the two answers differ only in the test's directory.
    env = dict(e.split("=", 1) for e in edits.env)
    assert env == {k: v.replace(str(envvar_dir), str(cdi_dir)) for k, v in envvar.envs.items()}
    mounts = [Mount(m.container_path, m.host_path, read_only="ro" in m.options) for m in edits.mounts]
    assert mounts == [
        Mount(
            m.container_path.replace(str(envvar_dir), str(cdi_dir)),
            m.host_path.replace(str(envvar_dir), str(cdi_dir)),
            m.read_only,
        )
        for m in envvar.mounts
    ]


async def test_an_allocate_replaces_a_spec_already_there(tmp_path: Path) -> None:
    path = tmp_path / "cdi" / SPEC
    path.parent.mkdir()
    path.write_bytes(b"stale")
    await (await make_allocator(node_kube(legit_pod()), tmp_path, strategy="cdi-cri")).allocate(
        [[f"{UUID_B}-0"]]
    )
    assert decode_spec(path.read_bytes()).devices[0].name == "uid-ns-legit_main"


async def test_a_spec_that_cannot_be_written_fails_the_pod_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "cdi").write_text("a file where the spec directory should be")
    api = node_kube(legit_pod())
    error = await refused_over_grpc(await make_allocator(api, tmp_path, strategy="cdi-cri"), f"{UUID_B}-0")
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "pod ns/legit" in (error.details() or "")
    assert phase_of(api, "legit") == "failed"


@pytest.mark.parametrize("strategy", ["envvar", "cdi-cri"])
async def test_only_the_cdi_strategy_writes_specs(tmp_path: Path, strategy: str) -> None:
    await (await make_allocator(node_kube(legit_pod()), tmp_path, strategy=strategy)).allocate(
        [[f"{UUID_B}-0"]]
    )
    assert (tmp_path / "cdi" / SPEC).exists() == (strategy == "cdi-cri")
