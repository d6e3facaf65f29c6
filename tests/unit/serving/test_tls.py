"""``serving_context``: our HTTPS servers send no session ticket (their Go callers never resume one;
each is work on the event loop thrown away), and demand a client certificate when given a CA."""

from __future__ import annotations

import datetime
import ssl
from pathlib import Path

import pytest

from hamipy.kube.certs import issue_cert, make_ca
from hamipy.serving.tls import serving_context

DAY = datetime.timedelta(days=1)
HOST = "server.example"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    ca = make_ca("ca", validity=DAY)
    server = issue_cert(ca, common_name="server", validity=DAY, dns_names=[HOST], server=True)
    client = issue_cert(ca, common_name="client", validity=DAY, client=True)
    stranger = issue_cert(make_ca("other", validity=DAY), common_name="x", validity=DAY, client=True)
    out = {}
    for name, data in {
        "ca": ca.cert_pem,
        "cert": server.cert_pem,
        "key": server.key_pem,
        "client.cert": client.cert_pem,
        "client.key": client.key_pem,
        "stranger.cert": stranger.cert_pem,
        "stranger.key": stranger.key_pem,
    }.items():
        out[name] = tmp_path / name
        out[name].write_bytes(data)
    return out


def client_context(files: dict[str, Path], who: str | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=files["ca"])
    if who is not None:
        context.load_cert_chain(files[f"{who}.cert"], files[f"{who}.key"])
    return context


def talk(server_context: ssl.SSLContext, client_context: ssl.SSLContext) -> ssl.SSLObject:
    """A whole handshake in memory, then one message from the server read by the client (a TLS 1.3
    ticket comes after the handshake, with the server's first records); the client's side."""
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    server_in, server_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_context.wrap_bio(to_client, to_server, server_hostname=HOST)
    server = server_context.wrap_bio(server_in, server_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(10):
        for name, side in (("client", client), ("server", server)):
            if not done[name]:
                try:
                    side.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
            server_in.write(to_server.read())
            to_client.write(server_out.read())
        if all(done.values()):
            break
    assert all(done.values()), done
    server.write(b"hello")
    to_client.write(server_out.read())
    assert client.read(5) == b"hello"
    return client


def test_no_session_ticket_is_sent(files: dict[str, Path]) -> None:
    client = talk(serving_context(files["cert"], files["key"]), client_context(files))
    assert client.version() == "TLSv1.3"
    assert client.session is not None
    assert not client.session.has_ticket
    # The same exchange with OpenSSL's default server settings does get one: the check can fail.
    default = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    default.load_cert_chain(files["cert"], files["key"])
    ticketed = talk(default, client_context(files))
    assert ticketed.session is not None
    assert ticketed.session.has_ticket


def test_no_session_ticket_is_sent_over_tls_1_2(files: dict[str, Path]) -> None:
    """TLS 1.2 tickets are another switch (``OP_NO_TICKET``) than TLS 1.3's count of them."""
    tls12 = client_context(files)
    tls12.maximum_version = ssl.TLSVersion.TLSv1_2
    client = talk(serving_context(files["cert"], files["key"]), tls12)
    assert client.version() == "TLSv1.2"
    assert client.session is not None
    assert not client.session.has_ticket
    default = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    default.load_cert_chain(files["cert"], files["key"])
    tls12 = client_context(files)
    tls12.maximum_version = ssl.TLSVersion.TLSv1_2
    ticketed = talk(default, tls12)
    assert ticketed.session is not None
    assert ticketed.session.has_ticket


@pytest.mark.parametrize("who", ["client", "stranger", None])
def test_with_a_client_ca_only_its_client_certificates_get_in(
    files: dict[str, Path], who: str | None
) -> None:
    server = serving_context(files["cert"], files["key"], client_ca=files["ca"])
    if who == "client":
        assert talk(server, client_context(files, who)).read(0) == b""
        return
    with pytest.raises(ssl.SSLError):
        talk(server, client_context(files, who))


def test_unreadable_files_raise(tmp_path: Path, files: dict[str, Path]) -> None:
    with pytest.raises(FileNotFoundError):
        serving_context(tmp_path / "missing.crt", files["key"])
    with pytest.raises(ssl.SSLError):
        serving_context(files["cert"], files["client.key"])  # a key that is not the certificate's
