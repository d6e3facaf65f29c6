"""The devcluster's own certificate authority and the keys the control plane needs.

Everything is generated in memory with `cryptography` (ECDSA P-256: fast to make, accepted by
kube-apiserver for serving, client certificates and service-account tokens) and returned as PEM
bytes, so the logic stays testable without files; `cluster` writes them to its temp directory.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from collections.abc import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# One day is plenty for a test run or a `make up` session and keeps stale certs useless.
CERT_VALIDITY = datetime.timedelta(days=1)
# Clock skew between cert creation and first use would otherwise make fresh certs "not yet valid".
BACKDATE = datetime.timedelta(minutes=5)


@dataclasses.dataclass(frozen=True)
class KeyPair:
    """A PEM certificate and its PEM (PKCS#8, unencrypted) private key."""

    cert_pem: bytes
    key_pem: bytes


@dataclasses.dataclass(frozen=True)
class ClusterPKI:
    """All the key material one devcluster uses."""

    ca: KeyPair
    apiserver_serving: KeyPair
    admin_client: KeyPair
    scheduler_client: KeyPair
    service_account_key_pem: bytes
    service_account_pub_pem: bytes


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str, organizations: Sequence[str] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


def make_ca(common_name: str = "hamipy-devcluster-ca") -> KeyPair:
    """A self-signed CA certificate allowed to sign leaf certificates only."""
    key = _new_key()
    now = datetime.datetime.now(datetime.UTC)
    name = _name(common_name)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + CERT_VALIDITY)
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
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue_cert(
    ca: KeyPair,
    *,
    common_name: str,
    organizations: Sequence[str] = (),
    dns_names: Sequence[str] = (),
    ip_addresses: Sequence[str] = (),
    server: bool = False,
    client: bool = False,
) -> KeyPair:
    """A leaf certificate signed by `ca` for a server (with SANs), a client (CN=user, O=groups) or both."""
    if not (server or client):
        raise ValueError("issue_cert: a certificate must be for a server, a client, or both")
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError("issue_cert: the CA key must be an EC key")
    key = _new_key()
    now = datetime.datetime.now(datetime.UTC)
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
        [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, organizations))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + CERT_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
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


# The names the apiserver is reached by: loopback for us, the in-cluster service names for pods
# (and for webhooks configured by service), and the first service IP (the `kubernetes` Service).
APISERVER_DNS_NAMES = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


def make_cluster_pki(*, service_ip: str) -> ClusterPKI:
    """A fresh CA with the apiserver serving cert, the admin and scheduler client certs, and SA keys."""
    ca = make_ca()
    serving = issue_cert(
        ca,
        common_name="kube-apiserver",
        dns_names=APISERVER_DNS_NAMES,
        ip_addresses=("127.0.0.1", service_ip),
        server=True,
    )
    admin = issue_cert(ca, common_name="hamipy-admin", organizations=("system:masters",), client=True)
    scheduler = issue_cert(ca, common_name="system:kube-scheduler", client=True)
    sa_key = _new_key()
    sa_pub = sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return ClusterPKI(
        ca=ca,
        apiserver_serving=serving,
        admin_client=admin,
        scheduler_client=scheduler,
        service_account_key_pem=_key_pem(sa_key),
        service_account_pub_pem=sa_pub,
    )
