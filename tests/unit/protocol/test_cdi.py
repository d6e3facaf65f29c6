"""The CDI devices and spec files of the ``cdi-cri`` strategy (docs/device-plugin.md#cdi): a slot's
spec holds exactly the env and mounts the ``envvar`` strategy answers, under names CDI accepts."""

from __future__ import annotations

import json
import re
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hamipy.protocol import cdi
from hamipy.protocol.allocation_env import ContainerAllocation, Mount, container_allocation, region_dir_name
from hamipy.protocol.cdi import (
    CDI_VERSION,
    GPU_KIND,
    SLOT_KIND,
    CdiDevice,
    CdiMount,
    CdiSpec,
    ContainerEdits,
    decode_spec,
    encode_spec,
    gpu_device,
    parse_spec_file_name,
    slot_cdi_devices,
    slot_device,
    slot_spec,
    spec_file_name,
)
from hamipy.protocol.devices import ContainerDevice
from hamipy.protocol.errors import ProtocolError

GPU_A = "GPU-0fc3eda5-e98b-a25b-5b0d-cf5c855d1448"
GPU_B = "GPU-00552014-5c87-89ac-b1a6-7b53aa24b0ec"
POD_UID = "5b9f3e0c-2d7a-4c1e-9f5e-7a6b8c9d0e1f"
HOOK = "/usr/local/vgpu"
TWO = [ContainerDevice(GPU_A, "NVIDIA", 2500, 25), ContainerDevice(GPU_B, "NVIDIA", 2000, 60)]

# CDI's rules (tags.cncf.io/container-device-interface/pkg/parser): the device name's first and
# last characters a letter or digit, those between letters, digits, '_', '-', '.' or ':'.
CDI_DEVICE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")
CDI_QUALIFIED = re.compile(r"([A-Za-z][A-Za-z0-9_.-]*[A-Za-z0-9])/([A-Za-z][A-Za-z0-9_-]*[A-Za-z0-9])=(.+)")

dns_labels = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", fullmatch=True)
pod_uids = st.one_of(st.uuids().map(str), st.from_regex(r"[0-9a-f]{32}", fullmatch=True))
"""What the API server gives pods: a UUID, or (a static pod) the hex of its manifest's hash."""


def allocation() -> ContainerAllocation:
    return container_allocation(
        TWO, pod_uid=POD_UID, container_name="cuda", cache_id="c0ffee", hook_path=HOOK
    )


def test_the_slots_spec_holds_the_env_and_mounts_of_the_envvar_answer() -> None:
    envvar = container_allocation(
        TWO,
        pod_uid=POD_UID,
        container_name="cuda",
        cache_id="c0ffee",
        hook_path=HOOK,
        memory_scaling=2.0,
        core_policy="force",
        log_level=3,
        task_priority=0,
    )
    spec = slot_spec(envvar, pod_uid=POD_UID, container_name="cuda")
    assert (spec.cdi_version, spec.kind) == (CDI_VERSION, SLOT_KIND)
    (device,) = spec.devices
    assert device.name == f"{POD_UID}_cuda"
    edits = device.container_edits
    assert dict(e.split("=", 1) for e in edits.env) == dict(envvar.envs)
    assert len(edits.env) == len(envvar.envs)
    as_mounts = [Mount(m.container_path, m.host_path, read_only="ro" in m.options) for m in edits.mounts]
    assert as_mounts == list(envvar.mounts)
    for m in edits.mounts:
        # What containerd's CRI plugin makes of the same kubelet mount: a private recursive bind.
        assert m.type == "bind"
        assert m.options == ("rbind", "rprivate", "ro" if "ro" in m.options else "rw")
    assert [m.options[-1] for m in edits.mounts] == ["ro", "rw", "ro", "ro"]


def test_a_spec_file_is_cdi_json() -> None:
    spec = slot_spec(allocation(), pod_uid=POD_UID, container_name="cuda")
    doc = json.loads(encode_spec(spec))
    assert doc["cdiVersion"] == "0.5.0"
    assert doc["kind"] == "hami.io/vgpu"
    (device,) = doc["devices"]
    assert device["name"] == f"{POD_UID}_cuda"
    assert set(device["containerEdits"]) == {"env", "mounts"}
    assert device["containerEdits"]["mounts"][0] == {
        "hostPath": f"{HOOK}/libvgpu.so",
        "containerPath": f"{HOOK}/libvgpu.so",
        "type": "bind",
        "options": ["rbind", "rprivate", "ro"],
    }
    assert decode_spec(encode_spec(spec)) == spec


def test_spec_level_edits_are_written_only_where_a_spec_has_them() -> None:
    """The NVIDIA toolkit's spec carries edits of its own (the driver) beside its devices' (each
    GPU); a slot's spec has none, and no empty field is written."""
    mount = CdiMount(
        host_path="/lib/libcuda.so.1", container_path="/lib/libcuda.so.1", type="bind", options=("ro",)
    )
    gpu = CdiDevice(name=GPU_A, container_edits=ContainerEdits(mounts=(mount,)))
    spec = CdiSpec(
        cdi_version=CDI_VERSION,
        kind=GPU_KIND,
        devices=(gpu,),
        container_edits=ContainerEdits(env=("NVIDIA_VISIBLE_DEVICES=void",), mounts=(mount,)),
    )
    doc = json.loads(encode_spec(spec))
    assert doc["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert set(doc["devices"][0]["containerEdits"]) == {"mounts"}
    assert decode_spec(encode_spec(spec)) == spec
    assert "containerEdits" not in json.loads(
        encode_spec(slot_spec(allocation(), pod_uid=POD_UID, container_name="c"))
    )


def test_a_spec_that_is_not_one_is_refused() -> None:
    with pytest.raises(ProtocolError, match="cdi spec"):
        decode_spec(b'{"cdiVersion": "0.5.0"}')


def test_the_answer_names_the_slot_then_each_gpu() -> None:
    assert slot_cdi_devices(POD_UID, "cuda", [GPU_A, GPU_B]) == (
        f"hami.io/vgpu={POD_UID}_cuda",
        f"nvidia.com/gpu={GPU_A}",
        f"nvidia.com/gpu={GPU_B}",
    )
    assert gpu_device(GPU_A).startswith(f"{GPU_KIND}=")


def test_the_spec_file_name_is_cdis_transient_name_and_reads_back() -> None:
    name = spec_file_name(POD_UID, "cuda")
    assert name == f"hami.io-vgpu_{POD_UID}_cuda.json"
    assert parse_spec_file_name(name) == (POD_UID, "cuda")


@pytest.mark.parametrize(
    "name",
    [
        "nvidia.com-gpu.json",
        f"hami.io-vgpu_{POD_UID}_cuda.yaml",
        f".hami.io-vgpu_{POD_UID}_cuda.json.1234.tmp",
        f"hami.io-vgpu_{POD_UID}.json",
        "hami.io-vgpu_..json",
        f"hami.io-vgpu_{POD_UID}_a/b.json",
    ],
)
def test_file_names_not_of_a_slots_spec_are_refused(name: str) -> None:
    with pytest.raises(ProtocolError):
        parse_spec_file_name(name)


@given(pod_uid=pod_uids, container=dns_labels)
def test_every_pod_uid_and_container_name_maps_to_a_cdi_name_one_to_one(pod_uid: str, container: str) -> None:
    qualified = slot_device(pod_uid, container)
    match = CDI_QUALIFIED.fullmatch(qualified)
    assert match is not None
    assert match[1] + "/" + match[2] == SLOT_KIND
    assert CDI_DEVICE_NAME.fullmatch(match[3]), qualified
    assert match[3] == region_dir_name(pod_uid, container)
    assert parse_spec_file_name(spec_file_name(pod_uid, container)) == (pod_uid, container)


def test_a_uid_starting_with_a_digit_needs_cdi_0_5_0() -> None:
    """CDI refuses a spec whose version is below what its features need; a device name that
    starts with a digit needs 0.5.0 and mounts with a type 0.4.0, so 0.5.0 is the least."""
    digit_uid = str(uuid.UUID("0" * 32))
    assert slot_device(digit_uid, "c") == f"hami.io/vgpu={digit_uid}_c"
    assert cdi.CDI_VERSION == "0.5.0"


@pytest.mark.parametrize(
    ("pod_uid", "container"),
    [
        (POD_UID, "cuda-"),  # a plain file name, but a CDI name ends with a letter or digit
        (POD_UID, "cuda_"),
        ("../x", "cuda"),
        (POD_UID, "a/b"),
        ("", "cuda"),
    ],
)
def test_names_cdi_would_refuse_are_refused(pod_uid: str, container: str) -> None:
    with pytest.raises(ProtocolError):
        slot_device(pod_uid, container)


@pytest.mark.parametrize("gpu", ["", "GPU-a,GPU-b", "GPU-a=b", "GPU a"])
def test_gpu_names_cdi_would_refuse_are_refused(gpu: str) -> None:
    with pytest.raises(ProtocolError):
        gpu_device(gpu)
