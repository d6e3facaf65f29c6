"""``hamipy-webhook manifest --policy``: prints the admission policies ``hamipy.manifests`` builds,
for the users, namespaces and hook paths given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hamipy.kube.options import EXIT_USAGE
from hamipy.manifests.admission_policy import admission_policies
from hamipy.protocol.resources import ResourceNames
from hamipy.webhook.cli import main


def test_manifest_policy_prints_the_policies_for_the_users_given(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["manifest", "--policy", "--format", "json", "--scheduler-user", "s1", "--scheduler-user", "s2"]
    assert main([*argv, "--device-plugin-user", "p"], env={}) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == admission_policies(schedulers=["s1", "s2"], device_plugins=["p"])
    assert main(["manifest", "--policy"], env={}) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert docs == admission_policies(schedulers=[], device_plugins=[])


def test_manifest_policy_takes_the_config_exempt_namespaces_and_hook_paths(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("nvidia:\n  resourceCountName: example.com/vgpu\n  hookPath: /opt/hami/vgpu\n")
    argv = ["manifest", "--policy", "--format", "json", "--config", str(config)]
    names = ResourceNames(count="example.com/vgpu")
    assert main([*argv, "--exempt-namespace", "a", "--exempt-namespace", "b"], env={}) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == admission_policies(
        schedulers=[],
        device_plugins=[],
        names=names,
        exempt_namespaces=["a", "b"],
        hook_paths=["/opt/hami/vgpu"],
    )
    # Flags name every hook path in use (nodes whose device plugins differ), instead of the config's.
    assert main([*argv, "--hook-path", "/a", "--hook-path", "/b"], env={}) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == admission_policies(
        schedulers=[], device_plugins=[], names=names, hook_paths=["/a", "/b"]
    )


@pytest.mark.parametrize(
    ("path", "why"),
    [
        pytest.param("/it's", "may not hold ' or \\", id="quote"),
        pytest.param("/a\\b", "may not hold ' or \\", id="backslash"),
        pytest.param("opt/vgpu", "must be an absolute path without '..'", id="relative"),
        pytest.param("/opt/../vgpu", "must be an absolute path without '..'", id="dot-dot"),
    ],
)
def test_manifest_policy_refuses_a_hook_path_it_cannot_use(
    capsys: pytest.CaptureFixture[str], path: str, why: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["manifest", "--policy", "--hook-path", path], env={})
    assert exited.value.code == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"argument --hook-path: {path!r}: {why}" in captured.err
