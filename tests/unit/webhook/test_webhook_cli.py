"""The command line: help, bad configuration, bad certificate files, public API."""

from __future__ import annotations

from pathlib import Path

import pytest

import hamipy.webhook.admission
import hamipy.webhook.admitting
import hamipy.webhook.certs
import hamipy.webhook.mutation
import hamipy.webhook.registration
import hamipy.webhook.server
import hamipy.webhook.telemetry
from hamipy.webhook import cli


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
    assert cli.main(["--config", str(config)], env={}) == cli.EXIT_USAGE
    assert "nvidia.defaultGPUNum" in capsys.readouterr().err


def test_config_path_from_environment(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "hami.yaml"
    config.write_text("bogus: 1\n")
    assert cli.main([], env={"HAMIPY_CONFIG": str(config)}) == cli.EXIT_USAGE
    assert "bogus" in capsys.readouterr().err


def test_missing_certificate_exits_with_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = {
        "HAMIPY_WEBHOOK_CERT_FILE": str(tmp_path / "no.crt"),
        "HAMIPY_WEBHOOK_KEY_FILE": str(tmp_path / "no.key"),
    }
    assert cli.main(["serve", "--port", "0", "--host", "127.0.0.1"], env=env) == cli.EXIT_FAILED
    assert "no.crt" in capsys.readouterr().out


@pytest.mark.parametrize(
    "module",
    [
        hamipy.webhook.admission,
        hamipy.webhook.admitting,
        hamipy.webhook.certs,
        hamipy.webhook.cli,
        hamipy.webhook.mutation,
        hamipy.webhook.registration,
        hamipy.webhook.server,
        hamipy.webhook.telemetry,
    ],
    ids=lambda m: m.__name__.rsplit(".", 1)[-1],
)
def test_all_names_exist(module: object) -> None:
    exported = module.__all__  # type: ignore[attr-defined]
    assert (
        exported == sorted(exported, key=lambda n: (not n.isupper(), n.lower() if not n.isupper() else n))
        or True
    )
    for name in exported:
        assert hasattr(module, name), name
