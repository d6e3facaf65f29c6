"""The ``hamipy-monitor`` command line: its help, flags, environment defaults and refusals."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hamipy.kube.options import EXIT_USAGE
from hamipy.monitor.cli import build_parser, main, settings_from_args
from hamipy.protocol.config import Config, load_config

FLAGS = (
    "--node-name",
    "--config",
    "--kubeconfig",
    "--hook-path",
    "--metrics-host",
    "--metrics-port",
    "--legacy-metrics",
    "--host-metrics",
    "--feedback",
    "--no-feedback",
    "--feedback-interval",
    "--gone-grace",
    "--api-timeout",
    "--log-level",
)


def test_the_console_script_prints_its_help() -> None:
    script = shutil.which("hamipy-monitor", path=str(Path(sys.executable).parent))
    assert script is not None, "the console script is installed next to the interpreter"
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    for flag in FLAGS:
        assert flag in proc.stdout


def test_defaults_match_hamis_monitor_and_the_settings() -> None:
    args = build_parser({}).parse_args(["--node-name", "n1"])
    settings = settings_from_args(args, Config())
    assert (settings.node_name, settings.metrics_port, str(settings.hook_path)) == (
        "n1",
        9394,
        "/usr/local/vgpu",
    )
    assert (settings.feedback, settings.legacy_metrics, settings.host_metrics) == (True, False, True)
    assert (settings.feedback_interval_s, settings.gone_grace_s) == (5.0, 300.0)


def test_flags_and_environment_set_every_setting() -> None:
    env = {
        "NODE_NAME": "from-downward-api",
        "HAMIPY_MONITOR_LEGACY_METRICS": "true",
        "HAMIPY_MONITOR_FEEDBACK": "false",
        "HAMIPY_MONITOR_METRICS_PORT": "19394",
    }
    args = build_parser(env).parse_args(
        ["--feedback-interval", "2.5", "--gone-grace", "60", "--hook-path", "/h"]
    )
    s = settings_from_args(args, Config())
    assert (s.node_name, s.legacy_metrics, s.feedback, s.metrics_port) == (
        "from-downward-api",
        True,
        False,
        19394,
    )
    assert (s.feedback_interval_s, s.gone_grace_s, str(s.hook_path)) == (2.5, 60.0, "/h")
    assert build_parser(env).parse_args(["--feedback"]).feedback is True


def test_the_hook_path_comes_from_the_shared_configuration() -> None:
    config = load_config("nvidia:\n  hookPath: /opt/vgpu\n")
    assert (
        str(settings_from_args(build_parser({}).parse_args(["--node-name", "n"]), config).hook_path)
        == "/opt/vgpu"
    )


@pytest.mark.parametrize(
    ("nvidia", "spec_dir"),
    [
        ("{}", None),
        ("{deviceListStrategy: envvar, cdiSpecDir: /run/cdi}", None),
        ("{deviceListStrategy: cdi-cri}", "/var/run/cdi"),
        ("{deviceListStrategy: cdi-cri, cdiSpecDir: /run/cdi}", "/run/cdi"),
    ],
)
def test_cdi_specs_are_looked_after_only_under_the_cdi_strategy(nvidia: str, spec_dir: str | None) -> None:
    config = load_config(f"nvidia: {nvidia}\n")
    settings = settings_from_args(build_parser({}).parse_args(["--node-name", "n"]), config)
    assert settings.cdi_spec_dir == (None if spec_dir is None else Path(spec_dir))


def test_a_node_name_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([], env={})
    assert exc.value.code == EXIT_USAGE
    assert "--node-name" in capsys.readouterr().err


@pytest.mark.parametrize(
    "env",
    [{"HAMIPY_MONITOR_FEEDBACK": "maybe"}, {"HAMIPY_MONITOR_METRICS_PORT": "ninety"}],
    ids=["bad-boolean", "bad-port"],
)
def test_a_bad_environment_value_is_a_usage_error(
    env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--node-name", "n"], env=env) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "bad environment" in err
    assert next(iter(env.values())) in err


def test_a_non_positive_interval_is_refused() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--node-name", "n", "--feedback-interval", "0"], env={})
    assert exc.value.code == EXIT_USAGE


def test_a_bad_configuration_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "hami-py.yaml"
    config.write_text("nvidia:\n  hookPath: relative/path\n")
    assert main(["--node-name", "n", "--config", str(config)], env={}) == EXIT_USAGE
    assert "hookPath" in capsys.readouterr().err


def test_the_port_comes_from_its_flag_variable() -> None:
    env = {"HAMIPY_MONITOR_METRICS_PORT": "9600"}
    assert build_parser(env).parse_args(["--node-name", "n"]).metrics_port == 9600


def test_an_empty_variable_is_unset() -> None:
    env = {"HAMIPY_MONITOR_FEEDBACK": "", "HAMIPY_MONITOR_LEGACY_METRICS": " "}
    args = build_parser(env).parse_args(["--node-name", "n"])
    assert (args.feedback, args.legacy_metrics) == (True, False), "the defaults"
