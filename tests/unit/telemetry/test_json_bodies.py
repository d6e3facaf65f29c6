"""Reading untrusted JSON bodies: every failure is a ``BadJson`` with a reason, nesting is bounded,
and shapes name the first field of the wrong JSON type."""

from __future__ import annotations

import json

import pytest

from hamipy.telemetry.json_bodies import MAX_DEPTH, BadJson, ListOf, MapOf, Shape, decode_json, shape_problem


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        pytest.param(b"[" * 100_000, "too_deep", id="deep-beyond-the-parser"),
        pytest.param(nested(MAX_DEPTH + 1), "too_deep", id="one-level-too-deep"),
        pytest.param(b'{"a":' * 101 + b"1" + b"}" * 101, "too_deep", id="deep-objects"),
        pytest.param(b'[{"a": ' * 51 + b"1" + b"}]" * 51, "too_deep", id="deep-mixed"),
        pytest.param(b"{not json", "not_json", id="not-json"),
        pytest.param(b"", "not_json", id="empty"),
        pytest.param(b'"\xff"', "not_json", id="not-utf8"),
    ],
)
def test_bodies_that_cannot_be_read_say_why(body: bytes, reason: str) -> None:
    with pytest.raises(BadJson) as info:
        decode_json(body)
    assert info.value.reason == reason
    assert str(info.value)


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(nested(MAX_DEPTH), id="exactly-the-bound"),
        pytest.param(json.dumps({"text": "[" * 500}).encode(), id="brackets-in-a-string"),
        pytest.param(b"1", id="scalar"),
        pytest.param('{"name": "\u00e9"}'.encode(), id="utf8"),
    ],
)
def test_bodies_within_the_bounds_are_decoded(body: bytes) -> None:
    assert decode_json(body) == json.loads(body)


def test_a_tighter_bound_can_be_asked_for() -> None:
    assert decode_json(nested(3), max_depth=3) == [[[]]]
    with pytest.raises(BadJson):
        decode_json(nested(4), max_depth=3)


POD: Shape = {
    "metadata": {"name": str, "annotations": MapOf(str)},
    "spec": {"containers": ListOf({"name": str, "privileged": bool}), "replicas": int},
}


@pytest.mark.parametrize(
    ("doc", "problem"),
    [
        pytest.param({}, None, id="absent-fields-pass"),
        pytest.param({"metadata": None, "spec": {"containers": None}}, None, id="null-is-absent"),
        pytest.param({"metadata": {"other": [1]}}, None, id="unnamed-fields-are-not-looked-at"),
        pytest.param([], "pod is an array, expected an object", id="not-an-object"),
        pytest.param(
            {"metadata": "m"}, "pod.metadata is a string, expected an object", id="string-for-object"
        ),
        pytest.param(
            {"metadata": {"annotations": ["a"]}},
            "pod.metadata.annotations is an array, expected an object",
            id="array-for-map",
        ),
        pytest.param(
            {"metadata": {"annotations": {"a": None}}},
            "pod.metadata.annotations['a'] is null, expected a string",
            id="null-map-value",
        ),
        pytest.param(
            {"spec": {"containers": {"name": "c"}}},
            "pod.spec.containers is an object, expected an array",
            id="object-for-array",
        ),
        pytest.param(
            {"spec": {"containers": [{"name": "a"}, {"name": 2}]}},
            "pod.spec.containers[1].name is a number, expected a string",
            id="second-item",
        ),
        pytest.param(
            {"spec": {"containers": [{"privileged": "yes"}]}},
            "pod.spec.containers[0].privileged is a string, expected true or false",
            id="string-for-bool",
        ),
        pytest.param(
            {"spec": {"replicas": True}},
            "pod.spec.replicas is true or false, expected an integer",
            id="bool-for-int",
        ),
        pytest.param({"spec": {"replicas": 3}}, None, id="int"),
    ],
)
def test_shape_problems_name_the_field(doc: object, problem: str | None) -> None:
    assert shape_problem(doc, POD, "pod") == problem


def test_a_long_key_is_cut_in_the_message() -> None:
    key = "k" * 10_000
    problem = shape_problem({"metadata": {"annotations": {key: 1}}}, POD, "pod")
    assert problem is not None
    assert len(problem) < 200
    assert "kkk..." in problem
