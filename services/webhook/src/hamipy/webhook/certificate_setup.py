"""Certificates for a real cluster: the Secret the webhook pods mount, and the ``caBundle`` the
apiserver trusts them by.

``hamipy-webhook certs`` (see ``cli``) runs ``ensure_certificates``: it reuses the certificate in the
Secret while it covers the Service names and has more than ``renew_before`` left, else makes a new
CA and serving certificate (``certs``); it writes the Secret (``kubernetes.io/tls`` with
``ca.crt``), and patches the ``caBundle`` of every webhook in the MutatingWebhookConfiguration
(creating the configuration when asked). The webhook pods mount the Secret and pick a renewed
certificate up without a restart (``server.CertificateStore``). cert-manager can replace all of this.

This is the I/O half (the decisions are in ``certs``): every call goes through a
``hamipy.kube.client.KubeApi`` with a timeout, and its ``KubeError`` is translated here:

    Exception
     └── CertificateSetupError   the Secret or the configuration could not be read or written
"""

from __future__ import annotations

import base64
import datetime
from collections.abc import Mapping, Sequence
from typing import Any, Final

from hamipy.kube.client import API_TIMEOUT_S, JSON_PATCH, KubeApi
from hamipy.kube.errors import KubeError, NotFound
from hamipy.webhook.certs import (
    DEFAULT_RENEW_BEFORE,
    CertificateBundle,
    bundle_from_secret,
    generate_certificates,
    needs_renewal,
    secret_data,
    service_dns_names,
)
from hamipy.webhook.errors import CertificateSetupError

__all__ = [
    "CertificateSetupError",
    "ensure_certificates",
    "ensure_secret",
    "patch_ca_bundle",
]

_CONFIGURATIONS: Final = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"


def _secrets_path(namespace: str, name: str = "") -> str:
    base = f"/api/v1/namespaces/{namespace}/secrets"
    return f"{base}/{name}" if name else base


def _secret_body(
    name: str, namespace: str, bundle: CertificateBundle, owner: Mapping[str, str] | None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "hamipy-webhook"},
        },
        "data": secret_data(bundle),
    }
    if owner is not None:
        body["metadata"]["ownerReferences"] = [dict(owner)]
    return body


def _owned_by(secret: Mapping[str, Any], owner: Mapping[str, str]) -> bool:
    return any(ref.get("uid") == owner["uid"] for ref in secret["metadata"].get("ownerReferences") or ())


async def configuration_owner(
    api: KubeApi, configuration_name: str, *, timeout_s: float = API_TIMEOUT_S
) -> dict[str, str] | None:
    """An owner reference to the MutatingWebhookConfiguration, or None when it does not exist yet:
    the Secret it trusts then goes with it (garbage collection deletes it after ``helm uninstall``)."""
    try:
        config = await api.request("GET", f"{_CONFIGURATIONS}/{configuration_name}", timeout_s=timeout_s)
    except NotFound:
        return None
    except KubeError as exc:
        raise CertificateSetupError(
            f"cannot read MutatingWebhookConfiguration {configuration_name}: {exc}"
        ) from exc
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "name": configuration_name,
        "uid": config["metadata"]["uid"],
    }


async def ensure_secret(
    api: KubeApi,
    *,
    namespace: str,
    secret_name: str,
    dns_names: Sequence[str],
    ip_addresses: Sequence[str] = (),
    force: bool = False,
    renew_before: datetime.timedelta = DEFAULT_RENEW_BEFORE,
    owner: Mapping[str, str] | None = None,
    timeout_s: float = API_TIMEOUT_S,
) -> tuple[CertificateBundle, bool]:
    """The bundle in the Secret, renewed (and written) when needed; returns it and whether it is new.
    ``owner``: an owner reference the Secret gets (added to a current one, its data kept)."""
    what = f"Secret {namespace}/{secret_name}"
    existing: dict[str, Any] | None = None
    try:
        existing = await api.request("GET", _secrets_path(namespace, secret_name), timeout_s=timeout_s)
    except NotFound:
        pass
    except KubeError as exc:
        raise CertificateSetupError(f"cannot read {what}: {exc}") from exc
    current = bundle_from_secret(existing.get("data") if existing is not None else None)
    keep = (
        current is not None and not force and not needs_renewal(current, dns_names, renew_before=renew_before)
    )
    if keep and current is not None and existing is not None:
        if owner is None or _owned_by(existing, owner):
            return current, False
        bundle = current
    else:
        bundle = generate_certificates(dns_names=dns_names, ip_addresses=ip_addresses)
    body = _secret_body(secret_name, namespace, bundle, owner)
    try:
        if existing is None:
            await api.request("POST", _secrets_path(namespace), body=body, timeout_s=timeout_s)
        else:
            # Replace only the version read: a concurrent writer makes this a Conflict, not a loss.
            body["metadata"]["resourceVersion"] = existing["metadata"]["resourceVersion"]
            await api.request("PUT", _secrets_path(namespace, secret_name), body=body, timeout_s=timeout_s)
    except KubeError as exc:
        raise CertificateSetupError(f"cannot write {what}: {exc}") from exc
    return bundle, not keep


async def patch_ca_bundle(
    api: KubeApi,
    *,
    configuration_name: str,
    ca_pem: bytes,
    create: Mapping[str, Any] | None = None,
    timeout_s: float = API_TIMEOUT_S,
) -> bool:
    """Set ``caBundle`` on every webhook of the MutatingWebhookConfiguration.

    When it does not exist, ``create`` (a full configuration, e.g. ``registration.webhook_configuration``)
    is created with the bundle; without ``create`` that is an error. Returns whether anything changed.
    """
    what = f"MutatingWebhookConfiguration {configuration_name}"
    path = f"{_CONFIGURATIONS}/{configuration_name}"
    encoded = base64.b64encode(ca_pem).decode("ascii")
    try:
        current: dict[str, Any] = await api.request("GET", path, timeout_s=timeout_s)
    except NotFound as exc:
        if create is None:
            raise CertificateSetupError(f"{what} does not exist (apply it first)") from exc
        body = dict(create)
        body["metadata"] = {**body.get("metadata", {}), "name": configuration_name}
        body["webhooks"] = [
            {**hook, "clientConfig": {**hook["clientConfig"], "caBundle": encoded}}
            for hook in body["webhooks"]
        ]
        try:
            await api.request("POST", _CONFIGURATIONS, body=body, timeout_s=timeout_s)
        except KubeError as create_exc:
            raise CertificateSetupError(f"cannot create {what}: {create_exc}") from create_exc
        return True
    except KubeError as exc:
        raise CertificateSetupError(f"cannot read {what}: {exc}") from exc

    # The "test" makes the patch apply only to the version read (else the apiserver refuses it).
    ops: list[dict[str, Any]] = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": current["metadata"]["resourceVersion"]}
    ]
    for index, hook in enumerate(current.get("webhooks") or []):
        if (hook.get("clientConfig") or {}).get("caBundle") != encoded:
            ops.append({"op": "add", "path": f"/webhooks/{index}/clientConfig/caBundle", "value": encoded})
    if len(ops) == 1:
        return False
    try:
        await api.request("PATCH", path, body=ops, content_type=JSON_PATCH, timeout_s=timeout_s)
    except KubeError as exc:
        raise CertificateSetupError(f"cannot patch caBundle of {what}: {exc}") from exc
    return True


async def ensure_certificates(
    api: KubeApi,
    *,
    namespace: str,
    secret_name: str,
    service_name: str,
    configuration_name: str,
    cluster_domain: str = "cluster.local",
    create_configuration: Mapping[str, Any] | None = None,
    force: bool = False,
    renew_before: datetime.timedelta = DEFAULT_RENEW_BEFORE,
    timeout_s: float = API_TIMEOUT_S,
) -> tuple[CertificateBundle, bool, bool]:
    """Secret then caBundle (in that order, so the apiserver never trusts a CA whose certificate the
    pods cannot have). Returns the bundle, whether it is new, and whether the configuration changed.
    The Secret is owned by the configuration when that exists already (the chart's)."""
    owner = await configuration_owner(api, configuration_name, timeout_s=timeout_s)
    bundle, renewed = await ensure_secret(
        api,
        namespace=namespace,
        secret_name=secret_name,
        dns_names=service_dns_names(service_name, namespace, cluster_domain=cluster_domain),
        force=force,
        renew_before=renew_before,
        owner=owner,
        timeout_s=timeout_s,
    )
    patched = await patch_ca_bundle(
        api,
        configuration_name=configuration_name,
        ca_pem=bundle.ca_pem,
        create=create_configuration,
        timeout_s=timeout_s,
    )
    return bundle, renewed, patched
