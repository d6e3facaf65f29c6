"""Certificate generation, renewal decisions, atomic files, Secret decoding (the pure half)."""

from __future__ import annotations

import base64
import datetime
import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from hamipy.webhook.certs import (
    CA_NAME,
    CertificateBundle,
    bundle_from_secret,
    generate_certificates,
    needs_renewal,
    secret_data,
    service_dns_names,
    write_files,
)

NAMES = service_dns_names("hamipy-webhook", "hami-system")


def test_service_dns_names() -> None:
    assert NAMES == [
        "hamipy-webhook",
        "hamipy-webhook.hami-system",
        "hamipy-webhook.hami-system.svc",
        "hamipy-webhook.hami-system.svc.cluster.local",
    ]


def test_serving_certificate_is_signed_by_the_ca_for_the_names() -> None:
    bundle = generate_certificates(dns_names=NAMES, ip_addresses=["127.0.0.1"])
    ca = x509.load_pem_x509_certificate(bundle.ca_pem)
    cert = x509.load_pem_x509_certificate(bundle.cert_pem)
    cert.verify_directly_issued_by(ca)
    assert ca.subject.rfc4514_string() == f"CN={CA_NAME}"
    assert cert.subject.rfc4514_string() == f"CN={NAMES[0]}"
    assert bundle.not_after == cert.not_valid_after_utc
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == NAMES
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    key = serialization.load_pem_private_key(bundle.key_pem, password=None)
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()  # type: ignore[union-attr]


def test_renewal_decisions() -> None:
    now = datetime.datetime.now(datetime.UTC)
    bundle = generate_certificates(dns_names=NAMES, validity=datetime.timedelta(days=365), now=now)
    assert not needs_renewal(bundle, NAMES, now=now)
    assert needs_renewal(bundle, NAMES, now=now + datetime.timedelta(days=340))
    assert needs_renewal(bundle, [*NAMES, "other.svc"], now=now)
    assert needs_renewal(CertificateBundle(b"x", bundle.cert_pem, bundle.key_pem), NAMES, now=now)
    assert needs_renewal(CertificateBundle(bundle.ca_pem, b"x", bundle.key_pem), NAMES, now=now)
    assert needs_renewal(CertificateBundle(bundle.ca_pem, bundle.cert_pem, b"x"), NAMES, now=now)


def test_an_ip_only_certificate_is_renewed_for_names() -> None:
    bundle = generate_certificates(dns_names=[], ip_addresses=["127.0.0.1"])
    assert needs_renewal(bundle, NAMES)


def test_files_are_written_with_a_private_key(tmp_path: Path) -> None:
    bundle = generate_certificates(dns_names=NAMES)
    cert, key, ca = write_files(bundle, tmp_path / "tls")
    assert (cert.read_bytes(), key.read_bytes(), ca.read_bytes()) == (
        bundle.cert_pem,
        bundle.key_pem,
        bundle.ca_pem,
    )
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert sorted(p.name for p in (tmp_path / "tls").iterdir()) == ["ca.crt", "tls.crt", "tls.key"]


def test_bundle_from_secret_data() -> None:
    bundle = generate_certificates(dns_names=NAMES)
    data = {
        "tls.crt": base64.b64encode(bundle.cert_pem).decode(),
        "tls.key": base64.b64encode(bundle.key_pem).decode(),
        "ca.crt": base64.b64encode(bundle.ca_pem).decode(),
    }
    assert bundle_from_secret(data) == bundle
    assert secret_data(bundle) == data
    assert bundle_from_secret({"tls.crt": data["tls.crt"]}) is None
    assert bundle_from_secret(None) is None


def test_a_certificate_needs_a_name_or_an_address() -> None:
    with pytest.raises(ValueError, match="at least one DNS name or IP address"):
        generate_certificates(dns_names=[])
