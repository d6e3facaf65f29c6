"""``hami.io/vgpu-mig-allocations`` (docs/wire-format.md#mig-allocations): HAMi's bytes and checks."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hamipy.protocol import keys, mig_allocations
from hamipy.protocol.devices import MigPlacement
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.mig_allocations import (
    MigAllocation,
    decode_mig_allocations,
    encode_mig_allocations,
    runtime_ready,
    with_runtime,
)

KEY = "hami.io/vgpu-mig-allocations"

# What HAMi's EncodeMigAllocations writes for its test pod (mig_profiles_test.go): the scheduler's
# fields only.
SCHEDULED = MigAllocation(0, 0, "GPU-a", "1g.5gb", MigPlacement(6, 1))
SCHEDULED_JSON = (
    '[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"1g.5gb",'
    '"placement":{"start":6,"size":1}}]'
)
# HAMi's runtime-identity test value: a compute instance ID of 0 is written, not left out.
RUNTIME_JSON = (
    '[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"2g.10gb","placement":{"start":0,"size":2},'
    '"migUUID":"MIG-a","gpuInstanceID":4,"computeInstanceID":0}]'
)
RUNTIME = MigAllocation(0, 0, "GPU-a", "2g.10gb", MigPlacement(0, 2), "MIG-a", 4, 0)


def test_public_api_is_complete() -> None:
    assert sorted(mig_allocations.__all__) == [
        "MigAllocation",
        "decode_mig_allocations",
        "encode_mig_allocations",
        "runtime_ready",
        "with_runtime",
    ]
    assert keys.MIG_ALLOCATIONS == KEY
    assert KEY in keys.ALLOCATION_STATE_ANNOTATIONS
    assert KEY in keys.PLUGIN_WRITTEN_ANNOTATIONS


def test_hamis_scheduler_value_round_trips_byte_for_byte() -> None:
    assert encode_mig_allocations([SCHEDULED]) == SCHEDULED_JSON
    assert decode_mig_allocations(SCHEDULED_JSON) == (SCHEDULED,)


def test_zero_instance_ids_are_kept_and_written() -> None:
    assert decode_mig_allocations(RUNTIME_JSON) == (RUNTIME,)
    assert encode_mig_allocations([RUNTIME]) == RUNTIME_JSON
    assert runtime_ready(RUNTIME)
    assert not runtime_ready(SCHEDULED)


def test_with_runtime_adds_the_instance() -> None:
    made = with_runtime(SCHEDULED, "MIG-x", 0, 0)
    assert runtime_ready(made)
    assert encode_mig_allocations([made]).endswith(
        ',"migUUID":"MIG-x","gpuInstanceID":0,"computeInstanceID":0}]'
    )


@pytest.mark.parametrize("value", ["", "null", "[]"])
def test_empty_null_and_no_elements_are_no_allocations(value: str) -> None:
    assert decode_mig_allocations(value) == ()


def test_keys_fold_and_unknown_keys_are_ignored_like_go() -> None:
    value = (
        '[{"ContainerIndex":1,"deviceindex":2,"GPUUUID":"GPU-b","Profile":"3g.20gb",'
        '"Placement":{"Start":4,"Size":4},"extra":true}]'
    )
    assert decode_mig_allocations(value) == (MigAllocation(1, 2, "GPU-b", "3g.20gb", MigPlacement(4, 4)),)


@pytest.mark.parametrize("null", ['"migUUID":"",', '"migUUID":null,"gpuInstanceID":null,'])
def test_empty_or_null_runtime_fields_are_absent(null: str) -> None:
    value = SCHEDULED_JSON[:2] + null + SCHEDULED_JSON[2:]
    assert decode_mig_allocations(value) == (SCHEDULED,)


BAD = {
    # HAMi's refusals (DecodeMigAllocations)
    "container-negative": ('"containerIndex":-1', "[0].containerIndex"),
    "device-negative": ('"deviceIndex":-1', "[0].deviceIndex"),
    "gpu-empty": ('"gpuUUID":""', "[0].gpuUUID"),
    "profile-empty": ('"profile":""', "[0].profile"),
    "size-zero": ('"placement":{"start":0,"size":0}', "[0].placement.size"),
    "partial-runtime": ('"migUUID":"MIG-a"', "[0]"),
    "partial-runtime-ids": ('"gpuInstanceID":1,"computeInstanceID":0', "[0]"),
    # and, unlike Go, a wrong type or a missing key
    "container-null": ('"containerIndex":null', "[0].containerIndex"),
    "device-float": ('"deviceIndex":1.0', "[0].deviceIndex"),
    "gpu-number": ('"gpuUUID":7', "[0].gpuUUID"),
    "gi-negative": ('"migUUID":"M","gpuInstanceID":-1,"computeInstanceID":0', "[0].gpuInstanceID"),
    "ci-overflow": (f'"migUUID":"M","gpuInstanceID":1,"computeInstanceID":{2**32}', "[0].computeInstanceID"),
    "placement-string": ('"placement":"0,1"', "[0].placement"),
}


def _with(fields: str) -> str:
    base = {"containerIndex": 0, "deviceIndex": 0, "gpuUUID": "GPU-a", "profile": "1g.5gb",
            "placement": {"start": 6, "size": 1}}  # fmt: skip
    base.update(json.loads("{" + fields + "}"))
    return json.dumps([base])


@pytest.mark.parametrize(("fields", "field"), BAD.values(), ids=BAD.keys())
def test_malformed_elements_are_refused_naming_the_field(fields: str, field: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_mig_allocations(_with(fields))
    assert info.value.field == KEY + field


@pytest.mark.parametrize("missing", ["containerIndex", "deviceIndex", "gpuUUID", "profile", "placement"])
def test_a_missing_scheduler_key_is_refused(missing: str) -> None:
    obj = json.loads(SCHEDULED_JSON)
    del obj[0][missing]
    with pytest.raises(ProtocolError) as info:
        decode_mig_allocations(json.dumps(obj))
    assert info.value.field == f"{KEY}[0].{missing}"


def test_a_second_allocation_for_one_device_is_refused() -> None:
    # HAMi's TestDecodeMigAllocationsRejectsDuplicateDeviceIndex value.
    value = (
        '[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"1g.5gb","placement":{"start":6,"size":1}},'
        '{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"1g.5gb","placement":{"start":5,"size":1}}]'
    )
    with pytest.raises(ProtocolError) as info:
        decode_mig_allocations(value)
    assert info.value.field == KEY + "[1]"
    with pytest.raises(ProtocolError):
        encode_mig_allocations(decode_mig_allocations(value[: value.index("},{") + 1] + "]") * 2)


@pytest.mark.parametrize("value", ["{}", '"x"', "[1]", "[", "[" * 100_000, "x" * (256 * 1024 + 1)], ids=repr)
def test_malformed_values_are_refused(value: str) -> None:
    with pytest.raises(ProtocolError):
        decode_mig_allocations(value)


@pytest.mark.parametrize(
    "allocation",
    [
        MigAllocation(-1, 0, "GPU-a", "1g.5gb", MigPlacement(0, 1)),
        MigAllocation(0, 0, "", "1g.5gb", MigPlacement(0, 1)),
        MigAllocation(0, 0, "GPU-a", "1g.5gb", MigPlacement(0, 0)),
        MigAllocation(0, 0, "GPU-a", "1g.5gb", MigPlacement(0, 1), "MIG-a"),
        MigAllocation(0, 0, "GPU-a", "1g.5gb", MigPlacement(0, 1), "", 1, 1),
        MigAllocation(0, 0, "GPU-\ud800", "1g.5gb", MigPlacement(0, 1)),
    ],
    ids=["negative-index", "no-gpu", "size-zero", "partial-runtime", "empty-mig-uuid", "surrogate"],
)
def test_encode_refuses_what_decode_would_refuse(allocation: MigAllocation) -> None:
    with pytest.raises(ProtocolError):
        encode_mig_allocations([allocation])


_text = st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=20)
_u32 = st.integers(min_value=0, max_value=2**32 - 1)
_allocation = st.builds(
    MigAllocation,
    container_index=st.integers(min_value=0, max_value=2**63 - 1),
    device_index=st.integers(min_value=0, max_value=2**63 - 1),
    gpu_uuid=_text,
    profile=_text,
    placement=st.builds(MigPlacement, start=_u32, size=st.integers(min_value=1, max_value=2**32 - 1)),
)
_allocations = st.lists(
    st.one_of(_allocation, st.builds(with_runtime, _allocation, _text, _u32, _u32)),
    max_size=6,
    unique_by=lambda a: (a.container_index, a.device_index),
)


@given(_allocations)
def test_decode_inverts_encode(allocations: list[MigAllocation]) -> None:
    assert decode_mig_allocations(encode_mig_allocations(allocations)) == tuple(allocations)


@given(_allocations)
def test_encode_writes_go_struct_order_with_omitempty_runtime_fields(
    allocations: list[MigAllocation],
) -> None:
    for obj, a in zip(json.loads(encode_mig_allocations(allocations)), allocations, strict=True):
        runtime = ["migUUID", "gpuInstanceID", "computeInstanceID"] if runtime_ready(a) else []
        assert list(obj) == ["containerIndex", "deviceIndex", "gpuUUID", "profile", "placement", *runtime]
        assert list(obj["placement"]) == ["start", "size"]
