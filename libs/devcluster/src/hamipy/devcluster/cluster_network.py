"""A cluster's pod network: one network namespace that holds the cluster's real-runtime nodes (their
containerd, kubelets, bridges and pods) and kube-proxy, joined to the host by a veth pair.

Pods reach Services as on any cluster: kube-proxy's rules translate ClusterIPs, and the kubernetes
Service's endpoint is the host's end of the veth, where the apiserver is advertised. Everything
kube-proxy writes stays in the namespace, so two clusters on one machine (``make up`` beside
``make test``) never touch each other's rules, nor the host's. The host reaches the nodes' pod
subnets (the apiserver calls webhooks and kubelets there, Prometheus scrapes pods) through a route
per node via the namespace's end.

Names derive from the cluster's workdir: namespace ``hpn-<id>``, host link ``hpn-<id>``, a /24 of
10.128.0.0/9 no host route uses (host .1, namespace .2). ``delete`` and, after a killed run,
``sweep_network_orphans`` (from ``REGISTRY``) delete the namespace; the veth, its routes and every
rule in the namespace go with it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import os
import subprocess
from pathlib import Path
from typing import Final

from hamipy.devcluster.errors import DevClusterError
from hamipy.devcluster.node_subnets import free_subnet
from hamipy.devcluster.processes import pid_alive

__all__ = [
    "NETNS_DIR",
    "REGISTRY",
    "ClusterNetwork",
    "NetworkNames",
    "make_bridge",
    "sweep_network_orphans",
]

REGISTRY: Final = Path("/run/hamipy-devcluster/networks")
"""One record per live network (its names and owner's pid), for ``sweep_network_orphans``."""
NETNS_DIR: Final = Path("/run/netns")
"""Where ``ip netns`` keeps the namespaces it names."""
IP_TIMEOUT_S: Final = 10.0


@dataclasses.dataclass(frozen=True)
class NetworkNames:
    id: str
    netns: str
    link: str
    subnet: str

    @classmethod
    def for_workdir(cls, workdir: Path) -> NetworkNames:
        digest = hashlib.sha256(b"network:" + str(workdir.resolve()).encode()).hexdigest()
        net_id = digest[:8]
        return cls(net_id, f"hpn-{net_id}", f"hpn-{net_id}", free_subnet(int(digest[8:16], 16)))

    @property
    def host_ip(self) -> str:
        """The host's end: where the apiserver is advertised and pods reach the host."""
        return str(ipaddress.IPv4Network(self.subnet).network_address + 1)

    @property
    def inside_ip(self) -> str:
        """The namespace's end: the host's gateway to the nodes' pod subnets."""
        return str(ipaddress.IPv4Network(self.subnet).network_address + 2)


def ip(*args: str, netns: str | None = None, ok_if: str = "") -> None:
    """Run ``ip`` (in ``netns`` when given); an error unless it succeeds or its error contains
    ``ok_if``."""
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False)
    if done.returncode != 0 and not (ok_if and ok_if in done.stderr):
        raise DevClusterError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


def make_bridge(bridge: str, gateway: str, subnet: str, *, netns: str | None = None) -> None:
    """A bridge (in ``netns``, else the host's namespace) up with its ``gateway`` address of
    ``subnet``; one made already is kept."""
    prefix = ipaddress.IPv4Network(subnet).prefixlen
    ip("link", "add", "name", bridge, "type", "bridge", netns=netns, ok_if="File exists")
    ip("addr", "add", f"{gateway}/{prefix}", "dev", bridge, netns=netns, ok_if="File exists")
    ip("link", "set", bridge, "up", netns=netns)


class ClusterNetwork:
    """The namespace and its veth; ``create()`` makes them, ``delete()`` removes all of it."""

    def __init__(self, workdir: Path, *, dns_ip: str | None = None) -> None:
        self.names = NetworkNames.for_workdir(workdir)
        self.dns_ip = dns_ip
        """The cluster DNS Service's ClusterIP the kubelets give pods (None: no cluster DNS)."""

    @property
    def record(self) -> Path:
        return REGISTRY / f"{self.names.id}.json"

    @property
    def netns_path(self) -> Path:
        return NETNS_DIR / self.names.netns

    def enter(self) -> list[str]:
        """The argv prefix that runs a command in the namespace."""
        return ["nsenter", f"--net={self.netns_path}", "--"]

    def create(self) -> None:
        n = self.names
        REGISTRY.mkdir(parents=True, exist_ok=True)
        self.record.write_text(json.dumps({**dataclasses.asdict(n), "owner": os.getpid()}))
        prefix = ipaddress.IPv4Network(n.subnet).prefixlen
        ip("netns", "add", n.netns, ok_if="File exists")
        ip("link", "add", n.link, "type", "veth", "peer", "name", "eth0", "netns", n.netns)
        ip("addr", "add", f"{n.host_ip}/{prefix}", "dev", n.link)
        ip("link", "set", n.link, "up")
        ip("link", "set", "lo", "up", netns=n.netns)
        ip("addr", "add", f"{n.inside_ip}/{prefix}", "dev", "eth0", netns=n.netns)
        ip("link", "set", "eth0", "up", netns=n.netns)
        ip("route", "add", "default", "via", n.host_ip, netns=n.netns)
        # The namespace routes between the nodes' bridges and the host.
        done = subprocess.run(
            [*self.enter(), "sysctl", "-qw", "net.ipv4.ip_forward=1"],
            capture_output=True,
            text=True,
            timeout=IP_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            raise DevClusterError(f"enabling forwarding in {n.netns} failed: {done.stderr.strip()}")

    def add_bridge(self, bridge: str, gateway: str, subnet: str) -> None:
        """A node's bridge in the namespace, up with its gateway address, and the host's route to it."""
        make_bridge(bridge, gateway, subnet, netns=self.names.netns)
        ip("route", "replace", subnet, "via", self.names.inside_ip)

    def delete(self) -> None:
        sweep_network(self.record)


def sweep_network(record: Path) -> None:
    """Delete the network of ``record`` (its namespace, veth and routes) and the record. Run after
    its nodes are swept (a namespace lives on while a process is in it). Idempotent."""
    try:
        names = NetworkNames(**{k: v for k, v in json.loads(record.read_text()).items() if k != "owner"})
    except (OSError, ValueError, TypeError):
        return
    subprocess.run(
        ["ip", "link", "delete", names.link], capture_output=True, timeout=IP_TIMEOUT_S, check=False
    )
    subprocess.run(
        ["ip", "netns", "delete", names.netns], capture_output=True, timeout=IP_TIMEOUT_S, check=False
    )
    record.unlink(missing_ok=True)


def sweep_network_orphans() -> list[str]:
    """``sweep_network`` every network whose owner is gone; the namespaces swept."""
    swept = []
    for record in sorted(REGISTRY.glob("*.json")) if REGISTRY.is_dir() else ():
        try:
            data = json.loads(record.read_text())
            owner, netns = int(data["owner"]), str(data["netns"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not pid_alive(owner):
            sweep_network(record)
            swept.append(netns)
    return swept
