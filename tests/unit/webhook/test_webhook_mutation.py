"""mutation.decide: every webhook rule, refusals with their messages, and idempotency."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from builders import container, pod
from hypothesis import given, settings
from hypothesis import strategies as st
from webhook_jsonpatch import apply_patch

from hamipy.protocol import keys
from hamipy.protocol.config import load_config
from hamipy.protocol.reserved_env import GPU_CONTAINER_NAMES
from hamipy.protocol.resources import ResourceNames
from hamipy.webhook.mutation import Decision, MutationSettings, decide, pointer_token

TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
DEFAULTS = MutationSettings()


def load_settings(config: str) -> MutationSettings:
    return MutationSettings.from_config(load_config(config))


def mutate(p: dict[str, Any], s: MutationSettings = DEFAULTS, trace: str | None = TRACE) -> dict[str, Any]:
    decision = decide(p, s, trace_context=trace)
    assert decision.allowed, decision.message
    return apply_patch(p, [dict(op) for op in decision.patch])


GPU_POD = pod(
    "p",
    container(limits={"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4096"}),
    scheduler_name="default-scheduler",
)


# -- which pods are touched -------------------------------------------------------------------------


def test_non_gpu_pod_is_allowed_unchanged() -> None:
    p = pod("p", container(limits={"cpu": "1", "memory": "1Gi"}), scheduler_name="default-scheduler")
    assert decide(p, DEFAULTS, trace_context=TRACE) == Decision("allowed", "not_gpu_pod")


def test_non_gpu_privileged_pod_with_node_name_is_allowed_unchanged() -> None:
    p = pod("p", container(securityContext={"privileged": True}), node_name="n1")
    assert decide(p, DEFAULTS) == Decision("allowed", "not_gpu_pod")


def test_gpu_pod_with_default_scheduler_goes_to_hami_scheduler() -> None:
    out = mutate(GPU_POD)
    assert out["spec"]["schedulerName"] == "hami-scheduler"


def test_gpu_pod_without_scheduler_name_gets_one_added() -> None:
    p = pod("p", container(limits={"nvidia.com/gpu": "1"}))
    decision = decide(p, DEFAULTS)
    assert {"op": "add", "path": "/spec/schedulerName", "value": "hami-scheduler"} in decision.patch


def test_configured_scheduler_name_is_used() -> None:
    out = mutate(GPU_POD, MutationSettings(scheduler_name="gpu-sched"))
    assert out["spec"]["schedulerName"] == "gpu-sched"


def test_default_scheduler_is_another_scheduler_when_overwrite_is_off() -> None:
    """Removing spec.schedulerName cannot help here (the API server fills in default-scheduler):
    the refusal says which name to set."""
    s = MutationSettings(overwrite_default_scheduler=False)
    decision = decide(GPU_POD, s)
    assert decision.reason == "scheduler_not_allowed"
    assert "set spec.schedulerName to hami-scheduler," in decision.message
    assert "remove" not in decision.message
    allowed = MutationSettings(
        overwrite_default_scheduler=False, allowed_schedulers=frozenset({"default-scheduler"})
    )
    assert decide(GPU_POD, allowed) == Decision("allowed", "other_scheduler")


def test_gpu_pod_naming_another_scheduler_is_refused_saying_how_to_allow_it() -> None:
    p = pod("p", container(limits={"nvidia.com/gpu": "1"}), scheduler_name="my-scheduler")
    decision = decide(p, MutationSettings(allowed_schedulers=frozenset({"volcano"})))
    assert (decision.outcome, decision.reason, decision.patch) == ("refused", "scheduler_not_allowed", ())
    for part in (
        "'my-scheduler'",
        "set spec.schedulerName to hami-scheduler (or remove it),",
        "allowedSchedulers",
        "allowed: volcano",
    ):
        assert part in decision.message


def test_gpu_pod_of_an_allowed_scheduler_is_left_alone() -> None:
    p = pod("p", container(limits={"nvidia.com/gpumem": "1000"}), scheduler_name="volcano")
    s = MutationSettings(allowed_schedulers=frozenset({"volcano", "kueue"}))
    assert decide(p, s) == Decision("allowed", "other_scheduler")


@pytest.mark.parametrize("scheduler", ["my-scheduler", "volcano", "hami-scheduler", None])
def test_gpu_pod_with_node_name_is_refused_whatever_scheduler_it_names(scheduler: str | None) -> None:
    """A pod placed by its author reaches the kubelet with no scheduler of ours choosing its GPUs:
    checked before the scheduler lets any pod through."""
    p = pod("p", container(limits={"nvidia.com/gpu": "1"}), scheduler_name=scheduler, node_name="n1")
    decision = decide(p, MutationSettings(allowed_schedulers=frozenset({"volcano"})))
    assert (decision.outcome, decision.reason) == ("refused", "node_name")
    assert "'n1'" in decision.message


def test_pod_already_naming_our_scheduler_still_gets_defaults() -> None:
    p = pod("p", container(limits={"nvidia.com/gpumem": "1000"}), scheduler_name="hami-scheduler")
    out = mutate(p)
    assert out["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_names_only_in_requests_count_as_gpu_pod() -> None:
    p = pod("p", container("c", requests={"nvidia.com/gpu": "1"}))
    out = mutate(p)
    assert out["spec"]["schedulerName"] == "hami-scheduler"


@pytest.mark.parametrize(
    "first",
    [
        pytest.param(container("sidecar"), id="no-resources"),
        pytest.param(container("sidecar", limits={"cpu": "1"}), id="cpu-only"),
    ],
)
@pytest.mark.parametrize("kind", ["containers", "initContainers"])
def test_a_gpu_pod_whose_first_container_asks_nothing_is_still_a_gpu_pod(
    first: dict[str, Any], kind: str
) -> None:
    # Without this, a sidecar (or init container) listed first lets the GPU pod bypass the webhook.
    gpu_container = container("app", limits={"nvidia.com/gpu": "1"})
    if kind == "containers":
        p = pod("p", first, gpu_container, scheduler_name="default-scheduler")
    else:
        p = pod("p", container("app"), init=[first, gpu_container], scheduler_name="default-scheduler")
    out = mutate(p)
    assert out["spec"]["schedulerName"] == "hami-scheduler"


def test_configured_resource_names_are_used() -> None:
    names = ResourceNames(count="example.com/vgpu", memory="example.com/vmem")
    s = MutationSettings(names=names)
    assert decide(GPU_POD, s).reason == "not_gpu_pod"
    out = mutate(pod("p", container(limits={"example.com/vmem": "100"})), s)
    assert out["spec"]["containers"][0]["resources"]["limits"]["example.com/vgpu"] == "1"


# -- resource defaults (docs/wire-format.md#resources) -------------------------------------------------


@pytest.mark.parametrize(
    ("limits", "added"),
    [
        pytest.param({"nvidia.com/gpumem": "3000"}, {"nvidia.com/gpu": "1"}, id="memory-only-gets-count"),
        pytest.param({"nvidia.com/gpucores": "30"}, {"nvidia.com/gpu": "1"}, id="cores-only-gets-count"),
        pytest.param(
            {"nvidia.com/gpumem-percentage": "50"}, {"nvidia.com/gpu": "1"}, id="percentage-only-gets-count"
        ),
        pytest.param(
            {"nvidia.com/gpumem-percentage": "100"},
            {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "100"},
            id="whole-percentage-is-exclusive",
        ),
        pytest.param({"nvidia.com/gpu": "2"}, {"nvidia.com/gpucores": "100"}, id="count-alone-is-exclusive"),
        pytest.param(
            {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024"}, {}, id="count-and-memory-no-cores"
        ),
        pytest.param({"nvidia.com/gpu": "1", "nvidia.com/gpucores": "0"}, {}, id="explicit-cores-kept"),
    ],
)
def test_resource_defaults(limits: dict[str, str], added: dict[str, str]) -> None:
    out = mutate(pod("p", container(limits=dict(limits))))
    assert out["spec"]["containers"][0]["resources"]["limits"] == {**limits, **added}


def test_default_gpu_count_zero_adds_no_count_and_pod_is_left_alone() -> None:
    p = pod("p", container(limits={"nvidia.com/gpumem": "3000"}))
    assert decide(p, MutationSettings(default_gpu_count=0)) == Decision("allowed", "no_gpu_asked")


def test_configured_default_gpu_count() -> None:
    out = mutate(
        pod("p", container(limits={"nvidia.com/gpucores": "20"})), MutationSettings(default_gpu_count=2)
    )
    assert out["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"


def test_init_containers_get_defaults_too() -> None:
    p = pod(
        "p",
        container("main", limits={"cpu": "1"}),
        init=[container("warmup", limits={"nvidia.com/gpumem": "100"})],
    )
    out = mutate(p)
    assert out["spec"]["initContainers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert out["spec"]["containers"][0]["resources"]["limits"] == {"cpu": "1"}


@pytest.mark.parametrize(
    "resources",
    [
        pytest.param({"limits": None, "requests": {"nvidia.com/gpu": "1"}}, id="limits-null"),
        pytest.param({"requests": {"nvidia.com/gpu": "1"}}, id="limits-absent"),
    ],
)
def test_missing_limits_map_is_created(resources: dict[str, Any]) -> None:
    out = mutate(pod("p", container("c", resources=resources)))
    assert out["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpucores": "100"}


# -- env ------------------------------------------------------------------------------------------------


def env_of(out: dict[str, Any], index: int = 0, kind: str = "containers") -> dict[str, str]:
    return {e["name"]: e.get("value") for e in out["spec"][kind][index].get("env", [])}


def test_priority_and_core_policy_add_no_env() -> None:
    """They travel with the device plugin's limits; the admission policy would refuse the pod's
    own env setting them, the webhook's mutation included."""
    limits = {"nvidia.com/gpu": "1", "nvidia.com/priority": "0"}
    out = mutate(
        pod("p", container(limits=limits, env={"A": "x"})), load_settings("nvidia: {gpuCorePolicy: force}")
    )
    assert env_of(out) == {"A": "x"}


def test_overwrite_env_hides_gpus_from_containers_without_one() -> None:
    p = pod(
        "p",
        container("gpu", limits={"nvidia.com/gpu": "1"}),
        container("sidecar", env={"A": "x"}),
        container("hidden", env={"NVIDIA_VISIBLE_DEVICES": "none"}),
        init=[container("init")],
    )
    decision = decide(p, MutationSettings(overwrite_env=True))
    assert {
        "op": "add",
        "path": "/spec/containers/1/env/-",
        "value": {"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"},
    } in decision.patch
    out = apply_patch(p, [dict(op) for op in decision.patch])
    assert env_of(out, 0) == {}
    assert env_of(out, 1) == {"A": "x", "NVIDIA_VISIBLE_DEVICES": "none"}
    assert env_of(out, 2) == {"NVIDIA_VISIBLE_DEVICES": "none"}
    assert env_of(out, 0, "initContainers") == {"NVIDIA_VISIBLE_DEVICES": "none"}


def test_overwrite_env_off_by_default() -> None:
    out = mutate(pod("p", container("gpu", limits={"nvidia.com/gpu": "1"}), container("sidecar")))
    assert "env" not in out["spec"]["containers"][1]


# -- the env a pod may not set (hamipy.protocol.reserved_env) --------------------------------------------

GPU_RESERVED = [
    *GPU_CONTAINER_NAMES,
    "CUDA_DEVICE_MEMORY_LIMIT_0",
    "CUDA_DEVICE_MEMORY_LIMIT_12",
    "CUDA_DEVICE_SM_LIMIT_1",
]


def refusal(p: dict[str, Any], s: MutationSettings = DEFAULTS) -> str:
    decision = decide(p, s)
    assert (decision.outcome, decision.reason, decision.patch) == ("refused", "reserved_env", ())
    return decision.message


@pytest.mark.parametrize("name", GPU_RESERVED)
@pytest.mark.parametrize(
    "limits",
    [
        pytest.param({"nvidia.com/gpu": "1"}, id="count"),
        pytest.param({"nvidia.com/gpumem": "1000"}, id="count-added-by-default"),
    ],
)
def test_a_gpu_container_may_not_set_its_own_limits(name: str, limits: dict[str, str]) -> None:
    p = pod("p", container("sidecar"), container("cuda", limits=limits, env={"A": "1", name: "20000m"}))
    message = refusal(p)
    assert f"containers[1] 'cuda' sets {name}," in message
    assert "device plugin" in message


@pytest.mark.parametrize(
    "name", ["CUDA_DEVICE_MEMORY_LIMIT_X", "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "A"]
)
def test_other_names_are_the_containers_own(name: str) -> None:
    assert decide(pod("p", container(limits={"nvidia.com/gpu": "1"}, env={name: "1"})), DEFAULTS).allowed


def test_containers_asking_no_gpu_may_use_the_gpu_names() -> None:
    """They get no slice, so no limit of theirs is at stake (the admission policy reads it alike)."""
    names = dict.fromkeys(GPU_RESERVED, "1")
    p = pod("p", container("cuda", limits={"nvidia.com/gpu": "1"}), container("sidecar", env=names))
    assert decide(p, DEFAULTS).allowed
    no_count = pod("p", container(limits={"nvidia.com/gpumem": "1000"}, env=names))
    assert decide(no_count, MutationSettings(default_gpu_count=0)) == Decision("allowed", "no_gpu_asked")


@pytest.mark.parametrize("kind", ["containers", "initContainers", "ephemeralContainers"])
@pytest.mark.parametrize(
    ("entry", "shown"),
    [
        pytest.param({"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}, "to 'all'", id="all"),
        pytest.param({"name": "NVIDIA_VISIBLE_DEVICES", "value": ""}, "to ''", id="empty"),
        pytest.param({"name": "NVIDIA_VISIBLE_DEVICES"}, "empty", id="no-value"),
        pytest.param(
            {"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            "from valueFrom",
            id="value-from",
        ),
    ],
)
def test_no_container_of_a_gpu_pod_chooses_the_gpus_the_runtime_hands_it(
    kind: str, entry: dict[str, Any], shown: str
) -> None:
    p = pod("p", container("cuda", limits={"nvidia.com/gpu": "1"}))
    p["spec"].setdefault(kind, []).append({"name": "other", "image": "img", "env": [entry]})
    message = refusal(p)
    assert f"{kind}[" in message
    assert f"'other' sets NVIDIA_VISIBLE_DEVICES {shown}:" in message


def test_nvidia_visible_devices_none_is_allowed_anywhere() -> None:
    hidden = {"NVIDIA_VISIBLE_DEVICES": "none"}
    p = pod("p", container("cuda", limits={"nvidia.com/gpu": "1"}, env=hidden), container("side", env=hidden))
    assert decide(p, DEFAULTS).allowed


@pytest.mark.parametrize(
    ("prefix", "gpu", "refused"),
    [
        pytest.param("CUDA_", True, True, id="CUDA_"),
        pytest.param("C", True, True, id="C"),
        pytest.param("LD_", True, True, id="LD_"),
        pytest.param("GPU_CORE_UTILIZATION_POLICY", True, True, id="a-whole-name"),
        pytest.param("CUDA_DEVICE_MEMORY_LIMIT_", True, True, id="per-device-base"),
        pytest.param("CUDA_DEVICE_SM_LIMIT_1", True, True, id="per-device-digit"),
        pytest.param("CUDA_DEVICE_MEMORY_LIMIT_X", True, False, id="past-every-name"),
        pytest.param("APP_", True, False, id="APP_"),
        pytest.param("", True, False, id="empty"),
        pytest.param(None, True, False, id="none"),
        pytest.param("NVIDIA_", False, True, id="NVIDIA_-in-a-sidecar"),
        pytest.param("CUDA_", False, False, id="CUDA_-in-a-sidecar"),
    ],
)
def test_env_from_is_judged_by_its_prefix(prefix: str | None, gpu: bool, refused: bool) -> None:
    source: dict[str, Any] = {"secretRef": {"name": "s"}}
    if prefix is not None:
        source["prefix"] = prefix
    target = container("target", limits={"nvidia.com/gpu": "1"} if gpu else None, envFrom=[source])
    p = pod("p", container("cuda", limits={"nvidia.com/gpu": "1"}), target)
    if not refused:
        assert decide(p, DEFAULTS).allowed
        return
    message = refusal(p)
    assert (
        f"containers[1] 'target' takes env from secretRef 's' with prefix {prefix!r}, which could set"
        in message
    )


def test_an_allowed_schedulers_pod_is_held_to_the_env_rules_too() -> None:
    """The admission policy refuses it for every pod: the webhook says so first."""
    p = pod(
        "p", container(limits={"nvidia.com/gpu": "1"}, env={"LD_PRELOAD": "/x.so"}), scheduler_name="volcano"
    )
    assert "sets LD_PRELOAD" in refusal(p, MutationSettings(allowed_schedulers=frozenset({"volcano"})))


@pytest.mark.parametrize("scheduler", [None, "volcano"])
def test_a_gpu_pod_may_not_name_cdi_devices_through_annotations(scheduler: str | None) -> None:
    """A runtime may take CDI devices from ``cdi.k8s.io/`` annotations: another pod's slot or a
    whole GPU. The admission policy refuses them on every pod; the webhook says so first."""
    p = pod("p", container(limits={"nvidia.com/gpu": "1"}), scheduler_name=scheduler)
    p["metadata"]["annotations"] = {"cdi.k8s.io/mine": "nvidia.com/gpu=GPU-a"}
    decision = decide(p, MutationSettings(allowed_schedulers=frozenset({"volcano"})))
    assert (decision.outcome, decision.reason, decision.patch) == ("refused", "reserved_annotation", ())
    assert decision.message.startswith("annotation cdi.k8s.io/mine: a runtime can take CDI devices")


# -- the paths a GPU container's own volumes may not cover (hamipy.protocol.reserved_mounts) -------------


GPU = {"nvidia.com/gpu": "1"}
PARENT = "parent of a path the device plugin mounts"


def mount_refusal(p: dict[str, Any], s: MutationSettings = DEFAULTS) -> str:
    decision = decide(p, s)
    assert (decision.outcome, decision.reason, decision.patch) == ("refused", "reserved_mount", ())
    return decision.message


def mounting(path: str, **limits: str) -> dict[str, Any]:
    """A pod whose container ``cuda`` (with ``limits``) mounts volume ``v`` at ``path``."""
    mounts = [{"name": "v", "mountPath": path}]
    return pod("p", container("sidecar"), container("cuda", limits=limits or None, volumeMounts=mounts))


@pytest.mark.parametrize(
    ("path", "covers"),
    [
        pytest.param("/usr/local/vgpu/limits", "interposer directory", id="limits-file"),
        pytest.param("/usr/local/vgpu", "interposer directory", id="hook-directory"),
        pytest.param("/usr/local/vgpu/libvgpu.so", "interposer directory", id="interposer"),
        pytest.param("/etc/ld.so.preload", "/etc/ld.so.preload", id="preload"),
        pytest.param("/usr/local//vgpu", "another spelling", id="double-slash"),
        pytest.param("/etc/./ld.so.preload", "another spelling", id="dot"),
        pytest.param("/usr/x/../local/vgpu/limits", "another spelling", id="dot-dot"),
        pytest.param("etc/ld.so.preload", "another spelling", id="relative"),
    ],
)
@pytest.mark.parametrize(
    "limits",
    [
        pytest.param({"nvidia.com/gpu": "1"}, id="count"),
        pytest.param({"nvidia.com/gpumem": "1000"}, id="count-added-by-default"),
    ],
)
def test_a_gpu_container_may_not_cover_the_device_plugins_mounts(
    path: str, covers: str, limits: dict[str, str]
) -> None:
    message = mount_refusal(mounting(path, **limits))
    assert f"containers[1] 'cuda' mounts volume 'v' at {path!r}:" in message
    assert covers in message


@pytest.mark.parametrize("path", ["/", "/etc", "/etc/", "/usr", "/usr/local", "/usr/local/"])
def test_a_gpu_container_may_not_mount_a_parent_of_them(path: str) -> None:
    """The pod chooses what is in its volume: a link there, which the runtime follows, could send
    the device plugin's deeper mount under another volume of the pod."""
    message = mount_refusal(mounting(path, **GPU))
    assert f"containers[1] 'cuda' mounts volume 'v' at {path!r}:" in message
    assert PARENT in message


def test_the_configured_hook_path_is_the_one_reserved() -> None:
    s = load_settings("nvidia:\n  hookPath: /opt/hami/vgpu\n")
    assert s.hook_path == "/opt/hami/vgpu"
    assert "interposer directory" in mount_refusal(mounting("/opt/hami/vgpu/limits", **GPU), s)
    for parent in ("/opt", "/opt/hami", "/etc", "/"):
        assert PARENT in mount_refusal(mounting(parent, **GPU), s)
    for path in ("/usr/local/vgpu/limits", "/usr/local", "/opt/hami2"):
        assert decide(mounting(path, **GPU), s).allowed, path


@pytest.mark.parametrize(
    "path", ["/data", "/etc2", "/usr/local/vgpu2", "/usr/local/cuda", "/etc/ld.so.preload.d", "/etc/ssl"]
)
def test_a_gpu_container_may_mount_anywhere_else(path: str) -> None:
    assert decide(mounting(path, **GPU), DEFAULTS).allowed


def test_containers_asking_no_gpu_may_mount_there() -> None:
    """They get none of the device plugin's mounts, so nothing of ours is covered."""
    p = mounting("/etc/ld.so.preload")
    p["spec"]["containers"][0] = container("gpu", limits=GPU)
    assert decide(p, DEFAULTS).allowed
    no_count = mounting("/usr/local/vgpu/limits", **{"nvidia.com/gpumem": "1000"})
    assert decide(no_count, MutationSettings(default_gpu_count=0)) == Decision("allowed", "no_gpu_asked")


def test_a_gpu_init_container_may_not_cover_them_either() -> None:
    init = container("setup", limits=GPU, volumeMounts=[{"name": "v", "mountPath": "/etc/ld.so.preload"}])
    message = mount_refusal(pod("p", container(), init=[init]))
    assert "initContainers[0] 'setup' mounts volume 'v' at '/etc/ld.so.preload'" in message


def test_an_allowed_schedulers_pod_is_held_to_the_mount_rules_too() -> None:
    p = mounting("/usr/local/vgpu/limits", **GPU)
    p["spec"]["schedulerName"] = "volcano"
    assert "'/usr/local/vgpu/limits'" in mount_refusal(
        p, MutationSettings(allowed_schedulers=frozenset({"volcano"}))
    )


# -- runtime class, trace annotation ------------------------------------------------------------------


def test_runtime_class_set_only_when_configured_and_unset() -> None:
    s = MutationSettings(runtime_class_name="nvidia")
    assert mutate(GPU_POD, s)["spec"]["runtimeClassName"] == "nvidia"
    assert "runtimeClassName" not in mutate(GPU_POD)["spec"]
    own = copy.deepcopy(GPU_POD)
    own["spec"]["runtimeClassName"] = "kata"
    assert mutate(own, s)["spec"]["runtimeClassName"] == "kata"


def test_trace_context_annotation_created_when_no_annotations() -> None:
    decision = decide(GPU_POD, DEFAULTS, trace_context=TRACE)
    assert {
        "op": "add",
        "path": "/metadata/annotations",
        "value": {keys.TRACE_CONTEXT: TRACE},
    } in decision.patch


def test_trace_context_annotation_key_is_escaped() -> None:
    p = copy.deepcopy(GPU_POD)
    p["metadata"]["annotations"] = {"a": "b"}
    decision = decide(p, DEFAULTS, trace_context=TRACE)
    assert {
        "op": "add",
        "path": "/metadata/annotations/hami-py.io~1traceparent",
        "value": TRACE,
    } in decision.patch
    assert mutate(p)["metadata"]["annotations"] == {"a": "b", keys.TRACE_CONTEXT: TRACE}


def test_existing_trace_context_is_kept() -> None:
    p = copy.deepcopy(GPU_POD)
    p["metadata"]["annotations"] = {keys.TRACE_CONTEXT: "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    assert mutate(p)["metadata"]["annotations"] == p["metadata"]["annotations"]


def test_no_trace_context_no_annotation() -> None:
    assert "annotations" not in mutate(GPU_POD, trace=None)["metadata"]


@pytest.mark.parametrize(
    ("key", "token"),
    [("a/b", "a~1b"), ("a~b", "a~0b"), ("~/", "~0~1"), ("~1", "~01"), ("plain", "plain")],
)
def test_pointer_token_escapes_rfc6901(key: str, token: str) -> None:
    assert pointer_token(key) == token


# -- refusals --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["containers", "initContainers"])
def test_privileged_container_in_gpu_pod_is_refused(kind: str) -> None:
    priv = container("debugger", securityContext={"privileged": True})
    gpu = container("cuda", limits={"nvidia.com/gpu": "1"})
    p = pod("p", gpu, priv) if kind == "containers" else pod("p", gpu, init=[priv])
    decision = decide(p, DEFAULTS)
    assert (decision.outcome, decision.reason) == ("refused", "privileged")
    assert "debugger" in decision.message
    assert "privileged" in decision.message
    assert decision.patch == ()


def test_unprivileged_security_context_is_fine() -> None:
    p = pod(
        "p",
        container(limits={"nvidia.com/gpu": "1"}, securityContext={"privileged": False, "runAsUser": 1000}),
    )
    assert decide(p, DEFAULTS).outcome == "mutated"


def test_gpu_pod_with_node_name_is_refused() -> None:
    p = pod("p", container(limits={"nvidia.com/gpu": "1"}), node_name="gpu-node-3")
    decision = decide(p, DEFAULTS)
    assert (decision.outcome, decision.reason) == ("refused", "node_name")
    assert "gpu-node-3" in decision.message
    assert "nodeName" in decision.message


@pytest.mark.parametrize(
    ("limits", "shown"),
    [
        pytest.param({"nvidia.com/gpumem-percentage": "101"}, "101", id="percentage-over-100"),
        pytest.param(
            {"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "-5"}, "-5", id="percentage-negative"
        ),
        pytest.param({"nvidia.com/gpu": "-1"}, "-1", id="negative-count"),
        pytest.param({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "0.5"}, "0.5", id="fraction-memory"),
        pytest.param({"nvidia.com/gpu": "1", "nvidia.com/gpucores": "1500m"}, "1500m", id="milli-cores"),
        pytest.param({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "lots"}, "lots", id="garbage"),
        pytest.param({"nvidia.com/gpu": "1", "nvidia.com/priority": "-1"}, "-1", id="negative-priority"),
    ],
)
def test_bad_quantities_are_refused_naming_container_and_value(limits: dict[str, str], shown: str) -> None:
    p = pod("p", container("ok", limits={"nvidia.com/gpu": "1"}), container("trainer", limits=limits))
    decision = decide(p, DEFAULTS)
    assert (decision.outcome, decision.reason) == ("refused", "invalid_resource")
    assert "trainer" in decision.message
    assert shown in decision.message
    name = next(iter(k for k in limits if k != "nvidia.com/gpu" or len(limits) == 1))
    assert name in decision.message


def test_bad_quantity_in_requests_is_refused() -> None:
    c = container("c", requests={"nvidia.com/gpumem": "-3"})
    assert decide(pod("p", c), DEFAULTS).reason == "invalid_resource"


def test_bad_quantity_of_an_allowed_scheduler_pod_is_not_our_business() -> None:
    p = pod("p", container(limits={"nvidia.com/gpu": "-1"}), scheduler_name="volcano")
    assert decide(p, MutationSettings(allowed_schedulers=frozenset({"volcano"}))).reason == "other_scheduler"


# -- settings from the shared configuration -------------------------------------------------------------


def test_settings_from_config() -> None:
    config = load_config(
        """
        schedulerName: my-sched
        forceOverwriteDefaultScheduler: false
        allowedSchedulers: [volcano, kueue]
        nvidia:
          resourceCountName: example.com/vgpu
          defaultGPUNum: 2
          gpuCorePolicy: force
          defaultMemory: 1000
        """
    )
    s = MutationSettings.from_config(config, overwrite_env=True, runtime_class_name="nvidia")
    assert s.scheduler_name == "my-sched"
    assert not s.overwrite_default_scheduler
    assert s.allowed_schedulers == {"volcano", "kueue"}
    assert s.names.count == "example.com/vgpu"
    assert s.default_gpu_count == 2
    assert s.request_defaults.memory_mib == 1000
    assert s.overwrite_env
    assert s.runtime_class_name == "nvidia"


def test_default_settings_match_default_config() -> None:
    assert MutationSettings.from_config(load_config("")) == MutationSettings()


# -- idempotency ------------------------------------------------------------------------------------------

FULL = MutationSettings(overwrite_env=True, runtime_class_name="nvidia")

_quantity = st.sampled_from(["1", "2", "50", "100", "4096"])
_our = st.dictionaries(
    st.sampled_from(
        [
            "nvidia.com/gpu",
            "nvidia.com/gpumem",
            "nvidia.com/gpumem-percentage",
            "nvidia.com/gpucores",
            "nvidia.com/priority",
        ]
    ),
    _quantity,
    max_size=4,
)


@st.composite
def containers(draw: st.DrawFn, prefix: str) -> list[dict[str, Any]]:
    out = []
    for i in range(draw(st.integers(0, 3))):
        c: dict[str, Any] = {"name": f"{prefix}{i}", "image": "img"}
        limits: dict[str, str] = draw(_our)
        if "nvidia.com/gpumem-percentage" in limits and limits["nvidia.com/gpumem-percentage"] == "4096":
            limits["nvidia.com/gpumem-percentage"] = "100"
        if limits or bool(draw(st.booleans())):
            c["resources"] = {"limits": limits}
        if draw(st.booleans()):
            c["env"] = [{"name": "X", "value": "y"}]
        out.append(c)
    return out


@st.composite
def pods(draw: st.DrawFn) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": "p"}
    if draw(st.booleans()):
        metadata["annotations"] = {"team/x": "1"}
    spec: dict[str, Any] = {"containers": draw(containers("c")) or [{"name": "main"}]}
    init = draw(containers("i"))
    if init:
        spec["initContainers"] = init
    spec["schedulerName"] = draw(st.sampled_from(["default-scheduler", "hami-scheduler"]))
    return {"metadata": metadata, "spec": spec}


@settings(max_examples=300, deadline=None)
@given(pods(), st.sampled_from([DEFAULTS, FULL]))
def test_mutating_the_mutated_pod_yields_nothing(p: dict[str, Any], s: MutationSettings) -> None:
    first = decide(p, s, trace_context=TRACE)
    assert first.allowed, first.message
    mutated = apply_patch(p, [dict(op) for op in first.patch])
    second = decide(mutated, s, trace_context="00-" + "3" * 32 + "-" + "4" * 16 + "-01")
    assert second.patch == ()
    assert second.reason in ("unchanged", "not_gpu_pod", "no_gpu_asked")


@settings(max_examples=200, deadline=None)
@given(pods())
def test_decide_never_changes_its_input(p: dict[str, Any]) -> None:
    before = copy.deepcopy(p)
    decide(p, FULL, trace_context=TRACE)
    assert p == before
