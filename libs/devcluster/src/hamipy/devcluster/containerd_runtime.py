"""A real container runtime for one dev-cluster node: containerd (``binaries.ensure_containerd``)
with Debian's runc and a bridge CNI network of the node's own.

containerd runs in a mount namespace of its own (``unshare -m``, private propagation) where the
node's directories are bind-mounted over ``/var/lib``, ``/var/log`` and ``/run`` (its state, the
kubelet's, the pods' network namespaces and the CNI's address leases all live there), and over the
sysctls the kubelet would set. The kubelet enters that namespace (``nsenter``): it hands containerd
paths (pod volumes, logs) that exist only there. Everything mounted dies with the namespace.

What lives in the host's namespaces is named after the node's workdir, so two clusters on one
machine (``make up`` beside ``make test``) never meet: the bridge ``hp-<id>``, the cgroup root
``/hamipy-<id>`` in every cgroup hierarchy, a /24 of 10.128.0.0/9 no host route uses; the bridge's
address is the node's InternalIP, where its kubelet serves. ``stop`` and, after a killed run,
``sweep_orphans`` (from ``REGISTRY``) remove the containers, the shims, the cgroups and the bridge;
the CNI is set up without masquerading, so no firewall chain is ever made.

On a GPU node an ``NvidiaToolkit`` (``fake_nvidia_toolkit``) stands for the NVIDIA container
toolkit: the handler ``nvidia`` (RuntimeClass ``nvidia``, which the webhook gives GPU pods) runs
runc through its runtime, which puts the node's fake driver into containers that ask for GPUs by
``NVIDIA_VISIBLE_DEVICES``, and its CDI spec of the node's GPUs, written into the node's CDI
directory at start, does so for containers given GPUs by CDI; other pods run on plain runc. CDI is
on, reading the node's directory and the ones given (the device plugin's ``cdiSpecDir``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import ipaddress
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Final, Protocol

import tomli_w

from hamipy.devcluster import binaries
from hamipy.devcluster.cluster_dns import DNS_CLUSTER_DOMAIN
from hamipy.devcluster.cluster_network import ClusterNetwork, make_bridge
from hamipy.devcluster.errors import DevClusterError
from hamipy.devcluster.host_packages import RUNTIME_PACKAGES, ensure_host_packages
from hamipy.devcluster.images import PAUSE_IMAGE
from hamipy.devcluster.node_subnets import free_subnet
from hamipy.devcluster.processes import ManagedProcess, free_port, pid_alive
from hamipy.devcluster.shadowed_host import ShadowedHost
from hamipy.protocol.allocation_env import DEFAULT_HOOK_PATH

__all__ = [
    "NVIDIA_HANDLER",
    "REGISTRY",
    "SHADOWED_DIRS",
    "ContainerdRuntime",
    "NodeNames",
    "NvidiaToolkit",
    "sweep",
    "sweep_orphans",
]

SHADOWED_DIRS: Final = ("/var/lib", "/var/log", "/run", DEFAULT_HOOK_PATH)
"""Host directories the node writes under, each replaced by the node's own in its namespace: its
state, logs and runtime files, and the hook path where a device plugin pod (the chart's) puts the
interposer and its containers' regions, as on a machine of its own."""
NVIDIA_HANDLER: Final = "nvidia"
REGISTRY: Final = Path("/run/hamipy-devcluster/nodes")
"""One record per running node (its names, workdir and owner's pid), for ``sweep_orphans`` after a
killed run. On /run: a reboot clears the records with what they describe."""
CGROUP_FS: Final = Path("/sys/fs/cgroup")
RUNC: Final = Path("/usr/sbin/runc")
CNI_BIN: Final = Path("/usr/lib/cni")
START_TIMEOUT_S: Final = 60.0
CTR_TIMEOUT_S: Final = 120.0
KILL_ROUNDS: Final = 50


@dataclasses.dataclass(frozen=True)
class NodeNames:
    """The node's names in the host's namespaces, derived from its workdir."""

    id: str
    bridge: str
    cgroup_root: str
    subnet: str

    @classmethod
    def for_workdir(cls, workdir: Path) -> NodeNames:
        digest = hashlib.sha256(str(workdir.resolve()).encode()).hexdigest()
        node_id = digest[:8]
        return cls(node_id, f"hp-{node_id}", f"/hamipy-{node_id}", free_subnet(int(digest[8:16], 16)))

    @property
    def gateway(self) -> str:
        """The bridge's address: the pods' gateway and the node's InternalIP, where its kubelet
        serves (the apiserver reaches kubelets by InternalIP, which may not be loopback)."""
        return str(ipaddress.IPv4Network(self.subnet).network_address + 1)


class NvidiaToolkit(Protocol):
    """What puts the GPU driver into a GPU node's containers, as the NVIDIA container toolkit does."""

    def runtime_argv(self, runc: Path) -> list[str]:
        """argv of the ``nvidia`` handler's OCI runtime, which ends in running ``runc`` (runc's
        arguments follow)."""
        ...

    def write_cdi_specs(self, cdi_dir: Path) -> None:
        """Write the CDI specs of the node's GPUs into ``cdi_dir`` (before containerd starts)."""
        ...


class ContainerdRuntime:
    """One node's containerd; ``start()`` returns once its CRI socket serves, with the images in
    ``image_archives`` imported. ``nvidia``: the node's GPU driver comes with it (the ``nvidia``
    handler and its CDI specs); ``cdi_spec_dirs``: CDI spec directories read after the node's own."""

    def __init__(
        self,
        workdir: Path,
        *,
        node: str,
        image_archives: Sequence[Path] = (),
        nvidia: NvidiaToolkit | None = None,
        cdi_spec_dirs: Sequence[Path] = (),
        network: ClusterNetwork | None = None,
    ) -> None:
        self.workdir = workdir
        self.network = network
        """The cluster's pod network the node joins (None: the host's network namespace)."""
        self.node = node
        self.image_archives = tuple(image_archives)
        self.nvidia = nvidia
        self.cdi_spec_dirs = (self.cdi_dir, *cdi_spec_dirs)
        """Where containerd's CDI finds specs (a device named in two: the later directory's)."""
        self.names = NodeNames.for_workdir(workdir)
        self.process: ManagedProcess | None = None
        self.bin_dir: Path | None = None
        self.stream_port = 0

    @property
    def socket(self) -> Path:
        return self.workdir / "containerd.sock"

    @property
    def record(self) -> Path:
        return REGISTRY / f"{self.names.id}.json"

    @property
    def cdi_dir(self) -> Path:
        """The node's CDI spec directory (the same path inside the namespace)."""
        return self.workdir / "cdi"

    @property
    def host(self) -> ShadowedHost:
        """What the namespace puts over the host's directories and sysctls."""
        return ShadowedHost(self.workdir, SHADOWED_DIRS)

    def shadow(self, path: str) -> Path:
        """Where the namespace's ``path`` (under one of ``SHADOWED_DIRS``) lies on the host."""
        return self.host.shadow(path)

    def _write_cni(self) -> None:
        net = ipaddress.IPv4Network(self.names.subnet)
        conf = {
            "cniVersion": "1.0.0",
            "name": self.names.bridge,
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.names.bridge,
                    "isGateway": True,
                    "ipMasq": False,  # no firewall chains: pods talk to the host and each other only
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": str(net), "gateway": self.names.gateway}]],
                        # The CNI result needs a default route for the kubelet's pod IP checks.
                        "routes": [{"dst": "0.0.0.0/0"}],
                    },
                },
                {"type": "loopback"},
            ],
        }
        conf_dir = self.workdir / "cni"
        conf_dir.mkdir(parents=True, exist_ok=True)
        (conf_dir / "10-bridge.conflist").write_text(json.dumps(conf, indent=2))

    def _write_config(self) -> Path:
        w = self.workdir
        self.stream_port = free_port()
        runtimes: dict[str, object] = {
            "runc": {
                "runtime_type": "io.containerd.runc.v2",
                "options": {"BinaryName": str(RUNC), "SystemdCgroup": False},
            },
        }
        if self.nvidia is not None:
            wrapper = w / "nvidia-container-runtime"
            wrapper.write_text(f'#!/bin/sh\nexec {shlex.join(self.nvidia.runtime_argv(RUNC))} "$@"\n')
            wrapper.chmod(0o755)
            runtimes[NVIDIA_HANDLER] = {
                "runtime_type": "io.containerd.runc.v2",
                "options": {"BinaryName": str(wrapper), "SystemdCgroup": False},
            }
        config = {
            "version": 3,
            "root": "/var/lib/containerd",
            "state": "/run/containerd",
            "grpc": {"address": str(self.socket)},
            "ttrpc": {"address": str(self.socket) + ".ttrpc"},
            "plugins": {
                "io.containerd.cri.v1.runtime": {
                    "enable_cdi": True,
                    "cdi_spec_dirs": [str(d) for d in self.cdi_spec_dirs],
                    # Root here lacks CAP_SYS_RESOURCE: no container may ask a lower OOM score.
                    "restrict_oom_score_adj": True,
                    "containerd": {
                        "default_runtime_name": "runc",
                        "runtimes": runtimes,
                    },
                    "cni": {"bin_dirs": [str(CNI_BIN)], "conf_dir": str(w / "cni")},
                },
                "io.containerd.cri.v1.images": {
                    "snapshotter": "overlayfs",
                    "pinned_images": {"sandbox": PAUSE_IMAGE},
                },
                "io.containerd.grpc.v1.cri": {
                    "stream_server_address": "127.0.0.1",
                    "stream_server_port": str(self.stream_port),
                },
            },
        }
        path = w / "containerd.toml"
        path.write_text(tomli_w.dumps(config))
        return path

    def _namespace_script(self, config: Path, bin_dir: Path) -> str:
        mounts = self.host.mount_lines()
        path = f"{bin_dir}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
        return (
            "set -e\n"
            + "\n".join(mounts)
            + f"\nexport PATH={shlex.quote(path)}\nexec containerd --config {shlex.quote(str(config))}\n"
        )

    def _prepare(self) -> Path:
        w = self.workdir
        self.host.prepare()
        self.cdi_dir.mkdir(exist_ok=True)
        if self.nvidia is not None:
            self.nvidia.write_cdi_specs(self.cdi_dir)
        REGISTRY.mkdir(parents=True, exist_ok=True)
        self.record.write_text(
            json.dumps(
                {
                    **dataclasses.asdict(self.names),
                    "workdir": str(w),
                    "owner": os.getpid(),
                    "netns": self.network.names.netns if self.network is not None else None,
                }
            )
        )
        for controller in _cgroup_controllers():
            (controller / self.names.cgroup_root.lstrip("/")).mkdir(exist_ok=True)
        self._write_cni()
        self._make_bridge()
        return self._write_config()

    def _make_bridge(self) -> None:
        """The node's bridge, up with the gateway address before any pod (the kubelet serves there)."""
        if self.network is not None:
            self.network.add_bridge(self.names.bridge, self.names.gateway, self.names.subnet)
            return
        make_bridge(self.names.bridge, self.names.gateway, self.names.subnet)

    def start(self) -> None:
        """Start containerd and import the images. Blocking (run it in a thread from async code)."""
        ensure_host_packages(RUNTIME_PACKAGES)
        self.bin_dir = binaries.ensure_containerd()
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self._prepare()
        script = self._namespace_script(config, self.bin_dir)
        self.process = ManagedProcess(
            f"containerd-{self.node}",
            [
                *(self.network.enter() if self.network is not None else []),
                *["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            ],
            log_path=self.workdir / "containerd.log",
            cwd=self.workdir,
        )
        self.process.start()
        self.process.wait_healthy(self.socket.exists, timeout_s=START_TIMEOUT_S, what="serving its socket")
        for archive in self.image_archives:
            self.ctr("images", "import", str(archive))

    def ctr(self, *args: str) -> str:
        """Run ``ctr`` against this node's containerd in the Kubernetes namespace; its output."""
        if self.bin_dir is None:
            raise DevClusterError(f"containerd of {self.node} is not started")
        done = subprocess.run(
            [str(self.bin_dir / "ctr"), "--address", str(self.socket), "--namespace", "k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=CTR_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            raise DevClusterError(
                f"ctr {' '.join(args)} on {self.node} failed: {done.stderr.strip()[-1000:]}"
            )
        return done.stdout

    def enter(self) -> list[str]:
        """The argv prefix that runs a command in containerd's mount and network namespaces (the
        kubelet's)."""
        if self.process is None or self.process.pid is None:
            raise DevClusterError(f"containerd of {self.node} is not running")
        ns = f"/proc/{self.process.pid}/ns"
        return ["nsenter", f"--mount={ns}/mnt", f"--net={ns}/net", "--"]

    def kubelet_config(self) -> dict[str, object]:
        """What the kubelet's configuration needs to run pods on this runtime."""
        config: dict[str, object] = {
            "address": self.names.gateway,
            # Where the host reaches it (its loopback is the pod network's, with one).
            "healthzBindAddress": self.names.gateway,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "imageServiceEndpoint": f"unix://{self.socket}",
            "cgroupDriver": "cgroupfs",
            "cgroupsPerQOS": True,
            "cgroupRoot": self.names.cgroup_root,
            "failCgroupV1": False,
            # Images are made here and cannot be pulled again: never collect them.
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
        }
        if self.network is not None and self.network.dns_ip is not None:
            config |= {"clusterDNS": [self.network.dns_ip], "clusterDomain": DNS_CLUSTER_DOMAIN}
        return config

    def pids(self) -> dict[str, int]:
        return {self.process.name: self.process.pid} if self.process is not None and self.process.pid else {}

    def running(self) -> bool:
        return self.process is not None and self.process.running()

    def stop(self) -> None:
        """Stop containerd, then remove what the node left in the host's namespaces."""
        if self.process is not None:
            self.process.stop()
            self.process = None
        sweep(self.record)


def _cgroup_controllers() -> list[Path]:
    """The mounted cgroup v1 hierarchies (or the v2 root): where a node's cgroup root is made."""
    if (CGROUP_FS / "cgroup.controllers").exists():
        return [CGROUP_FS]
    return sorted(p for p in CGROUP_FS.iterdir() if p.is_dir() and not p.is_symlink())


def _procs_in(cgroup_dirs: Iterable[Path]) -> set[int]:
    pids: set[int] = set()
    for top in cgroup_dirs:
        for procs in top.rglob("cgroup.procs"):
            with contextlib.suppress(OSError, ValueError):
                pids.update(int(line) for line in procs.read_text().split())
    return pids


def _procs_naming(text: str) -> set[int]:
    """Processes whose command line names ``text`` (containerd, its shims, the kubelet)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if text.encode() in (entry / "cmdline").read_bytes():
                found.add(int(entry.name))
    return found


def _rmdir_tree(top: Path) -> None:
    if not top.is_dir():
        return
    for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            d.rmdir()
    with contextlib.suppress(OSError):
        top.rmdir()


def sweep(record: Path) -> None:
    """Remove what the real-runtime node of ``record`` left in the host's namespaces: processes
    (containerd, shims, containers, a kubelet), cgroups and the bridge; then the record. Idempotent."""
    try:
        data = json.loads(record.read_text())
        names = NodeNames(data["id"], data["bridge"], data["cgroup_root"], data["subnet"])
        workdir = str(data["workdir"])
        netns = data.get("netns")
    except (OSError, ValueError, KeyError, TypeError):
        return
    cgroups = [c / names.cgroup_root.lstrip("/") for c in _cgroup_controllers()]
    pids: set[int] = set()
    for _ in range(KILL_ROUNDS):
        pids = _procs_in(cgroups) | _procs_naming(workdir)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)  # the kernel reaps killed processes asynchronously; poll until none is left
    else:
        raise DevClusterError(f"processes of the node in {workdir} survive SIGKILL: {sorted(pids)}")
    for top in cgroups:
        _rmdir_tree(top)
    in_netns = ["-n", str(netns)] if netns else []
    for args in (
        [*in_netns, "link", "delete", names.bridge],
        *([["route", "delete", names.subnet]] if netns else []),
    ):
        subprocess.run(["ip", *args], capture_output=True, timeout=10, check=False)
    record.unlink(missing_ok=True)


def sweep_orphans() -> list[str]:
    """``sweep`` every node whose owning process is gone (a run killed before it could stop its
    nodes), and remove its workdir; the workdirs of those swept."""
    swept = []
    for record in sorted(REGISTRY.glob("*.json")) if REGISTRY.is_dir() else ():
        try:
            data = json.loads(record.read_text())
            owner, workdir = int(data["owner"]), str(data["workdir"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not pid_alive(owner):
            sweep(record)
            shutil.rmtree(workdir, ignore_errors=True)  # its owner would have; the images are large
            swept.append(workdir)
    return swept
