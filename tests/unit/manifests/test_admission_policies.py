"""The admission policies' shape; their behaviour is tested in the real API server
(tests/integration/security/test_admission_policy.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hamipy.manifests.admission_policy import (
    ANNOTATION_POLICY_NAME,
    ENV_POLICY_NAME,
    MOUNT_POLICY_NAME,
    PLACEMENT_POLICY_NAME,
    admission_policies,
    chart_file,
)
from hamipy.protocol import keys
from hamipy.protocol.allocation_env import LD_SO_PRELOAD
from hamipy.protocol.cel import container_asks, gpu_pod_expression
from hamipy.protocol.reserved_env import GPU_CONTAINER_NAMES, PER_DEVICE_PATTERN
from hamipy.protocol.reserved_mounts import (
    HOOK_REASON,
    NOT_CANONICAL_ENDS,
    NOT_CANONICAL_PARTS,
    NOT_CANONICAL_REASON,
    PARENT_REASON,
    PRELOAD_REASON,
)
from hamipy.protocol.resources import ResourceNames

CHART_FILE = (
    Path(__file__).resolve().parents[3] / "deploy" / "helm" / "hami-py" / "files" / "admission-policies.yaml"
)


def test_the_chart_ships_the_policies_the_code_builds() -> None:
    assert CHART_FILE.read_text() == chart_file()


def test_every_allocation_key_is_guarded_and_the_plugin_writes_only_its_own() -> None:
    pod_policy, binding, node_policy, node_binding, *_quota = admission_policies(
        schedulers=["system:serviceaccount:hami-system:x"],
        device_plugins=["system:serviceaccount:hami-system:y"],
    )
    variables = {v["name"]: v["expression"] for v in pod_policy["spec"]["variables"]}
    for key in keys.ALLOCATION_STATE_ANNOTATIONS:
        assert f"'{key}'" in variables["changedAnnotations"]
    assert f"['{keys.VGPU_NODE_LABEL}']" in variables["changedLabels"]
    assert set(keys.PLUGIN_WRITTEN_ANNOTATIONS) < set(keys.ALLOCATION_STATE_ANNOTATIONS)
    # Every pod, on create and on update: the policy does not depend on the webhook seeing the pod.
    (rule,) = pod_policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["operations"] == ["CREATE", "UPDATE"]
    assert "matchConditions" not in pod_policy["spec"]
    assert pod_policy["spec"]["failurePolicy"] == "Fail"
    assert binding["spec"] == {"policyName": pod_policy["metadata"]["name"], "validationActions": ["Deny"]}
    assert node_binding["spec"]["policyName"] == node_policy["metadata"]["name"]
    # The trace context is set by the webhook under the pod author's identity: never guarded.
    assert keys.TRACE_CONTEXT not in variables["changedAnnotations"]


def _named(
    docs: list[dict[str, Any]], suffix: str, kind: str = "ValidatingAdmissionPolicy"
) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    return doc


NAMES = ResourceNames(
    count="example.com/vgpu",
    memory="example.com/vmem",
    memory_percentage="example.com/vmem-pct",
    cores="example.com/vcores",
)

GPU_CONTAINER = container_asks("c", ["example.com/vgpu"])
"""What makes ``c`` a GPU container with ``NAMES``: the count, in limits or requests."""


def test_gpu_pods_created_with_a_node_only_by_schedulers() -> None:
    docs = admission_policies(schedulers=["sched-a", "sched-b"], device_plugins=["p"], names=NAMES)
    spec = _named(docs, PLACEMENT_POLICY_NAME)["spec"]
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert (rule["operations"], rule["resources"]) == (["CREATE"], ["pods"])
    assert spec["matchConditions"] == [
        {"name": "asks-for-hami-gpus", "expression": gpu_pod_expression(NAMES)}
    ]
    assert "['sched-a', 'sched-b']" in spec["validations"][0]["expression"]
    assert spec["failurePolicy"] == "Fail"
    binding = _named(docs, PLACEMENT_POLICY_NAME, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["validationActions"] == ["Deny"]


def test_the_env_policy_reads_every_reserved_name_in_every_pod() -> None:
    """Every namespace: the exempt ones only may set NVIDIA_VISIBLE_DEVICES."""
    docs = admission_policies(
        schedulers=[], device_plugins=[], names=NAMES, exempt_namespaces=["hami-system"]
    )
    spec = _named(docs, ENV_POLICY_NAME)["spec"]
    rules = {(r["operations"][0], r["resources"][0]) for r in spec["matchConstraints"]["resourceRules"]}
    assert rules == {("CREATE", "pods"), ("UPDATE", "pods/ephemeralcontainers")}
    assert "matchConditions" not in spec
    variables = {v["name"]: v["expression"] for v in spec["variables"]}
    assert variables["exempt"] == "request.namespace in ['hami-system']"
    for name, expression in variables.items():
        exempted = expression.startswith("variables.exempt ? [] : (")
        assert exempted is (name in ("visible", "visibleFrom")), name
    assert f".filter(c, {GPU_CONTAINER})" in variables["gpuContainers"]
    for name in GPU_CONTAINER_NAMES:
        assert f"'{name}'" in variables["gpuEnv"]
        assert f"'{name}'" in variables["gpuEnvFrom"]
    assert PER_DEVICE_PATTERN in variables["gpuEnv"]
    assert "object.spec.ephemeralContainers" in variables["visible"]
    assert "object.spec.ephemeralContainers" in variables["visibleFrom"]
    assert [v["expression"] for v in spec["validations"]] == [
        f"size(variables.{name}) == 0" for name in ("gpuEnv", "gpuEnvFrom", "visible", "visibleFrom")
    ]
    assert spec["failurePolicy"] == "Fail"
    unexempt = _named(admission_policies(schedulers=[], device_plugins=[]), ENV_POLICY_NAME)["spec"]
    assert {"name": "exempt", "expression": "request.namespace in []"} in unexempt["variables"]


def test_configured_resource_names_reach_every_policy() -> None:
    text = json.dumps(admission_policies(schedulers=[], device_plugins=[], names=NAMES))
    assert "nvidia.com/" not in text
    for name in NAMES.gpu_asks:
        assert name in text


def test_the_annotation_policy_reads_every_pods_annotations_at_create_and_update() -> None:
    docs = admission_policies(schedulers=["s"], device_plugins=["d"])
    spec = _named(docs, ANNOTATION_POLICY_NAME)["spec"]
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert (rule["resources"], rule["operations"]) == (["pods"], ["CREATE", "UPDATE"])
    assert "matchConditions" not in spec, "every pod, GPU or not"
    assert spec["failurePolicy"] == "Fail"
    (variable,) = spec["variables"]
    assert "k.startsWith('cdi.k8s.io/')" in variable["expression"]
    binding = _named(docs, ANNOTATION_POLICY_NAME, "ValidatingAdmissionPolicyBinding")
    assert "matchResources" not in binding["spec"], "no namespace is exempt"


def test_the_mount_policy_reads_every_gpu_containers_volume_mounts_in_every_namespace() -> None:
    docs = admission_policies(
        schedulers=[], device_plugins=[], names=NAMES, exempt_namespaces=["hami-system"]
    )
    spec = _named(docs, MOUNT_POLICY_NAME)["spec"]
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert (rule["operations"], rule["resources"]) == (["CREATE"], ["pods"])
    assert "matchConditions" not in spec  # no namespace is exempt
    variables = {v["name"]: v["expression"] for v in spec["variables"]}
    assert "object.spec.initContainers" in variables["gpuContainers"]
    assert f".filter(c, {GPU_CONTAINER})" in variables["gpuContainers"]
    for section in ("limits", "requests"):
        assert f"['example.com/vgpu'].exists(r, r in c.resources.{section})" in GPU_CONTAINER
    covering = variables["covering"]
    for path in ("/usr/local/vgpu", LD_SO_PRELOAD):
        assert f"m.mountPath == '{path}'" in covering
        assert f"m.mountPath.startsWith('{path}/')" in covering
        assert f"'{path}/'.startsWith(" in covering  # a parent
    for part in NOT_CANONICAL_PARTS:
        assert f"!m.mountPath.contains('{part}')" in covering
    for end in NOT_CANONICAL_ENDS:
        assert f"!m.mountPath.endsWith('{end}')" in covering
    for reason in (HOOK_REASON, PRELOAD_REASON, PARENT_REASON, NOT_CANONICAL_REASON):
        assert f"'{reason}'" in covering
    (validation,) = spec["validations"]
    assert validation["expression"] == "size(variables.covering) == 0"
    assert spec["failurePolicy"] == "Fail"
    binding = _named(docs, MOUNT_POLICY_NAME, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["validationActions"] == ["Deny"]


def test_the_mount_policy_reserves_every_hook_path_given_cleaned() -> None:
    docs = admission_policies(schedulers=[], device_plugins=[], hook_paths=["/opt/a//vgpu/", "/srv/./b"])
    covering = {v["name"]: v["expression"] for v in _named(docs, MOUNT_POLICY_NAME)["spec"]["variables"]}[
        "covering"
    ]
    for path in ("/opt/a/vgpu", "/srv/b"):
        assert f"m.mountPath == '{path}' || m.mountPath.startsWith('{path}/')" in covering
        assert f"'{path}/'.startsWith(" in covering
    assert "/usr/local/vgpu" not in covering
    with pytest.raises(ValueError, match="CEL"):
        admission_policies(schedulers=[], device_plugins=[], hook_paths=["/it's"])
