"""One trace per pod: the webhook's admission span, the extender's filter and bind spans
and the device plugin's Allocate span arrive at an OTLP receiver as one trace, in that order, the
later ones children of the admission span (whose context the webhook left in the pod annotation).

Every service exports with the standard ``OTEL_*`` variables only: the webhook and extender in this
process, the device plugin as its own process (it inherits them). The receiver is devcluster's small
OTLP/HTTP endpoint (``hamipy.devcluster.otlp``), the one ``make up`` runs.

And with tracing switched off the way fleets do it (``OTEL_SDK_DISABLED=true``), the same pod is
admitted, scheduled and allocated exactly as with it on, minus the spans.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from builders import container
from stack_support import NEEDS_REAL_KUBELET, GpuStack, running_gpu_stack

from hamipy.devcluster import DevCluster, wait_for
from hamipy.devcluster.gpu_nodes import FakeGpu
from hamipy.devcluster.otlp import OtlpReceiver, ReceivedSpan
from hamipy.protocol import keys

pytestmark = [pytest.mark.integration, NEEDS_REAL_KUBELET]

GPUS = (FakeGpu("GPU-cccccccc-0000-4000-8000-000000000000", "NVIDIA H100 80GB HBM3", 81559),)
JOURNEY = ["webhook.admission", "extender.filter", "extender.bind", "device_plugin.allocate"]


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    otlp = OtlpReceiver()
    await otlp.start()
    yield otlp
    await otlp.stop()


@pytest.fixture
async def traced_stack(
    devcluster: DevCluster,
    kube_client: Any,
    namespace: str,
    hami_scheduler: Callable[..., Any],
    receiver: OtlpReceiver,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[GpuStack]:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within 0.1 s, not the default 5 s
    async with running_gpu_stack(devcluster, kube_client, namespace, hami_scheduler, gpus=GPUS) as stack:
        yield stack


async def test_one_pod_one_trace_from_admission_to_allocate(
    traced_stack: GpuStack, receiver: OtlpReceiver
) -> None:
    stack = traced_stack
    await stack.create(stack.pod_body("traced", [container("main", gpu=1, gpumem=2000, gpucores=20)]))
    pod = await stack.served("traced")
    meta = pod["metadata"]
    # 00-<trace id>-<admission span id>-<flags>
    _, trace_id, admission_id, _ = meta["annotations"][keys.TRACE_CONTEXT].split("-")

    def journey() -> list[ReceivedSpan] | None:
        spans = receiver.trace(trace_id)
        return spans if [s.name for s in spans] == JOURNEY else None

    spans = await wait_for(journey, timeout=30, interval=0.1, what=f"the spans {JOURNEY} of trace {trace_id}")
    assert spans is not None  # wait_for returns the first truthy value
    admission, filtering, binding, allocate = spans
    assert admission.span_id == admission_id
    assert [s.service for s in spans] == [
        "hamipy-webhook",
        "hamipy-extender",
        "hamipy-extender",
        "hamipy-device-plugin",
    ]
    for span in (filtering, binding, allocate):
        assert span.parent_id == admission.span_id, f"{span.name} is not a child of the admission span"
        assert span.attributes["k8s.pod.uid"] == meta["uid"]
    for span in spans:
        assert span.attributes["k8s.namespace.name"] == stack.namespace
        assert span.attributes["k8s.pod.name"] == "traced"
    assert allocate.attributes["k8s.container.name"] == "main"
    assert binding.attributes["k8s.node.name"] == stack.node


async def test_with_tracing_disabled_a_gpu_pod_is_admitted_scheduled_and_allocated(
    devcluster: DevCluster,
    kube_client: Any,
    namespace: str,
    hami_scheduler: Callable[..., Any],
    receiver: OtlpReceiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``OTEL_SDK_DISABLED=true`` in every service, with an exporter configured as well (a fleet
    default): admission, filter, bind and Allocate behave as with tracing on; no span leaves."""
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    async with running_gpu_stack(devcluster, kube_client, namespace, hami_scheduler, gpus=GPUS) as stack:
        await stack.create(stack.pod_body("untraced", [container("main", gpu=1, gpumem=2000, gpucores=20)]))
        pod = await stack.served("untraced")
        allocation = await stack.container("untraced", "main")
    annotations = pod["metadata"]["annotations"]
    assert pod["spec"]["schedulerName"] == "hami-scheduler"
    assert pod["spec"]["nodeName"] == stack.node
    assert annotations[keys.BIND_PHASE] == "success"
    assert keys.TRACE_CONTEXT not in annotations
    assert allocation.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "2000m"
    assert allocation.envs["CUDA_DEVICE_SM_LIMIT"] == "20"
    assert receiver.spans == []
