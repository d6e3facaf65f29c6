"""Reading a JSON request body from a client we do not trust (the webhook's AdmissionReview, the
extender's arguments): anything malformed must be a clear HTTP 400, never a 500.

``decode_json`` turns every way a body can fail to be JSON into ``BadJson``, and refuses arrays and
objects nested deeper than ``MAX_DEPTH``: the parser gives up (``RecursionError``) near 1000
levels, but anything that later recurses over the document (``repr`` in an error message,
``json.dumps`` of a part sent back) would fail far sooner than that. The parser is msgspec's: it
reads an extender's filter arguments (a pod and hundreds of node names) in half the standard
library's time, and is stricter where RFC 8259 is (no ``NaN``, no lone surrogates, UTF-8 only).
``shape_problem`` then checks that the fields the service reads have the JSON types it expects,
so the code that reads them never meets a list where it expects an object::

    POD = {"metadata": {"name": str, "annotations": MapOf(str)}, "spec": {"containers": ListOf(dict)}}
    shape_problem(doc, POD, "Pod")  # "Pod.metadata.annotations is an array, expected an object"

A shape is a type (``str``, ``bool``, ``int``, ``dict`` for any object, ``list`` for any array), a
mapping of field names to shapes (an object; fields it does not name are not looked at, and a named
field that is absent or null passes), ``ListOf(shape)`` or ``MapOf(shape)`` (an object whose every
value has the shape).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final, Literal, NamedTuple

import msgspec

__all__ = ["MAX_DEPTH", "BadJson", "ListOf", "MapOf", "Shape", "decode_json", "shape_problem"]

MAX_DEPTH: Final = 100
"""Deepest nesting of arrays and objects accepted. A Pod in an AdmissionReview, managedFields
included, is about 20 deep; Python recurses safely far deeper than 100."""

_SHOWN_KEY = 64
"""Longest object key quoted in a problem (keys come from the client)."""


class BadJson(ValueError):
    """The body is not JSON we can read; ``reason`` is a fixed label (a metric label)."""

    def __init__(self, reason: Literal["not_json", "too_deep"], message: str) -> None:
        self.reason: Literal["not_json", "too_deep"] = reason
        super().__init__(message)


class ListOf(NamedTuple):
    item: Shape


class MapOf(NamedTuple):
    value: Shape


Shape = type | ListOf | MapOf | Mapping[str, "Shape"]


def decode_json(body: bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON document in ``body`` (UTF-8, as RFC 8259 requires between systems); ``BadJson``
    naming what is wrong otherwise."""
    try:
        doc = msgspec.json.decode(body)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except ValueError as exc:  # msgspec.DecodeError, UnicodeDecodeError
        raise BadJson("not_json", f"body is not JSON: {exc}") from None
    if _deeper_than(doc, max_depth):
        raise _too_deep(max_depth)
    return doc


def _too_deep(max_depth: int) -> BadJson:
    return BadJson("too_deep", f"body is JSON nested deeper than {max_depth} levels")


def _deeper_than(doc: object, limit: int) -> bool:
    """Whether ``doc`` (as the parser made it: plain dicts and lists) nests arrays and objects
    deeper than ``limit``: a level at a time, without recursion, in about the time parsing took."""
    level: list[Any] = [doc] if type(doc) is dict or type(doc) is list else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        below: list[Any] = []
        for value in level:
            items = value.values() if type(value) is dict else value
            kinds = set(map(type, items))  # in C: a list of 1,000 node names is all str
            if dict in kinds or list in kinds:
                below += [item for item in items if type(item) is dict or type(item) is list]
        level = below
    return False


def shape_problem(value: object, shape: Shape, path: str) -> str | None:
    """Where ``value`` first departs from ``shape``, as a sentence naming its path; None if it fits."""
    if isinstance(shape, Mapping):
        if not isinstance(value, dict):
            return _wrong(path, value, "an object")
        for key, field in shape.items():
            item = value.get(key)
            if item is not None and (problem := shape_problem(item, field, f"{path}.{key}")) is not None:
                return problem
        return None
    if isinstance(shape, ListOf):
        if not isinstance(value, list):
            return _wrong(path, value, "an array")
        if _all_exactly(value, shape.item):
            return None
        for index, item in enumerate(value):
            if (problem := shape_problem(item, shape.item, f"{path}[{index}]")) is not None:
                return problem
        return None
    if isinstance(shape, MapOf):
        if not isinstance(value, dict):
            return _wrong(path, value, "an object")
        if _all_exactly(value.values(), shape.value):
            return None
        for key, item in value.items():
            if (problem := shape_problem(item, shape.value, f"{path}[{_shown(key)}]")) is not None:
                return problem
        return None
    # bool is an int to Python, not to JSON.
    if isinstance(value, shape) and (shape is bool or not isinstance(value, bool)):
        return None
    return _wrong(path, value, _KINDS.get(shape, shape.__name__))


def _all_exactly(items: Iterable[object], shape: Shape) -> bool:
    """Whether every item is exactly of the plain type ``shape`` (what the parser makes): the
    common case, checked without building a path per item (the slow part for the 1,000 node names
    of the extender's arguments). Anything else goes item by item for the message."""
    return isinstance(shape, type) and set(map(type, items)) <= {shape}


_KINDS: dict[type, str] = {
    dict: "an object",
    list: "an array",
    str: "a string",
    bool: "true or false",
    int: "an integer",
    float: "a number",
}


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, int | float):
        return "a number"
    return _KINDS.get(type(value), type(value).__name__)


def _wrong(path: str, value: object, expected: str) -> str:
    return f"{path} is {_kind(value)}, expected {expected}"


def _shown(key: str) -> str:
    return repr(key if len(key) <= _SHOWN_KEY else key[:_SHOWN_KEY] + "...")
