"""Build and cache the Kubernetes control-plane binaries the tests and `make up` run.

There is no Docker and no release download here, only the Go module proxy, so the Kubernetes
binaries (``KUBE_COMPONENTS``) are built from `k8s.io/kubernetes` through a small wrapper module that
replaces every `k8s.io/*` staging module (which the real go.mod points at `./staging/...`) with its
published `v0.x.y` release; ``fakecri`` (the kubelet's fake container runtime, our source) in the
same module. etcd is built the same way from
`go.etcd.io/etcd/server/v3`. Binaries are cached outside the clone, keyed by version, and binaries
already present (``KUBEBUILDER_ASSETS``, ``PATH``) are reused when their ``--version`` matches.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from hamipy.devcluster.errors import BinaryBuildError

KUBERNETES_VERSION = "v1.34.4"
ETCD_VERSION = "v3.6.5"
HELM_VERSION = "v3.22.0"
GO_PROXY_PROBE_TIMEOUT_S = 20.0

_STAGING_REPLACE = re.compile(r"^\s*(k8s\.io/[\w.-]+)\s*=>\s*\./staging/src/\S+\s*$", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class ControlPlaneBinaries:
    """Paths of the binaries a devcluster runs."""

    etcd: Path
    kube_apiserver: Path
    kube_scheduler: Path
    kube_controller_manager: Path
    kubelet: Path
    kube_proxy: Path
    """Services' virtual IPs on a node (run in the node's network namespace)."""
    kubectl: Path
    """For the user of `make up` (``.hamipy/kubectl``): the client of the cluster's own version."""
    fakecri: Path
    """The upstream CRI fake on a unix socket (``fakecri/main.go``): the kubelet's container runtime."""


KUBE_COMPONENTS: tuple[str, ...] = (
    "kube-apiserver",
    "kube-scheduler",
    "kube-controller-manager",
    "kubelet",
    "kube-proxy",
    "kubectl",
)
"""Built from ``k8s.io/kubernetes/cmd/<name>``, those missing in one ``go build`` (Go's build cache
keeps the packages they share, so adding one to a machine that has the others compiles only its own)."""


def cache_root() -> Path:
    """Where built binaries live: outside the clone, so fresh clones reuse them."""
    override = os.environ.get("HAMIPY_CACHE_DIR")
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "hamipy"


def _kube_minor(version: str) -> str:
    return "v0." + version.removeprefix("v1.")


def _run_version(binary: Path) -> str:
    try:
        # kubectl has no --version flag: "Client Version: v1.34.4".
        args = ["version", "--client"] if binary.name == "kubectl" else ["--version"]
        proc = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=30, check=False)
    except OSError:
        return ""
    return proc.stdout + proc.stderr


def version_matches(binary: Path, want: str) -> bool:
    """True if `binary --version` names exactly the release `want` (e.g. ``v1.34.4`` or ``v3.6.5``)."""
    if not binary.is_file() or not os.access(binary, os.X_OK):
        return False
    out = _run_version(binary)
    bare = want.removeprefix("v")
    # kube: "Kubernetes v1.34.4"; etcd: "etcd Version: 3.6.5"
    return re.search(rf"(?<![\w.])v?{re.escape(bare)}(?![\w.])", out) is not None


def _candidates(name: str) -> list[Path]:
    found: list[Path] = []
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets:
        found.append(Path(assets) / name)
    on_path = shutil.which(name)
    if on_path:
        found.append(Path(on_path))
    return found


def _find_existing(name: str, version: str, cached: Path) -> Path | None:
    for path in [*_candidates(name), cached]:
        if version_matches(path, version):
            return path
    return None


def _elapsed(began: float) -> str:
    minutes, seconds = divmod(int(time.monotonic() - began), 60)
    return f"{minutes}m{seconds:02d}s"


def _progress(msg: str) -> None:
    print(f"[devcluster] {msg}", file=sys.stderr, flush=True)


def check_proxy() -> None:
    """Fail early, with a clear message, when the Go module proxy is unreachable."""
    proxy = os.environ.get("GOPROXY", "https://proxy.golang.org").split(",")[0].split("|")[0]
    if proxy in ("off", "direct") or not proxy.startswith("http"):
        return
    url = f"{proxy.rstrip('/')}/k8s.io/kubernetes/@v/{KUBERNETES_VERSION}.info"
    try:
        with urllib.request.urlopen(url, timeout=GO_PROXY_PROBE_TIMEOUT_S) as resp:
            resp.read()
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise BinaryBuildError(
            f"cannot reach the Go module proxy at {proxy} ({exc}); the control-plane binaries are "
            "built from it on first use. Set GOPROXY to a reachable proxy, or point "
            f"KUBEBUILDER_ASSETS at a directory holding etcd, {', '.join(KUBE_COMPONENTS)} "
            f"({KUBERNETES_VERSION}, etcd {ETCD_VERSION})."
        ) from exc


def _go(args: list[str], *, cwd: Path, env: dict[str, str], what: str) -> None:
    """Run a go command, streaming a compact progress line per 25 packages compiled."""
    _progress(f"{what}: go {' '.join(args)}")
    tail: collections.deque[str] = collections.deque(maxlen=40)
    with subprocess.Popen(
        ["go", *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:  # closes the pipe
        assert proc.stdout is not None
        for count, raw in enumerate(proc.stdout, start=1):
            line = raw.rstrip()
            tail.append(line)
            if count % 25 == 0:
                _progress(f"{what}: {count} steps ({line[:90]})")
    if proc.returncode != 0:
        raise BinaryBuildError(f"{what} failed (go {' '.join(args)}):\n" + "\n".join(tail))


def _go_env(workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("GOFLAGS", "-mod=mod")
    env["CGO_ENABLED"] = "0"
    env["GOWORK"] = "off"
    env.setdefault("GOTOOLCHAIN", "local")
    return env


def _kube_ldflags(version: str) -> str:
    major, minor = version.removeprefix("v").split(".")[:2]
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    flags = []
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {pkg}.gitVersion={version}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
            f"-X {pkg}.buildDate={now}",
        ]
    return "-s -w " + " ".join(flags)


def _staging_modules(kubernetes_gomod: str) -> list[str]:
    mods = _STAGING_REPLACE.findall(kubernetes_gomod)
    if not mods:
        raise BinaryBuildError("no staging replace directives found in k8s.io/kubernetes go.mod")
    return sorted(set(mods))


def _kube_module(version: str = KUBERNETES_VERSION) -> Path:
    """The wrapper module that builds from `k8s.io/kubernetes` at `version` (set up once)."""
    work = cache_root() / "build" / f"kubernetes-{version}"
    work.mkdir(parents=True, exist_ok=True)
    env = _go_env(work)
    (work / "go.mod").write_text("module hamipy.local/kubebuild\n\ngo 1.24\n")
    _go(
        ["mod", "download", "-json", f"k8s.io/kubernetes@{version}"],
        cwd=work,
        env=env,
        what="download k8s.io/kubernetes",
    )
    info = subprocess.run(
        ["go", "mod", "download", "-json", f"k8s.io/kubernetes@{version}"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    gomod = Path(json.loads(info.stdout)["GoMod"]).read_text()
    staging = _staging_modules(gomod)
    lines = ["module hamipy.local/kubebuild", "", "go 1.24", "", f"require k8s.io/kubernetes {version}", ""]
    lines += ["replace ("] + [f"\t{m} => {m} {_kube_minor(version)}" for m in staging] + [")", ""]
    (work / "go.mod").write_text("\n".join(lines))
    (work / "go.sum").unlink(missing_ok=True)
    return work


def build_kubernetes(
    dest: Path, version: str = KUBERNETES_VERSION, *, names: Sequence[str] = KUBE_COMPONENTS
) -> None:
    """Build `names` (of ``KUBE_COMPONENTS``) at `version` into `dest`."""
    work = _kube_module(version)
    env = _go_env(work)
    tmp = Path(tempfile.mkdtemp(prefix="kubebin-", dir=work))
    _go(
        [
            "build",
            "-v",
            "-trimpath",
            "-ldflags",
            _kube_ldflags(version),
            "-o",
            str(tmp) + "/",
            *(f"k8s.io/kubernetes/cmd/{name}" for name in names),
        ],
        cwd=work,
        env=env,
        what=f"build kubernetes {version}",
    )
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        os.replace(tmp / name, dest / name)
    shutil.rmtree(tmp, ignore_errors=True)


FAKECRI_SOURCE = Path(__file__).with_name("fakecri") / "main.go"


def _fakecri_stamp() -> str:
    return hashlib.sha256(FAKECRI_SOURCE.read_bytes()).hexdigest()


def _fakecri_built(dest: Path) -> Path | None:
    """The cached fake runtime, if it was built from the current source."""
    binary, stamp = dest / "fakecri", dest / "fakecri.sha256"
    if binary.is_file() and stamp.is_file() and stamp.read_text().strip() == _fakecri_stamp():
        return binary
    return None


def build_fakecri(dest: Path, version: str = KUBERNETES_VERSION) -> None:
    """Build ``fakecri/main.go`` in the Kubernetes wrapper module (it imports k8s.io/cri-client's
    fake, at `version`'s release) into `dest`."""
    work = _kube_module(version)
    _place_fakecri(work, FAKECRI_SOURCE)
    tmp = Path(tempfile.mkdtemp(prefix="fakecri-", dir=work))
    _go(
        ["build", "-v", "-trimpath", "-ldflags", "-s -w", "-o", str(tmp / "fakecri"), "./cmd/fakecri"],
        cwd=work,
        env=_go_env(work),
        what="build fakecri",
    )
    dest.mkdir(parents=True, exist_ok=True)
    os.replace(tmp / "fakecri", dest / "fakecri")
    (dest / "fakecri.sha256").write_text(_fakecri_stamp() + "\n")
    shutil.rmtree(tmp, ignore_errors=True)


def run_fakecri_go_tests(version: str = KUBERNETES_VERSION) -> None:
    """Run ``fakecri/main_test.go`` (``go test``) in the Kubernetes wrapper module, under the build
    lock; ``BinaryBuildError`` with Go's output when a test fails."""
    with _build_lock():
        work = _kube_module(version)
        _place_fakecri(work, FAKECRI_SOURCE, FAKECRI_SOURCE.with_name("main_test.go"))
        _go(["test", "-count=1", "./cmd/fakecri"], cwd=work, env=_go_env(work), what="test fakecri")


def _place_fakecri(work: Path, *sources: Path) -> None:
    """Copy ``sources`` into the wrapper module's ``cmd/fakecri`` package."""
    package = work / "cmd" / "fakecri"
    package.mkdir(parents=True, exist_ok=True)
    for source in sources:
        shutil.copyfile(source, package / source.name)


def build_etcd(dest: Path, version: str = ETCD_VERSION) -> None:
    """Build etcd at `version` into `dest`."""
    work = cache_root() / "build" / f"etcd-{version}"
    work.mkdir(parents=True, exist_ok=True)
    env = _go_env(work)
    (work / "go.mod").write_text(
        f"module hamipy.local/etcdbuild\n\ngo 1.24\n\nrequire go.etcd.io/etcd/server/v3 {version}\n"
    )
    (work / "go.sum").unlink(missing_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="etcdbin-", dir=work))
    _go(
        [
            "build",
            "-v",
            "-trimpath",
            "-ldflags",
            "-s -w",
            "-o",
            str(tmp / "etcd"),
            "go.etcd.io/etcd/server/v3",
        ],
        cwd=work,
        env=env,
        what=f"build etcd {version}",
    )
    dest.mkdir(parents=True, exist_ok=True)
    os.replace(tmp / "etcd", dest / "etcd")
    shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _build_lock() -> Iterator[None]:
    """One build per machine at a time (pytest and `make up` may both ask on a fresh machine)."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with (root / "build.lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _progress(f"another process is building the binaries; waiting for its lock {root / 'build.lock'}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _verified(path: Path, want: str) -> Path:
    if not version_matches(path, want):
        raise BinaryBuildError(f"{path} does not report version {want}: {_run_version(path)[:200]!r}")
    return path


def ensure_binaries() -> ControlPlaneBinaries:
    """Return the binaries, building (once per machine) whatever is missing."""
    kube_dir = cache_root() / "bin" / f"kubernetes-{KUBERNETES_VERSION}"
    etcd_dir = cache_root() / "bin" / f"etcd-{ETCD_VERSION}"

    def find() -> tuple[Path | None, dict[str, Path | None]]:
        return (
            _find_existing("etcd", ETCD_VERSION, etcd_dir / "etcd"),
            {name: _find_existing(name, KUBERNETES_VERSION, kube_dir / name) for name in KUBE_COMPONENTS},
        )

    def found(etcd: Path, kube: dict[str, Path], fakecri: Path) -> ControlPlaneBinaries:
        return ControlPlaneBinaries(
            etcd=etcd,
            kube_apiserver=kube["kube-apiserver"],
            kube_scheduler=kube["kube-scheduler"],
            kube_controller_manager=kube["kube-controller-manager"],
            kubelet=kube["kubelet"],
            kube_proxy=kube["kube-proxy"],
            kubectl=kube["kubectl"],
            fakecri=fakecri,
        )

    etcd, kube = find()
    fakecri = _fakecri_built(kube_dir)
    if etcd is not None and all(kube.values()) and fakecri is not None:
        return found(etcd, {name: path for name, path in kube.items() if path is not None}, fakecri)
    if shutil.which("go") is None:
        raise BinaryBuildError(
            "Go is not installed and no matching control-plane binaries were found (cache "
            f"{cache_root() / 'bin'}, KUBEBUILDER_ASSETS, PATH); install Go or point KUBEBUILDER_ASSETS "
            f"at etcd {ETCD_VERSION} and {', '.join(KUBE_COMPONENTS)} {KUBERNETES_VERSION}"
        )
    with _build_lock():
        etcd, kube = find()  # another process may have built them while we waited
        fakecri = _fakecri_built(kube_dir)
        if etcd is None or not all(kube.values()) or fakecri is None:
            check_proxy()
        if etcd is None:
            _progress(f"building etcd {ETCD_VERSION} into {etcd_dir} (first run on this machine only)")
            began = time.monotonic()
            build_etcd(etcd_dir)
            _progress(f"built etcd {ETCD_VERSION} in {_elapsed(began)}")
            etcd = _verified(etcd_dir / "etcd", ETCD_VERSION)
        missing = [name for name, path in kube.items() if path is None]
        if missing:
            _progress(
                f"building {', '.join(missing)} {KUBERNETES_VERSION} into {kube_dir} "
                "(first run on this machine only; about 8 minutes on 2 cores when all are missing)"
            )
            began = time.monotonic()
            build_kubernetes(kube_dir, names=missing)
            _progress(f"built {', '.join(missing)} {KUBERNETES_VERSION} in {_elapsed(began)}")
            kube |= {name: _verified(kube_dir / name, KUBERNETES_VERSION) for name in missing}
        if fakecri is None:
            began = time.monotonic()
            build_fakecri(kube_dir)
            _progress(f"built the fake container runtime in {_elapsed(began)}")
            fakecri = kube_dir / "fakecri"
    return found(etcd, {name: path for name, path in kube.items() if path is not None}, fakecri)


def _helm_version_matches(helm: Path, want: str = HELM_VERSION) -> bool:
    if not helm.is_file() or not os.access(helm, os.X_OK):
        return False
    try:
        out = subprocess.run(
            [str(helm), "version", "--short"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except OSError:
        return False
    # "v3.22.0+g<commit>" or "v3.22.0"
    return out.strip().split("+")[0] == want


def _go_install(what: str, packages: list[str], dest: Path, *, ldflags: str, tags: str = "") -> None:
    """``go install`` module-versioned ``packages`` (no replace directives needed) into ``dest``,
    through a temporary GOBIN so that ``dest`` never holds half a build. Hold the build lock."""
    check_proxy()
    began = time.monotonic()
    _progress(f"building {what} into {dest} (first run on this machine only)")
    tmp = Path(tempfile.mkdtemp(prefix="gobin-", dir=cache_root()))
    env = _go_env(tmp)
    env["GOBIN"] = str(tmp)
    env["GOFLAGS"] = "-mod=mod -trimpath"
    _go(
        ["install", "-v", *(["-tags", tags] if tags else []), "-ldflags", ldflags, *packages],
        cwd=tmp,
        env=env,
        what=f"build {what}",
    )
    dest.mkdir(parents=True, exist_ok=True)
    for built in tmp.iterdir():
        os.replace(built, dest / built.name)
    shutil.rmtree(tmp, ignore_errors=True)
    _progress(f"built {what} in {_elapsed(began)}")


def ensure_helm() -> Path:
    """Return a helm binary at HELM_VERSION (for rendering the chart), building it once per machine
    from the Go module proxy (helm's module has no replace directives, so `go install` works)."""
    cached = cache_root() / "bin" / f"helm-{HELM_VERSION}" / "helm"
    on_path = shutil.which("helm")
    for path in ([Path(on_path)] if on_path else []) + [cached]:
        if _helm_version_matches(path):
            return path
    if shutil.which("go") is None:
        raise BinaryBuildError(
            f"Go is not installed and no helm {HELM_VERSION} was found on PATH or in {cached}"
        )
    with _build_lock():
        if _helm_version_matches(cached):
            return cached
        ldflags = f"-s -w -X helm.sh/helm/v3/internal/version.version={HELM_VERSION}"
        _go_install(
            f"helm {HELM_VERSION}",
            [f"helm.sh/helm/v3/cmd/helm@{HELM_VERSION}"],
            cached.parent,
            ldflags=ldflags,
        )
    if not _helm_version_matches(cached):
        raise BinaryBuildError(f"{cached} does not report helm {HELM_VERSION}")
    return cached


CONTAINERD_VERSION = "v2.2.9"
CONTAINERD_COMMANDS: tuple[str, ...] = ("containerd", "containerd-shim-runc-v2", "ctr")
"""Built from ``github.com/containerd/containerd/v2/cmd/<name>``: the daemon, the runc shim it
starts for each pod (found on its PATH) and the client that imports the images made here."""


def _containerd_built(dest: Path) -> bool:
    binary = dest / "containerd"
    return all((dest / name).is_file() for name in CONTAINERD_COMMANDS) and version_matches(
        binary, CONTAINERD_VERSION
    )


def ensure_containerd() -> Path:
    """The directory holding ``CONTAINERD_COMMANDS`` at ``CONTAINERD_VERSION``, built once per
    machine from the Go module proxy (about 2 minutes on 2 cores). Pure Go (``CGO_ENABLED=0``, no
    btrfs, zfs or devmapper snapshotters): the nodes use overlayfs."""
    dest = cache_root() / "bin" / f"containerd-{CONTAINERD_VERSION}"
    if _containerd_built(dest):
        return dest
    if shutil.which("go") is None:
        raise BinaryBuildError(
            f"Go is not installed and no containerd {CONTAINERD_VERSION} was found in {dest}"
        )
    with _build_lock():
        if _containerd_built(dest):
            return dest
        module = "github.com/containerd/containerd/v2"
        _go_install(
            f"containerd {CONTAINERD_VERSION}",
            [f"{module}/cmd/{name}@{CONTAINERD_VERSION}" for name in CONTAINERD_COMMANDS],
            dest,
            ldflags=f"-s -w -X {module}/version.Version={CONTAINERD_VERSION}",
            tags="no_btrfs no_zfs no_devmapper",
        )
    if not _containerd_built(dest):
        raise BinaryBuildError(f"{dest / 'containerd'} does not report containerd {CONTAINERD_VERSION}")
    return dest


COREDNS_VERSION = "v1.14.7"
COREDNS_MODULE = "github.com/coredns/coredns"


def ensure_coredns() -> Path:
    """The ``coredns`` binary at ``COREDNS_VERSION`` (the dev cluster's DNS server, run in a pod from
    ``images.ensure_coredns_image``), built once per machine from the Go module proxy. Pure Go and
    static (``CGO_ENABLED=0``), as the image holds nothing else; its version is compiled in
    (``coremain.CoreVersion``), so ``coredns -version`` prints ``CoreDNS-1.14.7``."""
    binary = cache_root() / "bin" / f"coredns-{COREDNS_VERSION}" / "coredns"
    if version_matches(binary, COREDNS_VERSION):
        return binary
    if shutil.which("go") is None:
        raise BinaryBuildError(f"Go is not installed and no coredns {COREDNS_VERSION} was found at {binary}")
    with _build_lock():
        if version_matches(binary, COREDNS_VERSION):
            return binary
        _go_install(
            f"coredns {COREDNS_VERSION}",
            [f"{COREDNS_MODULE}@{COREDNS_VERSION}"],
            binary.parent,
            ldflags="-s -w",
        )
    return _verified(binary, COREDNS_VERSION)


PROMETHEUS_VERSION = "v3.16.0"
PROMETHEUS_COMMANDS: tuple[str, ...] = ("prometheus", "promtool")
PROMETHEUS_TAGS = "remove_all_sd,enable_kubernetes_sd"
"""Of the service discovery mechanisms, Kubernetes' only (file and HTTP are always built in): the
tests discover the chart's ServiceMonitors' targets with it, and the cloud SDKs of the others would
about double the build."""


def _prometheus_module_version(version: str) -> str:
    """Prometheus's Go module numbers release vX.Y.Z as v0.XYY.Z (v3.16.0 is v0.316.0)."""
    major, minor, patch = version.removeprefix("v").split(".")
    return f"v0.{major}{int(minor):02d}.{patch}"


def prometheus_built(dest: Path) -> bool:
    """Whether `dest` holds ``PROMETHEUS_COMMANDS`` at ``PROMETHEUS_VERSION``."""
    return all(version_matches(dest / name, PROMETHEUS_VERSION) for name in PROMETHEUS_COMMANDS)


def ensure_prometheus_build() -> Path:
    """The directory holding ``prometheus`` and ``promtool`` at ``PROMETHEUS_VERSION``, built once
    per machine from the Go module proxy with ``PROMETHEUS_TAGS`` (no web UI: the API is what the
    tests use). Debian's package cannot serve: it is built without Kubernetes service discovery."""
    dest = cache_root() / "bin" / f"prometheus-{PROMETHEUS_VERSION}"
    if prometheus_built(dest):
        return dest
    if shutil.which("go") is None:
        raise BinaryBuildError(
            f"Go is not installed and no Prometheus {PROMETHEUS_VERSION} was found in {dest}"
        )
    with _build_lock():
        if prometheus_built(dest):
            return dest
        module = _prometheus_module_version(PROMETHEUS_VERSION)
        release = PROMETHEUS_VERSION.removeprefix("v")
        _go_install(
            f"prometheus and promtool {PROMETHEUS_VERSION}",
            [f"github.com/prometheus/prometheus/cmd/{name}@{module}" for name in PROMETHEUS_COMMANDS],
            dest,
            ldflags=f"-s -w -X github.com/prometheus/common/version.Version={release}",
            tags=PROMETHEUS_TAGS,
        )
    if not prometheus_built(dest):
        raise BinaryBuildError(f"{dest} does not hold prometheus and promtool reporting {PROMETHEUS_VERSION}")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hamipy-devcluster-binaries",
        description="Build (once) and print the cached control-plane binaries.",
    )
    parser.parse_args(argv)
    try:
        bins = ensure_binaries()
        helm = ensure_helm()
        prometheus = ensure_prometheus_build()
    except BinaryBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for field in dataclasses.fields(bins):
        print(f"{field.name}={getattr(bins, field.name)}")
    print(f"helm={helm}")
    print(f"prometheus={prometheus}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
