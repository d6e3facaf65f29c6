"""A real kubelet (the pinned release) for one dev-cluster node, over a fake container runtime.

The runtime is the upstream CRI fake kubemark's hollow nodes use (``fakecri/main.go``: no container
runs; sandboxes get the IP 127.0.0.1, images a non-zero size). The kubelet runs in a mount namespace
of its own (``unshare -m``, so root only), where:

- the node's own directory is bind-mounted on ``/var/lib/kubelet``: the device-plugin directory is
  fixed at ``/var/lib/kubelet/device-plugins`` whatever ``--root-dir`` says, and each kubelet wipes it
  at start, so two kubelets must not share it;
- files holding the host's values are bind-mounted over ``vm.overcommit_memory``, ``kernel.panic``
  and ``kernel.panic_on_oops``: the kubelet sets those at start (``protectKernelDefaults`` off), and
  its writes land in the files, never in the host's kernel.

The namespace dies with the kubelet, so nothing stays mounted. The kubelet authenticates as
``system:node:<name>`` (group ``system:nodes``) with a certificate from the cluster's CA, as a
joined node does, and serves only on loopback. This is the first part of issue 17: the GPU nodes of
``make up`` and the device-plugin tests still use the kubelet stand-in.
"""

from __future__ import annotations

import os
import shlex
import shutil
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Final

import yaml

from hamipy.devcluster.errors import DevClusterError
from hamipy.devcluster.processes import ManagedProcess, free_port

if TYPE_CHECKING:
    from hamipy.devcluster.cluster import DevCluster

__all__ = ["KUBELET_DIR", "PROTECTED_SYSCTLS", "RealKubelet", "can_run_real_kubelets"]

KUBELET_DIR: Final = Path("/var/lib/kubelet")
PROTECTED_SYSCTLS: Final = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops")
"""What the kubelet would set on the host; each is shadowed by a file in its mount namespace."""
START_TIMEOUT_S: Final = 60.0


def can_run_real_kubelets() -> str | None:
    """Why real kubelets cannot run here (not root, no ``unshare``), or None when they can."""
    if os.geteuid() != 0:
        return "a real kubelet needs root (a mount namespace of its own: unshare -m)"
    if shutil.which("unshare") is None:
        return "a real kubelet needs unshare (util-linux)"
    return None


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


class RealKubelet:
    """One node's kubelet and fake runtime; ``start()`` returns once the kubelet is healthy (the
    Node then registers and turns Ready on its own), ``stop()`` ends both."""

    def __init__(self, cluster: DevCluster, node: str, workdir: Path) -> None:
        self.cluster = cluster
        self.node = node
        self.workdir = workdir
        self.runtime: ManagedProcess | None = None
        self.kubelet: ManagedProcess | None = None
        self.healthz_port = 0

    @property
    def socket(self) -> Path:
        return self.workdir / "cri.sock"

    def _write_files(self) -> Path:
        w = self.workdir
        (w / "root" / "device-plugins").mkdir(parents=True, exist_ok=True)
        kubeconfig = self.cluster.node_kubeconfig(self.node, w / "kubelet.kubeconfig")
        sysctls = w / "sysctl"
        sysctls.mkdir(exist_ok=True)
        for name in PROTECTED_SYSCTLS:
            (sysctls / name.replace("/", ".")).write_text(Path("/proc/sys", name).read_text())
        self.healthz_port = free_port()
        config = {
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
        path = w / "kubelet-config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return kubeconfig

    def namespace_script(self, kubelet: Path, kubeconfig: Path) -> str:
        w = self.workdir
        mounts = [f"mount --bind {shlex.quote(str(w / 'root'))} {KUBELET_DIR}"]
        for name in PROTECTED_SYSCTLS:
            shadow = w / "sysctl" / name.replace("/", ".")
            mounts.append(f"mount --bind {shlex.quote(str(shadow))} /proc/sys/{name}")
        argv = [
            str(kubelet),
            f"--config={w / 'kubelet-config.yaml'}",
            f"--kubeconfig={kubeconfig}",
            f"--root-dir={KUBELET_DIR}",
            f"--cert-dir={w / 'pki'}",
            f"--hostname-override={self.node}",
            "--v=2",
        ]
        return "set -e\n" + "\n".join(mounts) + "\nexec " + shlex.join(argv) + "\n"

    def start(self) -> None:
        """Blocking (run it in a thread from async code)."""
        why = can_run_real_kubelets()
        if why is not None:
            raise DevClusterError(why)
        bins = self.cluster.binaries
        self.workdir.mkdir(parents=True, exist_ok=True)
        # The mount point must exist on the host; it is left empty there (a kubelet's directory).
        KUBELET_DIR.mkdir(parents=True, exist_ok=True)
        kubeconfig = self._write_files()
        self.runtime = ManagedProcess(
            f"fakecri-{self.node}",
            [str(bins.fakecri), f"unix://{self.socket}"],
            log_path=self.workdir / "fakecri.log",
            cwd=self.workdir,
        )
        self.runtime.start()
        self.runtime.wait_healthy(self.socket.exists, timeout_s=START_TIMEOUT_S, what="serving its socket")
        script = self.namespace_script(bins.kubelet, kubeconfig)
        self.kubelet = ManagedProcess(
            f"kubelet-{self.node}",
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            log_path=self.workdir / "kubelet.log",
            cwd=self.workdir,
        )
        self.kubelet.start()
        url = f"http://127.0.0.1:{self.healthz_port}/healthz"
        self.kubelet.wait_healthy(
            lambda: _healthy(url), timeout_s=START_TIMEOUT_S, what="healthy (GET /healthz)"
        )

    def stop(self) -> None:
        for proc in (self.kubelet, self.runtime):
            if proc is not None:
                proc.stop()
        self.kubelet = self.runtime = None
