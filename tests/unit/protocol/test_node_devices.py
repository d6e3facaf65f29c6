"""``hami.io/node-nvidia-register`` (docs/wire-format.md#register-annotation): JSON and legacy forms."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hamipy.protocol import node_devices
from hamipy.protocol.devices import DEVICE_MODES, DeviceInfo, MigPlacement, MigProfile
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.node_devices import MAX_VALUE_BYTES, decode_node_devices, encode_node_devices

KEY = "hami.io/node-nvidia-register"
GPU_A = "GPU-00552014-5c87-89ac-b1a6-7b53aa24b0ec"
GPU_B = "GPU-0fc3eda5-e98b-a25b-5b0d-cf5c855d1448"
V100 = "NVIDIA-Tesla V100-PCIE-32GB"

# The JSON example of docs/wire-format.md#register-annotation with health before mode (order does not matter).
WIRE_JSON = (
    '[{"id":"GPU-0","count":10,"devmem":8192,"devcore":100,"type":"NVIDIA-A100",'
    '"health":true,"mode":"hami-core"}]'
)
WIRE_JSON_DEVICE = DeviceInfo(
    id="GPU-0", index=0, count=10, devmem=8192, devcore=100, type="NVIDIA-A100", numa=0,
    mode="hami-core", health=True,
)  # fmt: skip
# The legacy example of docs/wire-format.md#register-annotation: two 32 GB V100s.
WIRE_LEGACY = f"{GPU_A},10,32768,100,{V100},0,true:{GPU_B},10,32768,100,{V100},0,true:"
WIRE_LEGACY_DEVICES = [
    DeviceInfo(GPU_A, 0, 10, 32768, 100, V100, 0, "hami-core", True),
    DeviceInfo(GPU_B, 0, 10, 32768, 100, V100, 0, "hami-core", True),
]
# What upstream's MarshalNodeDevices writes for two devices (Go struct order: mode before health;
# omitempty drops index 0, numa 0 and health false).
H100 = "NVIDIA-NVIDIA H100 80GB HBM3"
TWO_DEVICES = [
    DeviceInfo(GPU_A, 0, 10, 81920, 100, H100, 0, "hami-core", True),
    DeviceInfo(GPU_B, 1, 10, 81920, 100, H100, 1, "mig", False),
]
TWO_DEVICES_JSON = (
    f'[{{"id":"{GPU_A}","count":10,"devmem":81920,"devcore":100,"type":"{H100}","mode":"hami-core",'
    f'"health":true}},'
    f'{{"id":"{GPU_B}","index":1,"count":10,"devmem":81920,"devcore":100,"type":"{H100}","numa":1,'
    f'"mode":"mig"}}]'
)


def test_public_api_is_complete() -> None:
    assert sorted(node_devices.__all__) == [
        "DEFAULT_MODE",
        "MAX_VALUE_BYTES",
        "check_go_int",
        "check_mig_placement",
        "check_utf8",
        "check_value",
        "decode_mig_placement",
        "decode_node_devices",
        "device_type",
        "encode_mig_placement",
        "encode_node_devices",
        "fold_keys",
        "go_json",
        "go_string",
        "parse_json",
    ]


# -- the wire examples --------------------------------------------------------------------------------


def test_wire_json_example_decodes() -> None:
    assert decode_node_devices(WIRE_JSON) == [WIRE_JSON_DEVICE]


def test_wire_legacy_example_decodes() -> None:
    assert decode_node_devices(WIRE_LEGACY) == WIRE_LEGACY_DEVICES


def test_wire_json_example_reencodes_in_go_key_order() -> None:
    assert encode_node_devices([WIRE_JSON_DEVICE]) == (
        '[{"id":"GPU-0","count":10,"devmem":8192,"devcore":100,"type":"NVIDIA-A100",'
        '"mode":"hami-core","health":true}]'
    )


# -- JSON form: reading -------------------------------------------------------------------------------


def test_omitted_keys_are_go_zero_values() -> None:
    assert decode_node_devices('[{"id":"GPU-0","mode":"mps"}]') == [
        DeviceInfo("GPU-0", 0, 0, 0, 0, "", 0, "mps", False)
    ]


@pytest.mark.parametrize("mode_json", ["", ',"mode":""'], ids=["absent", "empty"])
def test_missing_mode_means_hami_core(mode_json: str) -> None:
    (dev,) = decode_node_devices(f'[{{"id":"GPU-0"{mode_json}}}]')
    assert dev.mode == "hami-core"


def test_unknown_keys_are_ignored() -> None:
    value = (
        '[{"id":"GPU-0","count":2,"mode":"mig","health":true,'
        '"migtemplate":[[{"name":"x"}]],"devicevendor":"NVIDIA","custominfo":{"a":1},'
        '"devicepairscore":{},"somethingNew":[1,2]}]'
    )
    assert decode_node_devices(value) == [DeviceInfo("GPU-0", 0, 2, 0, 0, "", 0, "mig", True)]


# -- migProfiles (a dynamic MIG GPU) ------------------------------------------------------------------

# HAMi's documented profile (its dynamic-MIG migration guide) and its test GPU's (A100 40GB,
# pkg/device/nvidia/mig_capability_test.go), as its device plugin publishes them.
A100_PROFILES = (
    MigProfile("1g.5gb", 5120, 14, 1, tuple(MigPlacement(s, 1) for s in range(7))),
    MigProfile("2g.10gb", 9984, 29, 2, (MigPlacement(0, 2), MigPlacement(2, 2), MigPlacement(4, 2))),
    MigProfile("3g.20gb", 20480, 42, 3, (MigPlacement(0, 4), MigPlacement(4, 4))),
)
A100_MIG = DeviceInfo(GPU_A, 0, 7, 40960, 100, "NVIDIA-A100-SXM4-40GB", 0, "mig", True, A100_PROFILES)
A100_MIG_JSON = (
    f'[{{"id":"{GPU_A}","count":7,"devmem":40960,"devcore":100,"type":"NVIDIA-A100-SXM4-40GB",'
    '"mode":"mig","migProfiles":['
    '{"name":"1g.5gb","memoryMB":5120,"core":14,"sliceCount":1,"placements":['
    '{"start":0,"size":1},{"start":1,"size":1},{"start":2,"size":1},{"start":3,"size":1},'
    '{"start":4,"size":1},{"start":5,"size":1},{"start":6,"size":1}]},'
    '{"name":"2g.10gb","memoryMB":9984,"core":29,"sliceCount":2,"placements":'
    '[{"start":0,"size":2},{"start":2,"size":2},{"start":4,"size":2}]},'
    '{"name":"3g.20gb","memoryMB":20480,"core":42,"sliceCount":3,"placements":'
    '[{"start":0,"size":4},{"start":4,"size":4}]}],"health":true}]'
)


def test_mig_profiles_encode_as_hamis_plugin_marshals_them() -> None:
    """Struct order puts migProfiles between mode and health; a profile's keys have no omitempty."""
    assert encode_node_devices([A100_MIG]) == A100_MIG_JSON


def test_mig_profiles_decode_on_both_paths() -> None:
    assert decode_node_devices(A100_MIG_JSON) == [A100_MIG]
    # Folded keys take the exact decoder; it reads the same.
    folded = A100_MIG_JSON.replace('"migProfiles"', '"MigProfiles"').replace('"memoryMB"', '"MemoryMB"')
    assert decode_node_devices(folded) == [A100_MIG]


def test_a_profile_without_placements_is_null_as_go_writes_a_nil_slice() -> None:
    dev = DeviceInfo("GPU-0", mode="mig", mig_profiles=(MigProfile("7g.40gb", 40192, 100, 8),))
    encoded = encode_node_devices([dev])
    assert encoded == (
        '[{"id":"GPU-0","mode":"mig","migProfiles":'
        '[{"name":"7g.40gb","memoryMB":40192,"core":100,"sliceCount":8,"placements":null}]}]'
    )
    assert decode_node_devices(encoded) == [dev]
    assert decode_node_devices(encoded.replace("null", "[]")) == [dev]


@pytest.mark.parametrize(
    "empty", ['"migProfiles":null,', '"migProfiles":[],', ""], ids=["null", "[]", "absent"]
)
def test_no_mig_profiles_is_an_empty_tuple(empty: str) -> None:
    (dev,) = decode_node_devices(f'[{{{empty}"id":"GPU-0","mode":"mig"}}]')
    assert dev.mig_profiles == ()
    assert "migProfiles" not in encode_node_devices([dev])  # omitempty


def test_unknown_profile_keys_are_ignored_like_go() -> None:
    value = (
        '[{"id":"GPU-0","mode":"mig","migProfiles":[{"name":"1g.5gb","memoryMB":1,"core":2,'
        '"sliceCount":1,"instanceCount":7,"placements":[{"start":3,"size":1,"x":0}]}]}]'
    )
    (dev,) = decode_node_devices(value)
    assert dev.mig_profiles == (MigProfile("1g.5gb", 1, 2, 1, (MigPlacement(3, 1),)),)


def test_keys_match_case_insensitively_like_go() -> None:
    # Upstream's own tests write Go field names; json.Unmarshal folds case.
    value = '[{"ID":"GPU-0","Count":4,"Devmem":8738,"Devcore":8,"Type":"Ascend910","Numa":0,"Health":true}]'
    assert decode_node_devices(value) == [
        DeviceInfo("GPU-0", 0, 4, 8738, 8, "Ascend910", 0, "hami-core", True)
    ]


def test_keys_fold_case_even_when_id_is_spelt_exactly() -> None:
    # The fast typed decoder knows only the exact keys: any other spelling must reach the folding one.
    value = '[{"id":"GPU-0","Count":4,"DEVMEM":8738,"mode":"mps"}]'
    assert decode_node_devices(value) == [DeviceInfo("GPU-0", 0, 4, 8738, 0, "", 0, "mps", False)]


def test_omitted_keys_are_go_zero_values_when_keys_fold() -> None:
    assert decode_node_devices('[{"ID":"GPU-0"}]') == [
        DeviceInfo("GPU-0", 0, 0, 0, 0, "", 0, "hami-core", False)
    ]


def test_empty_array_is_no_devices() -> None:
    assert decode_node_devices("[]") == []


def test_blanks_around_json_are_accepted() -> None:
    assert decode_node_devices(f"  {WIRE_JSON}\n") == [WIRE_JSON_DEVICE]


def test_largest_values_of_the_go_types_decode() -> None:
    value = (
        f'[{{"id":"GPU-0","index":{2**64 - 1},"count":{2**31 - 1},"devmem":{2**31 - 1},'
        f'"devcore":{2**31 - 1},"numa":{2**63 - 1},"mode":"hami-core"}}]'
    )
    (dev,) = decode_node_devices(value)
    assert (dev.index, dev.count, dev.devmem, dev.devcore, dev.numa) == (
        2**64 - 1, 2**31 - 1, 2**31 - 1, 2**31 - 1, 2**63 - 1,
    )  # fmt: skip


# -- legacy form: reading -----------------------------------------------------------------------------


def test_legacy_nine_fields_carry_index_and_mode() -> None:
    value = f"{GPU_A},10,32768,100,{V100},1,false,3,mig:"
    assert decode_node_devices(value) == [DeviceInfo(GPU_A, 3, 10, 32768, 100, V100, 1, "mig", False)]


def test_legacy_last_terminator_may_be_missing() -> None:
    assert decode_node_devices(WIRE_LEGACY[:-1]) == WIRE_LEGACY_DEVICES


@pytest.mark.parametrize(
    ("spelling", "health"),
    [("1", True), ("t", True), ("T", True), ("TRUE", True), ("True", True),
     ("0", False), ("f", False), ("F", False), ("FALSE", False), ("False", False), ("false", False)],
)  # fmt: skip
def test_legacy_health_takes_go_parsebool_spellings(spelling: str, health: bool) -> None:
    (dev,) = decode_node_devices(f"GPU-0,1,2,3,T,0,{spelling}:")
    assert dev.health is health


def test_legacy_empty_mode_means_hami_core() -> None:
    (dev,) = decode_node_devices("GPU-0,1,2,3,T,0,true,0,:")
    assert dev.mode == "hami-core"


# -- JSON form: writing exactly as Go -----------------------------------------------------------------


def test_encode_matches_upstream_bytes() -> None:
    assert encode_node_devices(TWO_DEVICES) == TWO_DEVICES_JSON


def test_encode_of_no_devices_is_empty_array() -> None:
    # MarshalNodeDevices marshals a non-nil empty slice: "[]", never "null".
    assert encode_node_devices([]) == "[]"


def test_encode_escapes_like_go() -> None:
    dev = DeviceInfo("GPU-0", 0, 1, 1, 1, 'A<B>&"C"\\\n\b\f\x01\x7f\u2028\u2029é', 0, "hami-core", False)
    assert encode_node_devices([dev]) == (
        '[{"id":"GPU-0","count":1,"devmem":1,"devcore":1,'
        '"type":"A\\u003cB\\u003e\\u0026\\"C\\"\\\\\\n\\b\\f\\u0001\x7f\\u2028\\u2029é",'
        '"mode":"hami-core"}]'
    )


def test_encode_omits_zero_values_but_always_writes_id_and_mode() -> None:
    dev = DeviceInfo("GPU-0", 0, 0, 0, 0, "", 0, "hami-core", False)
    assert encode_node_devices([dev]) == '[{"id":"GPU-0","mode":"hami-core"}]'


# -- laws ---------------------------------------------------------------------------------------------

_ids = st.text(
    alphabet=st.characters(codec="utf-8", exclude_characters=",:;"), min_size=1, max_size=40
).filter(lambda s: not any(c.isspace() for c in s))
_types = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)
_i32 = st.integers(min_value=0, max_value=2**31 - 1)
devices = st.builds(
    DeviceInfo,
    id=_ids,
    index=st.integers(min_value=0, max_value=2**64 - 1),
    count=_i32,
    devmem=_i32,
    devcore=_i32,
    type=_types,
    numa=st.integers(min_value=0, max_value=2**63 - 1),
    mode=st.sampled_from(DEVICE_MODES),
    health=st.booleans(),
    mig_profiles=st.lists(
        st.builds(
            MigProfile,
            name=_ids,
            memory_mb=_i32,
            core=_i32,
            slice_count=st.integers(min_value=0, max_value=2**32 - 1),
            placements=st.lists(
                st.builds(
                    MigPlacement,
                    start=st.integers(min_value=0, max_value=2**32 - 1),
                    size=st.integers(min_value=1, max_value=2**32 - 1),
                ),
                max_size=3,
            ).map(tuple),
        ),
        max_size=3,
    ).map(tuple),
)


@given(st.lists(devices, max_size=16, unique_by=lambda d: d.id))
def test_decode_inverts_encode(devs: list[DeviceInfo]) -> None:
    assert decode_node_devices(encode_node_devices(devs)) == devs


@given(st.lists(devices, max_size=8, unique_by=lambda d: d.id))
def test_encode_is_valid_json_with_go_omitempty(devs: list[DeviceInfo]) -> None:
    objs = json.loads(encode_node_devices(devs))
    for obj, dev in zip(objs, devs, strict=True):
        go_keys = (
            "id",
            "index",
            "count",
            "devmem",
            "devcore",
            "type",
            "numa",
            "mode",
            "migProfiles",
            "health",
        )
        names = {"migProfiles": "mig_profiles"}
        expected = [k for k in go_keys if getattr(dev, names.get(k, k)) or k in ("id", "mode")]
        assert list(obj) == expected
        for profile in obj.get("migProfiles", ()):
            assert list(profile) == ["name", "memoryMB", "core", "sliceCount", "placements"]


# Upstream's legacy fields: no separators in the type, index from Atoi (int64), and ids that do
# not look like JSON (no GPU id starts with '[' or '{').
legacy_devices = st.builds(
    DeviceInfo,
    id=_ids.filter(lambda s: s[0] not in "[{"),
    index=st.integers(min_value=0, max_value=2**63 - 1),
    count=_i32,
    devmem=_i32,
    devcore=_i32,
    type=st.text(alphabet=st.characters(codec="utf-8", exclude_characters=",:"), max_size=40),
    numa=st.integers(min_value=0, max_value=2**63 - 1),
    mode=st.sampled_from(DEVICE_MODES),
    health=st.booleans(),
)


def _upstream_legacy(devs: list[DeviceInfo]) -> str:
    """What upstream's EncodeNodeDevices writes (9 fields, each device ended by ':')."""
    return "".join(
        f"{d.id},{d.count},{d.devmem},{d.devcore},{d.type},{d.numa},{str(d.health).lower()},{d.index},{d.mode}:"
        for d in devs
    )


@given(st.lists(legacy_devices, min_size=1, max_size=8, unique_by=lambda d: d.id))
def test_legacy_form_decodes_to_the_same_devices(devs: list[DeviceInfo]) -> None:
    assert decode_node_devices(_upstream_legacy(devs)) == devs


# -- malformed input ----------------------------------------------------------------------------------

BAD_JSON = {
    "devmem-negative": ('[{"id":"GPU-0","devmem":-1}]', "[0].devmem"),
    "devmem-float": ('[{"id":"GPU-0","devmem":1.0}]', "[0].devmem"),
    "devmem-exponent": ('[{"id":"GPU-0","devmem":1e3}]', "[0].devmem"),
    "devmem-string": ('[{"id":"GPU-0","devmem":"8192"}]', "[0].devmem"),
    "devmem-bool": ('[{"id":"GPU-0","devmem":true}]', "[0].devmem"),
    "devmem-null": ('[{"id":"GPU-0","devmem":null}]', "[0].devmem"),
    "count-int32-overflow": (f'[{{"id":"GPU-0","count":{2**31}}}]', "[0].count"),
    "devcore-int32-overflow": (f'[{{"id":"GPU-0","devcore":{2**31}}}]', "[0].devcore"),
    "index-uint64-overflow": (f'[{{"id":"GPU-0","index":{2**64}}}]', "[0].index"),
    "index-negative": ('[{"id":"GPU-0","index":-1}]', "[0].index"),
    "numa-int64-overflow": (f'[{{"id":"GPU-0","numa":{2**63}}}]', "[0].numa"),
    "numa-negative": ('[{"id":"GPU-0","numa":-1}]', "[0].numa"),
    "count-negative": ('[{"id":"GPU-0","count":-1}]', "[0].count"),
    "devcore-negative": ('[{"id":"GPU-0","devcore":-1}]', "[0].devcore"),
    # The same through the decoder that folds key case (the typed fast path refuses "ID").
    "folded-index-negative": ('[{"ID":"GPU-0","index":-1}]', "[0].index"),
    "folded-count-negative": ('[{"ID":"GPU-0","count":-1}]', "[0].count"),
    "folded-devmem-negative": ('[{"ID":"GPU-0","devmem":-1}]', "[0].devmem"),
    "folded-devcore-negative": ('[{"ID":"GPU-0","devcore":-1}]', "[0].devcore"),
    "folded-numa-negative": ('[{"ID":"GPU-0","numa":-1}]', "[0].numa"),
    "health-int": ('[{"id":"GPU-0","health":1}]', "[0].health"),
    "health-string": ('[{"id":"GPU-0","health":"true"}]', "[0].health"),
    "id-missing": ('[{"count":1}]', "[0].id"),
    "id-empty": ('[{"id":""}]', "[0].id"),
    "id-number": ('[{"id":7}]', "[0].id"),
    "id-with-comma": ('[{"id":"GPU-0,1"}]', "[0].id"),
    "id-with-blank": ('[{"id":"GPU 0"}]', "[0].id"),
    "type-number": ('[{"id":"GPU-0","type":3}]', "[0].type"),
    "mode-unknown": ('[{"id":"GPU-0","mode":"vgpu"}]', "[0].mode"),
    "mode-number": ('[{"id":"GPU-0","mode":1}]', "[0].mode"),
    "second-device-bad": ('[{"id":"GPU-0"},{"id":"GPU-1"},{"id":"GPU-2","devmem":-5}]', "[2].devmem"),
    "id-twice": ('[{"id":"GPU-0"},{"id":"GPU-1"},{"id":"GPU-0"}]', "[2].id"),
    "element-not-object": ('[{"id":"GPU-0"},"GPU-1"]', "[1]"),
    "not-an-array": ('{"id":"GPU-0"}', KEY),
    "truncated": (WIRE_JSON[:-5], KEY),
    "trailing-garbage": (WIRE_JSON + "x", KEY),
    "deeply-nested": ("[" * 100_000, KEY),
    "mig-profiles-object": ('[{"id":"GPU-0","migProfiles":{}}]', "[0].migProfiles"),
    "mig-profile-not-object": ('[{"id":"GPU-0","migProfiles":[1]}]', "[0].migProfiles[0]"),
    "mig-profile-no-name": ('[{"id":"GPU-0","migProfiles":[{"memoryMB":1}]}]', "[0].migProfiles[0].name"),
    "mig-profile-name-number": ('[{"id":"GPU-0","migProfiles":[{"name":1}]}]', "[0].migProfiles[0].name"),
    "mig-profile-memory-negative": (
        '[{"id":"GPU-0","migProfiles":[{"name":"a","memoryMB":-1}]}]',
        "[0].migProfiles[0].memoryMB",
    ),
    "mig-profile-memory-null": (
        '[{"id":"GPU-0","migProfiles":[{"name":"a","memoryMB":null}]}]',
        "[0].migProfiles[0].memoryMB",
    ),
    "mig-profile-core-overflow": (
        f'[{{"id":"GPU-0","migProfiles":[{{"name":"a","core":{2**31}}}]}}]',
        "[0].migProfiles[0].core",
    ),
    "mig-profile-slices-overflow": (
        f'[{{"id":"GPU-0","migProfiles":[{{"name":"a","sliceCount":{2**32}}}]}}]',
        "[0].migProfiles[0].sliceCount",
    ),
    "mig-placements-object": (
        '[{"id":"GPU-0","migProfiles":[{"name":"a","placements":{}}]}]',
        "[0].migProfiles[0].placements",
    ),
    "mig-placement-size-zero": (
        '[{"id":"GPU-0","migProfiles":[{"name":"a","placements":[{"start":1}]}]}]',
        "[0].migProfiles[0].placements[0].size",
    ),
    "mig-placement-start-negative": (
        '[{"id":"GPU-0","migProfiles":[{"name":"a","placements":[{"start":1,"size":1},{"start":-1,"size":1}]}]}]',
        "[0].migProfiles[0].placements[1].start",
    ),
    "mig-placement-float": (
        '[{"id":"GPU-0","migProfiles":[{"name":"a","placements":[{"start":1.5,"size":1}]}]}]',
        "[0].migProfiles[0].placements[0].start",
    ),
}


@pytest.mark.parametrize(("value", "field"), BAD_JSON.values(), ids=BAD_JSON.keys())
def test_malformed_json_is_refused_naming_the_field(value: str, field: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_node_devices(value)
    assert info.value.field.startswith(KEY)
    assert info.value.field.endswith(field)
    assert field in str(info.value)


def test_error_shows_the_offending_value() -> None:
    with pytest.raises(ProtocolError, match=r"\[0\]\.devmem: must not be negative \(got -7\)"):
        decode_node_devices('[{"id":"GPU-0","devmem":-7}]')


BAD_LEGACY = {
    "empty": ("", KEY),
    "only-terminator": (":", "[0]"),
    "six-fields": ("GPU-0,1,2,3,T,0:", "[0]"),
    "eight-fields": ("GPU-0,1,2,3,T,0,true,1:", "[0]"),
    "ten-fields": ("GPU-0,1,2,3,T,0,true,1,mig,x:", "[0]"),
    "doubled-separator": (f"{WIRE_LEGACY}:GPU-9,1,2,3,T,0,true:", "[2]"),
    "count-not-a-number": ("GPU-0,ten,2,3,T,0,true:", "[0].count"),
    "devmem-negative": ("GPU-0,1,-2,3,T,0,true:", "[0].devmem"),
    "devmem-blank": ("GPU-0,1, 2,3,T,0,true:", "[0].devmem"),
    "devmem-underscore": ("GPU-0,1,1_000,3,T,0,true:", "[0].devmem"),
    "devmem-plus": ("GPU-0,1,+2,3,T,0,true:", "[0].devmem"),
    "devmem-non-ascii-digit": ("GPU-0,1,\u0663,3,T,0,true:", "[0].devmem"),
    "devcore-overflow": (f"GPU-0,1,2,{2**31},T,0,true:", "[0].devcore"),
    "devcore-empty": ("GPU-0,1,2,,T,0,true:", "[0].devcore"),
    "numa-negative": ("GPU-0,1,2,3,T,-1,true:", "[0].numa"),
    "health-yes": ("GPU-0,1,2,3,T,0,yes:", "[0].health"),
    "index-negative": ("GPU-0,1,2,3,T,0,true,-1,hami-core:", "[0].index"),
    "mode-unknown": ("GPU-0,1,2,3,T,0,true,0,vgpu:", "[0].mode"),
    "id-empty": (",1,2,3,T,0,true:", "[0].id"),
    "id-blank": ("GPU 0,1,2,3,T,0,true:", "[0].id"),
    "second-device-bad": (f"{GPU_A},1,2,3,T,0,true:{GPU_B},1,2,3,T,0,maybe:", "[1].health"),
    "id-twice": (f"{GPU_A},1,2,3,T,0,true:{GPU_A},1,2,3,T,0,true:", "[1].id"),
}


@pytest.mark.parametrize(("value", "field"), BAD_LEGACY.values(), ids=BAD_LEGACY.keys())
def test_malformed_legacy_is_refused_naming_the_field(value: str, field: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_node_devices(value)
    assert info.value.field.startswith(KEY)
    assert info.value.field.endswith(field)


# Legacy numbers: a sign is read as a negative number only when digits follow it.
LEGACY_NUMBER_REASONS = {
    "minus-digits": ("-2", "must not be negative"),
    "plus-digits": ("+2", "not a decimal integer"),
    "lone-minus": ("-", "not a decimal integer"),
    "minus-letters": ("-x", "not a decimal integer"),
}


@pytest.mark.parametrize(("text", "reason"), LEGACY_NUMBER_REASONS.values(), ids=LEGACY_NUMBER_REASONS.keys())
def test_legacy_number_errors_say_why(text: str, reason: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_node_devices(f"GPU-0,1,{text},3,T,0,true:")
    assert (info.value.field, info.value.value, info.value.reason) == (f"{KEY}[0].devmem", text, reason)


def test_legacy_doubled_separator_is_called_an_empty_entry() -> None:
    with pytest.raises(ProtocolError, match="empty device entry"):
        decode_node_devices(f"{WIRE_LEGACY}:")


def test_legacy_bad_health_shows_the_health_text() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_node_devices("GPU-0,1,2,3,T,0,yes:")
    assert info.value.value == "yes"


def _json_of_bytes(size: int, fill: str) -> str:
    """A register value of exactly ``size`` UTF-8 bytes: one device whose type is ``fill`` repeated."""
    head, tail = '[{"id":"GPU-0","type":"', '"}]'
    room = size - len(head) - len(tail)
    each = len(fill.encode())
    return head + fill * (room // each) + "x" * (room % each) + tail


@pytest.mark.parametrize("fill", ["x", "é"], ids=["ascii", "multibyte"])
def test_value_of_exactly_256_kib_is_read(fill: str) -> None:
    value = _json_of_bytes(MAX_VALUE_BYTES, fill)
    assert len(value.encode()) == 256 * 1024
    (dev,) = decode_node_devices(value)
    assert dev.id == "GPU-0"
    with pytest.raises(ProtocolError, match="longer than 262144 bytes"):
        decode_node_devices(_json_of_bytes(MAX_VALUE_BYTES + 1, fill))


@pytest.mark.parametrize("value", ["[" + " " * MAX_VALUE_BYTES + "]", "é" * (MAX_VALUE_BYTES // 2 + 1)],
                         ids=["ascii", "multibyte"])  # fmt: skip
def test_oversized_value_is_refused_before_parsing(value: str) -> None:
    with pytest.raises(ProtocolError, match="longer than"):
        decode_node_devices(value)


BAD_DEVICES = {
    "id-empty": (DeviceInfo("", 0, 1, 1, 1, "T", 0, "hami-core", True), "[0].id"),
    "id-with-colon": (DeviceInfo("GPU:0", 0, 1, 1, 1, "T", 0, "hami-core", True), "[0].id"),
    "count-negative": (DeviceInfo("GPU-0", 0, -1, 1, 1, "T", 0, "hami-core", True), "[0].count"),
    "devmem-overflow": (DeviceInfo("GPU-0", 0, 1, 2**31, 1, "T", 0, "hami-core", True), "[0].devmem"),
    "index-bool": (DeviceInfo("GPU-0", True, 1, 1, 1, "T", 0, "hami-core", True), "[0].index"),
    "mode-empty": (DeviceInfo("GPU-0", 0, 1, 1, 1, "T", 0, "", True), "[0].mode"),
    "health-int": (DeviceInfo("GPU-0", 0, 1, 1, 1, "T", 0, "mig", 1), "[0].health"),  # type: ignore[arg-type]
    "type-surrogate": (DeviceInfo("GPU-0", 0, 1, 1, 1, "\ud800", 0, "mig", True), "[0].type"),
    "profile-name-empty": (
        DeviceInfo("GPU-0", mode="mig", mig_profiles=(MigProfile("", 1, 1, 1),)),
        "[0].migProfiles[0].name",
    ),
    "profile-memory-negative": (
        DeviceInfo("GPU-0", mode="mig", mig_profiles=(MigProfile("a", -1, 1, 1),)),
        "[0].migProfiles[0].memoryMB",
    ),
    "placement-size-zero": (
        DeviceInfo("GPU-0", mode="mig", mig_profiles=(MigProfile("a", 1, 1, 1, (MigPlacement(0, 0),)),)),
        "[0].migProfiles[0].placements[0].size",
    ),
}


@pytest.mark.parametrize(("device", "field"), BAD_DEVICES.values(), ids=BAD_DEVICES.keys())
def test_encode_refuses_what_decode_would_refuse(device: DeviceInfo, field: str) -> None:
    with pytest.raises(ProtocolError) as info:
        encode_node_devices([device])
    assert info.value.field == KEY + field


def test_encode_refuses_an_id_twice() -> None:
    with pytest.raises(ProtocolError) as info:
        encode_node_devices([TWO_DEVICES[0], TWO_DEVICES[1], TWO_DEVICES[0]])
    assert info.value.field == KEY + "[2].id"


@pytest.mark.parametrize(
    ("nvml_name", "expected"),
    [
        ("Tesla V100-PCIE-32GB", "NVIDIA-Tesla V100-PCIE-32GB"),
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"),
        ("nvidia A10", "nvidia A10"),
    ],
)
def test_device_type_follows_upstreams_rule(nvml_name: str, expected: str) -> None:
    assert node_devices.device_type(nvml_name) == expected
