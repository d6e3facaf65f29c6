"""The dev cluster's stand-in for ``nvidia-container-runtime``: an OCI runtime that puts the node's
fake driver into the containers that ask for GPUs, then runs runc.

On a GPU node the NVIDIA container toolkit sees ``NVIDIA_VISIBLE_DEVICES`` in a container's spec
(set by the device plugin) and adds the driver's libraries and the device nodes of those GPUs; the
container then sees those GPUs only, numbered from 0. This does the same with ``native/``'s fake
driver: at ``create`` it bind-mounts the fake ``libcuda.so.1`` and ``libnvidia-ml.so.1`` read-only,
writes the container a driver configuration that lists only its GPUs (each with the host's slot in
the shared state, so usage lands on the host's GPU) and mounts the node's driver state. Containers
without the variable, or with ``void``/``none``, are left alone. Every other command goes to runc
as it is.

Run by path (``python fake_nvidia_runtime.py``), it imports nothing outside the standard library:
containerd's shim calls it for every runc command.

    fake_nvidia_runtime.py --config GPUS_CONF --libs DIR --runc RUNC -- RUNC_ARGS...
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, NoReturn

VISIBLE_DEVICES: Final = "NVIDIA_VISIBLE_DEVICES"
CONFIG_ENV: Final = "HAMIPY_FAKE_GPU_CONFIG"
"""Where the fake driver finds its configuration (``native/fake/fake.h``): a file, or a directory."""
CONFIG_IN_CONTAINER: Final = "/etc/hamipy-fake-gpu/gpus.conf"
"""Where the driver also looks without ``CONFIG_ENV`` (``FAKE_INSTALLED_CONFIG``): a process that
``kubectl exec`` starts gets the container's environment as the kubelet asked for it, without the
variable added here."""
STATE_IN_CONTAINER: Final = "/etc/hamipy-fake-gpu/gpus.state"
LIB_DIR_IN_CONTAINER: Final = "/usr/lib/x86_64-linux-gnu"
DRIVER_LIBS: Final = ("libcuda.so.1", "libnvidia-ml.so.1")
NO_DEVICES: Final = ("", "void", "none")
MIG_PREFIX: Final = "MIG-"


def gpu_lines(host_config: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The host configuration's global lines (its ``state`` left out) and its GPUs as (uuid, line)."""
    settings: list[str] = []
    gpus: list[tuple[str, str]] = []
    for raw in host_config.splitlines():
        line = raw.strip()
        if line.startswith("gpu ") or line == "gpu":
            uuid = next((w.split("=", 1)[1] for w in line.split() if w.startswith("uuid=")), "")
            gpus.append((uuid, line))
        elif line and not line.startswith("#") and line.split("=", 1)[0].strip() != "state":
            settings.append(line)
    return settings, gpus


def container_config(host_config: str, visible: str) -> str:
    """The driver configuration of a container given ``visible`` (``all``, or GPU UUIDs, MIG
    instance UUIDs or host indices, comma-separated, in the order the container numbers them)."""
    settings, gpus = gpu_lines(host_config)
    if visible.strip() == "all":
        return driver_settings(settings) + "".join(gpu_with_slot(line, i) for i, (_, line) in enumerate(gpus))
    chosen = []
    for want in (w.strip() for w in visible.split(",") if w.strip()):
        if want.startswith(MIG_PREFIX):
            # A MIG instance: the driver finds its GPU and memory in the node's state.
            chosen.append(f"gpu uuid={want}\n")
            continue
        index = int(want) if want.isdigit() else next((i for i, (u, _) in enumerate(gpus) if u == want), -1)
        if not 0 <= index < len(gpus):
            raise SystemExit(f"fake nvidia runtime: {VISIBLE_DEVICES} names unknown GPU {want!r}")
        chosen.append(gpu_with_slot(gpus[index][1], index))
    return driver_settings(settings) + "".join(chosen)


def driver_settings(settings: Sequence[str]) -> str:
    """A container's driver settings: the host's, with the host's state at ``STATE_IN_CONTAINER``."""
    return "".join(f"{line}\n" for line in (*settings, f"state = {STATE_IN_CONTAINER}"))


def gpu_with_slot(line: str, slot: int) -> str:
    """A host GPU line as a container lists it: with the host's index, where its use is counted."""
    return f"{line} slot={slot}\n"


def host_state(host_config: Path) -> Path:
    """The node's driver state beside ``host_config``, made empty if missing (the driver sizes it
    at first use) so that it can be mounted."""
    state = Path(f"{host_config}.state")
    state.touch(exist_ok=True)
    return state


def _env_value(spec: dict[str, Any], name: str) -> str | None:
    value = None
    for entry in (spec.get("process") or {}).get("env") or ():
        key, _, val = str(entry).partition("=")
        if key == name:
            value = val  # the last one wins, as in a process's environment
    return value


def bind_options(*, read_only: bool) -> list[str]:
    """The OCI options of a bind mount of the driver's files."""
    return ["rbind", "nosuid", "nodev", "ro" if read_only else "rw"]


def _bind(source: str, destination: str, *, read_only: bool) -> dict[str, Any]:
    options = bind_options(read_only=read_only)
    return {"destination": destination, "type": "bind", "source": source, "options": options}


def inject(spec: dict[str, Any], *, host_config: Path, libs: Path, container_conf: Path) -> bool:
    """Add the fake driver to ``spec`` if it asks for GPUs; whether it did."""
    visible = _env_value(spec, VISIBLE_DEVICES)
    if visible is None or visible.strip().lower() in NO_DEVICES:
        return False
    container_conf.parent.mkdir(parents=True, exist_ok=True)
    container_conf.write_text(container_config(host_config.read_text(), visible))
    state = host_state(host_config)
    mounts = spec.setdefault("mounts", [])
    mounts += [
        _bind(str(libs / name), f"{LIB_DIR_IN_CONTAINER}/{name}", read_only=True) for name in DRIVER_LIBS
    ]
    mounts.append(_bind(str(container_conf), CONFIG_IN_CONTAINER, read_only=True))
    mounts.append(_bind(str(state), STATE_IN_CONTAINER, read_only=False))
    spec["process"].setdefault("env", []).append(f"{CONFIG_ENV}={CONFIG_IN_CONTAINER}")
    return True


def runc_command(runc_args: Sequence[str]) -> tuple[str | None, str, str | None]:
    """(subcommand, bundle, container id) of a runc command line."""
    args = list(runc_args)
    value_flags = {"--root", "--log", "--log-format", "--criu", "--rootless"}
    i = 0
    while i < len(args) and args[i].startswith("-"):
        i += 1 if "=" in args[i] or args[i] not in value_flags else 2
    if i >= len(args):
        return None, ".", None
    sub, rest = args[i], args[i + 1 :]
    bundle = "."
    for j, arg in enumerate(rest):
        if arg in ("--bundle", "-b") and j + 1 < len(rest):
            bundle = rest[j + 1]
        elif arg.startswith("--bundle="):
            bundle = arg.split("=", 1)[1]
    return sub, bundle, rest[-1] if rest else None


def main(argv: Sequence[str] | None = None) -> NoReturn:
    parser = argparse.ArgumentParser(prog="fake-nvidia-container-runtime")
    parser.add_argument("--config", type=Path, required=True, help="the node's fake driver configuration")
    parser.add_argument("--libs", type=Path, required=True, help="directory of the fake driver's libraries")
    parser.add_argument("--runc", required=True)
    parser.add_argument("runc_args", nargs=argparse.REMAINDER)
    opts = parser.parse_args(argv)
    runc_args = opts.runc_args[1:] if opts.runc_args[:1] == ["--"] else opts.runc_args
    sub, bundle, container = runc_command(runc_args)
    conf_dir = opts.config.parent / "containers"
    if sub == "create" and container:
        spec_path = Path(bundle) / "config.json"
        spec = json.loads(spec_path.read_text())
        if inject(
            spec, host_config=opts.config, libs=opts.libs, container_conf=conf_dir / f"{container}.conf"
        ):
            spec_path.write_text(json.dumps(spec))
    elif sub == "delete" and container:
        (conf_dir / f"{container}.conf").unlink(missing_ok=True)
    os.execv(opts.runc, [opts.runc, *runc_args])


if __name__ == "__main__":
    main()
