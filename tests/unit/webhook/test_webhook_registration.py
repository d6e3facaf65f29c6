"""The shipped MutatingWebhookConfiguration, its builder and the CLI's manifest agree."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import yaml

from hamipy.protocol.cel import gpu_pod_expression
from hamipy.protocol.resources import ResourceNames
from hamipy.webhook import cli
from hamipy.webhook.registration import (
    IGNORE_LABEL,
    render_yaml,
    webhook_configuration,
)

SHIPPED = Path(__file__).parents[3] / "deploy" / "webhook" / "mutatingwebhookconfiguration.yaml"


def test_shipped_manifest_is_the_builders_output() -> None:
    assert SHIPPED.read_text() == render_yaml(webhook_configuration())
    assert yaml.safe_load(SHIPPED.read_text()) == webhook_configuration()


def test_fails_closed_for_gpu_pods_only() -> None:
    [hook] = webhook_configuration()["webhooks"]
    assert hook["failurePolicy"] == "Fail"
    assert hook["sideEffects"] == "None"
    assert hook["admissionReviewVersions"] == ["v1", "v1beta1"]
    assert hook["rules"] == [
        {
            "operations": ["CREATE"],
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]
    [condition] = hook["matchConditions"]
    assert condition["expression"] == gpu_pod_expression()
    assert 1 <= hook["timeoutSeconds"] <= 30
    assert hook["namespaceSelector"]["matchExpressions"] == [
        {"key": IGNORE_LABEL, "operator": "NotIn", "values": ["ignore"]}
    ]
    # No pod-level opt-out: a pod author must not be able to keep a GPU pod from the webhook.
    assert "objectSelector" not in hook


def test_expression_names_every_gpu_resource_in_limits_and_requests_of_both_container_lists() -> None:
    names = ResourceNames(count="a.io/n", memory="a.io/m", memory_percentage="a.io/p", cores="a.io/c")
    expression = gpu_pod_expression(names)
    for name in names.gpu_asks:
        assert f"'{name}'" in expression
    assert names.priority not in expression
    for part in ("object.spec.containers", "object.spec.initContainers", ".limits", ".requests"):
        assert part in expression


def test_url_and_ca_bundle() -> None:
    doc = webhook_configuration(url="https://127.0.0.1:9443/webhook", ca_bundle=b"PEM")
    client = doc["webhooks"][0]["clientConfig"]
    assert client == {"url": "https://127.0.0.1:9443/webhook", "caBundle": base64.b64encode(b"PEM").decode()}


def test_manifest_command_prints_the_builders_output(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert cli.main(["manifest"], env={}) == 0
    assert capsys.readouterr().out == render_yaml(webhook_configuration())
    config = tmp_path / "hami.yaml"
    config.write_text("nvidia:\n  resourceCountName: example.com/vgpu\n")
    ca = tmp_path / "ca.crt"
    ca.write_bytes(b"CA")
    argv = [
        "manifest",
        "--config",
        str(config),
        "--format",
        "json",
        "--url",
        "https://h/webhook",
        "--ca-file",
        str(ca),
    ]
    assert cli.main(argv, env={}) == 0
    doc = json.loads(capsys.readouterr().out)
    names = ResourceNames(count="example.com/vgpu")
    assert doc == webhook_configuration(names=names, url="https://h/webhook", ca_bundle=b"CA")
