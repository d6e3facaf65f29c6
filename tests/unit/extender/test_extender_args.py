"""kube-scheduler's arguments decoded in one pass (hamipy.extender.extender_args): the fields read,
typed; a bad field is a BadRequest naming its path; nesting cannot crash the decoder."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hamipy.extender.errors import BadRequest
from hamipy.extender.extender_args import (
    ExtenderArgs,
    ExtenderBindingArgs,
    ExtenderPreemptionArgs,
    decode_args,
)

POD: dict[str, Any] = {
    "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "resourceVersion": "7", "managedFields": [{}]},
    "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": 1}}, "image": "x"}]},
    "status": {"phase": "Pending"},
}


def body(doc: object) -> bytes:
    return json.dumps(doc).encode()


def test_filter_args_keep_the_fields_read_and_skip_the_rest() -> None:
    args = decode_args(body({"Pod": POD, "NodeNames": ["a", "b"], "Nodes": None, "Future": 1}), ExtenderArgs)
    assert args.node_names == ["a", "b"]
    assert (args.pod.metadata.uid, args.pod.metadata.resource_version) == ("u1", "7")
    assert args.pod.spec is not None
    assert args.pod.spec.containers is not None
    assert args.pod.spec.containers[0].resources is not None
    assert args.pod.spec.containers[0].resources.limits == {"nvidia.com/gpu": 1}


def test_binding_args_name_the_pod_and_node() -> None:
    args = decode_args(
        body({"PodName": "p", "PodNamespace": "ns", "PodUID": "u1", "Node": "n"}), ExtenderBindingArgs
    )
    assert (args.pod_namespace, args.pod_name, args.pod_uid, args.node) == ("ns", "p", "u1", "n")


def test_preemption_args_read_victims_by_uid_in_either_form() -> None:
    meta = {"n": {"Pods": [{"UID": "v1"}], "NumPDBViolations": 1}}
    args = decode_args(body({"Pod": POD, "NodeNameToMetaVictims": meta}), ExtenderPreemptionArgs)
    assert {n: (v.uids(), v.violations) for n, v in args.proposed().items()} == {"n": (["v1"], 1)}
    full = {"n": {"Pods": [{"metadata": {"uid": "v2", "name": "x"}, "spec": {}}], "NumPDBViolations": 0}}
    args = decode_args(body({"Pod": POD, "NodeNameToVictims": full}), ExtenderPreemptionArgs)
    assert {n: (v.uids(), v.violations) for n, v in args.proposed().items()} == {"n": (["v2"], 0)}


@pytest.mark.parametrize(
    ("kind", "doc", "says"),
    [
        pytest.param(ExtenderArgs, {"NodeNames": []}, "missing required field `Pod`", id="no-pod"),
        pytest.param(
            ExtenderArgs,
            {"Pod": POD, "NodeNames": ["a", 3]},
            "got `int` - at `$.NodeNames[1]`",
            id="name-int",
        ),
        pytest.param(
            ExtenderArgs,
            {"Pod": {"metadata": {"uid": 5}}},
            "Expected `str | null`, got `int` - at `$.Pod.metadata.uid`",
            id="uid-int",
        ),
        pytest.param(
            ExtenderArgs,
            {"Pod": {"spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": [1]}}}]}}},
            "got `array` - at `$.Pod.spec.containers[0].resources.limits[...]`",
            id="quantity-array",
        ),
        pytest.param(
            ExtenderBindingArgs,
            {"PodName": "p", "Node": "n"},
            "missing required field `PodNamespace`",
            id="no-ns",
        ),
        pytest.param(
            ExtenderPreemptionArgs,
            {"Pod": POD, "NodeNameToMetaVictims": {"n": {"Pods": [{}]}}},
            "missing required field `UID` - at `$.NodeNameToMetaVictims[...].Pods[0]`",
            id="victim-no-uid",
        ),
        pytest.param(
            ExtenderPreemptionArgs,
            {"Pod": POD, "NodeNameToVictims": {"n": {"Pods": [{"metadata": {}}]}}},
            "missing required field `uid` - at `$.NodeNameToVictims[...].Pods[0].metadata`",
            id="full-victim-no-uid",
        ),
        *(
            pytest.param(
                ExtenderPreemptionArgs,
                {"Pod": POD, "NodeNameToMetaVictims": {"n": {"Pods": [], "NumPDBViolations": bad}}},
                "at `$.NodeNameToMetaVictims[...].NumPDBViolations`",
                id=f"violations-{bad!r}",
            )
            for bad in (True, -1, 1.5, "0")
        ),
    ],
)
def test_a_bad_field_is_refused_with_its_path(kind: Any, doc: object, says: str) -> None:
    with pytest.raises(BadRequest) as refused:
        decode_args(body(doc), kind)
    assert says in str(refused.value)
    assert str(refused.value).startswith(f"not {kind.__name__}: ")


@pytest.mark.parametrize("kind", [ExtenderArgs, ExtenderBindingArgs, ExtenderPreemptionArgs])
@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"{not json", id="not-json"),
        pytest.param(b"\xff\xfe{}", id="not-utf8"),
        pytest.param(b"", id="empty"),
    ],
)
def test_a_body_that_is_not_json_is_refused(kind: Any, data: bytes) -> None:
    with pytest.raises(BadRequest, match="body is not JSON"):
        decode_args(data, kind)


@pytest.mark.parametrize("kind", [ExtenderArgs, ExtenderBindingArgs, ExtenderPreemptionArgs])
@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_deep_nesting_in_a_field_not_read_is_refused_not_a_crash(kind: Any, depth: int) -> None:
    """Skipping a value recurses in C under Python's recursion guard: a RecursionError there is
    a BadRequest (HTTP 400), never an exception out of the route."""
    data = b'{"x": ' + b"[" * depth + b"]" * depth + b"}"
    with pytest.raises(BadRequest, match="nested too deeply"):
        decode_args(data, kind)
