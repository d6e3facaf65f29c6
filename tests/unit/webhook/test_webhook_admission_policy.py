"""The admission policies' shape; their behaviour is tested in the real API server
(tests/integration/security/test_admission_policy.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hamipy.protocol import keys
from hamipy.webhook.admission_policy import admission_policies, chart_file
from hamipy.webhook.cli import main

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


def test_manifest_policy_prints_the_policies_for_the_users_given(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["manifest", "--policy", "--format", "json", "--scheduler-user", "s1", "--scheduler-user", "s2"]
    assert main([*argv, "--device-plugin-user", "p"], env={}) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == admission_policies(schedulers=["s1", "s2"], device_plugins=["p"])
    assert main(["manifest", "--policy"], env={}) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert docs == admission_policies(schedulers=[], device_plugins=[])
