"""The service images: no Docker engine runs here, so each Dockerfile is linted with
hadolint and checked against the repository: what it copies exists (and is not docker-ignored),
the package it installs is a workspace member whose console script is the entry point, and the
native target it builds is a real make target."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCKER = ROOT / "deploy" / "docker"
SERVICES = {
    "webhook": "hamipy-webhook",
    "extender": "hamipy-extender",
    "device-plugin": "hamipy-device-plugin",
    "monitor": "hamipy-monitor",
}
# Services that can run without root; the node agents need host paths and sockets.
NON_ROOT = {"webhook", "extender"}


def dockerfile(service: str) -> str:
    return (DOCKER / f"{service}.Dockerfile").read_text()


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerignored(path: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()]
    return any(p and not p.startswith("#") and fnmatch.fnmatch(path.rstrip("/"), p) for p in patterns)


def workspace_packages() -> dict[str, dict[str, Any]]:
    found = {}
    for pyproject in [*ROOT.glob("libs/*/pyproject.toml"), *ROOT.glob("services/*/pyproject.toml")]:
        project = tomllib.loads(pyproject.read_text())["project"]
        found[project["name"]] = project
    return found


def test_every_service_has_a_dockerfile() -> None:
    assert sorted(p.stem for p in DOCKER.glob("*.Dockerfile")) == sorted(SERVICES)


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_hadolint_is_clean(service: str) -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    proc = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "info", str(DOCKER / f"{service}.Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_what_it_copies_exists_in_the_repository(service: str) -> None:
    copies = [args for word, args in instructions(dockerfile(service)) if word == "COPY"]
    assert copies
    for args in copies:
        if args.startswith("--from="):
            continue
        *sources, _ = args.split()
        for source in sources:
            assert (ROOT / source).exists(), f"{service}: COPY {source} does not exist"
            assert not dockerignored(source), f"{service}: COPY {source} is excluded by .dockerignore"


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_it_installs_only_its_own_package_whose_script_is_the_entrypoint(service: str) -> None:
    steps = instructions(dockerfile(service))
    packages = [m for _, args in steps for m in re.findall(r"--package (\S+)", args)]
    assert packages == [SERVICES[service]]
    project = workspace_packages()[SERVICES[service]]
    (entrypoint,) = [args for word, args in steps if word == "ENTRYPOINT"]
    script = entrypoint.strip('[]" ').split('"')[0]
    assert script in project.get("scripts", {}), f"{script} is not a console script of {SERVICES[service]}"


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_runs_as_non_root_where_the_service_allows(service: str) -> None:
    users = [args for word, args in instructions(dockerfile(service)) if word == "USER"]
    if service in NON_ROOT:
        assert users, f"{service} should not run as root"
        assert users[-1] not in ("0", "root")
    else:
        assert not users, f"{service} needs root on the node (say why in its Dockerfile if that changes)"


def test_device_plugin_image_carries_the_interposer_it_builds() -> None:
    text = dockerfile("device-plugin")
    (target,) = re.findall(r"make -C native (\S+)", text)
    proc = subprocess.run(
        ["make", "-n", "-C", str(ROOT / "native"), target],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"COPY --from=native /src/native/{target} /opt/hamipy/lib/libvgpu.so" in text
    assert '"--interposer", "/opt/hamipy/lib/libvgpu.so"' in text
