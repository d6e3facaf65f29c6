"""``hami.io/node-nvidia-score``: the pair scores computed from NVML's facts as upstream computes
them, and the annotation written byte for byte as upstream's plugin writes it and read from either
plugin. The cases are upstream's tests (calculate_score_test.go, links_test.go, devices_test.go,
nvidia/device_test.go), carried over as data."""

from __future__ import annotations

from typing import Any

import pytest

from hamipy.protocol import ProtocolError
from hamipy.protocol.node_scores import (
    ASYMMETRIC_REASON,
    GpuLinks,
    PairPath,
    bus_id,
    decode_node_scores,
    encode_node_scores,
    node_scores,
    nvlink_count,
    score_paths,
)

# Upstream's link types as (PCIe level, NVLinks) of one entry.
SAME_CPU = (40, 0)
FOUR_NVLINKS = (None, 4)


def _nvlinks(n: int) -> tuple[None, int]:
    return (None, n)


def _path(*entries: tuple[int | None, int]) -> PairPath:
    """One pair's entries in upstream's form (a PCIe level entry, an NVLink entry) as a PairPath."""
    levels = [level for level, _ in entries if level is not None]
    return PairPath(levels[0] if levels else None, sum(n for _, n in entries))


# Test_calculateGPUScore ("nvlink test"): NVLink entries only.
NVLINK_ONLY: dict[str, dict[str, list[tuple[int | None, int]]]] = {
    "gpu0": {"gpu1": [_nvlinks(1)], "gpu2": [_nvlinks(1)], "gpu3": [_nvlinks(2)]},
    "gpu1": {"gpu0": [_nvlinks(1)], "gpu2": [_nvlinks(2)], "gpu3": [_nvlinks(1)]},
    "gpu2": {"gpu0": [_nvlinks(1)], "gpu1": [_nvlinks(2)], "gpu3": [_nvlinks(2)]},
    "gpu3": {"gpu0": [_nvlinks(2)], "gpu1": [_nvlinks(1)], "gpu2": [_nvlinks(2)]},
}
NVLINK_ONLY_SCORES = {
    "gpu0": {"gpu1": 100, "gpu2": 100, "gpu3": 200},
    "gpu1": {"gpu0": 100, "gpu2": 200, "gpu3": 100},
    "gpu2": {"gpu0": 100, "gpu1": 200, "gpu3": 200},
    "gpu3": {"gpu0": 200, "gpu1": 100, "gpu2": 200},
}


def test_calculate_gpu_score_nvlink_test() -> None:
    paths = {a: {b: _path(*entries) for b, entries in row.items()} for a, row in NVLINK_ONLY.items()}
    assert score_paths(paths) == (NVLINK_ONLY_SCORES, [])


def test_calculate_gpu_pair_score_asymmetric() -> None:
    """dev0 records [SameCPU, FourNVLINK] towards dev1, dev1 only [SameCPU]: 0 both ways, reported."""
    paths = {"gpu0": {"gpu1": _path(SAME_CPU, FOUR_NVLINKS)}, "gpu1": {"gpu0": _path(SAME_CPU)}}
    assert score_paths(paths) == ({"gpu0": {"gpu1": 0}, "gpu1": {"gpu0": 0}}, [("gpu0", "gpu1")])
    assert ASYMMETRIC_REASON == "AsymmetricGPUP2PLink"


@pytest.mark.parametrize(
    ("level", "score"), [(0, 60), (10, 50), (20, 40), (30, 30), (40, 20), (50, 10)], ids=str
)
def test_each_p2p_level_scores_as_upstream(level: int, score: int) -> None:
    gpus = [GpuLinks("a", "00000000:01:00.0"), GpuLinks("b", "00000000:02:00.0")]
    levels = {("a", "b"): level, ("b", "a"): level}
    assert node_scores(gpus, levels) == ({"a": {"b": score}, "b": {"a": score}}, [])


def test_an_unknown_p2p_level_fails_the_computation() -> None:
    gpus = [GpuLinks("a", "00000000:01:00.0"), GpuLinks("b", "00000000:02:00.0")]
    with pytest.raises(ProtocolError, match="P2P level a -> b: unknown topology level"):
        node_scores(gpus, {("a", "b"): 60, ("b", "a"): 60})


def test_two_gpus_on_one_switch_with_four_nvlinks_score_450() -> None:
    a = GpuLinks("GPU-a", "00000000:01:00.0", ("00000000:02:00.0",) * 4)
    b = GpuLinks("GPU-b", "00000000:02:00.0", ("00000000:01:00.0",) * 4)
    scores, asymmetric = node_scores([a, b], {("GPU-a", "GPU-b"): 10, ("GPU-b", "GPU-a"): 10})
    assert (encode_node_scores(scores), asymmetric) == (
        '[{"uuid":"GPU-a","score":{"GPU-b":450}},{"uuid":"GPU-b","score":{"GPU-a":450}}]',
        [],
    )


def test_nvlinks_one_way_only_are_asymmetric() -> None:
    a = GpuLinks("a", "00000000:01:00.0", ("00000000:02:00.0",) * 2)
    b = GpuLinks("b", "00000000:02:00.0")
    assert node_scores([a, b], {("a", "b"): 40, ("b", "a"): 40}) == (
        {"a": {"b": 0}, "b": {"a": 0}},
        [("a", "b")],
    )


# Test_countMatchingLinks: the remote bus ids of the enabled links, the target GPU's bus id (as
# NVML writes it; upstream's test hands in the normalised form), the links counted.
@pytest.mark.parametrize(
    ("remote", "target", "want"),
    [
        pytest.param([], "00000000:01:00.0", 0, id="empty"),
        pytest.param(["00000000:01:00.0"], "00000000:01:00.0", 1, id="single match"),
        pytest.param(["00000000:01:00.0"], "00000000:02:00.0", 0, id="no match"),
        pytest.param(
            ["00000000:01:00.0", "00000000:02:00.0", "00000000:01:00.0"], "00000000:01:00.0", 2, id="multiple"
        ),
        pytest.param(["00000000:0a:00.0"] * 3, "00000000:0a:00.0", 3, id="all match"),
        pytest.param(
            ["00000000:05:00.0", "00000000:06:00.0", "00000000:07:00.0", "00000000:08:00.0"],
            "00000000:18:00.0",
            0,
            id="NVSwitch remote vs GPU PCI",
        ),
    ],
)
def test_count_matching_links(remote: list[str], target: str, want: int) -> None:
    assert nvlink_count(GpuLinks("src", "00000000:99:00.0", tuple(remote)), GpuLinks("dst", target)) == want


@pytest.mark.parametrize(
    ("raw", "want"),
    [("00000000:2A:00.0", "0000:2a:00.0"), ("00000000:01:00.0\0\0", "0000:01:00.0"), ("0000", "0000")],
)
def test_bus_id_normalisation(raw: str, want: str) -> None:
    assert bus_id(raw) == want


# Test_nvlinkCountToType: 1..18 links count, fewer or more are no NVLink.
@pytest.mark.parametrize(("n", "want"), [(0, 0), *((n, n) for n in range(1, 19)), (19, 0), (100, 0)])
def test_nvlink_count_to_type(n: int, want: int) -> None:
    src = GpuLinks("src", "00000000:01:00.0", ("00000000:2a:00.0",) * n)
    assert nvlink_count(src, GpuLinks("dst", "00000000:2a:00.0")) == want


D2 = "00000000:2a:00.0"
SW = "00000000:07:00.0"


# Test_GetNVLink (the cases without an NVML error): dev1's enabled links' remote bus id and its
# switch links, dev2's switch links.
@pytest.mark.parametrize(
    ("src", "dst_switch_links", "want"),
    [
        pytest.param(GpuLinks("d1", "00000000:01:00.0", (D2,) * 18), 0, 18, id="direct_connect_18_links"),
        pytest.param(GpuLinks("d1", "00000000:01:00.0", (D2,) * 4), 0, 4, id="direct_connect_partial"),
        pytest.param(GpuLinks("d1", "00000000:01:00.0", (SW,) * 18, 18), 18, 18, id="nvswitch_full_mesh_18"),
        pytest.param(GpuLinks("d1", "00000000:01:00.0", (SW,) * 18, 18), 4, 4, id="nvswitch_asymmetric"),
        pytest.param(GpuLinks("d1", "00000000:01:00.0", (SW,) * 18, 18), 0, 0, id="one_side_no_nvswitch"),
        pytest.param(GpuLinks("d1", "00000000:01:00.0"), 0, 0, id="no_nvlink_anywhere"),
        pytest.param(
            GpuLinks("d1", "00000000:01:00.0", (SW,) * 4, 4), 18, 4, id="nvswitch_asymmetric_swapped"
        ),
        pytest.param(GpuLinks("d1", "00000000:01:00.0"), 18, 0, id="one_side_no_nvswitch_swapped"),
    ],
)
def test_get_nvlink(src: GpuLinks, dst_switch_links: int, want: int) -> None:
    dst = GpuLinks("d2", D2, (SW,) * dst_switch_links, dst_switch_links)
    assert nvlink_count(src, dst) == want


# -- the annotation ---------------------------------------------------------------------------------

UPSTREAM_VALUES = [
    '[{"uuid":"GPU-0","score":{"GPU-1":50,"GPU-2":20,"GPU-3":20}}]',  # TestDecodeNodeDevices
    '[{"uuid":"GPU-0","score":{"GPU-1":100}},{"uuid":"GPU-1","score":{"GPU-0":100}}]',  # TestGetNodeDevices
    '[{"uuid":"GPU-x","score":{}}]',  # one GPU
]


@pytest.mark.parametrize("value", UPSTREAM_VALUES)
def test_upstream_values_decode_and_encode_back_byte_for_byte(value: str) -> None:
    assert encode_node_scores(decode_node_scores(value, node="n1")) == value


def test_pair_scores_are_read_by_uuid() -> None:
    scores = decode_node_scores(UPSTREAM_VALUES[1], node="n1")
    assert (len(scores), scores["GPU-0"]["GPU-1"]) == (2, 100)


def test_encoding_sorts_each_row_and_keeps_the_gpu_order() -> None:
    scores = {"GPU-b": {"GPU-c": 1, "GPU-a": -5}, "GPU-a": {}}
    assert (
        encode_node_scores(scores)
        == '[{"uuid":"GPU-b","score":{"GPU-a":-5,"GPU-c":1}},{"uuid":"GPU-a","score":{}}]'
    )


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ('[{"UUID":"GPU-0","Score":{"GPU-1":7},"extra":1}]', {"GPU-0": {"GPU-1": 7}}),
        ('[{"uuid":"GPU-0"}]', {"GPU-0": {}}),
        ('[{"uuid":"GPU-0","score":null}]', {"GPU-0": {}}),
        ("null", {}),
        ("[]", {}),
    ],
    ids=["key case and unknown keys", "no score", "null score", "null", "empty"],
)
def test_decoding_reads_what_go_reads(value: str, want: dict[str, Any]) -> None:
    assert decode_node_scores(value, node="n1") == want


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("not-valid-json", "node n1: hami.io/node-nvidia-score: not valid JSON"),  # InvalidPairScores
        ("", "node n1: hami.io/node-nvidia-score: not valid JSON"),
        ('{"uuid":"GPU-0"}', "node n1: hami.io/node-nvidia-score: expected a JSON array"),
        ("[1]", r"hami.io/node-nvidia-score\[0\]: expected a JSON object"),
        ('[{"score":{}}]', r"\[0\].uuid: expected a non-empty string"),
        ('[{"uuid":"a"},{"uuid":"a"}]', r"\[1\].uuid: given twice"),
        ('[{"uuid":"a","score":[]}]', r"\[0\].score: expected a JSON object of scores"),
        ('[{"uuid":"a","score":{"b":1.5}}]', r"\[0\].score\['b'\]: expected a whole number within int64"),
        ('[{"uuid":"a","score":{"b":"1"}}]', "expected a whole number"),
        ('[{"uuid":"a","score":{"b":true}}]', "expected a whole number"),
        ('[{"uuid":"a","score":{"b":null}}]', "expected a whole number"),
        ('[{"uuid":"a","score":{"b":9223372036854775808}}]', "expected a whole number"),
    ],
)
def test_malformed_values_are_refused_naming_the_node(value: str, error: str) -> None:
    with pytest.raises(ProtocolError, match=error) as caught:
        decode_node_scores(value, node="n1")
    assert str(caught.value).startswith("node n1: hami.io/node-nvidia-score")
