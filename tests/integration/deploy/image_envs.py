"""Each service's image environment, built here exactly as its Dockerfile builds it.

``deploy/docker/<service>.Dockerfile`` is read, not copied: the build stage's ``ENV UV_*`` settings,
its ``WORKDIR`` and ``COPY`` lines and its ``RUN uv sync ...`` line, and the final stage's
``ENTRYPOINT``/``CMD``. The build context those ``COPY`` lines take (``.dockerignore`` applied) is
copied into a fresh temporary directory, and the same ``uv sync`` runs there with
``UV_PROJECT_ENVIRONMENT`` pointing at a directory of ours instead of ``/opt/hamipy`` (and
``UV_PYTHON`` at this machine's Python 3.11, the image's only interpreter). A fresh copy each time
also keeps uv from reusing a wheel of our own packages built from an older tree (uv keys those by
path and ``pyproject.toml`` mtime).

Built environments are cached outside the clone, under ``<cache_root()>/image-envs/``, keyed by a
hash of the Dockerfile, ``.dockerignore``, every file the build context holds (``pyproject.toml``,
``uv.lock``, ``libs/``, ``services/``; no ``__pycache__``), the uv version and the interpreter: an
unchanged tree reuses its environment, any change builds a new one. A per-service lock file keeps
parallel test sessions from building the same environment twice or reading a half-built one; an
entry counts only once its ``build.json`` is written, last. The three most recently used entries of
each service are kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, Final

from hamipy.devcluster.binaries import cache_root
from hamipy.devcluster.dockerfiles import DockerIgnore, instructions

ROOT: Final = Path(__file__).resolve().parents[3]
DOCKER_DIR: Final = ROOT / "deploy" / "docker"
NATIVE_BUILD: Final = ROOT / "native" / "build"
SERVICES: Final = ("webhook", "extender", "device-plugin", "monitor")
UV_SYNC_TIMEOUT_S: Final = 600.0
KEEP_PER_SERVICE: Final = 3
# uv settings of the caller that only say where packages come from (an index, a proxy's
# certificates, the cache); every other UV_* of the caller is dropped so only the Dockerfile's apply.
_UV_PASSTHROUGH: Final = frozenset(
    {
        "UV_CACHE_DIR",
        "UV_INDEX",
        "UV_INDEX_URL",
        "UV_DEFAULT_INDEX",
        "UV_EXTRA_INDEX_URL",
        "UV_NATIVE_TLS",
        "UV_OFFLINE",
        "UV_HTTP_TIMEOUT",
        "UV_INSECURE_HOST",
        "UV_KEYRING_PROVIDER",
    }
)
_SYSTEM_PATH: Final = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
_ENV_LEAKS: Final = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE")


class ImageEnvError(Exception):
    """The Dockerfile says something this reproduction cannot do, or the build failed."""


# -- the Dockerfile ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Stage:
    """One ``FROM`` stage: what the reproduction needs of it."""

    name: str
    workdir: str = "/"
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    copies: list[tuple[list[str], list[str], str]] = dataclasses.field(default_factory=list)
    """``(options, sources, destination)`` of each ``COPY``."""
    runs: list[str] = dataclasses.field(default_factory=list)
    entrypoint: list[str] = dataclasses.field(default_factory=list)
    cmd: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class DockerBuild:
    """What one Dockerfile does that matters to the Python environment it ships."""

    service: str
    dockerfile: Path
    uv_env: Mapping[str, str]
    """The build stage's ``ENV UV_*`` settings, as written."""
    workdir: str
    copies: tuple[tuple[tuple[str, ...], str], ...]
    """``(sources, destination)`` of each build-context ``COPY`` of the build stage."""
    sync_argv: tuple[str, ...]
    """The ``RUN uv sync ...`` command, split."""
    uv_pin: str | None
    """The uv version the build stage installs (``uv==X``), if it pins one."""
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    stage_files: Mapping[str, str]
    """Image path -> checkout-relative path of each file the final stage copies from another stage
    (``COPY --from=native /src/native/build/libvgpu.so /opt/hamipy/lib/libvgpu.so`` ->
    ``native/build/libvgpu.so``: ``make native`` builds the same file here)."""

    @property
    def package(self) -> str:
        argv = list(self.sync_argv)
        if "--package" not in argv:
            raise ImageEnvError(f"{self.dockerfile}: `uv sync` names no --package")
        return argv[argv.index("--package") + 1]

    @property
    def project_environment(self) -> str:
        try:
            return self.uv_env["UV_PROJECT_ENVIRONMENT"]
        except KeyError:
            raise ImageEnvError(f"{self.dockerfile}: no UV_PROJECT_ENVIRONMENT in its build stage") from None


def _exec_form(args: str, where: str) -> list[str]:
    if args.startswith("["):
        value = json.loads(args)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ImageEnvError(f"{where}: not a JSON list of strings: {args}")
        return value
    return ["/bin/sh", "-c", args]


def _env_pairs(args: str) -> dict[str, str]:
    words = shlex.split(args)
    if words and "=" not in words[0]:  # the legacy `ENV KEY value with spaces` form
        return {words[0]: " ".join(words[1:])}
    pairs = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep:
            raise ImageEnvError(f"ENV {args}: {word!r} is not KEY=value")
        pairs[key] = value
    return pairs


def parse_stages(text: str, where: str) -> list[Stage]:
    """The stages of a Dockerfile, with the instructions the reproduction reads."""
    stages: list[Stage] = []
    for keyword, args in instructions(text):
        if keyword == "FROM":
            words = args.split()
            name = words[2] if len(words) >= 3 and words[1].lower() == "as" else str(len(stages))
            stages.append(Stage(name=name))
            continue
        if keyword in ("ARG", "EXPOSE", "LABEL", "USER", "SHELL", "STOPSIGNAL", "HEALTHCHECK", "VOLUME"):
            continue
        if not stages:
            raise ImageEnvError(f"{where}: {keyword} before any FROM")
        stage = stages[-1]
        if keyword == "WORKDIR":
            stage.workdir = str(PurePosixPath(stage.workdir) / args)
        elif keyword == "ENV":
            stage.env.update(_env_pairs(args))
        elif keyword in ("COPY", "ADD"):
            if keyword == "ADD":
                raise ImageEnvError(f"{where}: ADD is not reproduced here; use COPY")
            words = _exec_form(args, where) if args.startswith("[") else shlex.split(args)
            options = [w for w in words if w.startswith("--")]
            paths = [w for w in words if not w.startswith("--")]
            stage.copies.append((options, paths[:-1], paths[-1]))
        elif keyword == "RUN":
            stage.runs.append(args)
        elif keyword == "ENTRYPOINT":
            stage.entrypoint = _exec_form(args, where)
        elif keyword == "CMD":
            stage.cmd = _exec_form(args, where)
        else:
            raise ImageEnvError(f"{where}: instruction {keyword} is not understood by this reproduction")
    return stages


def read_dockerfile(service: str, dockerfile: Path | None = None) -> DockerBuild:
    """Parse ``deploy/docker/<service>.Dockerfile``."""
    path = dockerfile or DOCKER_DIR / f"{service}.Dockerfile"
    stages = parse_stages(path.read_text(), str(path))
    builders = [s for s in stages if any(shlex.split(r)[:2] == ["uv", "sync"] for r in s.runs)]
    if len(builders) != 1:
        raise ImageEnvError(f"{path}: expected one stage that runs `uv sync`, found {len(builders)}")
    build = builders[0]
    (sync,) = [r for r in build.runs if shlex.split(r)[:2] == ["uv", "sync"]]
    argv = shlex.split(sync)
    if any(w in ("&&", "||", ";", "|") or w.endswith(";") for w in argv):
        raise ImageEnvError(f"{path}: `RUN {sync}` is more than one command; keep `uv sync` on its own")
    pin = None
    for run in build.runs:
        found = re.search(r"\buv==([\w.+-]+)", run)
        if found:
            pin = found.group(1)
    copies = []
    for options, sources, dest in build.copies:
        if any(o.startswith("--from") for o in options):
            continue
        if any(ch in s for s in sources for ch in "*?["):
            raise ImageEnvError(f"{path}: COPY with wildcards ({sources}) is not reproduced here")
        copies.append((tuple(sources), dest))
    final = stages[-1]
    stage_files = {}
    for options, sources, dest in final.copies:
        origin = next((o.split("=", 1)[1] for o in options if o.startswith("--from=")), None)
        if origin is None:
            continue
        if origin == build.name:
            continue  # the environment itself (COPY --from=build /opt/hamipy /opt/hamipy)
        source_stage = next((s for s in stages if s.name == origin), None)
        workdir = PurePosixPath(source_stage.workdir if source_stage else "/")
        for source in sources:
            if not PurePosixPath(source).is_relative_to(workdir):
                raise ImageEnvError(f"{path}: COPY --from={origin} {source}: not under that stage's WORKDIR")
            relative = PurePosixPath(source).relative_to(workdir)
            target = PurePosixPath(dest) / relative.name if dest.endswith("/") else PurePosixPath(dest)
            stage_files[str(target)] = str(relative)
    return DockerBuild(
        service=service,
        dockerfile=path,
        uv_env={k: v for k, v in build.env.items() if k.startswith("UV_")},
        workdir=build.workdir,
        copies=tuple(copies),
        sync_argv=tuple(argv),
        uv_pin=pin,
        entrypoint=tuple(final.entrypoint),
        cmd=tuple(final.cmd),
        stage_files=stage_files,
    )


# -- the build context ------------------------------------------------------------------------------


def context_files(build: DockerBuild, root: Path = ROOT) -> list[tuple[Path, str]]:
    """``(source in the checkout, path relative to WORKDIR in the image)`` of every file the build
    stage's ``COPY`` lines take, ``.dockerignore`` and ``__pycache__`` left out, sorted."""
    ignore = DockerIgnore.of(root)
    files: dict[str, Path] = {}
    for sources, dest in build.copies:
        for source in sources:
            src = (root / source).resolve()
            if not src.is_relative_to(root):
                raise ImageEnvError(f"{build.dockerfile}: COPY {source} leaves the build context")
            rel_src = src.relative_to(root).as_posix()
            if src.is_dir():
                for dirpath, dirnames, filenames in os.walk(src):
                    dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
                    for filename in filenames:
                        path = Path(dirpath) / filename
                        rel = path.relative_to(root).as_posix()
                        if ignore.excluded(rel) or path.is_symlink() or not path.is_file():
                            continue
                        under = path.relative_to(src).as_posix()
                        files[str(PurePosixPath(dest) / under)] = path
            elif src.is_file():
                if ignore.excluded(rel_src):
                    raise ImageEnvError(f"{build.dockerfile}: COPY {source} names a file .dockerignore drops")
                target = PurePosixPath(dest) / src.name if dest.endswith("/") else PurePosixPath(dest)
                files[str(target)] = src
            else:
                raise ImageEnvError(f"{build.dockerfile}: COPY {source}: no such file in the checkout")
    return sorted(((path, os.path.normpath(rel)) for rel, path in files.items()), key=lambda item: item[1])


def copy_context(files: Sequence[tuple[Path, str]], dest: Path) -> str:
    """Copy the context files under ``dest`` and return the hash of what was copied (paths, contents
    and executable bits, read from the copies, so the key is the content that is built)."""
    digest = hashlib.sha256()
    for source, rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        mode = source.stat().st_mode
        executable = bool(mode & stat.S_IXUSR)
        if executable:
            target.chmod(0o755)
        digest.update(rel.encode() + b"\0" + (b"x" if executable else b"-") + b"\0")
        digest.update(hashlib.sha256(target.read_bytes()).digest())
    return digest.hexdigest()


# -- the tools --------------------------------------------------------------------------------------


def uv_binary() -> Path:
    """The uv the Makefile uses: ``uv`` on PATH, else the one ``make`` installs in ``.hamipy/tools``."""
    found = shutil.which("uv")
    if found:
        return Path(found)
    local = ROOT / ".hamipy" / "tools" / "bin" / "uv"
    if local.is_file():
        return local
    raise ImageEnvError("uv not found on PATH nor in .hamipy/tools/bin (run `make sync`)")


def uv_version(uv: Path) -> str:
    out = subprocess.run([str(uv), "--version"], capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.split()[1]


def base_python() -> Path:
    """This machine's CPython 3.11 (the interpreter under the test's virtualenv)."""
    v = sys.version_info
    path = Path(sys.base_prefix) / "bin" / f"python{v.major}.{v.minor}"
    if not path.is_file():
        raise ImageEnvError(f"no base interpreter at {path}")
    return path


def makefile_uv_version() -> str:
    found = re.search(r"^UV_VERSION\s*:?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    if found is None:
        raise ImageEnvError("Makefile sets no UV_VERSION")
    return found.group(1)


# -- the cached environment -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ImageEnv:
    """A built environment: ``path`` stands for the image's ``/opt/hamipy``."""

    build: DockerBuild
    path: Path
    key: str
    build_s: float | None
    """Seconds `uv sync` took, when this call built it; None when it was reused from the cache."""
    prepare_s: float
    """Seconds to copy and hash the context and take the lock (the whole cost of a warm run)."""

    @property
    def bin(self) -> Path:
        return self.path / "bin"

    @property
    def python(self) -> Path:
        return self.bin / "python"

    def script(self, name: str) -> Path:
        return self.bin / name

    def image_path(self, arg: str) -> str:
        """An argument of the image's ENTRYPOINT with its paths made local: files copied from another
        stage come from the checkout, the rest of ``UV_PROJECT_ENVIRONMENT`` is this environment."""
        if arg in self.build.stage_files:
            return str(ROOT / self.build.stage_files[arg])
        prefix = self.build.project_environment.rstrip("/")
        if arg == prefix or arg.startswith(prefix + "/"):
            return str(self.path) + arg[len(prefix) :]
        return arg

    def command(self, *args: str) -> list[str]:
        """``ENTRYPOINT + CMD`` of the image (CMD replaced when ``args`` are given, as
        ``docker run IMAGE ARGS`` does), its first word resolved to this environment's script."""
        argv = [*self.build.entrypoint, *(args if args else self.build.cmd)]
        if not argv:
            raise ImageEnvError(f"{self.build.dockerfile}: no ENTRYPOINT or CMD")
        first = argv[0] if "/" in argv[0] else str(self.script(argv[0]))
        return [first, *(self.image_path(a) for a in argv[1:])]

    def clean_environ(self, home: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """An environment like the image's: this environment's bin first on a system PATH (no
        workspace .venv, no pyenv shims), no PYTHONPATH, HOME in a scratch directory (so no user
        site-packages and no ~/.kube), unbuffered output."""
        return {
            "PATH": os.pathsep.join([str(self.bin), *_SYSTEM_PATH]),
            "HOME": str(home),
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            **(extra or {}),
        }


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cache_dir() -> Path:
    return cache_root() / "image-envs"


def _prune(service: str, keep: Path) -> None:
    """Remove all but the most recently used entries of `service` (the lock is held)."""
    entries = []
    for entry in cache_dir().glob(f"{service}-*"):
        marker = entry / "build.json"
        if entry == keep or not entry.is_dir():
            continue
        entries.append((marker.stat().st_mtime if marker.exists() else 0.0, entry))
    for _, entry in sorted(entries, reverse=True)[KEEP_PER_SERVICE - 1 :]:
        shutil.rmtree(entry, ignore_errors=True)


def sync_environ(build: DockerBuild, env_dir: Path, python: Path) -> dict[str, str]:
    """The environment of `uv sync`: the caller's, less every UV_* but where packages come from,
    plus the Dockerfile's UV_* with the project environment moved to `env_dir`."""
    environ = {
        k: v
        for k, v in os.environ.items()
        if (not k.startswith("UV_") or k in _UV_PASSTHROUGH) and k not in _ENV_LEAKS
    }
    for key, value in build.uv_env.items():
        if "$" in value:
            raise ImageEnvError(f"{build.dockerfile}: ENV {key}={value}: variables are not expanded here")
    environ.update(build.uv_env)
    environ["UV_PROJECT_ENVIRONMENT"] = str(env_dir)
    environ["UV_PYTHON"] = str(python)
    return environ


def ensure_image_env(service: str, *, dockerfile: Path | None = None, root: Path = ROOT) -> ImageEnv:
    """The environment of `service`'s image, built now if no cached one matches the tree."""
    started = time.monotonic()
    build = read_dockerfile(service, dockerfile)
    uv = uv_binary()
    python = base_python()
    with tempfile.TemporaryDirectory(prefix=f"hamipy-image-{service}-") as tmp:
        workdir = Path(tmp) / build.workdir.lstrip("/")
        context = copy_context(context_files(build, root), workdir)
        digest = hashlib.sha256()
        for part in (
            build.dockerfile.read_bytes(),
            (root / ".dockerignore").read_bytes() if (root / ".dockerignore").is_file() else b"",
            context.encode(),
            uv_version(uv).encode(),
            f"{python}:{sys.version}".encode(),
        ):
            digest.update(hashlib.sha256(part).digest())
        key = digest.hexdigest()[:20]
        entry = cache_dir() / f"{service}-{key}"
        marker = entry / "build.json"
        with _locked(cache_dir() / f"{service}.lock"):
            if marker.is_file():
                os.utime(marker)
                return ImageEnv(build, entry / "env", key, None, time.monotonic() - started)
            prepare_s = time.monotonic() - started
            shutil.rmtree(entry, ignore_errors=True)  # a build that died half-way
            entry.mkdir(parents=True)
            env_dir = entry / "env"
            argv = [str(uv), *build.sync_argv[1:]]
            began = time.monotonic()
            try:
                proc = subprocess.run(
                    argv,
                    cwd=workdir,
                    env=sync_environ(build, env_dir, python),
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    text=True,
                    timeout=UV_SYNC_TIMEOUT_S,
                    check=False,
                )
            except subprocess.TimeoutExpired as exc:
                shutil.rmtree(entry, ignore_errors=True)
                raise ImageEnvError(f"{shlex.join(argv)} ran past {UV_SYNC_TIMEOUT_S:g}s") from exc
            build_s = time.monotonic() - began
            output = proc.stdout + proc.stderr
            if proc.returncode != 0:
                shutil.rmtree(entry, ignore_errors=True)
                raise ImageEnvError(
                    f"{build.dockerfile.name}: `{' '.join(build.sync_argv)}` failed "
                    f"(exit {proc.returncode}):\n{output}"
                )
            (entry / "build.log").write_text(output)
            record: dict[str, Any] = {
                "service": service,
                "key": key,
                "dockerfile": str(build.dockerfile),
                "sync": list(build.sync_argv),
                "uv_env": dict(build.uv_env),
                "uv": uv_version(uv),
                "python": str(python),
                "build_s": round(build_s, 2),
            }
            tmp_marker = entry / "build.json.tmp"
            tmp_marker.write_text(json.dumps(record, indent=2) + "\n")
            tmp_marker.replace(marker)
            _prune(service, entry)
            return ImageEnv(build, env_dir, key, build_s, prepare_s)
