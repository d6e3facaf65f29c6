"""The container images the dev cluster's nodes run, made on this machine.

No registry is reachable and there is no Docker, so every image a pod runs is built here as an OCI
image-layout archive (``oci_archive``) that ``ctr -n k8s.io images import <archive>`` takes:

- the pause image (``PAUSE_IMAGE``), the sandbox every pod's containers join: Kubernetes' own
  ``build/pause/linux/pause.c`` from the ``k8s.io/kubernetes`` module the binaries are built from,
  compiled with ``gcc -static``, as upstream builds it; under the name containerd's CRI pins and
  never pulls.
- the GPU workload image (``GPU_WORKLOAD_IMAGE``): ``native/build/gpu-workload`` (the program that
  reports what a CUDA application sees of its GPUs and limits), the shared libraries it, the
  interposer and the fake driver load (the C runtime only: ``libcuda.so.1`` and
  ``libnvidia-ml.so.1`` are the node's, mounted by its runtime as the NVIDIA toolkit mounts them),
  and a static busybox for ``kubectl exec ... -- sh``.
- the CoreDNS image (``COREDNS_IMAGE``), the cluster's DNS server (``cluster_dns``): the static
  ``coredns`` binary (``binaries.ensure_coredns``) alone, run as a user other than root.

Archives are cached under ``cache_root()/images``, named by a hash of everything that goes into
them (the files' contents, the compiler, this builder's source), reused while that hash holds and
built under the binaries' build lock, written to a temporary file and renamed into place.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath
from typing import Final

from hamipy.devcluster import binaries, oci_archive
from hamipy.devcluster.errors import ImageBuildError
from hamipy.devcluster.oci_archive import Directory, Entry, File, ImageBlobs, ImageSpec, Symlink

PAUSE_VERSION: Final = "3.10.1"
PAUSE_IMAGE: Final = f"registry.k8s.io/pause:{PAUSE_VERSION}"
"""containerd 2.2's default sandbox image (``DefaultSandboxImage``) and kubeadm's pause for
Kubernetes v1.34 (``PauseVersion``): the CRI plugin pins it and never pulls it while it is there."""
PAUSE_CFLAGS: Final = ("-Os", "-Wall", "-Werror", "-static", f"-DVERSION=v{PAUSE_VERSION}-hamipy")
"""Upstream's (``build/pause/Makefile``), the revision being ours."""

GPU_WORKLOAD_REPOSITORY: Final = "hamipy.local/gpu-workload"
GPU_WORKLOAD_IMAGE: Final = f"{GPU_WORKLOAD_REPOSITORY}:dev"
"""The stable name for manifests. Not ``:latest``, for which the kubelet's default pull policy is
Always (there is nothing to pull from); every archive also names its own build,
``hamipy.local/gpu-workload:<first 12 hex digits of its manifest digest>``."""
WORKLOAD_PROGRAM: Final = "/usr/local/bin/gpu-workload"
BUSYBOX: Final = Path("/bin/busybox")
BUSYBOX_PACKAGE: Final = "busybox-static"
BUSYBOX_APPLETS: Final = ("cat", "env", "grep", "id", "kill", "ls", "ps", "sh", "sleep")
NODE_LIBRARIES: Final = frozenset({"libcuda.so.1", "libnvidia-ml.so.1"})
"""The driver's: a node's runtime mounts them into the container, so the image must not hold them."""
C_RUNTIME: Final = ("libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1")
"""Present whatever the program links: the NVIDIA driver's libraries load these."""
IMAGE_PATH: Final = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",)
MERGED_DIRECTORIES: Final = ("bin", "lib", "lib64", "sbin")
"""Links into /usr in the images, as in Debian since 12: /bin/sh and /lib64/ld-linux-... both work."""
PASSWD: Final = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
GROUP: Final = b"root:x:0:\nnogroup:x:65534:\n"
COREDNS_IMAGE: Final = f"hamipy.local/coredns:{binaries.COREDNS_VERSION}"
COREDNS_PROGRAM: Final = "/coredns"
"""Where upstream's image has it (its entrypoint)."""
COREDNS_USER: Final = "65532:65532"
"""Upstream's (distroless ``nonroot``): it listens above 1024, so it needs no capability."""
TOOL_TIMEOUT_S: Final = 120.0
KEEP_PER_IMAGE: Final = 4
"""Archives kept per image (the most recently used): other checkouts may be using older ones."""
_ARCHITECTURES: Final = {"x86_64": "amd64", "aarch64": "arm64"}


@dataclasses.dataclass(frozen=True)
class ImageArchive:
    """An image archive ready for ``ctr -n k8s.io images import``."""

    ref: str
    """The name the import gives the image."""
    archive: Path
    manifest_digest: str
    config_digest: str
    """The image ID, as the kubelet and ``crictl images`` show it."""
    aliases: tuple[str, ...] = ()
    """Further names the same import gives it."""


@dataclasses.dataclass(frozen=True)
class DevImages:
    pause: ImageArchive
    gpu_workload: ImageArchive


def ensure_images(native_build: Path) -> DevImages:
    """Both images, built where their archive is missing or stale (`native_build`: ``native/build``)."""
    return DevImages(pause=ensure_pause_image(), gpu_workload=ensure_workload_image(native_build))


def ensure_pause_image(source: Path | None = None) -> ImageArchive:
    """The pause image, from `source` (default: the Kubernetes module's ``pause.c``)."""
    source = source or pause_source()
    gcc = shutil.which("gcc")
    if gcc is None:
        raise ImageBuildError("gcc is needed to build the pause image (Debian package gcc)")
    text = source.read_bytes()
    compiler = _run([gcc, "--version"]) + _run([gcc, "-dumpmachine"])  # its version and target
    key = _key(b"pause", text, compiler.encode(), _static_libc(gcc), *map(str.encode, PAUSE_CFLAGS))

    def make() -> tuple[ImageBlobs, tuple[str, ...]]:
        spec = ImageSpec(
            entries=(File("/pause", _compile_pause(gcc, text)),),
            entrypoint=("/pause",),
            user="65535:65535",
            architecture=_architecture(),
        )
        return oci_archive.image_blobs(spec), (PAUSE_IMAGE,)

    return _cached("pause", key, make)


def ensure_workload_image(native_build: Path, *, busybox: Path = BUSYBOX) -> ImageArchive:
    """The GPU workload image of `native_build`'s ``gpu-workload``, with `busybox` for a shell."""
    spec = workload_spec(native_build, busybox=busybox)

    def make() -> tuple[ImageBlobs, tuple[str, ...]]:
        blobs = oci_archive.image_blobs(spec)
        short = blobs.manifest_digest.removeprefix("sha256:")[:12]
        return blobs, (f"{GPU_WORKLOAD_REPOSITORY}:{short}", GPU_WORKLOAD_IMAGE)

    return _cached("gpu-workload", _spec_key("gpu-workload", spec), make)


def ensure_coredns_image(binary: Path | None = None) -> ImageArchive:
    """The CoreDNS image, ``COREDNS_IMAGE``, of `binary` (default: ``binaries.ensure_coredns()``):
    its ``archive`` for the node's ``ctr images import``, its ``ref`` for the Deployment."""
    spec = coredns_spec(binary or binaries.ensure_coredns())
    return _cached(
        "coredns", _spec_key("coredns", spec), lambda: (oci_archive.image_blobs(spec), (COREDNS_IMAGE,))
    )


def coredns_spec(binary: Path) -> ImageSpec:
    """What the CoreDNS image holds: `binary` as its entrypoint (read now), and a /tmp."""
    return ImageSpec(
        entries=(File(COREDNS_PROGRAM, binary.read_bytes()), Directory("/tmp", 0o1777)),
        entrypoint=(COREDNS_PROGRAM,),
        env=IMAGE_PATH,
        user=COREDNS_USER,
        architecture=_architecture(),
    )


def workload_spec(native_build: Path, *, busybox: Path = BUSYBOX) -> ImageSpec:
    """What the GPU workload image holds; the files are read now."""
    program = native_build / "gpu-workload"
    # What the container loads besides the program: the interposer (/etc/ld.so.preload) and the
    # driver the node mounts; their own dependencies must be in the image.
    loaded_with = (native_build / "libvgpu.so", native_build / "fake" / "libcuda.so.1")
    for path in (program, *loaded_with):
        if not path.is_file():
            raise ImageBuildError(f"{path} is missing: build native/ first (make -C native)")
    if not busybox.is_file():
        raise ImageBuildError(f"{busybox} is missing: install the Debian package {BUSYBOX_PACKAGE}")
    if _shared_libraries(busybox) is not None:
        raise ImageBuildError(
            f"{busybox} is dynamically linked: install the Debian package {BUSYBOX_PACKAGE}"
        )
    libraries = _runtime_libraries([program, *loaded_with])
    entries: list[Entry] = [
        File(WORKLOAD_PROGRAM, program.read_bytes()),
        File("/usr/bin/busybox", busybox.read_bytes()),
        *(Symlink(f"/usr/bin/{applet}", "busybox") for applet in BUSYBOX_APPLETS),
        *(File(_in_image(path), Path(path).read_bytes()) for path in sorted(libraries)),
        File("/etc/passwd", PASSWD, 0o644),
        File("/etc/group", GROUP, 0o644),
        Directory("/tmp", 0o1777),
        Directory("/root", 0o700),
    ]
    return ImageSpec(
        entries=(*entries, *_merged_usr_links(entries)),
        entrypoint=(WORKLOAD_PROGRAM,),
        env=IMAGE_PATH,
        architecture=_architecture(),
    )


def pause_source() -> Path:
    """``build/pause/linux/pause.c`` of the ``k8s.io/kubernetes`` module the binaries come from,
    downloaded into Go's module cache (by the binaries' wrapper module) if it is not there."""
    if shutil.which("go") is None:
        raise ImageBuildError("Go is needed to find Kubernetes' pause.c (in the k8s.io/kubernetes module)")
    path = (
        Path(_run(["go", "env", "GOMODCACHE"]).strip())
        / f"k8s.io/kubernetes@{binaries.KUBERNETES_VERSION}"
        / "build/pause/linux/pause.c"
    )
    if not path.is_file():
        with binaries._build_lock():
            binaries._kube_module()
    if not path.is_file():
        raise ImageBuildError(
            f"{path} is missing after downloading k8s.io/kubernetes@{binaries.KUBERNETES_VERSION}"
        )
    return path


def _tool(argv: list[str], *, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Runs a host tool without the caller's LD_* settings (an LD_PRELOAD or LD_LIBRARY_PATH of a
    test must not change which libraries the loader finds)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("LD_")}
    return subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False
    )


def _run(argv: list[str], *, cwd: Path | None = None) -> str:
    try:
        proc = _tool(argv, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ImageBuildError(f"{' '.join(argv)} failed: {exc}") from exc
    if proc.returncode != 0:
        raise ImageBuildError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def _static_libc(gcc: str) -> bytes:
    archive = Path(_run([gcc, "-print-file-name=libc.a"]).strip())
    if not archive.is_absolute() or not archive.is_file():
        raise ImageBuildError(
            "the static C library (libc.a) is missing: install the Debian package libc6-dev"
        )
    return hashlib.sha256(archive.read_bytes()).digest()


def _compile_pause(gcc: str, source: bytes) -> bytes:
    with tempfile.TemporaryDirectory(prefix="hamipy-pause-") as tmp:
        # Compiled as ./pause.c in a fresh directory: no path of this machine ends up in the binary.
        (Path(tmp) / "pause.c").write_bytes(source)
        _run([gcc, *PAUSE_CFLAGS, "-o", "pause", "pause.c"], cwd=Path(tmp))
        return (Path(tmp) / "pause").read_bytes()


def _shared_libraries(binary: Path) -> dict[str, str] | None:
    """What the dynamic loader maps for `binary`: soname (or the loader's own path) -> the path it
    opens; None for a static binary. The driver's libraries, not found or not, are left out."""
    try:
        proc = _tool(["ldd", str(binary)])
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ImageBuildError(f"ldd {binary} failed ({exc}): ldd is in the Debian package libc-bin") from exc
    if "not a dynamic executable" in proc.stdout + proc.stderr or "statically linked" in proc.stdout:
        return None
    if proc.returncode != 0:
        raise ImageBuildError(f"ldd {binary} exited {proc.returncode}: {proc.stderr.strip()}")
    found: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        words = line.split()
        if not words or words[0] in NODE_LIBRARIES or words[0].startswith("linux-vdso"):
            continue
        if len(words) >= 3 and words[1] == "=>":
            if not words[2].startswith("/"):
                raise ImageBuildError(f"{binary} needs {words[0]}, which the dynamic loader cannot find")
            found[words[0]] = words[2]
        elif words[0].startswith("/"):
            found[words[0]] = words[0]  # the loader itself, at the program's PT_INTERP path
    return found


def _runtime_libraries(binaries_: Iterable[Path]) -> set[str]:
    """Host paths of every library `binaries_` load, and of the C runtime beside their libc."""
    paths: set[str] = set()
    libc: str | None = None
    for binary in binaries_:
        found = _shared_libraries(binary)
        if found is None:
            raise ImageBuildError(f"{binary} is statically linked: the interposer cannot reach it")
        paths.update(found.values())
        libc = found.get("libc.so.6", libc)
    if libc is None:
        raise ImageBuildError("no libc.so.6 among the libraries of the workload (is it a glibc program?)")
    for name in C_RUNTIME:
        sibling = PurePosixPath(libc).with_name(name)
        if not Path(sibling).is_file():
            raise ImageBuildError(f"{sibling} is missing: install the Debian package libc6")
        paths.add(str(sibling))
    return paths


def _in_image(host_path: str) -> str:
    """Where a host file goes in an image with /usr merged (/lib/x -> /usr/lib/x)."""
    parts = PurePosixPath(host_path).parts
    if len(parts) > 2 and parts[1] in MERGED_DIRECTORIES:
        return str(PurePosixPath("/usr", *parts[1:]))
    return host_path


def _merged_usr_links(entries: Iterable[Entry]) -> list[Entry]:
    used = {
        PurePosixPath(entry.path).parts[2] for entry in entries if PurePosixPath(entry.path).parts[1] == "usr"
    }
    return [Symlink(f"/{name}", f"usr/{name}") for name in MERGED_DIRECTORIES if name in used]


def _architecture() -> str:
    machine = platform.machine()
    if machine not in _ARCHITECTURES:
        raise ImageBuildError(f"no OCI architecture known for this machine ({machine})")
    return _ARCHITECTURES[machine]


def _builder_source() -> bytes:
    return Path(__file__).read_bytes() + Path(oci_archive.__file__).read_bytes()


def _key(*parts: bytes) -> str:
    return digest_of(_builder_source(), *parts)


def _spec_key(name: str, spec: ImageSpec) -> str:
    """The hash of the image `spec` describes: its files and how it starts."""
    runtime = repr((spec.entrypoint, spec.env, spec.user, spec.architecture)).encode()
    return _key(name.encode(), oci_archive.layer_tar(spec.entries), runtime)


def digest_of(*parts: bytes) -> str:
    """A hash of `parts`, each counted with its length (so no two lists of parts hash alike)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()


def images_dir() -> Path:
    return binaries.cache_root() / "images"


def _cached(name: str, key: str, make: Callable[[], tuple[ImageBlobs, tuple[str, ...]]]) -> ImageArchive:
    """The archive of image `name` for `key`, built by `make` (blobs and names) if missing."""

    def write(path: Path) -> None:
        blobs, names = make()
        path.write_bytes(oci_archive.layout_archive(blobs, names))

    path, _ = cached_archive(name, key, write)
    return archive_of(path)


def cached_archive(name: str, key: str, write: Callable[[Path], None]) -> tuple[Path, bool]:
    """The archive of image `name` for `key` under ``images_dir()``, and whether this call made it:
    when missing, `write` makes it at the path it is given, under the binaries' build lock (so
    `write` must not take that lock), and it is renamed into place once whole."""
    directory = images_dir()
    path = directory / f"{name}-{key[:32]}.tar"
    built = False
    if not path.is_file():
        with binaries._build_lock():
            if not path.is_file():  # another process may have built it while we waited
                _write_atomically(path, write)
                _prune(directory, name, keep=path)
                built = True
    os.utime(path)  # the most recently used are the ones _prune keeps
    return path, built


def archive_of(path: Path) -> ImageArchive:
    """The names and digests of the image archive at `path`."""
    summary = oci_archive.summarize_archive(path)
    return ImageArchive(
        ref=summary.names[0],
        archive=path,
        manifest_digest=summary.manifest_digest,
        config_digest=summary.config_digest,
        aliases=summary.names[1:],
    )


def _write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """What `write` writes at a temporary path beside `path`, renamed to `path` once it returns
    (readers never see a partial archive)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _prune(directory: Path, name: str, *, keep: Path) -> None:
    others = sorted(
        (path for path in directory.glob(f"{name}-*.tar") if path != keep),
        key=lambda path: path.stat().st_mtime,
        reverse=True,
    )
    for stale in others[KEEP_PER_IMAGE - 1 :]:
        stale.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hamipy.devcluster.images",
        description="Build (when stale) the dev cluster's image archives and print them.",
    )
    parser.add_argument(
        "--native-build", type=Path, default=Path("native/build"), help="native/'s build directory"
    )
    args = parser.parse_args(argv)
    try:
        images = ensure_images(args.native_build)
    except ImageBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for image in (images.pause, images.gpu_workload):
        names = " ".join((image.ref, *image.aliases))
        print(f"{image.archive} {image.manifest_digest} {names}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
