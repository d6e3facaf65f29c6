"""Every command line answers ``--version`` with its package's version (what an image runs, for a
bug report or a rollout check), without needing a cluster, a GPU or a configuration."""

from __future__ import annotations

import importlib
from importlib.metadata import version

import pytest

COMMANDS = {
    "hamipy-webhook": "hamipy.webhook.cli",
    "hamipy-extender": "hamipy.extender.cli",
    "hamipy-device-plugin": "hamipy.device_plugin.cli",
    "hamipy-monitor": "hamipy.monitor.cli",
    "hamipy-devcluster": "hamipy.devcluster.cli",
}


@pytest.mark.parametrize(("command", "module"), COMMANDS.items(), ids=list(COMMANDS))
def test_version(command: str, module: str, capsys: pytest.CaptureFixture[str]) -> None:
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"{command} {version(command)}"
