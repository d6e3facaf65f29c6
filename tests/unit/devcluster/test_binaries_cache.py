"""The binaries' cache (hamipy.devcluster.binaries): a machine that has some Kubernetes binaries
builds only the ones it lacks, and the cached CoreDNS is recognised by its version line."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from hamipy.devcluster import binaries
from hamipy.devcluster.binaries import COREDNS_VERSION, ETCD_VERSION, KUBE_COMPONENTS, KUBERNETES_VERSION


def _fake(path: Path, version_line: str) -> Path:
    """An executable that prints `version_line` whatever it is asked."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho '{version_line}'\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache, a ``go`` on PATH (nothing else), and no Go module proxy to ask."""
    root = tmp_path / "cache"
    monkeypatch.setenv("HAMIPY_CACHE_DIR", str(root))
    monkeypatch.delenv("KUBEBUILDER_ASSETS", raising=False)
    monkeypatch.setenv("PATH", str(_fake(tmp_path / "path" / "go", "go version go0.0").parent))
    monkeypatch.setattr(binaries, "check_proxy", lambda: None)
    return root


def _cached_before(root: Path, kube: Sequence[str]) -> None:
    """What an earlier run on this machine left in the cache: etcd, fakecri and `kube`."""
    _fake(root / "bin" / f"etcd-{ETCD_VERSION}" / "etcd", f"etcd Version: {ETCD_VERSION[1:]}")
    kube_dir = root / "bin" / f"kubernetes-{KUBERNETES_VERSION}"
    for name in kube:
        _fake(kube_dir / name, f"Kubernetes {KUBERNETES_VERSION}")
    _fake(kube_dir / "fakecri", "fakecri")
    (kube_dir / "fakecri.sha256").write_text(binaries._fakecri_stamp() + "\n")


def test_a_machine_with_the_other_binaries_builds_only_kube_proxy(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _cached_before(cache, [name for name in KUBE_COMPONENTS if name != "kube-proxy"])
    asked: list[tuple[str, ...]] = []

    def build(
        dest: Path, version: str = KUBERNETES_VERSION, *, names: Sequence[str] = KUBE_COMPONENTS
    ) -> None:
        asked.append(tuple(names))
        for name in names:
            _fake(dest / name, f"Kubernetes {version}")

    monkeypatch.setattr(binaries, "build_kubernetes", build)
    found = binaries.ensure_binaries()
    assert asked == [("kube-proxy",)]
    assert found.kube_proxy == cache / "bin" / f"kubernetes-{KUBERNETES_VERSION}" / "kube-proxy"
    assert found.kubelet.parent == found.kube_proxy.parent


def test_coredns_version_line_is_recognised(tmp_path: Path) -> None:
    # `coredns -version` prints "CoreDNS-1.14.7" and the platform on the next line.
    binary = _fake(tmp_path / "coredns", f"CoreDNS-{COREDNS_VERSION[1:]}\nlinux/amd64, go1.26.8, ")
    assert binaries.version_matches(binary, COREDNS_VERSION)
    assert not binaries.version_matches(_fake(tmp_path / "old", "CoreDNS-1.14.70"), COREDNS_VERSION)


def test_a_cached_coredns_is_used_without_building(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cached = _fake(cache / "bin" / f"coredns-{COREDNS_VERSION}" / "coredns", f"CoreDNS-{COREDNS_VERSION[1:]}")

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("built although cached")

    monkeypatch.setattr(binaries, "_go_install", no_build)
    assert binaries.ensure_coredns() == cached


def test_a_coredns_of_another_version_is_rebuilt(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    binary = _fake(cache / "bin" / f"coredns-{COREDNS_VERSION}" / "coredns", "CoreDNS-1.11.1")
    packages: list[str] = []

    def go_install(what: str, wanted: list[str], dest: Path, *, ldflags: str, tags: str = "") -> None:
        packages.extend(wanted)
        _fake(dest / "coredns", f"CoreDNS-{COREDNS_VERSION[1:]}")

    monkeypatch.setattr(binaries, "_go_install", go_install)
    assert binaries.ensure_coredns() == binary
    assert packages == [f"github.com/coredns/coredns@{COREDNS_VERSION}"]
