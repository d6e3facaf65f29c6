"""OCI image-layout archives, byte for byte reproducible, for images made without a registry.

An image here is one gzip layer of ``Entry`` values and a runtime config (entrypoint, env, user).
``image_archive`` turns it into the tar of an OCI image layout (``oci-layout``, ``index.json``,
``blobs/sha256/...``) that ``ctr images import`` reads, naming the image with containerd's
``io.containerd.image.name`` annotation (the full reference) and OCI's
``org.opencontainers.image.ref.name`` (its tag), as containerd's own exporter writes them; one index
entry per name, so one import gives every name. Nothing depends on the clock, the user or the
order the caller lists the entries in: every mtime is 0, every owner root, entries sorted, gzip
headers without a name or time.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import tarfile
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, Final

MEDIA_INDEX: Final = "application/vnd.oci.image.index.v1+json"
MEDIA_MANIFEST: Final = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG: Final = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER: Final = "application/vnd.oci.image.layer.v1.tar+gzip"
ANNOTATION_IMAGE_NAME: Final = "io.containerd.image.name"
ANNOTATION_REF_NAME: Final = "org.opencontainers.image.ref.name"


@dataclasses.dataclass(frozen=True)
class File:
    path: str
    """Absolute path in the image."""
    data: bytes
    mode: int = 0o755


@dataclasses.dataclass(frozen=True)
class Directory:
    path: str
    mode: int = 0o755


@dataclasses.dataclass(frozen=True)
class Symlink:
    path: str
    target: str


Entry = File | Directory | Symlink


@dataclasses.dataclass(frozen=True)
class ImageSpec:
    """What an image holds and how it starts."""

    entries: tuple[Entry, ...]
    entrypoint: tuple[str, ...]
    env: tuple[str, ...] = ()
    user: str = ""
    """``uid:gid``; empty: root."""
    architecture: str = "amd64"
    """GOARCH spelling, as platforms are named in OCI."""


@dataclasses.dataclass(frozen=True)
class ImageBlobs:
    """An image's content-addressed blobs: its gzip layer, config and manifest."""

    layer: bytes
    config: bytes
    manifest: bytes
    architecture: str

    @property
    def manifest_digest(self) -> str:
        return _digest(self.manifest)

    @property
    def config_digest(self) -> str:
        """The image ID (what ``crictl images`` and the kubelet's ``imageID`` show)."""
        return _digest(self.config)


def _member_name(path: str) -> str:
    pure = PurePosixPath(path)
    if not pure.is_absolute() or ".." in pure.parts or str(pure) == "/":
        raise ValueError(f"image path must be absolute, below / and without '..': {path!r}")
    return str(pure.relative_to("/"))


def _with_parents(entries: Iterable[Entry]) -> dict[str, Entry]:
    """Entries by member name, each parent directory present (0755 unless listed)."""
    by_name: dict[str, Entry] = {}
    for entry in entries:
        name = _member_name(entry.path)
        if name in by_name and by_name[name] != entry:
            raise ValueError(f"two different entries for {entry.path!r} in one image")
        by_name[name] = entry
    for name in list(by_name):
        for parent in PurePosixPath(name).parents:
            if str(parent) == ".":
                continue
            if not isinstance(by_name.setdefault(str(parent), Directory(f"/{parent}")), Directory):
                raise ValueError(f"/{parent} holds /{name} but is not a directory in the image")
    return by_name


def _tar_info(name: str, entry: Entry) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if isinstance(entry, File):
        info.type, info.mode, info.size = tarfile.REGTYPE, entry.mode, len(entry.data)
    elif isinstance(entry, Directory):
        info.type, info.mode = tarfile.DIRTYPE, entry.mode
    else:
        info.type, info.mode, info.linkname = tarfile.SYMTYPE, 0o777, entry.target
    return info


def layer_tar(entries: Iterable[Entry]) -> bytes:
    """The uncompressed layer: every entry and its parents, sorted by path."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, entry in sorted(_with_parents(entries).items()):
            data = io.BytesIO(entry.data) if isinstance(entry, File) else None
            tar.addfile(_tar_info(name, entry), data)
    return buffer.getvalue()


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _descriptor(media_type: str, data: bytes, **extra: Any) -> dict[str, Any]:
    return {"mediaType": media_type, "digest": _digest(data), "size": len(data), **extra}


def tag_of(reference: str) -> str:
    """The tag of ``host/repo:tag`` (what OCI's ref.name annotation holds)."""
    last = reference.rsplit("/", 1)[-1]
    if ":" not in last or "@" in reference:
        raise ValueError(f"image reference must end in a tag and carry no digest: {reference!r}")
    return last.rsplit(":", 1)[1]


def image_blobs(spec: ImageSpec) -> ImageBlobs:
    """The layer, config and manifest of `spec`."""
    layer = layer_tar(spec.entries)
    compressed = gzip.compress(layer, compresslevel=6, mtime=0)
    runtime: dict[str, Any] = {"Entrypoint": list(spec.entrypoint), "Env": list(spec.env), "WorkingDir": "/"}
    if spec.user:
        runtime["User"] = spec.user
    config = _json(
        {
            "architecture": spec.architecture,
            "os": "linux",
            "config": runtime,
            "rootfs": {"type": "layers", "diff_ids": [_digest(layer)]},
        }
    )
    manifest = _json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": _descriptor(MEDIA_CONFIG, config),
            "layers": [_descriptor(MEDIA_LAYER, compressed)],
        }
    )
    return ImageBlobs(layer=compressed, config=config, manifest=manifest, architecture=spec.architecture)


def layout_archive(blobs: ImageBlobs, names: Sequence[str]) -> bytes:
    """The OCI image layout of `blobs` as a tar, its index naming the image `names` (at least one)."""
    if not names:
        raise ValueError("an image archive needs at least one name")
    platform = {"architecture": blobs.architecture, "os": "linux"}
    index = _json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_INDEX,
            "manifests": [
                _descriptor(
                    MEDIA_MANIFEST,
                    blobs.manifest,
                    platform=platform,
                    annotations={ANNOTATION_IMAGE_NAME: name, ANNOTATION_REF_NAME: tag_of(name)},
                )
                for name in names
            ],
        }
    )
    files = [
        File("/oci-layout", _json({"imageLayoutVersion": "1.0.0"}), 0o644),
        File("/index.json", index, 0o644),
    ]
    files += [
        File(f"/blobs/sha256/{_digest(blob).removeprefix('sha256:')}", blob, 0o644)
        for blob in (blobs.config, blobs.manifest, blobs.layer)
    ]
    return layer_tar(files)


@dataclasses.dataclass(frozen=True)
class ArchiveSummary:
    names: tuple[str, ...]
    manifest_digest: str
    config_digest: str
    runtime: dict[str, Any]
    """The image config's ``config``: Entrypoint, Cmd, Env, User... as a runtime reads them."""


def summarize_archive(path: Path) -> ArchiveSummary:
    """The names, digests and runtime config of the (single-manifest) image in the layout archive at
    `path`. Its names are what ``ctr images import`` gives it: each index entry's containerd name, or
    else its OCI ref name (which tools other than containerd write, as a full reference)."""
    with tarfile.open(path, mode="r:") as tar:

        def member(name: str) -> Any:
            handle = tar.extractfile(name)
            if handle is None:
                raise ValueError(f"{path}: {name} is not a file")
            return json.loads(handle.read())

        index = member("index.json")
        manifests = index["manifests"]
        digests = {entry["digest"] for entry in manifests}
        if len(digests) != 1:
            raise ValueError(f"{path}: expected one image, found manifests {sorted(digests)}")
        (digest,) = digests
        manifest = member(_blob(digest))
        config = member(_blob(manifest["config"]["digest"]))
    names = []
    for entry in manifests:
        annotations = entry.get("annotations", {})
        name = annotations.get(ANNOTATION_IMAGE_NAME) or annotations.get(ANNOTATION_REF_NAME)
        if not name:
            raise ValueError(
                f"{path}: the index names no image (no {ANNOTATION_IMAGE_NAME} or {ANNOTATION_REF_NAME})"
            )
        names.append(name)
    return ArchiveSummary(
        names=tuple(names),
        manifest_digest=digest,
        config_digest=manifest["config"]["digest"],
        runtime=config.get("config", {}),
    )


def _blob(digest: str) -> str:
    algorithm, _, hexdigest = digest.partition(":")
    return f"blobs/{algorithm}/{hexdigest}"
