"""A real kubelet (the pinned release) for one dev-cluster node, over a fake container runtime.

The runtime is the upstream CRI fake kubemark's hollow nodes use (``fakecri/main.go``: no container
runs; sandboxes get the IP 127.0.0.1, images a non-zero size; a container whose command is
``["true"]`` exits 0 at once, others run until stopped). It records the config of every container
the kubelet creates (``RealKubelet.containers()``: the envs, mounts and devices the device plugin's
Allocate returned, as the kubelet passed them on). The kubelet runs in a mount namespace of its own
(``unshare -m``, so root only), where:

- directories of the node's own are bind-mounted over ``/var/lib`` and ``/var/log``: the
  device-plugin directory is fixed at ``/var/lib/kubelet/device-plugins`` whatever ``--root-dir``
  says, and each kubelet wipes it at start, so two kubelets must not share it; the kubelet writes
  pod logs under ``/var/log/pods`` and ``/var/log/containers``. Shadowing the parents rather than
  those directories means no mount point has to exist on the host: nothing there is created;
- files holding the host's values are bind-mounted over ``vm.overcommit_memory``, ``kernel.panic``
  and ``kernel.panic_on_oops``: the kubelet sets those at start (``protectKernelDefaults`` off), and
  its writes land in the files, never in the host's kernel.

The namespace dies with the kubelet, so nothing stays mounted. The kubelet authenticates as
``system:node:<name>`` (group ``system:nodes``) with a certificate from the cluster's CA, as a
joined node does, and serves only on loopback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import yaml

from hamipy.devcluster.errors import DevClusterError
from hamipy.devcluster.processes import ManagedProcess, free_port, http_ok
from hamipy.devcluster.shadowed_host import PROTECTED_SYSCTLS, ShadowedHost

if TYPE_CHECKING:
    from hamipy.devcluster.cluster import DevCluster
    from hamipy.devcluster.containerd_runtime import ContainerdRuntime

__all__ = [
    "KUBELET_DIR",
    "PROTECTED_SYSCTLS",
    "SHADOWED_DIRS",
    "ContainerConfig",
    "ContainerMount",
    "RealKubelet",
    "can_run_real_kubelets",
]

KUBELET_DIR: Final = Path("/var/lib/kubelet")
SHADOWED_DIRS: Final = ("/var/lib", "/var/log")
"""Host directories the kubelet writes under, each replaced by the node's own in its namespace."""
START_TIMEOUT_S: Final = 60.0


def can_run_real_kubelets() -> str | None:
    """Why real kubelets cannot run here (not root, no ``unshare``), or None when they can."""
    if os.geteuid() != 0:
        return "a real kubelet needs root (a mount namespace of its own: unshare -m)"
    if shutil.which("unshare") is None:
        return "a real kubelet needs unshare (util-linux)"
    return None


@dataclasses.dataclass(frozen=True)
class ContainerMount:
    container_path: str
    host_path: str
    read_only: bool


@dataclasses.dataclass(frozen=True)
class ContainerConfig:
    """One container the kubelet created (a CRI ``CreateContainer``), as the fake runtime recorded it."""

    id: str
    namespace: str
    pod: str
    pod_uid: str
    container: str
    attempt: int
    command: tuple[str, ...]
    envs: Mapping[str, str]
    mounts: tuple[ContainerMount, ...]
    devices: tuple[str, ...]
    """Host paths of the device nodes passed in."""
    cdi_devices: tuple[str, ...]
    """Qualified names of the CDI devices passed in (``vendor/class=name``), in order."""

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> ContainerConfig:
        return cls(
            id=rec["id"],
            namespace=rec["namespace"],
            pod=rec["pod"],
            pod_uid=rec["pod_uid"],
            container=rec["container"],
            attempt=int(rec["attempt"]),
            command=tuple(rec.get("command") or ()),
            envs=dict(rec.get("envs") or {}),
            mounts=tuple(
                ContainerMount(m["container_path"], m["host_path"], bool(m["readonly"]))
                for m in rec.get("mounts") or ()
            ),
            devices=tuple(d["host_path"] for d in rec.get("devices") or ()),
            cdi_devices=tuple(rec.get("cdi_devices") or ()),
        )

    def mount(self, container_path: str) -> ContainerMount:
        """The mount at ``container_path`` (KeyError naming what there is if none)."""
        for m in self.mounts:
            if m.container_path == container_path:
                return m
        raise KeyError(f"{self.pod}/{self.container}: no mount at {container_path}; has {self.mounts}")


class RealKubelet:
    """One node's kubelet and runtime (the fake one, or ``containerd`` when given);
    ``start()`` returns once the kubelet is healthy (the Node then registers and turns Ready on its
    own), ``stop()`` ends both."""

    def __init__(
        self,
        cluster: DevCluster,
        node: str,
        workdir: Path,
        *,
        labels: Mapping[str, str] | None = None,
        taints: Sequence[str] = (),
        containerd: ContainerdRuntime | None = None,
    ) -> None:
        self.cluster = cluster
        self.containerd = containerd
        self.node = node
        self.workdir = workdir
        self.labels = dict(labels or {})
        """Set on the Node at registration (``--node-labels``)."""
        self.taints = tuple(taints)
        """``key=value:Effect``, set at registration (``--register-with-taints``)."""
        self.runtime: ManagedProcess | None = None
        self.kubelet: ManagedProcess | None = None
        self.healthz_port = 0
        self.healthz_url = ""
        self._kubeconfig: Path | None = None

    @property
    def socket(self) -> Path:
        return self.workdir / "cri.sock" if self.containerd is None else self.containerd.socket

    @property
    def plugin_dir(self) -> Path:
        """The node's device-plugin directory as seen from the host (the kubelet sees it at
        ``/var/lib/kubelet/device-plugins``): where a device plugin on this node serves its socket."""
        return self.root_dir / "device-plugins"

    @property
    def pod_resources_socket(self) -> Path:
        """The kubelet's PodResources API socket as seen from the host (``pod-resources/kubelet.sock``
        under its root directory), which the device plugin asks which pod is being admitted."""
        return self.root_dir / "pod-resources" / "kubelet.sock"

    @property
    def root_dir(self) -> Path:
        """The kubelet's ``/var/lib/kubelet`` as seen from the host."""
        return self._shadow(str(KUBELET_DIR))

    @property
    def host(self) -> ShadowedHost:
        """What the kubelet's namespace (containerd's, on the real runtime) puts over the host's."""
        return ShadowedHost(self.workdir, SHADOWED_DIRS) if self.containerd is None else self.containerd.host

    def _shadow(self, path: str) -> Path:
        """Where the namespace's ``path`` lies on the host."""
        return self.host.shadow(path)

    @property
    def record_path(self) -> Path:
        return self.workdir / "containers.jsonl"

    def containers(self) -> list[ContainerConfig]:
        """Every container the kubelet created on this node, oldest first (restarts included)."""
        try:
            text = self.record_path.read_text()
        except FileNotFoundError:
            return []
        # The runtime writes each record in one write: only a last line without its newline can be
        # partial, and it is read next time.
        return [
            ContainerConfig.from_record(json.loads(line))
            for line in text.splitlines(keepends=True)
            if line.endswith("\n")
        ]

    def container(self, namespace: str, pod: str, container: str) -> ContainerConfig | None:
        """The newest config of that container, or None if the kubelet has not created it."""
        found = [
            c for c in self.containers() if (c.namespace, c.pod, c.container) == (namespace, pod, container)
        ]
        return found[-1] if found else None

    def device_ids(self) -> dict[tuple[str, str, str], list[str]]:
        """The kubelet's device assignments from its checkpoint, by (pod UID, container, resource):
        what its device manager handed out and keeps across restarts."""
        path = self.plugin_dir / "kubelet_internal_checkpoint"
        try:
            data = json.loads(path.read_text())["Data"]
        except FileNotFoundError:
            return {}
        out: dict[tuple[str, str, str], list[str]] = {}
        for entry in data.get("PodDeviceEntries") or ():
            ids = [i for per_numa in (entry.get("DeviceIDs") or {}).values() for i in per_numa]
            out[(entry["PodUID"], entry["ContainerName"], entry["ResourceName"])] = sorted(ids)
        return out

    def _write_files(self) -> Path:
        w = self.workdir
        if self.containerd is None:  # containerd prepared its namespace's already
            self.host.prepare()
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        kubeconfig = self.cluster.node_kubeconfig(self.node, w / "kubelet.kubeconfig")
        self.healthz_port = free_port()
        config: dict[str, Any] = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": False},
                "x509": {"clientCAFile": str(self.cluster.access.ca_file)},
            },
            "authorization": {"mode": "AlwaysAllow"},
            # No cgroups of its own and no node allocatable enforcement: nothing runs here.
            "cgroupsPerQOS": False,
            "enforceNodeAllocatable": [],
            "cgroupDriver": "cgroupfs",
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "imageServiceEndpoint": f"unix://{self.socket}",
            "address": "127.0.0.1",
            "port": free_port(),
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.healthz_port,
            "resolvConf": "",
            # The host's disk and memory are not the node's: never evict for them.
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "protectKernelDefaults": False,
        }
        if self.containerd is not None:
            config.update(self.containerd.kubelet_config())
            del config["enforceNodeAllocatable"]
        self.healthz_url = f"http://{config['healthzBindAddress']}:{self.healthz_port}/healthz"
        path = w / "kubelet-config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return kubeconfig

    def namespace_script(self, kubelet: Path, kubeconfig: Path) -> str:
        w = self.workdir
        # On the real runtime the kubelet enters containerd's namespace, which has them already.
        mounts = self.host.mount_lines() if self.containerd is None else []
        argv = [
            str(kubelet),
            f"--config={w / 'kubelet-config.yaml'}",
            f"--kubeconfig={kubeconfig}",
            f"--root-dir={KUBELET_DIR}",
            f"--cert-dir={w / 'pki'}",
            f"--hostname-override={self.node}",
            "--v=2",
        ]
        if self.containerd is not None:  # the apiserver reaches the kubelet (logs, exec) there
            argv.append(f"--node-ip={self.containerd.names.gateway}")
        if self.labels:
            argv.append("--node-labels=" + ",".join(f"{k}={v}" for k, v in sorted(self.labels.items())))
        if self.taints:
            argv.append("--register-with-taints=" + ",".join(self.taints))
        return "set -e\n" + "\n".join(mounts) + "\nexec " + shlex.join(argv) + "\n"

    def start(self) -> None:
        """Start the runtime, then the kubelet. Blocking (run it in a thread from async code)."""
        why = can_run_real_kubelets()
        if why is not None:
            raise DevClusterError(why)
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.containerd is not None:
            self.containerd.start()
            self._kubeconfig = self._write_files()
            self.start_kubelet()
            return
        self._kubeconfig = self._write_files()
        self.runtime = ManagedProcess(
            f"fakecri-{self.node}",
            [str(self.cluster.binaries.fakecri), f"unix://{self.socket}", str(self.record_path)],
            log_path=self.workdir / "fakecri.log",
            cwd=self.workdir,
        )
        self.runtime.start()
        self.runtime.wait_healthy(self.socket.exists, timeout_s=START_TIMEOUT_S, what="serving its socket")
        self.start_kubelet()

    def start_kubelet(self) -> None:
        """Start (or start again, after ``stop_kubelet``) the kubelet over the running runtime."""
        if self._kubeconfig is None or (self.runtime is None and self.containerd is None):
            raise DevClusterError(f"RealKubelet({self.node}).start_kubelet: call start() first")
        script = self.namespace_script(self.cluster.binaries.kubelet, self._kubeconfig)
        namespace = (
            ["unshare", "--mount", "--propagation", "private"]
            if self.containerd is None
            else self.containerd.enter()
        )
        # An empty working directory: a path the kubelet gets empty and resolves relative to it (a
        # container's log path, once) can then remove nothing of the runtime's.
        cwd = self.workdir / "kubelet-cwd"
        cwd.mkdir(exist_ok=True)
        self.kubelet = ManagedProcess(
            f"kubelet-{self.node}",
            [*namespace, "sh", "-c", script],
            log_path=self.workdir / "kubelet.log",
            cwd=cwd,
        )
        self.kubelet.start()
        self.kubelet.wait_healthy(
            http_ok(self.healthz_url, expect=b"ok"),
            timeout_s=START_TIMEOUT_S,
            what="healthy (GET /healthz)",
        )

    def stop_kubelet(self) -> None:
        """Stop the kubelet only: the runtime keeps its containers, as on a node whose kubelet
        restarts."""
        if self.kubelet is not None:
            self.kubelet.stop()
            self.kubelet = None

    def pids(self) -> dict[str, int]:
        """The kubelet's and the runtime's processes by name, while they run."""
        procs = (self.kubelet, self.runtime)
        found = {p.name: p.pid for p in procs if p is not None and p.pid}
        return found | (self.containerd.pids() if self.containerd is not None else {})

    def running(self) -> bool:
        """Both the kubelet and the runtime are up (neither exited under us)."""
        if self.containerd is not None:
            return self.kubelet is not None and self.kubelet.running() and self.containerd.running()
        return all(p is not None and p.running() for p in (self.kubelet, self.runtime))

    def restart_kubelet(self) -> None:
        self.stop_kubelet()
        self.start_kubelet()

    def stop(self) -> None:
        self.stop_kubelet()
        if self.runtime is not None:
            self.runtime.stop()
            self.runtime = None
        if self.containerd is not None:
            self.containerd.stop()
