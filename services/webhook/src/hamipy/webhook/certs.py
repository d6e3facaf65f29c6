"""The webhook's certificates, decided without a cluster: which names its Service has, when a
certificate must be renewed, a new CA and serving certificate, the bundle in a Secret, the files.

Pure helpers over ``hamipy.kube.certs`` (which makes the keys and certificates): no API calls here.
``certificate_setup`` writes the Secret and the ``caBundle`` with them (the ``certs`` command);
``write_files`` is the one function that touches the disk (``certs --cert-dir``, tests).
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

from hamipy.kube.certs import dns_names_of, issue_cert, make_ca, not_after, public_key_pem

__all__ = [
    "CA_NAME",
    "DEFAULT_RENEW_BEFORE",
    "DEFAULT_VALIDITY",
    "CertificateBundle",
    "bundle_from_secret",
    "generate_certificates",
    "needs_renewal",
    "secret_data",
    "service_dns_names",
    "write_files",
]

CA_NAME: Final = "hamipy-webhook-ca"
DEFAULT_VALIDITY: Final = datetime.timedelta(days=365)
"""A year: the ``certs`` job (a chart hook) renews it long before, so nobody has to remember."""
DEFAULT_RENEW_BEFORE: Final = datetime.timedelta(days=30)
"""Renew a month ahead, so a monthly job (or any restart of the chart hook) always renews in time."""


@dataclasses.dataclass(frozen=True, slots=True)
class CertificateBundle:
    """PEM bytes of the CA certificate, the serving certificate and its private key."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    @property
    def not_after(self) -> datetime.datetime:
        """When the serving certificate expires (UTC)."""
        return not_after(self.cert_pem)


def service_dns_names(service: str, namespace: str, *, cluster_domain: str = "cluster.local") -> list[str]:
    """The names the apiserver may use for a Service: ``svc``, ``svc.ns``, ``svc.ns.svc[.domain]``."""
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.{cluster_domain}",
    ]


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
    ca = make_ca(CA_NAME, validity=validity, now=now)
    serving = issue_cert(
        ca,
        common_name=dns_names[0] if dns_names else ip_addresses[0],
        validity=validity,
        dns_names=dns_names,
        ip_addresses=ip_addresses,
        server=True,
        now=now,
    )
    return CertificateBundle(ca_pem=ca.cert_pem, cert_pem=serving.cert_pem, key_pem=serving.key_pem)


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
        not_after(bundle.ca_pem)
        public_key_pem(bundle.key_pem)
        covered = dns_names_of(bundle.cert_pem)
        expires = not_after(bundle.cert_pem)
    except (ValueError, TypeError):
        return True
    if not set(dns_names) <= covered:
        return True
    moment = now or datetime.datetime.now(datetime.UTC)
    return expires - moment < renew_before


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


def secret_data(bundle: CertificateBundle) -> dict[str, str]:
    """A Secret's ``data`` for ``bundle`` (the inverse of ``bundle_from_secret``)."""

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode("ascii")

    return {"tls.crt": b64(bundle.cert_pem), "tls.key": b64(bundle.key_pem), "ca.crt": b64(bundle.ca_pem)}
