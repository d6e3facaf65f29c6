"""hamipy.kube's small parts: certificates, the shape of a service's command, the error tree."""

from __future__ import annotations

import argparse
import datetime
import ssl
import tempfile
from pathlib import Path

import pytest
from cryptography import x509

from hamipy.kube.certs import dns_names_of, issue_cert, make_ca, not_after
from hamipy.kube.errors import Conflict, Gone, KubeError, NotFound, error_for
from hamipy.kube.options import ProcessSettings, run_command, with_default_command
from hamipy.protocol.config import ConfigError
from hamipy.protocol.settings import Group, add_settings

DAY = datetime.timedelta(days=1)


def test_a_serving_certificate_verifies_against_its_ca_for_its_names() -> None:
    ca = make_ca("test-ca", validity=DAY)
    leaf = issue_cert(
        ca, common_name="svc", validity=DAY, dns_names=["svc.ns.svc"], ip_addresses=["127.0.0.1"], server=True
    )
    assert dns_names_of(leaf.cert_pem) == {"svc.ns.svc"}
    assert (
        datetime.timedelta(hours=23) < not_after(leaf.cert_pem) - datetime.datetime.now(datetime.UTC) <= DAY
    )
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "ca.pem").write_bytes(ca.cert_pem)
        (Path(tmp) / "leaf.pem").write_bytes(leaf.cert_pem)
        (Path(tmp) / "leaf.key").write_bytes(leaf.key_pem)
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(Path(tmp) / "leaf.pem", Path(tmp) / "leaf.key")  # key matches
    cert = x509.load_pem_x509_certificate(leaf.cert_pem)
    issuer = x509.load_pem_x509_certificate(ca.cert_pem)
    cert.verify_directly_issued_by(issuer)
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert [u.dotted_string for u in usage] == ["1.3.6.1.5.5.7.3.1"]  # serverAuth only


def test_a_client_certificate_names_user_and_groups() -> None:
    ca = make_ca("test-ca", validity=DAY)
    leaf = issue_cert(ca, common_name="admin", organizations=["system:masters"], validity=DAY, client=True)
    subject = x509.load_pem_x509_certificate(leaf.cert_pem).subject.rfc4514_string()
    assert subject == "CN=admin,O=system:masters"


@pytest.mark.parametrize(
    ("server", "problem"),
    [
        pytest.param(False, "server, a client, or both", id="neither"),
        pytest.param(True, "at least one DNS name", id="server-without-names"),
    ],
)
def test_a_certificate_that_would_be_useless_is_refused(server: bool, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        issue_cert(make_ca("ca", validity=DAY), common_name="x", validity=DAY, server=server)


@pytest.mark.parametrize(
    ("status", "kind"), [(404, NotFound), (409, Conflict), (410, Gone), (500, KubeError), (403, KubeError)]
)
def test_errors_by_status_with_the_servers_message(status: int, kind: type[KubeError]) -> None:
    error = error_for(
        status, "GET /api/v1/nodes/n1", b'{"kind":"Status","message":"nodes \\"n1\\" not found"}'
    )
    assert type(error) is kind
    assert error.status == status
    assert str(error) == f'GET /api/v1/nodes/n1: HTTP {status}: nodes "n1" not found'


def test_an_error_body_that_is_not_a_status_is_quoted_shortly() -> None:
    error = error_for(502, "GET /x", b"<html>" + b"x" * 1000)
    assert str(error).startswith("GET /x: HTTP 502: <html>xx")
    assert len(str(error)) < 260


async def test_no_api_configuration_is_a_kube_error_naming_where_it_looked(tmp_path: Path) -> None:
    from hamipy.kube.client import api_client

    missing = tmp_path / "no-such-kubeconfig"
    with pytest.raises(KubeError, match="no-such-kubeconfig"):
        await api_client(str(missing))


def _parser(env: dict[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hamipy-x")
    parser.add_argument("command")
    add_settings(parser, Group(ProcessSettings), env=env, prefix="HAMIPY_X_")
    return parser


class Broken(Exception):
    pass


class BadTracing(Exception):
    pass


@pytest.mark.parametrize(
    ("env", "raised", "status", "line"),
    [
        pytest.param({}, None, 0, "", id="ok"),
        pytest.param(
            {"HAMIPY_X_API_CONNECTIONS": "many"},
            None,
            2,
            "hamipy-x: bad environment: HAMIPY_X_API_CONNECTIONS",
            id="env",
        ),
        pytest.param(
            {},
            ConfigError("nvidia.deviceSplitCount", "ten", "not a number"),
            2,
            "hamipy-x: bad configuration: nvidia",
            id="config",
        ),
        pytest.param(
            {},
            BadTracing("OTEL_TRACES_EXPORTER names 'zipkin'"),
            2,
            "hamipy-x: bad tracing: OTEL",
            id="usage",
        ),
        pytest.param({}, Broken("cannot reach the API"), 1, "hamipy-x: cannot reach the API", id="failure"),
    ],
)
def test_a_command_turns_what_an_operator_can_fix_into_one_line_and_a_status(
    env: dict[str, str], raised: Exception | None, status: int, line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
        assert args.command == "serve"
        if raised is not None:
            raise raised
        return 0

    got = run_command(
        "hamipy-x",
        parser=lambda: _parser(env),
        argv=with_default_command([], ["serve", "check"], "serve"),
        run=run,
        usage_errors={BadTracing: "bad tracing"},
        failures=(Broken,),
    )
    assert got == status
    err = capsys.readouterr().err
    assert err.startswith(line) if line else err == ""


def test_a_bug_keeps_its_traceback() -> None:
    def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
        raise TypeError("a bug")

    with pytest.raises(TypeError):
        run_command("hamipy-x", parser=lambda: _parser({}), argv=["serve"], run=run)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], ["serve"]),
        (["--port", "1"], ["serve", "--port", "1"]),
        (["check"], ["check"]),
        (["--version"], ["--version"]),
        (["-h"], ["-h"]),
    ],
)
def test_the_default_command(argv: list[str], expected: list[str]) -> None:
    assert with_default_command(argv, ["serve", "check"], "serve") == expected
