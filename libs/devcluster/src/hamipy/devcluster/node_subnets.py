"""Subnets of the dev cluster's real-runtime networks: /24s of 10.128.0.0/9 that no host route uses
(a node's pod bridge, a cluster's veth), so none shadows or collides with the machine's own."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import subprocess

from hamipy.devcluster.errors import DevClusterError

__all__ = ["free_subnet", "host_routes"]


def host_routes() -> list[ipaddress.IPv4Network]:
    out = subprocess.run(["ip", "-4", "-j", "route"], capture_output=True, text=True, timeout=10, check=False)
    nets = []
    for route in json.loads(out.stdout or "[]"):
        dst = route.get("dst", "")
        if dst and dst != "default":
            with contextlib.suppress(ValueError):
                nets.append(ipaddress.IPv4Network(dst, strict=False))
    return nets


def free_subnet(seed: int) -> str:
    """A /24 in 10.128.0.0/9 that no host route overlaps, chosen from ``seed``."""
    used = host_routes()
    for step in range(32768):
        n = (seed + step * 7919) % 32768
        candidate = ipaddress.IPv4Network(f"10.{128 + n // 256}.{n % 256}.0/24")
        if not any(candidate.overlaps(u) for u in used):
            return str(candidate)
    raise DevClusterError("no free /24 left in 10.128.0.0/9 for a node's pod network")
