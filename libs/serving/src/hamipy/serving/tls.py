"""The TLS our HTTPS servers serve with (the webhook's port and the extender's decision port).

Their callers are Go clients of Kubernetes (kube-apiserver calling the webhook, kube-scheduler
calling the extender) that keep no TLS session cache, so they never resume a session: each new
connection is a full handshake, and a session ticket sent to them is work thrown away. Under a
burst kube-scheduler opens a new connection for most of its calls over HTTP/1.1 (at most 2 kept
idle; the extender's HTTP/2 spares that, docs/extender.md#tls-handshakes), and the server's share
of each handshake runs on the event loop that also answers filters. OpenSSL 3 sends two TLS 1.3
tickets by default; none are sent here (what they and the key type cost the server:
``tests/bench/bench_tls_handshake.py``).
"""

from __future__ import annotations

import ssl
from pathlib import Path

__all__ = ["serving_context"]


def serving_context(
    cert_file: Path | str, key_file: Path | str, *, client_ca: Path | str | None = None
) -> ssl.SSLContext:
    """A server context for this certificate and key: TLS 1.2 or later, no session tickets; with
    ``client_ca`` a client must present a certificate that CA signed, or the handshake fails.
    ``OSError``/``ssl.SSLError`` when a file cannot be read or does not hold what it should."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.num_tickets = 0  # TLS 1.3's tickets; TLS 1.2's are switched off by the option below
    context.options |= ssl.OP_NO_TICKET
    context.load_cert_chain(cert_file, key_file)
    if client_ca is not None:
        context.load_verify_locations(cafile=client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context
