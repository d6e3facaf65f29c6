"""User annotations (docs/wire-format.md#user-annotations)."""

from __future__ import annotations

from typing import Any

import pytest

from hamipy.protocol import keys, pod_preferences
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.pod_preferences import (
    PodPreferences,
    ScoringWeights,
    mode_allowed,
    parse_gpu_policy,
    parse_node_policy,
    parse_preferences,
    parse_scoring_weights,
    preferences_of,
    type_allowed,
    uuid_allowed,
)

V100 = "NVIDIA-Tesla V100-PCIE-32GB"
A10 = "NVIDIA A10"
A100 = "NVIDIA-NVIDIA A100-SXM4-80GB"
GPU_A = "GPU-0fc3eda5-e98b-a25b-5b0d-cf5c855d1448"
GPU_B = "GPU-00552014-5c87-89ac-b1a6-7b53aa24b0ec"

FULL_ANNOTATIONS = {
    keys.USE_GPU_TYPE: "Tesla V100-PCIE-32GB, NVIDIA A10",
    keys.NOUSE_GPU_TYPE: "a100",
    keys.USE_GPU_UUID: f"{GPU_A},{GPU_B}",
    keys.NOUSE_GPU_UUID: GPU_B,
    keys.NUMA_BIND: "true",
    keys.VGPU_MODE: "hami-core",
    keys.NODE_SCHEDULER_POLICY: "spread",
    keys.GPU_SCHEDULER_POLICY: "binpack,numa",
    keys.DEVICE_SCORING_WEIGHTS: "slot=1,core=1,memory=3",
    "unrelated.io/annotation": "ignored",
}


def test_all_annotations_parse() -> None:
    assert parse_preferences(FULL_ANNOTATIONS) == PodPreferences(
        use_types=("TESLA V100-PCIE-32GB", "NVIDIA A10"),
        nouse_types=("A100",),
        use_uuids=frozenset({GPU_A, GPU_B}),
        nouse_uuids=frozenset({GPU_B}),
        numa_bind=True,
        vgpu_mode="hami-core",
        node_policy="spread",
        gpu_policy=("binpack", "numa"),
        scoring_weights=ScoringWeights(slot=1, core=1, memory=3),
    )


@pytest.mark.parametrize("annotations", [None, {}, {"other": "x"}], ids=["none", "empty", "unrelated"])
def test_no_annotations_means_no_preferences(annotations: dict[str, str] | None) -> None:
    assert parse_preferences(annotations) == PodPreferences()


def test_preferences_of_pod() -> None:
    pod = {"metadata": {"name": "p", "annotations": {keys.NUMA_BIND: "true"}}, "spec": {}}
    assert preferences_of(pod) == PodPreferences(numa_bind=True)
    assert preferences_of({"metadata": {"name": "p"}}) == PodPreferences()
    assert preferences_of({}) == PodPreferences()


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ([], "pod"),
        ({"metadata": []}, "metadata"),
        ({"metadata": {"annotations": ["x"]}}, "metadata.annotations"),
    ],
    ids=["pod-list", "metadata-list", "annotations-list"],
)
def test_preferences_of_malformed_pod(bad: Any, field: str) -> None:
    with pytest.raises(ProtocolError) as info:
        preferences_of(bad)
    assert info.value.field == field


# gpu type ----------------------------------------------------------------------------------------

TYPE_CASES = [
    ("no-filter", {}, V100, True),
    ("use-substring", {keys.USE_GPU_TYPE: "V100"}, V100, True),
    ("use-case-insensitive", {keys.USE_GPU_TYPE: "v100"}, V100, True),
    ("use-miss", {keys.USE_GPU_TYPE: "A100"}, V100, False),
    ("use-any-of-list", {keys.USE_GPU_TYPE: "A100,V100"}, V100, True),
    ("use-item-trimmed", {keys.USE_GPU_TYPE: "Tesla V100-PCIE-32GB, NVIDIA A10"}, A10, True),
    ("use-trailing-comma-does-not-match-all", {keys.USE_GPU_TYPE: "A100,"}, V100, False),
    ("use-empty-is-no-filter", {keys.USE_GPU_TYPE: ""}, V100, True),
    ("nouse-substring", {keys.NOUSE_GPU_TYPE: "v100"}, V100, False),
    ("nouse-miss", {keys.NOUSE_GPU_TYPE: "A100"}, V100, True),
    ("nouse-trailing-comma-does-not-refuse-all", {keys.NOUSE_GPU_TYPE: "A100,"}, V100, True),
    ("use-and-nouse", {keys.USE_GPU_TYPE: "NVIDIA", keys.NOUSE_GPU_TYPE: "A100"}, A100, False),
    ("use-and-nouse-other", {keys.USE_GPU_TYPE: "NVIDIA", keys.NOUSE_GPU_TYPE: "A100"}, V100, True),
]


@pytest.mark.parametrize(
    ("annotations", "device_type", "allowed"), [c[1:] for c in TYPE_CASES], ids=[c[0] for c in TYPE_CASES]
)
def test_type_allowed(annotations: dict[str, str], device_type: str, allowed: bool) -> None:
    assert type_allowed(parse_preferences(annotations), device_type) is allowed


# gpu uuid ----------------------------------------------------------------------------------------

UUID_CASES = [
    ("no-filter", {}, GPU_A, True),
    ("use-exact", {keys.USE_GPU_UUID: GPU_A}, GPU_A, True),
    ("use-other", {keys.USE_GPU_UUID: GPU_A}, GPU_B, False),
    ("use-no-substring", {keys.USE_GPU_UUID: GPU_A[:10]}, GPU_A, False),
    ("use-case-sensitive", {keys.USE_GPU_UUID: GPU_A.upper()}, GPU_A, False),
    ("use-list", {keys.USE_GPU_UUID: f"{GPU_B}, {GPU_A}"}, GPU_A, True),
    ("nouse-exact", {keys.NOUSE_GPU_UUID: GPU_A}, GPU_A, False),
    ("nouse-other", {keys.NOUSE_GPU_UUID: GPU_A}, GPU_B, True),
    ("both-apply", {keys.USE_GPU_UUID: f"{GPU_A},{GPU_B}", keys.NOUSE_GPU_UUID: GPU_B}, GPU_B, False),
    ("both-apply-other", {keys.USE_GPU_UUID: f"{GPU_A},{GPU_B}", keys.NOUSE_GPU_UUID: GPU_B}, GPU_A, True),
]


@pytest.mark.parametrize(
    ("annotations", "uuid", "allowed"), [c[1:] for c in UUID_CASES], ids=[c[0] for c in UUID_CASES]
)
def test_uuid_allowed(annotations: dict[str, str], uuid: str, allowed: bool) -> None:
    assert uuid_allowed(parse_preferences(annotations), uuid) is allowed


# numa-bind, vgpu-mode --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("true", True),
        ("false", False),
        ("True", True),
        ("1", True),
        ("0", False),
        ("FALSE", False),
        (" true ", True),
    ],
)
def test_numa_bind(value: str, expected: bool) -> None:
    assert parse_preferences({keys.NUMA_BIND: value}).numa_bind is expected


@pytest.mark.parametrize("value", ["yes", "", "on", "2", "tRuE"], ids=repr)
def test_numa_bind_refuses_other_values(value: str) -> None:
    with pytest.raises(ProtocolError, match='must be "true" or "false"') as info:
        parse_preferences({keys.NUMA_BIND: value})
    assert info.value.field == keys.NUMA_BIND
    assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    ("annotation", "device_mode", "allowed"),
    [
        (None, "mig", False),
        (None, "hami-core", True),
        ("hami-core", "hami-core", True),
        ("hami-core", "mig", False),
        ("mig", "mig", True),
        ("mps", "mps", True),
    ],
    ids=[
        "no-annotation-on-mig",
        "no-annotation-on-core",
        "core-on-core",
        "core-on-mig",
        "mig-on-mig",
        "mps-on-mps",
    ],
)
def test_mode_allowed(annotation: str | None, device_mode: str, allowed: bool) -> None:
    annotations = {} if annotation is None else {keys.VGPU_MODE: annotation}
    assert mode_allowed(parse_preferences(annotations), device_mode) is allowed


@pytest.mark.parametrize("value", ["hami", "MIG", "", "hami-core,mig"], ids=repr)
def test_vgpu_mode_refuses_other_values(value: str) -> None:
    with pytest.raises(ProtocolError, match="must be one of hami-core, mig, mps") as info:
        parse_preferences({keys.VGPU_MODE: value})
    assert info.value.field == keys.VGPU_MODE


# policies ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"), [("binpack", "binpack"), ("spread", "spread"), (" spread ", "spread")]
)
def test_node_policy(value: str, expected: str) -> None:
    assert parse_node_policy(value) == expected
    assert parse_preferences({keys.NODE_SCHEDULER_POLICY: value}).node_policy == expected


@pytest.mark.parametrize("value", ["numa", "Binpack", "", "binpack,spread"], ids=repr)
def test_node_policy_refuses_other_values(value: str) -> None:
    with pytest.raises(ProtocolError, match="must be one of binpack, spread") as info:
        parse_preferences({keys.NODE_SCHEDULER_POLICY: value})
    assert info.value.field == keys.NODE_SCHEDULER_POLICY
    assert info.value.value == value


GPU_POLICY_CASES = [
    ("binpack", ("binpack",)),
    ("spread", ("spread",)),
    ("topology-aware", ("topology-aware",)),
    ("mutex", ("mutex",)),
    ("numa", ("numa",)),
    ("binpack,numa", ("binpack", "numa")),
    ("mutex, topology-aware", ("mutex", "topology-aware")),
    ("numa,binpack", ("numa", "binpack")),
    ("binpack,binpack,numa", ("binpack", "numa")),
]


@pytest.mark.parametrize(("value", "expected"), GPU_POLICY_CASES, ids=[c[0] for c in GPU_POLICY_CASES])
def test_gpu_policy_chain(value: str, expected: tuple[str, ...]) -> None:
    assert parse_gpu_policy(value) == expected
    assert parse_preferences({keys.GPU_SCHEDULER_POLICY: value}).gpu_policy == expected


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("", "empty item"),
        (" ", "empty item"),
        ("binpack,", "empty item"),
        ("best", "unknown policy 'best'"),
        ("binpack,Numa", "unknown policy 'Numa'"),
    ],
    ids=["empty", "blank", "trailing-comma", "unknown", "unknown-in-chain"],
)
def test_gpu_policy_refuses_bad_chains(value: str, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason) as info:
        parse_preferences({keys.GPU_SCHEDULER_POLICY: value})
    assert info.value.field == keys.GPU_SCHEDULER_POLICY
    assert info.value.value == value


# scoring weights ---------------------------------------------------------------------------------

WEIGHT_CASES = [
    ("slot=1,core=1,memory=1", ScoringWeights(1, 1, 1)),
    ("slot=1,core=1,memory=3", ScoringWeights(1, 1, 3)),
    ("memory=2, slot=0 ,core=5", ScoringWeights(0, 5, 2)),
    ("slot=0,core=0,memory=1", ScoringWeights(0, 0, 1)),
    (" slot = 10 , core = 0 , memory = 0 ", ScoringWeights(10, 0, 0)),
    ("slot=1000000,core=0,memory=0", ScoringWeights(1_000_000, 0, 0)),
]


def test_default_weights_are_upstreams_one_each() -> None:
    assert ScoringWeights() == ScoringWeights(slot=1, core=1, memory=1)


@pytest.mark.parametrize(("value", "expected"), WEIGHT_CASES, ids=[c[0] for c in WEIGHT_CASES])
def test_scoring_weights(value: str, expected: ScoringWeights) -> None:
    assert parse_scoring_weights(value) == expected
    assert parse_preferences({keys.DEVICE_SCORING_WEIGHTS: value}).scoring_weights == expected


BAD_WEIGHTS = [
    ("missing-memory", "slot=1,core=1", "misses memory"),
    ("all-zero", "slot=0,core=0,memory=0", "at least one weight must be positive"),
    ("negative", "slot=-1,core=1,memory=1", "slot must be an integer"),
    ("fraction", "slot=1,core=1.5,memory=1", "core must be an integer"),
    ("unknown-key", "slot=1,core=1,memory=1,gpu=1", "items must be"),
    ("no-equals", "slot=1,core=1,memory", "items must be"),
    ("duplicate", "slot=1,core=1,memory=1,slot=2", "names 'slot' twice"),
    ("empty", "", "items must be"),
    ("empty-value", "slot=,core=1,memory=1", "slot must be an integer"),
    ("huge", "slot=99999999999,core=1,memory=1", "slot must be an integer"),
    ("one-past-the-bound", "slot=1,core=1,memory=1000001", "memory must be an integer 0-1000000"),
    ("uppercase-key", "SLOT=1,core=1,memory=1", "items must be"),
]


@pytest.mark.parametrize(("value", "reason"), [c[1:] for c in BAD_WEIGHTS], ids=[c[0] for c in BAD_WEIGHTS])
def test_scoring_weights_refuse(value: str, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason) as info:
        parse_preferences({keys.DEVICE_SCORING_WEIGHTS: value})
    assert info.value.field == keys.DEVICE_SCORING_WEIGHTS
    assert info.value.value == value


@pytest.mark.parametrize(
    "key",
    [
        keys.USE_GPU_TYPE,
        keys.NUMA_BIND,
        keys.VGPU_MODE,
        keys.NODE_SCHEDULER_POLICY,
        keys.GPU_SCHEDULER_POLICY,
        keys.DEVICE_SCORING_WEIGHTS,
    ],
)
def test_non_string_values_are_refused(key: str) -> None:
    with pytest.raises(ProtocolError, match="must be a string") as info:
        parse_preferences({key: 1})
    assert info.value.field == key


def test_public_api_is_complete() -> None:
    assert sorted(pod_preferences.__all__) == sorted(
        [
            "GPU_POLICIES",
            "NODE_POLICIES",
            "GpuPolicy",
            "NodePolicy",
            "PodPreferences",
            "ScoringWeights",
            "mode_allowed",
            "parse_gpu_policy",
            "parse_node_policy",
            "parse_preferences",
            "parse_scoring_weights",
            "preferences_of",
            "type_allowed",
            "uuid_allowed",
        ]
    )
    for name in pod_preferences.__all__:
        assert hasattr(pod_preferences, name)
