"""The ``hamipy-device-plugin`` command line: the node agents' shared options, environment
defaults, and refusals."""

from __future__ import annotations

import pytest

from hamipy.device_plugin.cli import build_parser, main
from hamipy.device_plugin.settings import PluginSettings
from hamipy.kube.options import EXIT_USAGE
from hamipy.protocol.settings import settings_from

SHARED = ("--node-name", "--config", "--kubeconfig", "--api-timeout", "--log-level")
OWN = (
    "--plugin-dir",
    "--socket-name",
    "--pod-resources-socket",
    "--metrics-host",
    "--metrics-port",
    "--register-interval",
    "--interposer",
)


def test_the_node_agents_shared_options_and_its_own() -> None:
    options = {o for action in build_parser({})._actions for o in action.option_strings}
    assert set(SHARED) | set(OWN) <= options


def test_defaults_and_environment() -> None:
    args = build_parser({}).parse_args(["--node-name", "n1"])
    settings = settings_from(PluginSettings, args)
    assert (settings.metrics_port, settings.register_interval_s, settings.api_timeout_s, args.log_level) == (
        9395,
        30.0,
        10.0,
        "info",
    )
    env = {
        "NODE_NAME": "from-downward-api",
        "HAMIPY_CONFIG": "/etc/hami-py/config.yaml",
        "HAMIPY_DEVICE_PLUGIN_METRICS_PORT": "19395",
        "HAMIPY_DEVICE_PLUGIN_REGISTER_INTERVAL": "15",
        "HAMIPY_DEVICE_PLUGIN_API_TIMEOUT": "3",
    }
    args = build_parser(env).parse_args([])
    settings = settings_from(PluginSettings, args)
    assert (
        settings.node_name,
        str(args.config),
        settings.metrics_port,
        settings.register_interval_s,
        settings.api_timeout_s,
    ) == (
        "from-downward-api",
        "/etc/hami-py/config.yaml",
        19395,
        15.0,
        3.0,
    )
    assert build_parser(env).parse_args(["--metrics-port", "1"]).metrics_port == 1, "a flag wins"


def test_the_kubelets_pod_resources_socket() -> None:
    args = build_parser({}).parse_args(["--node-name", "n1"])
    assert str(args.pod_resources_socket) == "/var/lib/kubelet/pod-resources/kubelet.sock"
    env = {"HAMIPY_DEVICE_PLUGIN_POD_RESOURCES_SOCKET": "/var/lib/k/pod-resources/kubelet.sock"}
    args = build_parser(env).parse_args(["--node-name", "n1"])
    assert str(args.pod_resources_socket) == "/var/lib/k/pod-resources/kubelet.sock"


@pytest.mark.parametrize(
    "env",
    [{"HAMIPY_DEVICE_PLUGIN_METRICS_PORT": "ninety"}, {"HAMIPY_DEVICE_PLUGIN_REGISTER_INTERVAL": "soon"}],
    ids=["bad-port", "bad-interval"],
)
def test_a_bad_environment_value_is_a_usage_error(
    env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--node-name", "n"], env=env) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "bad environment" in err
    assert next(iter(env)) in err


def test_a_node_name_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([], env={})
    assert exc.value.code == EXIT_USAGE
    assert "--node-name" in capsys.readouterr().err
