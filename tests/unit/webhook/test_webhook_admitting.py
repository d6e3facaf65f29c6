"""AdmissionReview decoding/encoding and one admission end to end (logs, metrics, spans)."""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import builders
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from hamipy.protocol import keys
from hamipy.webhook import admitting
from hamipy.webhook.admission import BadReview, decode_review, encode_response
from hamipy.webhook.admitting import Admitter
from hamipy.webhook.mutation import MutationSettings
from hamipy.webhook.telemetry import Telemetry

GPU_POD: dict[str, Any] = {
    **builders.pod("", builders.container("cuda", gpu=1), scheduler_name="default-scheduler"),
    "metadata": {"generateName": "train-", "namespace": "ml"},
}
"""A GPU pod as a Deployment's ReplicaSet creates it: a generated name, still to be given."""
PLAIN_POD = builders.pod("web", builders.container("nginx"))
PRIVILEGED_GPU_POD = builders.pod(
    "bad", builders.container("cuda", gpu=1, securityContext={"privileged": True})
)


def review(
    obj: dict[str, Any] | None,
    *,
    version: str = "admission.k8s.io/v1",
    uid: str = "705ab4f5-6393-11e8-b7cc-42010a800002",
    operation: str = "CREATE",
    kind: str = "Pod",
) -> bytes:
    return json.dumps(
        {
            "apiVersion": version,
            "kind": "AdmissionReview",
            "request": {
                "uid": uid,
                "kind": {"group": "", "version": "v1", "kind": kind},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": "ml",
                "operation": operation,
                "object": obj,
            },
        }
    ).encode()


class Harness:
    def __init__(self, settings: MutationSettings | None = None) -> None:
        self.log = io.StringIO()
        self.spans = InMemorySpanExporter()
        self.telemetry = Telemetry.create(stream=self.log, processor=SimpleSpanProcessor(self.spans))
        self.admitter = Admitter(settings or MutationSettings(), self.telemetry)

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.getvalue().splitlines()]

    def metric(self, name: str, **labels: str) -> float:
        value = self.telemetry.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


@pytest.fixture
def harness() -> Harness:
    return Harness()


def answer_of(raw: bytes) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(raw)
    return doc


def patch_of(doc: dict[str, Any]) -> list[dict[str, Any]]:
    response = doc["response"]
    assert response["patchType"] == "JSONPatch"
    ops: list[dict[str, Any]] = json.loads(base64.b64decode(response["patch"]))
    return ops


# -- decoding ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "reason", "says"),
    [
        pytest.param(b"{not json", "not_json", "body is not JSON", id="not-json"),
        pytest.param(b"\xff\xfe\x00", "not_json", "body is not JSON", id="not-utf8"),
        pytest.param(b"", "not_json", "body is not JSON", id="empty"),
        pytest.param(b"[1, 2]", "invalid", "Expected `object`, got `array`", id="array"),
        pytest.param(
            b'{"kind": "Pod", "apiVersion": "admission.k8s.io/v1", "request": {"uid": "u"}}',
            "invalid",
            "Invalid enum value 'Pod' - at `$.kind`",
            id="wrong-kind",
        ),
        pytest.param(
            b'{"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v2", "request": {"uid": "u"}}',
            "invalid",
            "Invalid enum value 'admission.k8s.io/v2' - at `$.apiVersion`",
            id="wrong-version",
        ),
        pytest.param(
            b'{"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1"}',
            "invalid",
            "missing required field `request`",
            id="no-request",
        ),
        pytest.param(
            b'{"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1", "request": {}}',
            "invalid",
            "missing required field `uid` - at `$.request`",
            id="no-uid",
        ),
        pytest.param(
            b'{"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1", "request": {"uid": ""}}',
            "invalid",
            "at `$.request.uid`",
            id="empty-uid",
        ),
        pytest.param(
            b'{"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1", "request": {"uid": 7}}',
            "invalid",
            "Expected `str`, got `int` - at `$.request.uid`",
            id="uid-not-string",
        ),
        pytest.param(
            b'{"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1", "request": {"uid": "u", "x": '
            + b"[" * 100_000
            + b"]" * 100_000
            + b"}}",
            "too_deep",
            "nested too deeply",
            id="deep-unread-field",
        ),
    ],
)
def test_bad_reviews_are_refused_with_a_reason(body: bytes, reason: str, says: str) -> None:
    with pytest.raises(BadReview) as info:
        decode_review(body)
    assert info.value.reason == reason
    assert says in str(info.value)


@pytest.mark.parametrize("version", ["admission.k8s.io/v1", "admission.k8s.io/v1beta1"])
def test_answer_is_in_the_version_asked_with_the_uid(version: str) -> None:
    r = decode_review(review(PLAIN_POD, version=version, uid="abc"))
    doc = encode_response(r, allowed=True)
    assert doc == {
        "apiVersion": version,
        "kind": "AdmissionReview",
        "response": {"uid": "abc", "allowed": True},
    }


def test_refusal_carries_status_message() -> None:
    doc = encode_response(decode_review(review(PLAIN_POD)), allowed=False, message="no")
    assert doc["response"]["status"] == {"code": 403, "message": "no", "reason": "Forbidden"}
    assert "patch" not in doc["response"]


def test_patch_is_base64_json_patch() -> None:
    ops = [{"op": "add", "path": "/a", "value": 1}]
    doc = encode_response(decode_review(review(PLAIN_POD)), allowed=True, patch=ops)  # type: ignore[arg-type]
    assert patch_of(dict(doc)) == ops


# -- Admitter ----------------------------------------------------------------------------------------------


def test_gpu_pod_is_mutated_logged_counted_and_traced(harness: Harness) -> None:
    answer = harness.admitter.admit(review(GPU_POD, uid="u-1"))
    assert answer.status == 200
    doc = answer_of(answer.body)
    assert doc["response"]["uid"] == "u-1"
    assert doc["response"]["allowed"] is True
    ops = patch_of(doc)
    assert {"op": "replace", "path": "/spec/schedulerName", "value": "hami-scheduler"} in ops

    [span] = harness.spans.get_finished_spans()
    assert span.name == "webhook.admission"
    assert span.attributes is not None
    assert span.attributes["hamipy.admission.outcome"] == "mutated"
    assert span.attributes["k8s.namespace.name"] == "ml"
    [annotation] = [op for op in ops if op["path"] == "/metadata/annotations"]
    traceparent = annotation["value"][keys.TRACE_CONTEXT]
    ctx = span.get_span_context()
    assert ctx is not None
    assert traceparent.startswith(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-")

    [line] = harness.lines()
    assert line["event"] == "pod admitted"
    assert (line["trace_id"], line["span_id"]) == (f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")
    assert (line["namespace"], line["name"], line["uid"]) == ("ml", "train-*", "u-1")
    assert line["outcome"] == "mutated"
    assert line["level"] == "info"
    assert harness.metric("hamipy_webhook_admissions_total", outcome="mutated", reason="patched") == 1
    assert harness.metric("hamipy_webhook_admission_duration_seconds_count", outcome="mutated") == 1


def test_existing_trace_context_is_continued(harness: Harness) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    pod = json.loads(json.dumps(GPU_POD))
    pod["metadata"]["annotations"] = {keys.TRACE_CONTEXT: f"00-{trace_id}-00f067aa0ba902b7-01"}
    answer = harness.admitter.admit(review(pod))
    [span] = harness.spans.get_finished_spans()
    ctx = span.get_span_context()
    assert ctx is not None
    assert f"{ctx.trace_id:032x}" == trace_id
    assert span.parent is not None
    assert f"{span.parent.span_id:016x}" == "00f067aa0ba902b7"
    assert all(
        op["path"] != "/metadata/annotations/hami-py.io~1traceparent"
        for op in patch_of(answer_of(answer.body))
    )


CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_TRACEPARENT = f"00-{CALLER_TRACE}-b7ad6b7169203331-01"


def test_the_api_servers_traceparent_is_continued(harness: Harness) -> None:
    """The API server (with its tracing on) sends its request's context; the pod's trace is a part
    of it, and the annotation names the admission span in it."""
    answer = harness.admitter.admit(review(GPU_POD), headers={"traceparent": CALLER_TRACEPARENT})
    [span] = harness.spans.get_finished_spans()
    assert f"{span.context.trace_id:032x}" == CALLER_TRACE
    assert span.parent is not None
    assert f"{span.parent.span_id:016x}" == "b7ad6b7169203331"
    [annotation] = [op for op in patch_of(answer_of(answer.body)) if op["path"] == "/metadata/annotations"]
    assert annotation["value"][keys.TRACE_CONTEXT].startswith(
        f"00-{CALLER_TRACE}-{span.context.span_id:016x}-"
    )


def test_a_pods_own_trace_wins_over_the_callers_which_is_linked(harness: Harness) -> None:
    pod = json.loads(json.dumps(GPU_POD))
    pod["metadata"]["annotations"] = {
        keys.TRACE_CONTEXT: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    }
    harness.admitter.admit(review(pod), headers={"traceparent": CALLER_TRACEPARENT})
    [span] = harness.spans.get_finished_spans()
    assert f"{span.context.trace_id:032x}" == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert [f"{link.context.trace_id:032x}" for link in span.links] == [CALLER_TRACE]


def test_with_tracing_disabled_a_gpu_pod_is_mutated_without_a_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """OTEL_SDK_DISABLED=true (how fleets turn tracing off) once refused every GPU pod with a
    KeyError('traceparent'): admission must be exactly the same, minus the span and annotation."""
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    h = Harness()
    answer = h.admitter.admit(review(GPU_POD, uid="u-off"))
    doc = answer_of(answer.body)
    assert (answer.status, doc["response"]["uid"], doc["response"]["allowed"]) == (200, "u-off", True)
    ops = patch_of(doc)
    assert {"op": "replace", "path": "/spec/schedulerName", "value": "hami-scheduler"} in ops
    assert not [op for op in ops if "annotations" in op["path"]]
    assert h.spans.get_finished_spans() == ()
    [line] = h.lines()
    assert line["event"] == "pod admitted"
    assert "trace_id" not in line
    assert h.metric("hamipy_webhook_admissions_total", outcome="mutated", reason="patched") == 1


def test_with_tracing_disabled_the_callers_context_still_reaches_the_pod(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No spans here, but a service downstream with tracing on can still join the caller's trace."""
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    h = Harness()
    answer = h.admitter.admit(review(GPU_POD), headers={"traceparent": CALLER_TRACEPARENT})
    [annotation] = [op for op in patch_of(answer_of(answer.body)) if op["path"] == "/metadata/annotations"]
    assert annotation["value"][keys.TRACE_CONTEXT] == CALLER_TRACEPARENT
    assert h.spans.get_finished_spans() == ()


def test_refusal_is_http_200_with_message_logged_and_counted(harness: Harness) -> None:
    answer = harness.admitter.admit(review(PRIVILEGED_GPU_POD))
    assert answer.status == 200
    response = answer_of(answer.body)["response"]
    assert response["allowed"] is False
    assert "cuda" in response["status"]["message"]
    assert "privileged" in response["status"]["message"]
    [line] = harness.lines()
    assert (line["level"], line["event"], line["name"]) == ("warning", "pod refused", "bad")
    assert harness.metric("hamipy_webhook_admissions_total", outcome="refused", reason="privileged") == 1


def test_non_gpu_pod_is_allowed_without_patch(harness: Harness) -> None:
    response = answer_of(harness.admitter.admit(review(PLAIN_POD)).body)["response"]
    assert response == {"uid": "705ab4f5-6393-11e8-b7cc-42010a800002", "allowed": True}


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        pytest.param({"operation": "UPDATE"}, "not_create", id="update"),
        pytest.param({"kind": "Deployment"}, "not_pod", id="not-a-pod"),
    ],
)
def test_requests_we_do_not_mutate_are_allowed(harness: Harness, kwargs: dict[str, str], reason: str) -> None:
    response = answer_of(harness.admitter.admit(review(GPU_POD, **kwargs)).body)["response"]
    assert response["allowed"] is True
    assert "patch" not in response
    assert harness.metric("hamipy_webhook_admissions_total", outcome="allowed", reason=reason) == 1


def test_counters_an_alert_watches_exist_at_zero_before_the_first_event(harness: Harness) -> None:
    """A labelled counter has no series before its first increment, so increase() would miss the
    first bad request or internal error: they start at zero."""
    text = harness.telemetry.metrics.render().decode()
    for reason in ("not_json", "too_deep", "invalid", "too_large"):
        assert f'hamipy_webhook_bad_requests_total{{reason="{reason}"}} 0.0' in text
    assert 'hamipy_webhook_admissions_total{outcome="error",reason="exception"} 0.0' in text


def test_bad_request_is_400_logged_and_counted(harness: Harness) -> None:
    answer = harness.admitter.admit(b"garbage", remote="10.0.0.1")
    assert answer.status == 400
    assert answer_of(answer.body)["error"] == "not_json"
    [line] = harness.lines()
    assert (line["level"], line["reason"], line["remote"]) == ("warning", "not_json", "10.0.0.1")
    assert harness.metric("hamipy_webhook_bad_requests_total", reason="not_json") == 1


def test_internal_error_fails_closed(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(admitting, "decide", broken)
    answer = harness.admitter.admit(review(GPU_POD))
    response = answer_of(answer.body)["response"]
    assert answer.status == 200
    assert response["allowed"] is False
    assert response["status"]["code"] == 500
    assert "boom" in response["status"]["message"]
    assert harness.metric("hamipy_webhook_admissions_total", outcome="error", reason="exception") == 1
    [line] = harness.lines()
    assert line["level"] == "error"
    assert line["exception"][0]["exc_value"] == "boom"


def test_an_exception_log_carries_no_request_body(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames' local variables hold the request body (and tokens elsewhere): never logged."""
    secret = "s3cr3t-token-in-an-env-value"

    def broken(pod: dict[str, Any], *args: object, **kwargs: object) -> None:
        token = pod["spec"]["containers"][0]["env"][0]["value"]  # a local holding a secret
        raise RuntimeError(f"boom after reading {len(token)} characters")

    monkeypatch.setattr(admitting, "decide", broken)
    pod = json.loads(json.dumps(GPU_POD))
    pod["spec"]["containers"][0]["env"] = [{"name": "TOKEN", "value": secret}]
    harness.admitter.admit(review(pod))
    logged = harness.log.getvalue()
    assert "RuntimeError" in logged
    assert secret not in logged


def test_metrics_render_names() -> None:
    h = Harness()
    h.admitter.admit(review(GPU_POD))
    text = h.telemetry.metrics.render().decode()
    for name in (
        "hamipy_webhook_admission_duration_seconds_bucket",
        "hamipy_webhook_admissions_total",
        "hamipy_webhook_bad_requests_total",
        "hamipy_webhook_certificate_reloads_total",
    ):
        assert name in text or name.removesuffix("_total") in text
