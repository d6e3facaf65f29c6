"""Certificates for a real cluster: a CA and a serving certificate for the webhook's Service.

``hamipy-webhook certs`` (see ``cli``) runs ``ensure_certificates``: it reuses the certificate in the
Secret while it covers the Service names and has more than ``renew_before`` left, else makes a new
CA and serving certificate; it writes the Secret (``kubernetes.io/tls`` with ``ca.crt``), and
patches the ``caBundle`` of every webhook in the MutatingWebhookConfiguration (creating the
configuration when asked). The webhook pods mount the Secret and pick a renewed certificate up
without a restart (``server.CertificateStore``). cert-manager can replace all of this.

Every API call has a timeout. Errors from the API are translated here:

    Exception
     └── CertificateSetupError   the Secret or the configuration could not be read or written
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import ipaddress
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "CertificateBundle",
    "CertificateSetupError",
    "bundle_from_secret",
    "ensure_certificates",
    "generate_certificates",
    "needs_renewal",
    "patch_ca_bundle",
    "service_dns_names",
    "write_files",
]

API_TIMEOUT_S: Final = 10.0
"""Per API call: the apiserver answers these in milliseconds; 10 s covers a busy one."""
DEFAULT_VALIDITY: Final = datetime.timedelta(days=365)
DEFAULT_RENEW_BEFORE: Final = datetime.timedelta(days=30)
"""Renew a month ahead, so a monthly job (or any restart of the chart hook) always renews in time."""


class CertificateSetupError(Exception):
    """The Secret or the MutatingWebhookConfiguration could not be read or written."""


@dataclasses.dataclass(frozen=True, slots=True)
class CertificateBundle:
    """PEM bytes of the CA certificate, the serving certificate and its private key."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    @property
    def certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)


def service_dns_names(service: str, namespace: str, *, cluster_domain: str = "cluster.local") -> list[str]:
    """The names the apiserver may use for a Service: ``svc``, ``svc.ns``, ``svc.ns.svc[.domain]``."""
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.{cluster_domain}",
    ]


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def generate_certificates(
    *,
    dns_names: Sequence[str],
    ip_addresses: Sequence[str] = (),
    validity: datetime.timedelta = DEFAULT_VALIDITY,
    now: datetime.datetime | None = None,
) -> CertificateBundle:
    """A fresh CA and a serving certificate it signs for ``dns_names`` and ``ip_addresses``."""
    if not dns_names and not ip_addresses:
        raise ValueError("a serving certificate needs at least one DNS name or IP address")
    start = (now or datetime.datetime.now(datetime.UTC)) - datetime.timedelta(minutes=5)  # clock skew
    end = start + validity
    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hamipy-webhook-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = _key()
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
    common = dns_names[0] if dns_names else ip_addresses[0]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return CertificateBundle(
        ca_pem=ca.public_bytes(serialization.Encoding.PEM),
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
        key_pem=key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )


def needs_renewal(
    bundle: CertificateBundle,
    dns_names: Sequence[str],
    *,
    renew_before: datetime.timedelta = DEFAULT_RENEW_BEFORE,
    now: datetime.datetime | None = None,
) -> bool:
    """Whether ``bundle`` must be replaced: unreadable, missing a name, or expiring within
    ``renew_before``."""
    try:
        cert = bundle.certificate
        x509.load_pem_x509_certificate(bundle.ca_pem)
        serialization.load_pem_private_key(bundle.key_pem, password=None)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return True
    covered = set(sans.get_values_for_type(x509.DNSName))
    if not set(dns_names) <= covered:
        return True
    moment = now or datetime.datetime.now(datetime.UTC)
    return cert.not_valid_after_utc - moment < renew_before


def write_files(bundle: CertificateBundle, directory: Path) -> tuple[Path, Path, Path]:
    """Write ``tls.crt``, ``tls.key`` (mode 0600) and ``ca.crt`` atomically (rename), key first, so a
    reloading server never reads half a file. Returns the three paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = (directory / "tls.crt", directory / "tls.key", directory / "ca.crt")
    for path, data, mode in (
        (paths[1], bundle.key_pem, 0o600),
        (paths[0], bundle.cert_pem, 0o644),
        (paths[2], bundle.ca_pem, 0o644),
    ):
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.")
        try:
            os.fchmod(fd, mode)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return paths


def bundle_from_secret(data: Mapping[str, str] | None) -> CertificateBundle | None:
    """The bundle in a Secret's ``data`` (base64 values), or None when a part is missing."""
    if not data:
        return None
    try:
        return CertificateBundle(
            ca_pem=base64.b64decode(data["ca.crt"]),
            cert_pem=base64.b64decode(data["tls.crt"]),
            key_pem=base64.b64decode(data["tls.key"]),
        )
    except (KeyError, ValueError):
        return None


def _secret_body(name: str, namespace: str, bundle: CertificateBundle) -> dict[str, Any]:
    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode("ascii")

    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "hamipy-webhook"},
        },
        "data": {
            "tls.crt": b64(bundle.cert_pem),
            "tls.key": b64(bundle.key_pem),
            "ca.crt": b64(bundle.ca_pem),
        },
    }


def _status(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


async def ensure_secret(
    api: Any,
    *,
    namespace: str,
    secret_name: str,
    dns_names: Sequence[str],
    ip_addresses: Sequence[str] = (),
    force: bool = False,
    renew_before: datetime.timedelta = DEFAULT_RENEW_BEFORE,
    timeout_s: float = API_TIMEOUT_S,
) -> tuple[CertificateBundle, bool]:
    """The bundle in the Secret, renewed (and written) when needed; returns it and whether it is new."""
    from kubernetes_asyncio import client

    core: Any = client.CoreV1Api(api)
    existing: Any = None
    try:
        existing = await core.read_namespaced_secret(secret_name, namespace, _request_timeout=timeout_s)
    except client.ApiException as exc:
        if _status(exc) != 404:
            raise CertificateSetupError(
                f"cannot read Secret {namespace}/{secret_name}: {exc.reason}"
            ) from exc
    current = bundle_from_secret(existing.data if existing is not None else None)
    if current is not None and not force and not needs_renewal(current, dns_names, renew_before=renew_before):
        return current, False
    bundle = generate_certificates(dns_names=dns_names, ip_addresses=ip_addresses)
    body = _secret_body(secret_name, namespace, bundle)
    try:
        if existing is None:
            await core.create_namespaced_secret(namespace, body, _request_timeout=timeout_s)
        else:
            body["metadata"]["resourceVersion"] = existing.metadata.resource_version
            await core.replace_namespaced_secret(secret_name, namespace, body, _request_timeout=timeout_s)
    except client.ApiException as exc:
        raise CertificateSetupError(f"cannot write Secret {namespace}/{secret_name}: {exc.reason}") from exc
    return bundle, True


async def patch_ca_bundle(
    api: Any,
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
    from kubernetes_asyncio import client

    admission: Any = client.AdmissionregistrationV1Api(api)
    encoded = base64.b64encode(ca_pem).decode("ascii")
    try:
        current = await admission.read_mutating_webhook_configuration(
            configuration_name, _request_timeout=timeout_s
        )
    except client.ApiException as exc:
        if _status(exc) != 404:
            raise CertificateSetupError(
                f"cannot read MutatingWebhookConfiguration {configuration_name}: {exc.reason}"
            ) from exc
        if create is None:
            raise CertificateSetupError(
                f"MutatingWebhookConfiguration {configuration_name} does not exist (apply it first)"
            ) from exc
        body = dict(create)
        body["metadata"] = {**body.get("metadata", {}), "name": configuration_name}
        body["webhooks"] = [
            {**hook, "clientConfig": {**hook["clientConfig"], "caBundle": encoded}}
            for hook in body["webhooks"]
        ]
        try:
            await admission.create_mutating_webhook_configuration(body, _request_timeout=timeout_s)
        except client.ApiException as create_exc:
            raise CertificateSetupError(
                f"cannot create MutatingWebhookConfiguration {configuration_name}: {create_exc.reason}"
            ) from create_exc
        return True

    webhooks = current.webhooks or []
    ops: list[dict[str, Any]] = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": current.metadata.resource_version}
    ]
    for index, hook in enumerate(webhooks):
        if hook.client_config.ca_bundle != encoded:
            ops.append({"op": "add", "path": f"/webhooks/{index}/clientConfig/caBundle", "value": encoded})
    if len(ops) == 1:
        return False
    try:
        await admission.patch_mutating_webhook_configuration(
            configuration_name, ops, _request_timeout=timeout_s
        )
    except client.ApiException as exc:
        raise CertificateSetupError(
            f"cannot patch caBundle of MutatingWebhookConfiguration {configuration_name}: {exc.reason}"
        ) from exc
    return True


async def ensure_certificates(
    api: Any,
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
    pods cannot have). Returns the bundle, whether it is new, and whether the configuration changed."""
    bundle, renewed = await ensure_secret(
        api,
        namespace=namespace,
        secret_name=secret_name,
        dns_names=service_dns_names(service_name, namespace, cluster_domain=cluster_domain),
        force=force,
        renew_before=renew_before,
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
