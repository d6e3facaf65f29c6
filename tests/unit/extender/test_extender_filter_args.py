"""A filter's arguments read without decoding the pod sent, only when the watch holds that pod and
the body is plainly well formed (hamipy.extender.filter_args); everything else is read whole."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hamipy.extender.filter_args import watched_filter_args

WATCHED = "uid-ns-p"


def watches(uid: str) -> bool:
    return uid == WATCHED


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


POD = {"metadata": {"name": "p", "namespace": "ns", "uid": WATCHED}, "spec": {"containers": [{"name": "c"}]}}


def test_a_watched_pods_filter_names_its_uid_and_the_nodes() -> None:
    args = watched_filter_args(body(Pod=POD, NodeNames=["a", "b"], Nodes=None), watches)
    assert args == {"Pod": {"metadata": {"uid": WATCHED}}, "NodeNames": ["a", "b"]}


def test_what_is_not_read_may_be_anything() -> None:
    pod = {**POD, "spec": {"containers": "not a list", "x": [[[{"y": None}]]]}, "status": 7}
    assert watched_filter_args(body(Pod=pod, NodeNames=[]), watches) == {
        "Pod": {"metadata": {"uid": WATCHED}},
        "NodeNames": [],
    }


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(body(Pod={**POD, "metadata": {"uid": "uid-other"}}, NodeNames=["a"]), id="not-watched"),
        pytest.param(body(Pod={"metadata": {}}, NodeNames=["a"]), id="no-uid"),
        pytest.param(body(Pod={**POD, "metadata": {"uid": 5}}, NodeNames=["a"]), id="uid-not-string"),
        pytest.param(body(Pod=POD, NodeNames=["a", 1]), id="name-not-string"),
        pytest.param(body(Pod=POD, NodeNames="a"), id="names-not-list"),
        pytest.param(body(Pod=POD), id="no-names"),
        pytest.param(body(Pod=POD, Nodes={"items": []}), id="node-objects"),
        pytest.param(body(Pod=POD, NodeNames=["a"], Nodes={"items": []}), id="names-and-objects"),
        pytest.param(body(Pod=None, NodeNames=["a"]), id="no-pod"),
        pytest.param(body(Pod={"metadata": None}, NodeNames=["a"]), id="no-metadata"),
        pytest.param(json.dumps([POD]).encode(), id="not-an-object"),
        pytest.param(b'{"Pod": ', id="not-json"),
        pytest.param(b"\xff\xfe", id="not-utf8"),
        pytest.param(
            b'{"Pod": {"metadata": {"uid": "uid-ns-p"}, "spec": '
            + b"[" * 100_000
            + b"]" * 100_000
            + b'}, "NodeNames": ["a"]}',
            id="nested-past-the-parser",
        ),
    ],
)
def test_anything_else_is_read_whole(data: bytes) -> None:
    assert watched_filter_args(data, watches) is None
