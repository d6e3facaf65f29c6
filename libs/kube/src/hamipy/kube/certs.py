"""Certificates, made in memory with ``cryptography`` and returned as PEM bytes: a CA, and leaf
certificates it signs for servers (with SANs), clients (CN = user, O = groups) or both.

Pure: no files, no API. ECDSA P-256 keys (fast to make; accepted by kube-apiserver for serving,
client certificates and service-account tokens, and by every TLS peer we have). Used by the
webhook's ``certs`` command (its CA and serving certificate) and by the dev cluster (its CA, the
API server's serving certificate, client certificates).
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from collections.abc import Sequence
from typing import Final

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "BACKDATE",
    "KeyPair",
    "dns_names_of",
    "issue_cert",
    "make_ca",
    "new_key_pem",
    "not_after",
    "public_key_pem",
]

BACKDATE: Final = datetime.timedelta(minutes=5)
"""Certificates start this much before now, so that clock skew never makes a fresh one "not yet
valid"."""


@dataclasses.dataclass(frozen=True, slots=True)
class KeyPair:
    """A PEM certificate and its PEM (PKCS#8, unencrypted) private key."""

    cert_pem: bytes
    key_pem: bytes


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def new_key_pem() -> bytes:
    """A fresh private key (PEM), e.g. for signing service-account tokens."""
    return _key_pem(_new_key())


def public_key_pem(key_pem: bytes) -> bytes:
    """The public half of a PEM private key, as PEM (SubjectPublicKeyInfo)."""
    key = serialization.load_pem_private_key(key_pem, password=None)
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _name(common_name: str, organizations: Sequence[str] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


def _usage(*, sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=sign,
        crl_sign=sign,
        encipher_only=False,
        decipher_only=False,
    )


def _start(now: datetime.datetime | None) -> datetime.datetime:
    return (now or datetime.datetime.now(datetime.UTC)) - BACKDATE


def make_ca(
    common_name: str, *, validity: datetime.timedelta, now: datetime.datetime | None = None
) -> KeyPair:
    """A self-signed CA certificate allowed to sign leaf certificates only."""
    key = _new_key()
    start = _start(now)
    name = _name(common_name)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue_cert(
    ca: KeyPair,
    *,
    common_name: str,
    validity: datetime.timedelta,
    organizations: Sequence[str] = (),
    dns_names: Sequence[str] = (),
    ip_addresses: Sequence[str] = (),
    server: bool = False,
    client: bool = False,
    now: datetime.datetime | None = None,
) -> KeyPair:
    """A leaf certificate signed by ``ca`` for a server (with SANs), a client (CN = user, O =
    groups) or both."""
    if not (server or client):
        raise ValueError("issue_cert: a certificate must be for a server, a client, or both")
    if server and not (dns_names or ip_addresses):
        raise ValueError("issue_cert: a serving certificate needs at least one DNS name or IP address")
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError("issue_cert: the CA key must be an EC key")
    key = _new_key()
    start = _start(now)
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
        [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, organizations))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + validity)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def dns_names_of(cert_pem: bytes) -> set[str]:
    """The DNS names a certificate is valid for (none without a SAN extension)."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return set(sans.get_values_for_type(x509.DNSName))


def not_after(cert_pem: bytes) -> datetime.datetime:
    """When a certificate expires (UTC)."""
    return x509.load_pem_x509_certificate(cert_pem).not_valid_after_utc
