"""What the real-runtime nodes need from the host's packages: found, or named when they cannot be
installed here."""

from __future__ import annotations

from pathlib import Path

import pytest

from hamipy.devcluster.errors import DevClusterError
from hamipy.devcluster.host_packages import (
    RUNTIME_PACKAGES,
    HostPackage,
    ensure_host_packages,
    missing_packages,
)


def test_present_packages_need_nothing(tmp_path: Path) -> None:
    present = tmp_path / "runc"
    present.touch()
    ensure_host_packages([HostPackage("runc", present)])


def test_without_root_the_missing_packages_are_named_with_the_command_to_install_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    wanted = [HostPackage("runc", tmp_path / "runc"), HostPackage("busybox-static", tmp_path / "busybox")]
    assert missing_packages(wanted) == wanted
    with pytest.raises(DevClusterError) as refused:
        ensure_host_packages(wanted)
    message = str(refused.value)
    assert "apt-get install -y busybox-static runc" in message
    assert str(tmp_path / "runc") in message


def test_the_runtime_needs_runc_the_cni_bridge_and_busybox() -> None:
    packages = {p.package: p.path for p in RUNTIME_PACKAGES}
    assert packages["runc"] == Path("/usr/sbin/runc")
    assert packages["containernetworking-plugins"] == Path("/usr/lib/cni/bridge")
    assert packages["busybox-static"] == Path("/bin/busybox")
