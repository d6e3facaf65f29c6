"""Per-container GPU asks and the webhook's defaults (docs/wire-format.md#resources)."""

from __future__ import annotations

from typing import Any

import pytest
from builders import container, pod
from hypothesis import given
from hypothesis import strategies as st

from hamipy.protocol import resources
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.resources import (
    ContainerRequest,
    PodRequests,
    RequestDefaults,
    ResourceNames,
    WebhookDefaults,
    container_request,
    cores_fit,
    exclusive_conflict,
    is_exclusive,
    memory_for_device,
    pod_requests,
    requests_any_gpu,
    sidecar_positions,
    validate_webhook_container,
    webhook_container_defaults,
    zero_core_conflict,
)

GPU = "nvidia.com/gpu"
MEM = "nvidia.com/gpumem"
PCT = "nvidia.com/gpumem-percentage"
CORES = "nvidia.com/gpucores"
PRIO = "nvidia.com/priority"
VGPU_NAMES = ResourceNames(count="nvidia.com/vgpu")


# (id, limits, requests, defaults, expected request)
REQUEST_CASES: list[
    tuple[str, dict[str, Any] | None, dict[str, Any] | None, RequestDefaults, ContainerRequest | None]
] = [
    ("count-only-takes-whole-memory", {GPU: "1"}, None, RequestDefaults(), ContainerRequest(1, None, 100, 0)),
    ("gpumem", {GPU: "1", MEM: "3000"}, None, RequestDefaults(), ContainerRequest(1, 3000, None, 0)),
    (
        "gpumem-and-cores",
        {GPU: "2", MEM: "4096", CORES: "30"},
        None,
        RequestDefaults(),
        ContainerRequest(2, 4096, None, 30),
    ),
    ("percentage", {GPU: "1", PCT: "50"}, None, RequestDefaults(), ContainerRequest(1, None, 50, 0)),
    (
        "gpumem-wins-over-percentage",
        {GPU: "1", MEM: "1000", PCT: "50"},
        None,
        RequestDefaults(),
        ContainerRequest(1, 1000, None, 0),
    ),
    (
        "gpumem-0-falls-to-percentage",
        {GPU: "1", MEM: "0", PCT: "25"},
        None,
        RequestDefaults(),
        ContainerRequest(1, None, 25, 0),
    ),
    (
        "gpumem-0-alone-is-100-percent",
        {GPU: "1", MEM: "0"},
        None,
        RequestDefaults(),
        ContainerRequest(1, None, 100, 0),
    ),
    (
        "percentage-above-100-clamped",
        {GPU: "1", PCT: "150"},
        None,
        RequestDefaults(),
        ContainerRequest(1, None, 100, 0),
    ),
    (
        "cores-above-100-clamped",
        {GPU: "1", CORES: "250"},
        None,
        RequestDefaults(),
        ContainerRequest(1, None, 100, 100),
    ),
    (
        "default-memory",
        {GPU: "1"},
        None,
        RequestDefaults(memory_mib=5000),
        ContainerRequest(1, 5000, None, 0),
    ),
    (
        "default-memory-not-over-percentage",
        {GPU: "1", PCT: "10"},
        None,
        RequestDefaults(memory_mib=5000),
        ContainerRequest(1, None, 10, 0),
    ),
    ("default-cores", {GPU: "1"}, None, RequestDefaults(cores=20), ContainerRequest(1, None, 100, 20)),
    (
        "explicit-cores-0-over-default",
        {GPU: "1", CORES: "0"},
        None,
        RequestDefaults(cores=20),
        ContainerRequest(1, None, 100, 0),
    ),
    (
        "default-cores-above-100-clamped",
        {GPU: "1"},
        None,
        RequestDefaults(cores=300),
        ContainerRequest(1, None, 100, 100),
    ),
    (
        "requests-fallback",
        None,
        {GPU: "1", MEM: "2000", CORES: "10"},
        RequestDefaults(),
        ContainerRequest(1, 2000, None, 10),
    ),
    (
        "limits-over-requests",
        {GPU: "2", MEM: "1000"},
        {GPU: "1", MEM: "9000"},
        RequestDefaults(),
        ContainerRequest(2, 1000, None, 0),
    ),
    (
        "mixed-limits-and-requests",
        {GPU: "1"},
        {MEM: "1234"},
        RequestDefaults(),
        ContainerRequest(1, 1234, None, 0),
    ),
    (
        "priority",
        {GPU: "1", PRIO: "1"},
        None,
        RequestDefaults(),
        ContainerRequest(1, None, 100, 0, priority=1),
    ),
    ("quantity-forms", {GPU: "1", MEM: "2Ki"}, None, RequestDefaults(), ContainerRequest(1, 2048, None, 0)),
    ("int-values", {GPU: 1, MEM: 3000}, None, RequestDefaults(), ContainerRequest(1, 3000, None, 0)),
    ("count-0-is-no-gpu", {GPU: "0", MEM: "3000"}, None, RequestDefaults(), None),
    ("no-count-is-no-gpu", {MEM: "3000", CORES: "30"}, None, RequestDefaults(), None),
    ("cpu-only", {"cpu": "500m", "memory": "1Gi"}, None, RequestDefaults(), None),
    ("no-resources", None, None, RequestDefaults(), None),
]


@pytest.mark.parametrize(
    ("limits", "requests", "defaults", "expected"),
    [c[1:] for c in REQUEST_CASES],
    ids=[c[0] for c in REQUEST_CASES],
)
def test_container_request(
    limits: dict[str, Any] | None,
    requests: dict[str, Any] | None,
    defaults: RequestDefaults,
    expected: ContainerRequest | None,
) -> None:
    assert (
        container_request(container("cuda", limits=limits, requests=requests), defaults=defaults) == expected
    )


def test_configured_names_are_read() -> None:
    c = container("cuda", limits={"nvidia.com/vgpu": "2", MEM: "100"})
    assert container_request(c, names=VGPU_NAMES) == ContainerRequest(2, 100, None, 0)
    assert container_request(c) is None


def test_nvidia_com_vgpu_is_not_read_alongside_the_default_count() -> None:
    assert container_request(container("cuda", limits={"nvidia.com/vgpu": "1"})) is None


def test_null_limits_and_requests_are_empty() -> None:
    c = {"name": "x", "resources": {"limits": None, "requests": {GPU: "1"}}}
    assert container_request(c) == ContainerRequest(1, None, 100, 0)


def test_pod_requests_align_init_and_regular_containers() -> None:
    p = pod(
        "p",
        container("main", limits={GPU: "1", MEM: "2500", CORES: "25"}),
        container("sidecar", limits={"cpu": "1"}),
        container("second", limits={GPU: "2", PCT: "50"}),
        init=(container("setup"), container("warmup", limits={GPU: "1"})),
    )
    got = pod_requests(p)
    assert got == PodRequests(
        init=(None, ContainerRequest(1, None, 100, 0)),
        containers=(ContainerRequest(1, 2500, None, 25), None, ContainerRequest(2, None, 50, 0)),
    )
    assert got.slots == got.init + got.containers
    assert got.any


def test_native_sidecars_are_the_init_containers_restarted_always() -> None:
    p = pod(
        "p",
        container("main", limits={GPU: "1"}),
        init=(
            container("setup", limits={GPU: "1"}),
            {**container("proxy", limits={GPU: "1"}), "restartPolicy": "Always"},
            {
                **container("other", limits={"cpu": "1"}),
                "restartPolicy": "OnFailure",
            },  # not valid, not a sidecar
            {**container("log"), "restartPolicy": "Always"},
        ),
    )
    assert sidecar_positions(p) == frozenset({1, 3})
    assert pod_requests(p).sidecars == frozenset({1, 3})
    assert sidecar_positions(pod("p", container("main"))) == frozenset()
    with pytest.raises(ProtocolError, match=r"spec\.initContainers"):
        sidecar_positions({"spec": {"initContainers": "proxy"}})


def test_pod_without_gpu() -> None:
    got = pod_requests(pod("p", container("web", limits={"cpu": "1"})))
    assert got == PodRequests(init=(), containers=(None,))
    assert not got.any


def test_pod_requests_use_names_and_defaults() -> None:
    p = pod("p", container("cuda", limits={"nvidia.com/vgpu": "1"}))
    got = pod_requests(p, names=VGPU_NAMES, defaults=RequestDefaults(memory_mib=1024, cores=10))
    assert got.containers == (ContainerRequest(1, 1024, None, 10),)


# (id, limits, resource named in the error, value shown)
BAD_VALUES = [
    ("negative-count", {GPU: "-1"}, GPU, "-1"),
    ("fractional-count", {GPU: "0.5"}, GPU, "0.5"),
    ("millis-memory", {GPU: "1", MEM: "500m"}, MEM, "500m"),
    ("garbage-cores", {GPU: "1", CORES: "lots"}, CORES, "lots"),
    ("negative-percentage", {GPU: "1", PCT: "-5"}, PCT, "-5"),
    ("float-json-memory", {GPU: "1", MEM: 1.5}, MEM, "1.5"),
    ("zero-percentage", {GPU: "1", PCT: "0"}, PCT, "0"),
    ("negative-priority", {GPU: "1", PRIO: "-1"}, PRIO, "-1"),
]


@pytest.mark.parametrize(
    ("limits", "resource", "shown"), [c[1:] for c in BAD_VALUES], ids=[c[0] for c in BAD_VALUES]
)
def test_malformed_values_name_container_and_resource(
    limits: dict[str, Any], resource: str, shown: str
) -> None:
    p = pod("p", container("ok", limits={GPU: "1"}), container("train", limits=limits))
    with pytest.raises(ProtocolError) as info:
        pod_requests(p)
    message = str(info.value)
    assert info.value.field == f"containers[1] 'train' {resource}"
    assert shown in message


def test_malformed_init_container_is_named_as_such() -> None:
    p = pod("p", container("cuda", limits={GPU: "1"}), init=(container("setup", limits={GPU: "x"}),))
    with pytest.raises(ProtocolError, match=r"initContainers\[0\] 'setup' nvidia.com/gpu"):
        pod_requests(p)


def test_one_mib_of_gpumem_is_an_ask() -> None:
    assert container_request(container("cuda", limits={GPU: "1", MEM: "1"})) == ContainerRequest(
        1, 1, None, 0
    )


def test_zero_percentage_is_fine_when_gpumem_is_given() -> None:
    assert container_request(container("cuda", limits={GPU: "1", MEM: "10", PCT: "0"})) == ContainerRequest(
        1, 10, None, 0
    )


def test_zero_percentage_explains_itself() -> None:
    with pytest.raises(ProtocolError, match="no memory limit"):
        container_request(container("cuda", limits={GPU: "1", PCT: "0"}))


@pytest.mark.parametrize(
    ("bad_pod", "field"),
    [
        ([], "pod"),
        ({"spec": []}, "spec"),
        ({"spec": {"containers": {}}}, "spec.containers"),
        ({"spec": {"containers": ["x"]}}, "spec.containers"),
        ({"spec": {"containers": [{"name": "a", "resources": []}]}}, "containers[0] 'a'.resources"),
        (
            {"spec": {"containers": [{"name": "a", "resources": {"limits": "1"}}]}},
            "containers[0] 'a'.resources.limits",
        ),
        ({"spec": {"containers": [{"resources": {"requests": [1]}}]}}, "containers[0].resources.requests"),
    ],
    ids=[
        "pod-list",
        "spec-list",
        "containers-dict",
        "container-str",
        "resources-list",
        "limits-str",
        "requests-list",
    ],
)
def test_malformed_pod_structure(bad_pod: Any, field: str) -> None:
    with pytest.raises(ProtocolError) as info:
        pod_requests(bad_pod)
    assert info.value.field == field


def test_pod_without_spec_has_no_containers() -> None:
    assert pod_requests({"metadata": {}}) == PodRequests(init=(), containers=())


def test_container_request_needs_exactly_one_memory_form() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        ContainerRequest(1, 100, 50, 0)
    with pytest.raises(ValueError, match="exactly one"):
        ContainerRequest(1, None, None, 0)


@given(st.integers(min_value=1, max_value=2**31 - 1))
def test_percentage_clamps_to_100(percentage: int) -> None:
    got = container_request(container("cuda", limits={GPU: "1", PCT: str(percentage)}))
    assert got is not None
    assert got.memory_percentage == min(percentage, 100)


@given(st.integers(min_value=0, max_value=2**31 - 1))
def test_cores_clamp_to_100(cores: int) -> None:
    got = container_request(container("cuda", limits={GPU: "1", CORES: str(cores)}))
    assert got is not None
    assert got.cores == min(cores, 100)


# memory_for_device ------------------------------------------------------------------------------

MEMORY_CASES = [
    ("gpumem-ignores-devmem", ContainerRequest(1, 3000, None, 0), 32768, 3000),
    ("half-of-32GiB", ContainerRequest(1, None, 50, 0), 32768, 16384),
    ("whole", ContainerRequest(1, None, 100, 0), 32768, 32768),
    ("rounds-down", ContainerRequest(1, None, 33, 0), 32767, 10813),
    ("one-percent-of-small", ContainerRequest(1, None, 1, 0), 99, 0),
    ("scaled-devmem", ContainerRequest(1, None, 25, 0), 65536, 16384),
]


@pytest.mark.parametrize(
    ("request_", "devmem", "expected"), [c[1:] for c in MEMORY_CASES], ids=[c[0] for c in MEMORY_CASES]
)
def test_memory_for_device(request_: ContainerRequest, devmem: int, expected: int) -> None:
    assert memory_for_device(request_, devmem) == expected


@given(st.integers(min_value=1, max_value=100), st.integers(min_value=0, max_value=10**7))
def test_percentage_memory_never_exceeds_devmem(percentage: int, devmem: int) -> None:
    got = memory_for_device(ContainerRequest(1, None, percentage, 0), devmem)
    assert 0 <= got <= devmem
    assert got == devmem * percentage // 100


# exclusivity ------------------------------------------------------------------------------------


def test_only_100_cores_is_exclusive() -> None:
    assert is_exclusive(100)
    assert not is_exclusive(99)
    assert not is_exclusive(0)


@pytest.mark.parametrize(
    ("cores", "used", "totalcore", "conflict"),
    [
        (100, 1, 100, True),
        (100, 0, 100, False),
        (99, 3, 100, False),
        (100, 1, 200, False),  # core scaling 2: 100 is half the device, not all of it
    ],
    ids=["exclusive-on-used-gpu", "exclusive-on-idle-gpu", "not-exclusive", "scaled-device"],
)
def test_exclusive_conflict(cores: int, used: int, totalcore: int, conflict: bool) -> None:
    assert exclusive_conflict(cores, device_used=used, device_totalcore=totalcore) is conflict


@pytest.mark.parametrize(
    ("cores", "usedcores", "totalcore", "conflict"),
    [
        (0, 100, 100, True),
        (0, 99, 100, False),
        (10, 100, 100, False),
        (0, 0, 0, False),
        (0, 200, 200, True),
    ],
    ids=["zero-on-full-gpu", "zero-on-nearly-full", "nonzero", "no-cores-registered", "scaled-full"],
)
def test_zero_core_conflict(cores: int, usedcores: int, totalcore: int, conflict: bool) -> None:
    assert zero_core_conflict(cores, device_usedcores=usedcores, device_totalcore=totalcore) is conflict


@pytest.mark.parametrize(
    ("cores", "used", "usedcores", "totalcore", "fits"),
    [
        (30, 2, 60, 100, True),
        (50, 2, 60, 100, False),
        (100, 1, 0, 100, False),
        (100, 0, 0, 100, True),
        (0, 1, 100, 100, False),
        (0, 3, 40, 100, True),
    ],
    ids=[
        "room-left",
        "not-enough-left",
        "exclusive-taken",
        "exclusive-free",
        "zero-on-full",
        "zero-on-shared",
    ],
)
def test_cores_fit(cores: int, used: int, usedcores: int, totalcore: int, fits: bool) -> None:
    assert cores_fit(cores, device_used=used, device_usedcores=usedcores, device_totalcore=totalcore) is fits


# requests_any_gpu -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("p", "expected"),
    [
        (pod("p", container("cuda", limits={GPU: "1"})), True),
        (pod("p", container("cuda", limits={MEM: "10"})), True),
        (pod("p", container("cuda", requests={PCT: "10"})), True),
        (pod("p", container("cuda", limits={CORES: "10"})), True),
        (
            pod("p", container("cuda", limits={"cpu": "1"}), init=(container("cuda", limits={GPU: "1"}),)),
            True,
        ),
        (pod("p", container("cuda", limits={PRIO: "0"})), False),
        (pod("p", container("cuda", limits={"cpu": "1"})), False),
        (pod("p", container("cuda")), False),
        (pod("p", container("cuda", limits={GPU: "garbage"})), True),
        ({"spec": {"containers": ["junk", {"resources": None}]}}, False),
        ({"spec": {"containers": [{"resources": None}, {"resources": {"limits": {GPU: "1"}}}]}}, True),
        ({}, False),
    ],
    ids=[
        "count",
        "memory",
        "percentage-in-requests",
        "cores",
        "init-container",
        "priority-alone",
        "cpu-only",
        "no-resources",
        "malformed-value-still-counts",
        "junk-containers",
        "second-container-after-one-without-resources",
        "no-spec",
    ],
)
def test_requests_any_gpu(p: dict[str, Any], expected: bool) -> None:
    assert requests_any_gpu(p) is expected


def test_requests_any_gpu_uses_configured_names() -> None:
    assert requests_any_gpu(pod("p", container("cuda", limits={"nvidia.com/vgpu": "1"})), VGPU_NAMES)
    assert not requests_any_gpu(pod("p", container("cuda", limits={"nvidia.com/vgpu": "1"})))


# webhook defaults -------------------------------------------------------------------------------

# (id, limits, requests, default_gpu_count, added limits, has_resource)
WEBHOOK_CASES: list[tuple[str, dict[str, Any] | None, dict[str, Any] | None, int, dict[str, str], bool]] = [
    ("count-alone-gets-exclusive-cores", {GPU: "1"}, None, 1, {CORES: "100"}, True),
    ("count-with-memory-stays-shared", {GPU: "1", MEM: "3000"}, None, 1, {}, True),
    ("count-with-percentage-100-exclusive", {GPU: "1", PCT: "100"}, None, 1, {CORES: "100"}, True),
    ("count-with-percentage-50-shared", {GPU: "1", PCT: "50"}, None, 1, {}, True),
    ("percentage-100-wins-over-memory", {GPU: "1", MEM: "3000", PCT: "100"}, None, 1, {CORES: "100"}, True),
    ("count-with-cores-kept", {GPU: "1", CORES: "30"}, None, 1, {}, True),
    ("count-with-cores-0-kept", {GPU: "1", CORES: "0"}, None, 1, {}, True),
    ("memory-without-count-gets-count", {MEM: "3000"}, None, 1, {GPU: "1"}, True),
    ("cores-without-count-gets-count", {CORES: "30"}, None, 1, {GPU: "1"}, True),
    ("percentage-100-without-count", {PCT: "100"}, None, 1, {GPU: "1", CORES: "100"}, True),
    ("percentage-50-without-count", {PCT: "50"}, None, 1, {GPU: "1"}, True),
    ("configured-default-count", {MEM: "3000"}, None, 2, {GPU: "2"}, True),
    ("default-count-0-adds-nothing", {MEM: "3000"}, None, 0, {}, False),
    ("memory-only-in-requests-adds-no-count", None, {MEM: "3000"}, 1, {}, False),
    ("count-in-requests-gets-cores", None, {GPU: "1"}, 1, {CORES: "100"}, True),
    ("count-in-requests-with-memory", None, {GPU: "1", MEM: "10"}, 1, {}, False),
    ("memory-in-requests-stays-shared", {GPU: "1"}, {MEM: "3000"}, 1, {}, True),
    ("cores-in-requests-kept", {GPU: "1"}, {CORES: "10"}, 1, {}, True),
    ("priority-adds-nothing", {GPU: "1", MEM: "10", PRIO: "0"}, None, 1, {}, True),
    ("no-gpu", {"cpu": "1"}, None, 1, {}, False),
    ("nothing", None, None, 1, {}, False),
]


@pytest.mark.parametrize(
    ("limits", "requests", "default_gpu_count", "added", "has_resource"),
    [c[1:] for c in WEBHOOK_CASES],
    ids=[c[0] for c in WEBHOOK_CASES],
)
def test_webhook_container_defaults(
    limits: dict[str, Any] | None,
    requests: dict[str, Any] | None,
    default_gpu_count: int,
    added: dict[str, str],
    has_resource: bool,
) -> None:
    got = webhook_container_defaults(
        container("cuda", limits=limits, requests=requests), default_gpu_count=default_gpu_count
    )
    assert got == WebhookDefaults(add_limits=added, has_resource=has_resource)


def test_webhook_uses_configured_names() -> None:
    got = webhook_container_defaults(container("cuda", limits={MEM: "10"}), names=VGPU_NAMES)
    assert got.add_limits == {"nvidia.com/vgpu": "1"}


def test_webhook_refuses_malformed_percentage() -> None:
    with pytest.raises(ProtocolError, match=r"container nvidia.com/gpumem-percentage: is not a whole number"):
        webhook_container_defaults(container("cuda", limits={GPU: "1", PCT: "50.5"}))


@pytest.mark.parametrize(
    ("limits", "resource", "reason"),
    [
        ({GPU: "1", PCT: "0"}, PCT, "must be 1-100"),
        ({GPU: "1", PCT: "101"}, PCT, "must be 1-100"),
        ({GPU: "-1"}, GPU, "negative"),
        ({GPU: "1", MEM: "1.5"}, MEM, "not a whole number"),
        ({GPU: "1", CORES: "x"}, CORES, "not a Kubernetes quantity"),
        ({GPU: "1", PRIO: "0.5"}, PRIO, "not a whole number"),
    ],
    ids=[
        "percentage-0",
        "percentage-101",
        "negative-count",
        "fractional-memory",
        "garbage-cores",
        "bad-priority",
    ],
)
def test_validate_webhook_container_refuses(limits: dict[str, Any], resource: str, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason) as info:
        validate_webhook_container(container("train", limits=limits), label="containers[0] 'train'")
    assert info.value.field == f"containers[0] 'train' {resource}"


@pytest.mark.parametrize(
    "limits",
    [{GPU: "1", PCT: "1"}, {GPU: "1", PCT: "100"}, {GPU: "1", CORES: "250"}, {"cpu": "2"}, {GPU: "0"}],
    ids=["percentage-1", "percentage-100", "cores-above-100-clamped-later", "no-gpu", "count-0"],
)
def test_validate_webhook_container_accepts(limits: dict[str, Any]) -> None:
    validate_webhook_container(container("cuda", limits=limits))


def test_container_label() -> None:
    assert resources.container_label("containers", 2, {"name": "train"}) == "containers[2] 'train'"
    assert resources.container_label("initContainers", 0, {}) == "initContainers[0]"


def test_public_api_is_complete() -> None:
    assert sorted(resources.__all__) == sorted(
        [
            "FULL_CORES",
            "FULL_PERCENT",
            "ContainerRequest",
            "PodRequests",
            "RequestDefaults",
            "ResourceNames",
            "WebhookDefaults",
            "container_label",
            "container_request",
            "cores_fit",
            "exclusive_conflict",
            "is_exclusive",
            "memory_for_device",
            "pod_requests",
            "requests_any_gpu",
            "sidecar_positions",
            "validate_webhook_container",
            "webhook_container_defaults",
            "zero_core_conflict",
        ]
    )
    for name in resources.__all__:
        assert hasattr(resources, name)
