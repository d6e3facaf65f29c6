"""The command line: help, bad configuration and environment, bad certificate files, how `serve`
ends (SIGTERM: 0; a supervised task that died: 1), public API."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

import hamipy.webhook.admission
import hamipy.webhook.admitting
import hamipy.webhook.certificate_setup
import hamipy.webhook.certs
import hamipy.webhook.mutation
import hamipy.webhook.registration
import hamipy.webhook.server
import hamipy.webhook.telemetry
from hamipy.kube.options import EXIT_FAILED, EXIT_USAGE
from hamipy.webhook import cli
from hamipy.webhook.admitting import Admitter
from hamipy.webhook.certs import generate_certificates, write_files
from hamipy.webhook.mutation import MutationSettings
from hamipy.webhook.server import CertificateStore, ServerSettings
from hamipy.webhook.telemetry import Telemetry


@pytest.mark.parametrize(
    "argv", [["--help"], ["serve", "--help"], ["certs", "--help"], ["manifest", "--help"]]
)
def test_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv, env={})
    assert info.value.code == 0
    assert "usage: hamipy-webhook" in capsys.readouterr().out


def test_bad_configuration_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "hami.yaml"
    config.write_text("nvidia:\n  defaultGPUNum: many\n")
    assert cli.main(["--config", str(config)], env={}) == EXIT_USAGE
    assert "nvidia.defaultGPUNum" in capsys.readouterr().err


def test_config_path_from_environment(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "hami.yaml"
    config.write_text("bogus: 1\n")
    assert cli.main([], env={"HAMIPY_CONFIG": str(config)}) == EXIT_USAGE
    assert "bogus" in capsys.readouterr().err


def test_missing_certificate_exits_with_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = {
        "HAMIPY_WEBHOOK_CERT_FILE": str(tmp_path / "no.crt"),
        "HAMIPY_WEBHOOK_KEY_FILE": str(tmp_path / "no.key"),
    }
    assert cli.main(["serve", "--port", "0", "--host", "127.0.0.1"], env=env) == EXIT_FAILED
    assert "no.crt" in capsys.readouterr().out


def serve_settings(tmp_path: Path) -> ServerSettings:
    cert, key, _ = write_files(generate_certificates(dns_names=["localhost"]), tmp_path)
    return ServerSettings(
        cert_file=cert,
        key_file=key,
        host="127.0.0.1",
        port=0,
        cert_check_interval_s=0.01,
        shutdown_timeout_s=1,
    )


def events(log: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.getvalue().splitlines()]


async def test_serve_ends_with_status_1_when_a_supervised_task_dies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: CertificateStore) -> bool:
        raise RuntimeError("injected")

    monkeypatch.setattr(CertificateStore, "refresh", broken)
    log = io.StringIO()
    admitter = Admitter(MutationSettings(), Telemetry.create(stream=log))

    assert await asyncio.wait_for(cli._serve(serve_settings(tmp_path), admitter), timeout=10) == EXIT_FAILED

    lines = events(log)
    died = next(line for line in lines if line["event"] == "background task died; the service stops")
    assert (died["level"], died["task"], died["error"]) == (
        "error",
        "certificate-watch",
        "RuntimeError: injected",
    )
    stopping = next(line for line in lines if line["event"] == "stopping: a background task died")
    assert stopping["reason"] == "task certificate-watch died: RuntimeError: injected"
    assert [line["event"] for line in lines][-1] == "webhook stopped"


async def test_serve_ends_with_status_0_on_sigterm(tmp_path: Path) -> None:
    log = io.StringIO()
    admitter = Admitter(MutationSettings(), Telemetry.create(stream=log))
    serving = asyncio.create_task(cli._serve(serve_settings(tmp_path), admitter), name="serve")
    for _ in range(500):  # the handlers are in place before the server says it serves
        if "webhook serving" in log.getvalue():
            break
        await asyncio.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)

    assert await asyncio.wait_for(serving, timeout=10) == 0
    assert [line["event"] for line in events(log)][-2:] == ["stopping on signal", "webhook stopped"]


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        pytest.param("HAMIPY_WEBHOOK_OVERWRITE_ENV", "maybe", id="unknown-boolean"),
        pytest.param("HAMIPY_WEBHOOK_CREATE_WEBHOOK_CONFIG", "enabled", id="unknown-boolean-of-certs"),
        pytest.param("HAMIPY_WEBHOOK_PORT", "https", id="port-not-a-number"),
        pytest.param("HAMIPY_WEBHOOK_METRICS_PORT", "9x", id="metrics-port-not-a-number"),
    ],
)
def test_a_bad_environment_variable_is_refused_by_name(
    variable: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["serve"], env={variable: value}) == EXIT_USAGE
    err = capsys.readouterr().err
    assert variable in err
    assert repr(value) in err


@pytest.mark.parametrize(
    ("env", "overwrite_env", "metrics_port"),
    [
        pytest.param({}, False, None, id="unset"),
        pytest.param(
            {"HAMIPY_WEBHOOK_OVERWRITE_ENV": "", "HAMIPY_WEBHOOK_METRICS_PORT": ""}, False, None, id="empty"
        ),
        pytest.param(
            {"HAMIPY_WEBHOOK_OVERWRITE_ENV": "Yes", "HAMIPY_WEBHOOK_METRICS_PORT": "9090"},
            True,
            9090,
            id="set",
        ),
        pytest.param({"HAMIPY_WEBHOOK_OVERWRITE_ENV": "off"}, False, None, id="off"),
    ],
)
def test_flags_from_the_environment(
    env: dict[str, str], overwrite_env: bool, metrics_port: int | None
) -> None:
    args = cli.build_parser(env).parse_args(["serve"])
    assert (args.overwrite_env, args.metrics_port) == (overwrite_env, metrics_port)
    assert cli.build_parser(env).parse_args(["serve", "--no-overwrite-env"]).overwrite_env is False


@pytest.mark.parametrize(
    "module",
    [
        hamipy.webhook.admission,
        hamipy.webhook.admitting,
        hamipy.webhook.certificate_setup,
        hamipy.webhook.certs,
        hamipy.webhook.cli,
        hamipy.webhook.mutation,
        hamipy.webhook.registration,
        hamipy.webhook.server,
        hamipy.webhook.telemetry,
    ],
    ids=lambda m: m.__name__.rsplit(".", 1)[-1],
)
def test_all_names_exist_in_isort_order(module: object) -> None:
    exported = module.__all__  # type: ignore[attr-defined]
    assert exported == sorted(exported, key=_isort_order)
    for name in exported:
        assert hasattr(module, name), name


def _isort_order(name: str) -> tuple[int, str]:
    """ruff's ``__all__`` order (RUF022): CONSTANTS, then Classes, then functions, each by name."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)
