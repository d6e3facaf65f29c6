"""The MutatingWebhookConfiguration we ship, built in one place.

``deploy/webhook/mutatingwebhookconfiguration.yaml``, the ``certs`` command (which creates it when
asked) and the integration tests all come from ``webhook_configuration``, and a unit test checks the
shipped file against it, so they cannot drift.

Fail closed for GPU pods only: the CEL ``matchConditions`` send the webhook only pods whose
containers or init containers name one of our resources (limits or requests), and for those
``failurePolicy: Fail`` applies, so a webhook that is down refuses GPU pods with a clear error instead
of letting them reach the default scheduler unmutated (HAMi's ``Ignore`` does that silently).
Every other pod never reaches the webhook, so it is admitted whether the webhook runs or not.
"""

from __future__ import annotations

import base64
from typing import Any, Final

import yaml

from hamipy.protocol.cel import gpu_pod_expression
from hamipy.protocol.resources import ResourceNames

__all__ = [
    "CONFIGURATION_NAME",
    "IGNORE_LABEL",
    "MANIFEST_HEADER",
    "WEBHOOK_NAME",
    "WEBHOOK_PATH",
    "render_yaml",
    "webhook_configuration",
]

CONFIGURATION_NAME: Final = "hamipy-webhook"
WEBHOOK_NAME: Final = "vgpu.webhook.hami-py.io"
WEBHOOK_PATH: Final = "/webhook"
IGNORE_LABEL: Final = "hami.io/webhook"
"""Namespaces labelled ``hami.io/webhook: ignore`` are skipped. Only on namespaces, which only the
admin labels: HAMi's chart also honours it on pods, which let any pod author opt a GPU pod out of the
webhook (docs/security.md)."""
DEFAULT_TIMEOUT_S: Final = 10
"""The apiserver's wait for our answer. Admission takes well under 5 ms; 10 s (the Kubernetes
default) only matters when the webhook is unreachable, which then fails GPU pods promptly."""


_DEFAULT_NAMES: Final = ResourceNames()


def webhook_configuration(
    *,
    names: ResourceNames = _DEFAULT_NAMES,
    name: str = CONFIGURATION_NAME,
    service_name: str = "hamipy-webhook",
    service_namespace: str = "hami-system",
    service_port: int = 443,
    url: str | None = None,
    ca_bundle: bytes | None = None,
    timeout_seconds: int = DEFAULT_TIMEOUT_S,
) -> dict[str, Any]:
    """The ``admissionregistration.k8s.io/v1`` MutatingWebhookConfiguration as a JSON-ready dict.

    The webhook is reached through the Service (``service_*``) or, when ``url`` is given, at that URL
    (e.g. ``https://127.0.0.1:8443/webhook`` in tests). ``ca_bundle`` is the PEM of the CA that signed
    the serving certificate; None leaves it out for the ``certs`` command (or cert-manager) to fill in.
    """
    client: dict[str, Any]
    if url is not None:
        client = {"url": url}
    else:
        client = {
            "service": {
                "name": service_name,
                "namespace": service_namespace,
                "path": WEBHOOK_PATH,
                "port": service_port,
            }
        }
    if ca_bundle is not None:
        client["caBundle"] = base64.b64encode(ca_bundle).decode("ascii")

    def not_ignored() -> dict[str, Any]:
        return {"matchExpressions": [{"key": IGNORE_LABEL, "operator": "NotIn", "values": ["ignore"]}]}

    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "hamipy-webhook"}},
        "webhooks": [
            {
                "name": WEBHOOK_NAME,
                "admissionReviewVersions": ["v1", "v1beta1"],
                "clientConfig": client,
                "rules": [
                    {
                        "operations": ["CREATE"],
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "resources": ["pods"],
                        "scope": "Namespaced",
                    }
                ],
                "matchConditions": [
                    {"name": "requests-hami-gpu-resources", "expression": gpu_pod_expression(names)}
                ],
                "failurePolicy": "Fail",
                "matchPolicy": "Equivalent",
                "sideEffects": "None",
                "timeoutSeconds": timeout_seconds,
                "reinvocationPolicy": "IfNeeded",
                "namespaceSelector": not_ignored(),
            }
        ],
    }


MANIFEST_HEADER: Final = """\
# The MutatingWebhookConfiguration of hamipy-webhook. Generated: do not edit by hand.
# Regenerate: hamipy-webhook manifest > deploy/webhook/mutatingwebhookconfiguration.yaml
# A unit test checks this file against hamipy.webhook.registration.webhook_configuration().
# caBundle is filled in by `hamipy-webhook certs` (or cert-manager's CA injector).
# Fail closed for GPU pods only: matchConditions select the pods naming our resources, and for
# those failurePolicy is Fail; every other pod never reaches the webhook.
"""


def render_yaml(doc: dict[str, Any], *, header: str = MANIFEST_HEADER) -> str:
    """``doc`` as the YAML we ship: the header comment, then block style in the builder's key order."""
    return header + yaml.safe_dump(doc, sort_keys=False, width=1_000_000)
