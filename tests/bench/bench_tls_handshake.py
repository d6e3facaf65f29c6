"""The extender's share of one TLS handshake on its decision port, by key type.

Over HTTP/1.1 (the extender's ``--no-http2``) kube-scheduler keeps at most two idle connections to
it (Go's ``MaxIdleConnsPerHost`` default; kube-scheduler sets no other), so in a burst most filters
and binds arrive on a new connection: ``bench_e2e.py --tls --extender-args=--no-http2`` counts them
(over HTTP/2, the default, it uses one). Each costs the extender one server
handshake, run on its event loop: the certificate's signature, the key exchange and the check of
kube-scheduler's client certificate. This times that share alone (the server side of in-memory
handshakes with the extender's own ``server_tls`` context; the client's work is not counted) for the
chart's certificates (ECDSA P-256, ``deploy/helm/hami-py/templates/extender-tls.yaml``) against
RSA-2048 ones (Helm's ``genCA``/``genSignedCert`` without a key type), each as served
(no session tickets: ``hamipy.serving.tls``), with OpenSSL's default two TLS 1.3 tickets, and
without the demand for kube-scheduler's certificate (what checking it costs).

    .venv/bin/python tests/bench/bench_tls_handshake.py [--handshakes N]
"""

from __future__ import annotations

import argparse
import datetime
import ssl
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _results import percentiles_us, record
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from hamipy.extender.cli import server_tls

VALIDITY = datetime.timedelta(days=1)
WARMUP = 20

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
KEY_TYPES: dict[str, Callable[[], PrivateKey]] = {
    "ecdsa-p256": lambda: ec.generate_private_key(ec.SECP256R1()),
    "rsa-2048": lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048),
}


def _cert(
    subject: str,
    key: PrivateKey,
    issuer: tuple[x509.Name, PrivateKey] | None,
    usage: list[x509.ObjectIdentifier],
) -> x509.Certificate:
    """A certificate for ``key``: a CA when ``issuer`` is None, else a leaf with ``usage``."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer_name, signer = issuer if issuer is not None else (name, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        if ExtendedKeyUsageOID.SERVER_AUTH in usage:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName("extender.hami-system.svc")]), critical=False
            )
    return builder.sign(signer, hashes.SHA256())


def _write(directory: Path, name: str, cert: x509.Certificate, key: PrivateKey) -> tuple[Path, Path]:
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def contexts(
    directory: Path, new_key: Callable[[], PrivateKey]
) -> tuple[ssl.SSLContext, ssl.SSLContext, ssl.SSLContext]:
    """The extender's server context, kube-scheduler's client context, both from one CA of this key
    type, and the same server context without the demand for a client certificate."""
    ca_key = new_key()
    ca = _cert("extender-ca", ca_key, None, [])
    issuer = (ca.subject, ca_key)
    server_key, client_key = new_key(), new_key()
    server = _cert("extender", server_key, issuer, [ExtendedKeyUsageOID.SERVER_AUTH])
    client = _cert("hami-scheduler", client_key, issuer, [ExtendedKeyUsageOID.CLIENT_AUTH])
    ca_path, _ = _write(directory, "ca", ca, ca_key)
    server_files = _write(directory, "server", server, server_key)
    client_files = _write(directory, "client", client, client_key)
    serving = server_tls(*server_files, ca_path)
    assert serving is not None
    calling = ssl.create_default_context(cafile=ca_path)
    calling.load_cert_chain(*client_files)
    unchecked = server_tls(*server_files, None)
    assert unchecked is not None
    return serving, calling, unchecked


def server_share(serving: ssl.SSLContext, calling: ssl.SSLContext) -> float:
    """Seconds the server side of one full handshake took (the client's own turns left out)."""
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = calling.wrap_bio(to_client, to_server, server_hostname="extender.hami-system.svc")
    server_out, server_in = ssl.MemoryBIO(), ssl.MemoryBIO()
    server = serving.wrap_bio(server_in, server_out, server_side=True)
    spent = 0.0
    client_done = server_done = False
    while not (client_done and server_done):
        if not client_done:
            try:
                client.do_handshake()
                client_done = True
            except ssl.SSLWantReadError:
                pass
        server_in.write(to_server.read())
        if not server_done:
            started = time.perf_counter()
            try:
                server.do_handshake()
                server_done = True
            except ssl.SSLWantReadError:
                pass
            spent += time.perf_counter() - started
        to_client.write(server_out.read())
    return spent


def handshakes(serving: ssl.SSLContext, calling: ssl.SSLContext, n: int) -> dict[str, float]:
    """Percentiles of the server's share of ``n`` handshakes, after a few untimed ones."""
    for _ in range(WARMUP):
        server_share(serving, calling)
    return percentiles_us([server_share(serving, calling) for _ in range(n)])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--handshakes", type=int, default=400)
    args = parser.parse_args()
    timed: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="hamipy-tls-") as tmp:
        for name, new_key in KEY_TYPES.items():
            directory = Path(tmp) / name
            directory.mkdir()
            serving, calling, unchecked = contexts(directory, new_key)
            timed[f"{name}, 0 tickets, no client certificate"] = handshakes(
                unchecked, calling, args.handshakes
            )
            for tickets in (0, 2):
                if tickets:  # OpenSSL's defaults, what a server that sets nothing sends
                    serving.options &= ~ssl.OP_NO_TICKET
                serving.num_tickets = tickets
                timed[f"{name}, {tickets} tickets"] = handshakes(serving, calling, args.handshakes)
    record(
        "tls_handshake",
        {
            "handshakes": args.handshakes,
            "tls": "1.3, mutual (client certificate)",
            **timed,
            "before_over_now_p50": round(
                timed["rsa-2048, 2 tickets"]["p50_us"] / timed["ecdsa-p256, 0 tickets"]["p50_us"], 2
            ),
        },
    )


if __name__ == "__main__":
    main()
