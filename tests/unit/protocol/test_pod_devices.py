"""Pod device lists ``hami.io/vgpu-devices-{allocated,to-allocate}`` (docs/wire-format.md#device-lists)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hamipy.protocol import keys, pod_devices
from hamipy.protocol.devices import ContainerDevice, PodDevices
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.node_devices import MAX_VALUE_BYTES
from hamipy.protocol.pod_devices import (
    clear_container_slot,
    decode_container_devices,
    decode_pod_devices,
    encode_container_devices,
    encode_pod_devices,
    slot_owners,
)

ALLOCATED = keys.DEVICES_ALLOCATED
GPU = "GPU-0fc3eda5-e98b-a25b-5b0d-cf5c855d1448"

# docs/wire-format.md#device-lists: one container with 3000 MiB, no core limit.
ONE_CONTAINER = f"{GPU},NVIDIA,3000,0:;"
ONE_CONTAINER_DEVICES = [[ContainerDevice(GPU, "NVIDIA", 3000, 0)]]
# docs/wire-format.md#device-lists: a non-GPU init container, then two GPU containers.
INIT_THEN_TWO = ";GPU-A,NVIDIA,2500,25:;GPU-B,NVIDIA,2500,25:;"
INIT_THEN_TWO_DEVICES: PodDevices = [
    [],
    [ContainerDevice("GPU-A", "NVIDIA", 2500, 25)],
    [ContainerDevice("GPU-B", "NVIDIA", 2500, 25)],
]
# One container with two GPUs, a container without, one with one GPU.
MULTI = "GPU-A,NVIDIA,1000,10:GPU-B,NVIDIA,2000,20:;;GPU-C,NVIDIA,0,100:;"
MULTI_DEVICES: PodDevices = [
    [ContainerDevice("GPU-A", "NVIDIA", 1000, 10), ContainerDevice("GPU-B", "NVIDIA", 2000, 20)],
    [],
    [ContainerDevice("GPU-C", "NVIDIA", 0, 100)],
]


def test_public_api_is_complete() -> None:
    assert sorted(pod_devices.__all__) == [
        "DEFAULT_FIELD",
        "clear_container_slot",
        "decode_container_devices",
        "decode_pod_devices",
        "encode_container_devices",
        "encode_pod_devices",
        "slot_owners",
    ]


# -- the wire examples, both ways ---------------------------------------------------------------------

EXAMPLES = {
    "one-container": (ONE_CONTAINER, ONE_CONTAINER_DEVICES),
    "init-then-two": (INIT_THEN_TWO, INIT_THEN_TWO_DEVICES),
    "multi-gpu-and-gap": (MULTI, MULTI_DEVICES),
    "one-empty-slot": (";", [[]]),
    "three-empty-slots": (";;;", [[], [], []]),
    "no-slots": ("", []),
}


@pytest.mark.parametrize(("value", "devices"), EXAMPLES.values(), ids=EXAMPLES.keys())
def test_example_decodes(value: str, devices: PodDevices) -> None:
    assert decode_pod_devices(value) == devices


@pytest.mark.parametrize(("value", "devices"), EXAMPLES.values(), ids=EXAMPLES.keys())
def test_example_encodes_to_upstream_bytes(value: str, devices: PodDevices) -> None:
    assert encode_pod_devices(devices) == value


# -- tolerance, as upstream ---------------------------------------------------------------------------


def test_empty_slots_are_kept_in_place() -> None:
    # v2.10.0 dropped them (#2899, #3079), moving container 2's GPU onto container 1.
    decoded = decode_pod_devices(";;GPU-A,NVIDIA,1,1:;")
    assert decoded == [[], [], [ContainerDevice("GPU-A", "NVIDIA", 1, 1)]]


def test_last_slot_terminator_may_be_missing() -> None:
    assert decode_pod_devices(INIT_THEN_TWO[:-1]) == INIT_THEN_TWO_DEVICES


def test_last_device_terminator_may_be_missing() -> None:
    assert decode_pod_devices("GPU-A,NVIDIA,1,2;") == [[ContainerDevice("GPU-A", "NVIDIA", 1, 2)]]


def test_cores_above_100_pass_as_upstream() -> None:
    assert decode_pod_devices("GPU-A,NVIDIA,1,200:;") == [[ContainerDevice("GPU-A", "NVIDIA", 1, 200)]]


def test_int32_limits_are_accepted() -> None:
    top = 2**31 - 1
    expected = [[ContainerDevice("GPU-A", "NVIDIA", top, top)]]
    assert decode_pod_devices(f"GPU-A,NVIDIA,{top},{top}:;") == expected


# -- one container's devices ------------------------------------------------------------------------


def test_container_devices_round_trip_upstream_format() -> None:
    devs = MULTI_DEVICES[0]
    assert encode_container_devices(devs) == "GPU-A,NVIDIA,1000,10:GPU-B,NVIDIA,2000,20:"
    assert decode_container_devices("GPU-A,NVIDIA,1000,10:GPU-B,NVIDIA,2000,20:") == devs
    assert decode_container_devices("") == []


def test_container_devices_name_the_device_of_a_bad_field() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_container_devices("GPU-A,NVIDIA,1,1:GPU-B,NVIDIA,1, 1:", field=ALLOCATED)
    assert info.value.field == ALLOCATED + "[1].usedcores"
    assert info.value.value == "GPU-B,NVIDIA,1, 1"


def test_container_devices_refuse_slot_separator() -> None:
    with pytest.raises(ProtocolError, match="must not hold ';'"):
        decode_container_devices("GPU-A,NVIDIA,1,1:;")


# -- clearing a served container's slot -------------------------------------------------------------


def test_clear_slot_empties_only_that_slot() -> None:
    cleared = clear_container_slot(INIT_THEN_TWO_DEVICES, 1)
    assert cleared == [[], [], [ContainerDevice("GPU-B", "NVIDIA", 2500, 25)]]
    assert encode_pod_devices(cleared) == ";;GPU-B,NVIDIA,2500,25:;"


def test_clear_slot_returns_a_new_list() -> None:
    original = [list(slot) for slot in MULTI_DEVICES]
    cleared = clear_container_slot(original, 0)
    cleared[2].append(ContainerDevice("GPU-X", "NVIDIA", 1, 1))
    assert original == MULTI_DEVICES


@pytest.mark.parametrize("index", [3, -1, 100], ids=["one-past-end", "negative", "far-past-end"])
def test_clear_slot_out_of_range_is_refused(index: int) -> None:
    with pytest.raises(ProtocolError, match="no such container slot; the list has 3 slots"):
        clear_container_slot(MULTI_DEVICES, index, field=ALLOCATED)


# -- laws ---------------------------------------------------------------------------------------------


def _no_blank(text: str) -> bool:
    return not any(c.isspace() for c in text)


_field_text = st.characters(codec="utf-8", exclude_characters=",:;")
_uuid = st.text(alphabet=_field_text, min_size=1, max_size=40).filter(_no_blank)
_type = st.text(alphabet=_field_text, min_size=1, max_size=12).filter(_no_blank)
_i32 = st.integers(min_value=0, max_value=2**31 - 1)
container_devices = st.builds(ContainerDevice, uuid=_uuid, type=_type, usedmem=_i32, usedcores=_i32)
pods = st.lists(st.lists(container_devices, max_size=4), max_size=12)


@given(pods)
def test_decode_inverts_encode(devices: PodDevices) -> None:
    assert decode_pod_devices(encode_pod_devices(devices)) == devices


@given(pods)
def test_slot_count_is_preserved(devices: PodDevices) -> None:
    assert encode_pod_devices(devices).count(";") == len(devices)


@given(pods, st.data())
def test_clearing_a_slot_changes_only_that_slot(devices: PodDevices, data: st.DataObject) -> None:
    if not devices:
        return
    index = data.draw(st.integers(min_value=0, max_value=len(devices) - 1))
    cleared = decode_pod_devices(encode_pod_devices(clear_container_slot(devices, index)))
    assert cleared[index] == []
    others = [s for i, s in enumerate(devices) if i != index]
    assert [s for i, s in enumerate(cleared) if i != index] == others


# -- malformed input ----------------------------------------------------------------------------------

BAD = {
    "three-fields": ("GPU-A,NVIDIA,1:;", "[0][0]"),
    "five-fields": ("GPU-A,NVIDIA,1,2,3:;", "[0][0]"),
    "truncated": ("GPU-A,NVI", "[0][0]"),
    "doubled-device-separator": ("GPU-A,NVIDIA,1,1::GPU-B,NVIDIA,1,1:;", "[0][1]"),
    "lone-device-separator": (":;", "[0][0]"),
    "uuid-empty": (",NVIDIA,1,1:;", "[0][0].uuid"),
    "uuid-blank": ("GPU A,NVIDIA,1,1:;", "[0][0].uuid"),
    "uuid-leading-blank": (";GPU-A,NVIDIA,1,1: GPU-B,NVIDIA,1,1:;", "[1][1].uuid"),
    "type-blank": ("GPU-A,NVIDIA,1,1:;GPU-B,NV IDIA,1,1:;", "[1][0].type"),
    "newline-after-cores": ("GPU-A,NVIDIA,1,1\n:;", "[0][0].usedcores"),
    "type-empty": ("GPU-A,,1,1:;", "[0][0].type"),
    "mem-not-a-number": ("GPU-A,NVIDIA,lots,1:;", "[0][0].usedmem"),
    "mem-negative": ("GPU-A,NVIDIA,-1,1:;", "[0][0].usedmem"),
    "mem-empty": ("GPU-A,NVIDIA,,1:;", "[0][0].usedmem"),
    "mem-blank": ("GPU-A,NVIDIA, 1,1:;", "[0][0].usedmem"),
    "mem-fraction": ("GPU-A,NVIDIA,1.5,1:;", "[0][0].usedmem"),
    "mem-overflow": (f"GPU-A,NVIDIA,{2**31},1:;", "[0][0].usedmem"),
    "mem-non-ascii-digit": ("GPU-A,NVIDIA,\u0663,1:;", "[0][0].usedmem"),
    "cores-negative": ("GPU-A,NVIDIA,1,-1:;", "[0][0].usedcores"),
    "cores-overflow": (f"GPU-A,NVIDIA,1,{2**40}:;", "[0][0].usedcores"),
    "bad-in-later-slot": (";GPU-A,NVIDIA,1,1:GPU-B,NVIDIA,x,1:;", "[1][1].usedmem"),
}


@pytest.mark.parametrize(("value", "field"), BAD.values(), ids=BAD.keys())
def test_malformed_entry_is_refused_naming_the_field(value: str, field: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_pod_devices(value, field=ALLOCATED)
    assert info.value.field == ALLOCATED + field
    assert ALLOCATED + field in str(info.value)


# Why a number was refused: a sign is "negative" only when ASCII digits follow it.
NUMBER_REASONS = {
    "minus-digits": ("-5", "must not be negative"),
    "plus-digits": ("+5", "not a decimal integer"),
    "lone-minus": ("-", "not a decimal integer"),
    "minus-letters": ("-x", "not a decimal integer"),
    "minus-non-ascii-digit": ("-\u0663", "not a decimal integer"),
}


@pytest.mark.parametrize(("text", "reason"), NUMBER_REASONS.values(), ids=NUMBER_REASONS.keys())
def test_number_errors_say_why(text: str, reason: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_pod_devices(f"GPU-A,NVIDIA,{text},1:;", field=ALLOCATED)
    assert (info.value.field, info.value.value, info.value.reason) == (
        f"{ALLOCATED}[0][0].usedmem",
        text,
        reason,
    )


def test_largest_memory_passes_while_bad_cores_are_named() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_pod_devices(f"GPU-A,NVIDIA,{2**31 - 1},x:;", field=ALLOCATED)
    assert info.value.field == f"{ALLOCATED}[0][0].usedcores"


# A blank is reported with the device entry that holds it and the field it falls in.
BLANKS = {
    "second-slot": (";GPU-A,NVIDIA,1, 2:;", "[1][0].usedcores", "GPU-A,NVIDIA,1, 2"),
    "fifth-field": ("GPU-A,NVIDIA,1,2,x y:;", "[0][0].usedcores", "GPU-A,NVIDIA,1,2,x y"),
    "second-device": ("GPU-A,NVIDIA,1,2:GPU B,NVIDIA,1,2:;", "[0][1].uuid", "GPU B,NVIDIA,1,2"),
}


@pytest.mark.parametrize(("value", "field", "entry"), BLANKS.values(), ids=BLANKS.keys())
def test_blank_names_its_field_and_entry(value: str, field: str, entry: str) -> None:
    with pytest.raises(ProtocolError, match="blank inside a field") as info:
        decode_pod_devices(value, field=ALLOCATED)
    assert (info.value.field, info.value.value) == (ALLOCATED + field, entry)


def _value_of_bytes(size: int, fill: str) -> str:
    """A one-device list of exactly ``size`` UTF-8 bytes, its type ``fill`` repeated."""
    head, tail = "GPU-A,", ",1,2:;"
    room = size - len(head) - len(tail)
    each = len(fill.encode())
    return head + fill * (room // each) + "T" * (room % each) + tail


@pytest.mark.parametrize("fill", ["T", "\u00e9"], ids=["ascii", "multibyte"])
def test_value_of_exactly_256_kib_is_read(fill: str) -> None:
    value = _value_of_bytes(MAX_VALUE_BYTES, fill)
    assert len(value.encode()) == MAX_VALUE_BYTES
    ((device,),) = decode_pod_devices(value)
    assert device.usedcores == 2
    with pytest.raises(ProtocolError, match=f"longer than {MAX_VALUE_BYTES} bytes"):
        decode_pod_devices(_value_of_bytes(MAX_VALUE_BYTES + 1, fill))


def test_oversized_value_is_refused() -> None:
    with pytest.raises(ProtocolError, match="longer than"):
        decode_pod_devices(";" * (MAX_VALUE_BYTES + 1))


BAD_DEVICES = {
    "uuid-empty": (ContainerDevice("", "NVIDIA", 1, 1), "[0][0].uuid"),
    "uuid-with-colon": (ContainerDevice("GPU:A", "NVIDIA", 1, 1), "[0][0].uuid"),
    "uuid-with-blank": (ContainerDevice("GPU A", "NVIDIA", 1, 1), "[0][0].uuid"),
    "type-with-semicolon": (ContainerDevice("GPU-A", "NV;IDIA", 1, 1), "[0][0].type"),
    "type-with-blank": (ContainerDevice("GPU-A", "NV IDIA", 1, 1), "[0][0].type"),
    "type-empty": (ContainerDevice("GPU-A", "", 1, 1), "[0][0].type"),
    "mem-negative": (ContainerDevice("GPU-A", "NVIDIA", -1, 1), "[0][0].usedmem"),
    "mem-bool": (ContainerDevice("GPU-A", "NVIDIA", True, 1), "[0][0].usedmem"),
    "cores-overflow": (ContainerDevice("GPU-A", "NVIDIA", 1, 2**31), "[0][0].usedcores"),
}


@pytest.mark.parametrize(("device", "field"), BAD_DEVICES.values(), ids=BAD_DEVICES.keys())
def test_encode_refuses_what_decode_would_refuse(device: ContainerDevice, field: str) -> None:
    with pytest.raises(ProtocolError) as info:
        encode_pod_devices([[device]], field=ALLOCATED)
    assert info.value.field == ALLOCATED + field


def test_slot_owners_one_slot_per_container_is_positional() -> None:
    def unread() -> list[bool]:
        raise AssertionError("a list of one slot per container needs no container's asks")

    assert slot_owners(INIT_THEN_TWO_DEVICES, 3, unread) == [0, 1, 2]


def test_slot_owners_match_hamis_list_without_empty_slots_to_the_containers_asking() -> None:
    # HAMi's scheduler: init (no GPU) + main (GPU) written as one slot; older HAMi: regular only.
    one = [[ContainerDevice("GPU-A", "NVIDIA", 1000, 0)]]
    assert slot_owners(one, 2, lambda: [False, True]) == [1]
    two = [[ContainerDevice("GPU-A", "NVIDIA", 1000, 0)], [], [ContainerDevice("GPU-B", "NVIDIA", 1, 0)]]
    assert slot_owners(two, 4, lambda: [False, True, False, True]) == [1, None, 3]


@pytest.mark.parametrize(
    ("slots", "asking"),
    [
        pytest.param(INIT_THEN_TWO_DEVICES, [True, True], id="more-slots-than-containers"),
        pytest.param(
            [[ContainerDevice("GPU-A", "NVIDIA", 1, 0)]], [False, False, True, True], id="fewer-filled"
        ),
        pytest.param([[], [ContainerDevice("GPU-A", "NVIDIA", 1, 0)]], [False, False, False], id="none-asks"),
    ],
)
def test_slot_owners_refuse_a_list_that_matches_no_reading(slots: PodDevices, asking: list[bool]) -> None:
    with pytest.raises(ProtocolError, match=f"{ALLOCATED}: .* slots .* containers"):
        slot_owners(slots, len(asking), lambda: asking, field=ALLOCATED)
