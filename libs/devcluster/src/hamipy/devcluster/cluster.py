"""A real etcd + kube-apiserver + kube-scheduler on loopback, started and stopped from Python.

    with DevCluster() as cluster:                     # etcd, kube-apiserver, default-scheduler
        cluster.start_scheduler(SchedulerConfig.hami(ExtenderConfig(url_prefix=...)))
        ...                                           # cluster.access.kubeconfig, cluster.api_client()

Everything lives in one temporary directory (certificates, kubeconfigs, scheduler configs, etcd
data, one log per process) that is removed on `stop` unless `keep_dir` is set. Ports are picked
free at random, so clusters can run side by side. `stop` runs on context exit, on garbage
collection / interpreter exit (a finalizer), and the kernel kills the children if Python dies
(``PR_SET_PDEATHSIG``): nothing is left behind.

kube-controller-manager runs with every default controller but the node lifecycle controller and
the pod garbage collector (``config.CONTROLLERS`` says why): namespaces get their ``default``
ServiceAccount and ``kube-root-ca.crt``, Deployments get ReplicaSets and pods, owners' deletion
cascades. Nodes join on their own: real kubelets (``kubelet_nodes``, with ``node_kubeconfig``) or
simulated Nodes kept Ready by ``nodes``; `kubeobjects` deletes namespaces without waiting for pods on
simulated nodes to be confirmed gone.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import shutil
import ssl
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import yaml

from hamipy.devcluster import binaries as _binaries
from hamipy.devcluster.cluster_network import ClusterNetwork, sweep_network_orphans
from hamipy.devcluster.config import (
    DEFAULT_SCHEDULER_NAME,
    SchedulerConfig,
    apiserver_args,
    controller_manager_args,
    kube_proxy_config,
    render_kubeconfig,
    render_scheduler_config,
)
from hamipy.devcluster.containerd_runtime import sweep_orphans
from hamipy.devcluster.errors import DevClusterError
from hamipy.devcluster.pki import CERT_VALIDITY, ClusterPKI, make_cluster_pki
from hamipy.devcluster.processes import ManagedProcess, free_port, http_ok, https_ok, pid_alive
from hamipy.kube.certs import issue_cert

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient, Configuration

DEFAULT_SCHEDULER = "default"
WORKDIR_PREFIX = "hamipy-devcluster-"
OWNER_FILE = "owner.pid"
DNS_SERVICE_OFFSET = 10
"""The cluster DNS Service's ClusterIP: this address of the Service range (10.96.0.10), as kubeadm's."""


@dataclasses.dataclass(frozen=True)
class ClusterSettings:
    """How a DevCluster is started."""

    # Range kube-apiserver allocates Service IPs from; its first address is the `kubernetes` Service.
    service_cluster_ip_range: str = "10.96.0.0/16"
    # Per process; kube-apiserver needs ~3-5 s warm on 2 cores, the rest is headroom for loaded CI.
    start_timeout_s: float = 60.0
    # Start a kube-scheduler with the `default-scheduler` profile (pods without schedulerName).
    default_scheduler: bool = True
    # Percentage for the default scheduler; 100 scores every node (deterministic in small tests).
    percentage_of_nodes_to_score: int | None = None
    # Where to put the cluster's files; None: a fresh temporary directory.
    workdir: Path | None = None
    # Keep the directory (logs!) after stop; a fresh temporary directory is otherwise removed.
    keep_dir: bool = False
    extra_apiserver_args: tuple[str, ...] = ()
    # Run kube-controller-manager (ServiceAccounts, kube-root-ca.crt, Deployments and ReplicaSets,
    # garbage collection, namespaces...), as a cluster does.
    controller_manager: bool = True
    # Give real-runtime nodes a pod network as a cluster has (``cluster_network``): their pods reach
    # Services (kube-proxy) and the apiserver, which is advertised on a non-loopback address.
    pod_network: bool = False


@dataclasses.dataclass(frozen=True)
class ClusterAccess:
    """How to reach a running cluster as admin: everything a client or another process needs."""

    server: str
    kubeconfig: Path
    ca_file: Path
    cert_file: Path
    key_file: Path

    def api_configuration(self) -> Configuration:
        """A kubernetes_asyncio Configuration for this cluster (client-certificate auth)."""
        from kubernetes_asyncio.client import Configuration

        cfg = Configuration(host=self.server)
        cfg.ssl_ca_cert = str(self.ca_file)
        cfg.cert_file = str(self.cert_file)
        cfg.key_file = str(self.key_file)
        cfg.verify_ssl = True
        return cfg

    def api_client(self) -> ApiClient:
        """A new kubernetes_asyncio ApiClient; the caller closes it (``async with`` or ``await close()``)."""
        from kubernetes_asyncio.client import ApiClient

        return ApiClient(configuration=self.api_configuration())

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        ctx.load_cert_chain(str(self.cert_file), str(self.key_file))
        return ctx

    def to_dict(self) -> dict[str, str]:
        return {f.name: str(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterAccess:
        return cls(
            server=str(data["server"]),
            kubeconfig=Path(data["kubeconfig"]),
            ca_file=Path(data["ca_file"]),
            cert_file=Path(data["cert_file"]),
            key_file=Path(data["key_file"]),
        )


def _write(path: Path, data: bytes, *, private: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if private:
        path.chmod(0o600)
    return path


def _sweep_stale_workdirs() -> None:
    """Remove temp dirs of devclusters whose Python owner died without cleaning up (e.g. SIGKILL).

    Their processes are gone already (PDEATHSIG); only the files are left.
    """
    for path in Path(tempfile.gettempdir()).glob(WORKDIR_PREFIX + "*"):
        try:
            owner = int((path / OWNER_FILE).read_text().strip())
        except (OSError, ValueError):
            continue
        if not pid_alive(owner):
            shutil.rmtree(path, ignore_errors=True)


def _stop_all(
    processes: dict[str, ManagedProcess], workdir: Path | None, network: ClusterNetwork | None
) -> None:
    """Stop every process, newest first (schedulers, apiserver, etcd); delete the pod network;
    remove `workdir` if given."""
    for proc in reversed(list(processes.values())):
        proc.stop()
    processes.clear()
    if network is not None:
        network.delete()
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)


def _self_signed_ok() -> ssl.SSLContext:
    """For the health checks of kube-scheduler and kube-controller-manager, which serve a certificate
    they make themselves at start."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


class DevCluster:
    """etcd, kube-apiserver and kube-schedulers as child processes of this Python process."""

    def __init__(
        self,
        settings: ClusterSettings | None = None,
        *,
        binaries: _binaries.ControlPlaneBinaries | None = None,
    ) -> None:
        self.settings = settings or ClusterSettings()
        self._binaries = binaries
        self._procs: dict[str, ManagedProcess] = {}
        self._scheduler_seq = 0
        self._workdir: Path | None = None
        self._access: ClusterAccess | None = None
        self._pki: ClusterPKI | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._kube_proxy_lock = threading.Lock()
        self.network: ClusterNetwork | None = None
        """The pod network of ``settings.pod_network``, once started."""
        self.etcd_port = 0
        self.etcd_peer_port = 0
        self.apiserver_port = 0
        self.controller_manager_port = 0
        self.scheduler_ports: dict[str, int] = {}
        self.start_seconds: float = 0.0

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> Self:
        """Start etcd, kube-apiserver (and the default kube-scheduler); return when all are healthy."""
        if self._workdir is not None:
            raise DevClusterError("DevCluster.start: already started")
        began = time.monotonic()
        bins = self._binaries or _binaries.ensure_binaries()
        self._binaries = bins
        sweep_orphans()  # real-runtime nodes of a killed run: their containers, cgroups, bridges
        sweep_network_orphans()  # then their pod networks
        if self.settings.workdir is not None:
            workdir = self.settings.workdir
            workdir.mkdir(parents=True, exist_ok=True)
            owned = False
        else:
            _sweep_stale_workdirs()
            workdir = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX))
            (workdir / OWNER_FILE).write_text(f"{os.getpid()}\n")
            owned = not self.settings.keep_dir
        self._workdir = workdir
        if self.settings.pod_network:
            service_net = ipaddress.ip_network(self.settings.service_cluster_ip_range)
            self.network = ClusterNetwork(workdir, dns_ip=str(service_net[DNS_SERVICE_OFFSET]))
        self._finalizer = weakref.finalize(
            self, _stop_all, self._procs, workdir if owned else None, self.network
        )
        try:
            if self.network is not None:
                self.network.create()
            self._start_etcd(bins, workdir)
            self._start_apiserver(bins, workdir)
            if self.settings.controller_manager:
                self._start_controller_manager(bins, workdir)
            if self.settings.default_scheduler:
                self.start_scheduler(
                    SchedulerConfig(
                        profiles=(DEFAULT_SCHEDULER_NAME,),
                        percentage_of_nodes_to_score=self.settings.percentage_of_nodes_to_score,
                    ),
                    name=DEFAULT_SCHEDULER,
                )
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - began
        return self

    def stop(self) -> None:
        """Stop every process (whole process groups) and remove the temporary directory."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self.scheduler_ports.clear()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- properties ------------------------------------------------------------------------

    @property
    def workdir(self) -> Path:
        if self._workdir is None:
            raise DevClusterError("DevCluster: not started")
        return self._workdir

    @property
    def access(self) -> ClusterAccess:
        if self._access is None:
            raise DevClusterError("DevCluster: not started")
        return self._access

    @property
    def processes(self) -> dict[str, ManagedProcess]:
        """The running processes by name (``etcd``, ``kube-apiserver``, ``kube-controller-manager``,
        ``kube-scheduler-<name>``)."""
        return dict(self._procs)

    @property
    def ports(self) -> list[int]:
        """Every TCP port the cluster's processes listen on."""
        found = [
            self.etcd_port,
            self.etcd_peer_port,
            self.apiserver_port,
            self.controller_manager_port,
            *self.scheduler_ports.values(),
        ]
        return [p for p in found if p]

    @property
    def binaries(self) -> _binaries.ControlPlaneBinaries:
        if self._binaries is None:
            raise DevClusterError("DevCluster: not started")
        return self._binaries

    @property
    def node_server(self) -> str:
        """The apiserver's URL for what runs on the nodes: the pod network's host address when the
        cluster has one (the nodes' loopback is their namespace's), else the admin's."""
        if self.network is None:
            return self.access.server
        return f"https://{self.network.names.host_ip}:{self.apiserver_port}"

    def node_kubeconfig(self, node: str, path: Path) -> Path:
        """A kubeconfig for a kubelet of ``node``: ``system:node:<node>`` in ``system:nodes``, the
        identity the Node authorizer and NodeRestriction hold to its own Node and pods."""
        if self._pki is None or self._access is None:
            raise DevClusterError("DevCluster.node_kubeconfig: the cluster is not started")
        pair = issue_cert(
            self._pki.ca,
            common_name=f"system:node:{node}",
            organizations=("system:nodes",),
            validity=CERT_VALIDITY,
            client=True,
        )
        return self._write_kubeconfig(
            path, self.node_server, pair.cert_pem, pair.key_pem, user=f"system:node:{node}"
        )

    def api_client(self) -> ApiClient:
        """A new admin kubernetes_asyncio ApiClient; the caller closes it."""
        return self.access.api_client()

    def log_path(self, process: str) -> Path:
        return self.workdir / "logs" / f"{process}.log"

    # -- etcd and apiserver ----------------------------------------------------------------

    def _start_etcd(self, bins: _binaries.ControlPlaneBinaries, workdir: Path) -> None:
        client, peer = free_port(), free_port()
        self.etcd_port, self.etcd_peer_port = client, peer
        data = workdir / "etcd-data"
        proc = ManagedProcess(
            "etcd",
            [
                str(bins.etcd),
                "--name=devcluster",
                f"--data-dir={data}",
                f"--listen-client-urls=http://127.0.0.1:{client}",
                f"--advertise-client-urls=http://127.0.0.1:{client}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=devcluster=http://127.0.0.1:{peer}",
                # Throwaway data: fsync only costs time.
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
            log_path=self.log_path("etcd"),
            cwd=workdir,
        )
        self._start_process(
            proc,
            http_ok(f"http://127.0.0.1:{client}/health", expect=b'"health":"true"'),
            "healthy (GET /health)",
        )

    def _start_apiserver(self, bins: _binaries.ControlPlaneBinaries, workdir: Path) -> None:
        net = ipaddress.ip_network(self.settings.service_cluster_ip_range)
        service_ip = str(next(net.hosts()))
        advertise = self.network.names.host_ip if self.network is not None else None
        pki = make_cluster_pki(service_ip=service_ip, extra_ips=(advertise,) if advertise else ())
        self._pki = pki
        certs = workdir / "pki"
        ca = _write(certs / "ca.crt", pki.ca.cert_pem)
        _write(certs / "apiserver.crt", pki.apiserver_serving.cert_pem)
        _write(certs / "apiserver.key", pki.apiserver_serving.key_pem, private=True)
        _write(certs / "sa.key", pki.service_account_key_pem, private=True)
        _write(certs / "sa.pub", pki.service_account_pub_pem)
        _write(certs / "kubelet-client.crt", pki.kubelet_client.cert_pem)
        _write(certs / "kubelet-client.key", pki.kubelet_client.key_pem, private=True)
        admin_crt = _write(certs / "admin.crt", pki.admin_client.cert_pem)
        admin_key = _write(certs / "admin.key", pki.admin_client.key_pem, private=True)

        port = free_port()
        self.apiserver_port = port
        server = f"https://127.0.0.1:{port}"
        kubeconfig = self._write_kubeconfig(
            workdir / "admin.kubeconfig", server, pki.admin_client.cert_pem, pki.admin_client.key_pem
        )
        self._write_kubeconfig(
            workdir / "scheduler.kubeconfig",
            server,
            pki.scheduler_client.cert_pem,
            pki.scheduler_client.key_pem,
            user="system:kube-scheduler",
        )
        self._write_kubeconfig(
            workdir / "controller-manager.kubeconfig",
            server,
            pki.controller_manager_client.cert_pem,
            pki.controller_manager_client.key_pem,
            user="system:kube-controller-manager",
        )
        self._access = ClusterAccess(
            server=server, kubeconfig=kubeconfig, ca_file=ca, cert_file=admin_crt, key_file=admin_key
        )
        proc = ManagedProcess(
            "kube-apiserver",
            [
                str(bins.kube_apiserver),
                *apiserver_args(
                    etcd_url=f"http://127.0.0.1:{self.etcd_port}",
                    secure_port=port,
                    cert_dir=str(certs),
                    service_cluster_ip_range=self.settings.service_cluster_ip_range,
                    advertise_address=advertise,
                    extra=self.settings.extra_apiserver_args,
                ),
            ],
            log_path=self.log_path("kube-apiserver"),
            cwd=workdir,
        )
        self._start_process(
            proc, https_ok(f"{server}/readyz", context=self._access.ssl_context()), "ready (GET /readyz)"
        )

    def _start_controller_manager(self, bins: _binaries.ControlPlaneBinaries, workdir: Path) -> None:
        kubeconfig = workdir / "controller-manager.kubeconfig"
        port = free_port()
        self.controller_manager_port = port
        name = "kube-controller-manager"
        proc = ManagedProcess(
            name,
            [
                str(bins.kube_controller_manager),
                *controller_manager_args(
                    kubeconfig=str(kubeconfig),
                    secure_port=port,
                    cert_dir=str(workdir / "pki" / name),
                    pki_dir=str(workdir / "pki"),
                ),
            ],
            log_path=self.log_path(name),
            cwd=workdir,
        )
        self._start_process(
            proc,
            https_ok(f"https://127.0.0.1:{port}/healthz", context=_self_signed_ok()),
            "healthy (GET /healthz)",
        )

    def ensure_kube_proxy(self, node: str) -> None:
        """Start the pod network's kube-proxy (once: its rules serve every node of the namespace),
        as ``system:kube-proxy`` (which the default ``system:node-proxier`` binding authorizes).
        ``node``: a registered Node (kube-proxy waits 30 s for its Node, and is healthy only
        with one)."""
        network, bins = self.network, self.binaries
        if network is None or self._pki is None:
            raise DevClusterError("DevCluster.ensure_kube_proxy: no pod network")
        with self._kube_proxy_lock:
            if "kube-proxy" not in self._procs:
                self._start_kube_proxy(network, bins, node)

    def _start_kube_proxy(
        self, network: ClusterNetwork, bins: _binaries.ControlPlaneBinaries, node: str
    ) -> None:
        assert self._pki is not None
        workdir = self.workdir
        pair = issue_cert(self._pki.ca, common_name="system:kube-proxy", validity=CERT_VALIDITY, client=True)
        kubeconfig = self._write_kubeconfig(
            workdir / "kube-proxy.kubeconfig",
            self.node_server,
            pair.cert_pem,
            pair.key_pem,
            user="kube-proxy",
        )
        healthz = f"{network.names.inside_ip}:{free_port()}"
        config = _write(
            workdir / "kube-proxy.yaml",
            yaml.safe_dump(
                kube_proxy_config(
                    kubeconfig=str(kubeconfig),
                    address=network.names.inside_ip,
                    healthz=healthz,
                    metrics=f"{network.names.inside_ip}:{free_port()}",
                    name=node,
                ),
                sort_keys=False,
            ).encode(),
        )
        proc = ManagedProcess(
            "kube-proxy",
            [*network.enter(), str(bins.kube_proxy), f"--config={config}", "--v=2"],
            log_path=self.log_path("kube-proxy"),
            cwd=workdir,
        )
        self._start_process(
            proc, http_ok(f"http://{healthz}/healthz", expect=b"lastUpdated"), "healthy (GET /healthz)"
        )

    def _start_process(self, proc: ManagedProcess, probe: Callable[[], bool], what: str) -> None:
        """Register, start and wait for one control-plane process (stopped with the cluster)."""
        self._procs[proc.name] = proc
        proc.start()
        proc.wait_healthy(probe, timeout_s=self.settings.start_timeout_s, what=what)

    def _write_kubeconfig(
        self, path: Path, server: str, cert: bytes, key: bytes, *, user: str = "admin"
    ) -> Path:
        assert self._pki is not None
        doc = render_kubeconfig(
            server=server, ca_pem=self._pki.ca.cert_pem, client_cert_pem=cert, client_key_pem=key, user=user
        )
        return _write(path, yaml.safe_dump(doc, sort_keys=False).encode(), private=True)

    # -- schedulers ------------------------------------------------------------------------

    def start_scheduler(self, config: SchedulerConfig, *, name: str = "hami") -> ManagedProcess:
        """Start (or restart, if `name` runs already) a kube-scheduler with `config`; wait for /readyz.

        Tests with different extenders share one apiserver by restarting the ``hami`` scheduler.
        """
        bins = self._binaries
        if bins is None or self._access is None:
            raise DevClusterError("DevCluster.start_scheduler: the cluster is not started")
        self.stop_scheduler(name)
        self._scheduler_seq += 1
        workdir = self.workdir
        kubeconfig = workdir / "scheduler.kubeconfig"
        cfg_path = _write(
            workdir / f"scheduler-{name}-{self._scheduler_seq}.yaml",
            yaml.safe_dump(
                render_scheduler_config(config, kubeconfig=str(kubeconfig)), sort_keys=False
            ).encode(),
        )
        port = free_port()
        proc_name = f"kube-scheduler-{name}"
        proc = ManagedProcess(
            proc_name,
            [
                str(bins.kube_scheduler),
                f"--config={cfg_path}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={workdir / 'pki' / proc_name}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--v=2",
            ],
            log_path=self.log_path(proc_name),
            cwd=workdir,
        )
        self.scheduler_ports[name] = port
        self._start_process(
            proc,
            https_ok(f"https://127.0.0.1:{port}/readyz", context=_self_signed_ok()),
            "ready (GET /readyz)",
        )
        return proc

    def stop_scheduler(self, name: str = "hami") -> None:
        """Stop the kube-scheduler called `name` if it runs."""
        proc = self._procs.pop(f"kube-scheduler-{name}", None)
        self.scheduler_ports.pop(name, None)
        if proc is not None:
            proc.stop()
