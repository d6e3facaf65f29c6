"""AdmissionReview in and out: the kube-apiserver's side of the webhook wire
(docs/wire-format.md#admission-review).

The apiserver POSTs an ``AdmissionReview`` (``admission.k8s.io/v1``, or ``v1beta1`` where a
configuration still asks for it) and expects one back in the same version, with ``response.uid``
copied from ``request.uid`` and a mutation as a base64 JSONPatch. ``decode_review`` reads the body
in one pass into ``Review`` (the request fields read, the pod's as ``hamipy.protocol.kube_objects``
names them; anything else skipped unread). A body it cannot read raises ``BadReview``, answered
HTTP 400: not JSON (``not_json``), nested deeper than the parser's recursion guard (``too_deep``),
or a field read with the wrong JSON type or value (``invalid``, msgspec's words with the field's
path, ``$.request.object.spec.containers[0].name``).

    ValueError
     └── BadReview        the body is not an AdmissionReview we can answer
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from typing import Annotated, Any, Final, Literal, NotRequired, TypedDict

import msgspec

from hamipy.protocol.kube_objects import Pod
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
]

API_V1: Final = "admission.k8s.io/v1"
API_V1BETA1: Final = "admission.k8s.io/v1beta1"
API_VERSIONS: Final = (API_V1, API_V1BETA1)
"""The versions we answer, in order of preference (the configuration we ship lists both)."""


class GroupVersionKind(msgspec.Struct, frozen=True):
    group: str = ""
    version: str = ""
    kind: str = ""


class GroupVersionResource(msgspec.Struct, frozen=True):
    group: str = ""
    version: str = ""
    resource: str = ""


class AdmissionRequest(msgspec.Struct, frozen=True, rename="camel"):
    """The fields of ``request`` we read (the apiserver sends more)."""

    uid: Annotated[str, msgspec.Meta(min_length=1)]
    kind: GroupVersionKind | None = None
    resource: GroupVersionResource | None = None
    namespace: str | None = None
    name: str | None = None
    operation: str | None = None
    object: Pod | None = None


class Review(msgspec.Struct, frozen=True, rename={"api_version": "apiVersion"}):
    """A decoded request: the version to answer in and the request itself."""

    api_version: Literal["admission.k8s.io/v1", "admission.k8s.io/v1beta1"]
    kind: Literal["AdmissionReview"]
    request: AdmissionRequest

    @property
    def uid(self) -> str:
        return self.request.uid

    @property
    def is_pod(self) -> bool:
        """Whether the request is about a core/v1 Pod (the only kind we mutate)."""
        kind, resource = self.request.kind, self.request.resource
        if kind is not None:
            return kind.group == "" and kind.kind == "Pod"
        return resource is not None and resource.resource == "pods"

    @property
    def pod(self) -> Pod | None:
        return self.request.object


_decoder: Final = msgspec.json.Decoder(Review)


def decode_review(body: bytes) -> Review:
    """Decode an AdmissionReview request body; raise ``BadReview`` naming what is wrong."""
    reason: BadReviewReason
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as exc:
        reason, message = "invalid", f"not an AdmissionReview: {exc}"
    except msgspec.DecodeError as exc:
        reason, message = "not_json", f"body is not JSON: {exc}"
    except RecursionError:
        reason, message = "too_deep", "body is JSON nested too deeply to read"
    raise BadReview(reason, message)


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
