"""The CoreDNS image (hamipy.devcluster.images.ensure_coredns_image): an OCI archive for
``ctr images import`` that runs the cached coredns binary as a user other than root, cached by
its contents."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from hamipy.devcluster import images
from hamipy.devcluster.binaries import COREDNS_VERSION

BINARY = b"\x7fELF not really coredns"


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("HAMIPY_CACHE_DIR", str(root))
    return root


@pytest.fixture
def binary(tmp_path: Path) -> Path:
    path = tmp_path / "coredns"
    path.write_bytes(BINARY)
    return path


def read_image(archive: Path) -> tuple[list[str], dict[str, Any], dict[str, tarfile.TarInfo], bytes]:
    """The names, config, layer members and /coredns of the image in `archive`, read with tarfile and
    json alone."""
    with tarfile.open(archive) as tar:

        def blob(digest: str) -> bytes:
            handle = tar.extractfile("blobs/sha256/" + digest.removeprefix("sha256:"))
            assert handle is not None
            return handle.read()

        index_file = tar.extractfile("index.json")
        assert index_file is not None
        index = json.load(index_file)
        manifest = json.loads(blob(index["manifests"][0]["digest"]))
        config = json.loads(blob(manifest["config"]["digest"]))
        layer = gzip.decompress(blob(manifest["layers"][0]["digest"]))
    names = [entry["annotations"]["io.containerd.image.name"] for entry in index["manifests"]]
    with tarfile.open(fileobj=io.BytesIO(layer)) as inner:
        members = {member.name: member for member in inner.getmembers()}
        handle = inner.extractfile("coredns")
        assert handle is not None
        program = handle.read()
    return names, config, members, program


def test_the_image_runs_the_binary_as_its_entrypoint_not_as_root(binary: Path) -> None:
    image = images.ensure_coredns_image(binary)
    names, config, members, program = read_image(image.archive)
    assert names == [f"hamipy.local/coredns:{COREDNS_VERSION}"] == [image.ref]
    assert config["config"]["Entrypoint"] == ["/coredns"]
    assert config["config"]["User"] == "65532:65532"
    assert program == BINARY
    assert members["coredns"].mode == 0o755
    assert members["coredns"].uid == 0  # owned by root, run by 65532: it cannot change its program


def test_a_second_call_reuses_the_archive(binary: Path) -> None:
    first = images.ensure_coredns_image(binary)
    before = first.archive.stat().st_ino
    again = images.ensure_coredns_image(binary)
    assert again == first
    assert again.archive.stat().st_ino == before


def test_a_changed_binary_makes_a_new_archive(binary: Path) -> None:
    first = images.ensure_coredns_image(binary)
    binary.write_bytes(BINARY + b" v2")
    second = images.ensure_coredns_image(binary)
    assert second.archive != first.archive
    assert second.ref == first.ref
    assert read_image(second.archive)[3] == BINARY + b" v2"
