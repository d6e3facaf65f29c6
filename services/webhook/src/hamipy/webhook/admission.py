"""AdmissionReview in and out: the kube-apiserver's side of the webhook wire
(docs/wire-format.md#admission-review).

The apiserver POSTs an ``AdmissionReview`` (``admission.k8s.io/v1``, or ``v1beta1`` where a
configuration still asks for it) and expects one back in the same version, with ``response.uid``
copied from ``request.uid`` and a mutation as a base64 JSONPatch. Anything else it sends us is a bad
request: ``review_of`` (the decoded document) and ``decode_review`` (the body) raise ``BadReview``
with a short machine reason (a metric label) and a message for the HTTP 400 body and the log. That
covers what keeps us from answering a review at all: not JSON, not an AdmissionReview, a request
field of the wrong JSON type. (The server decodes bodies with
``hamipy.telemetry.json_bodies.decode_json``, which also refuses deep nesting; a pod we cannot read
inside a good review is refused in the answer instead, ``admitting.POD_SHAPE``.) Values the client
sent are named in messages by their JSON type, or cut short, never echoed whole.

    ValueError
     └── BadReview        the body is not an AdmissionReview we can answer
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from typing import Any, Final, Literal, NotRequired, TypedDict, cast

from hamipy.webhook.errors import BadReview, BadReviewReason

__all__ = [
    "API_VERSIONS",
    "AdmissionRequest",
    "AdmissionResponse",
    "AdmissionReview",
    "BadReview",
    "BadReviewReason",
    "PatchOp",
    "ResponseStatus",
    "Review",
    "decode_review",
    "encode_response",
    "review_of",
]

API_V1: Final = "admission.k8s.io/v1"
API_V1BETA1: Final = "admission.k8s.io/v1beta1"
API_VERSIONS: Final = (API_V1, API_V1BETA1)
"""The versions we answer, in order of preference (the configuration we ship lists both)."""

_REQUEST_FIELDS: Final[dict[str, type]] = {
    "name": str,
    "namespace": str,
    "operation": str,
    "kind": dict,
    "resource": dict,
}
"""The request fields read besides ``uid`` and ``object``, and their JSON types (null is absent)."""
_SHOWN_TEXT: Final = 64


class GroupVersionKind(TypedDict):
    group: str
    version: str
    kind: str


class AdmissionRequest(TypedDict):
    """The fields of ``request`` we read (the apiserver sends more)."""

    uid: str
    kind: NotRequired[GroupVersionKind]
    resource: NotRequired[dict[str, str]]
    namespace: NotRequired[str]
    name: NotRequired[str]
    operation: NotRequired[str]
    object: NotRequired[dict[str, Any] | None]
    dryRun: NotRequired[bool]


class ResponseStatus(TypedDict):
    code: int
    message: str
    reason: NotRequired[str]


class AdmissionResponse(TypedDict):
    uid: str
    allowed: bool
    patchType: NotRequired[Literal["JSONPatch"]]
    patch: NotRequired[str]
    status: NotRequired[ResponseStatus]
    warnings: NotRequired[list[str]]


class AdmissionReview(TypedDict):
    apiVersion: str
    kind: Literal["AdmissionReview"]
    response: AdmissionResponse


class PatchOp(TypedDict):
    """One RFC 6902 operation (we emit only ``add`` and ``replace``)."""

    op: Literal["add", "replace"]
    path: str
    value: Any


class Review:
    """A decoded request: the version to answer in and the request itself."""

    __slots__ = ("api_version", "request")

    def __init__(self, api_version: str, request: AdmissionRequest) -> None:
        self.api_version = api_version
        self.request = request

    @property
    def uid(self) -> str:
        return self.request["uid"]

    @property
    def is_pod(self) -> bool:
        """Whether the request is about a core/v1 Pod (the only kind we mutate)."""
        kind = self.request.get("kind")
        if isinstance(kind, dict):
            return kind.get("group", "") == "" and kind.get("kind") == "Pod"
        resource = self.request.get("resource")
        return isinstance(resource, dict) and resource.get("resource") == "pods"

    @property
    def pod(self) -> dict[str, Any] | None:
        obj = self.request.get("object")
        return obj if isinstance(obj, dict) else None


def decode_review(body: bytes) -> Review:
    """Decode an AdmissionReview request body; raise ``BadReview`` naming what is wrong."""
    try:
        doc = json.loads(body)
    except RecursionError:
        raise BadReview("too_deep", "body is JSON nested too deeply to read") from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise BadReview("not_json", f"body is not JSON: {exc}") from None
    return review_of(doc)


def review_of(doc: object) -> Review:
    """The review in a decoded request body; raise ``BadReview`` naming what is wrong."""
    if not isinstance(doc, dict):
        raise BadReview("not_object", f"body is a JSON {type(doc).__name__}, not an AdmissionReview object")
    kind = doc.get("kind")
    if kind != "AdmissionReview":
        raise BadReview("wrong_kind", f"kind is {_shown(kind)}, expected 'AdmissionReview'")
    version = doc.get("apiVersion")
    if version not in API_VERSIONS:
        raise BadReview(
            "wrong_version", f"apiVersion is {_shown(version)}, expected one of {', '.join(API_VERSIONS)}"
        )
    request = doc.get("request")
    if not isinstance(request, dict):
        raise BadReview("no_request", "AdmissionReview has no request object")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise BadReview("no_uid", f"request.uid is {_shown(uid)}, expected a non-empty string")
    for field, kind in _REQUEST_FIELDS.items():
        value = request.get(field)
        if value is not None and not isinstance(value, kind):
            expected = "a string" if kind is str else "an object"
            raise BadReview("wrong_type", f"request.{field} is {_shown(value)}, expected {expected}")
    return Review(cast(str, version), cast(AdmissionRequest, request))


def _shown(value: object) -> str:
    """A client's value in a message: scalars as they are (long text cut), structures by kind."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str) and len(value) > _SHOWN_TEXT:
        return repr(value[:_SHOWN_TEXT] + "...")
    return repr(value)


def encode_response(
    review: Review,
    *,
    allowed: bool,
    patch: Sequence[PatchOp] = (),
    message: str = "",
    code: int = 403,
    warnings: Sequence[str] = (),
) -> AdmissionReview:
    """The AdmissionReview answering ``review``, in its version, with its uid.

    A refusal (``allowed=False``) carries ``message`` and ``code`` in ``status``; an allowed answer
    carries ``patch`` (when not empty) as a base64 JSONPatch.
    """
    response: AdmissionResponse = {"uid": review.uid, "allowed": allowed}
    if allowed:
        if patch:
            response["patchType"] = "JSONPatch"
            raw = json.dumps(list(patch), separators=(",", ":")).encode()
            response["patch"] = base64.b64encode(raw).decode("ascii")
    else:
        response["status"] = {"code": code, "message": message, "reason": _status_reason(code)}
    if warnings:
        response["warnings"] = list(warnings)
    return {"apiVersion": review.api_version, "kind": "AdmissionReview", "response": response}


def _status_reason(code: int) -> str:
    return {400: "BadRequest", 403: "Forbidden", 422: "Invalid"}.get(code, "InternalError")
