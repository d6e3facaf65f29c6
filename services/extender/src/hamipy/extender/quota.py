"""Namespace quotas on GPU memory and cores (docs/configuration.md#gpu-quotas), as HAMi reads them.

A ResourceQuota's ``spec.hard`` may carry ``limits.<memory resource>`` (``limits.nvidia.com/gpumem``,
MiB) and ``limits.<cores resource>`` (``limits.nvidia.com/gpucores``, percent). Kubernetes itself
counts each container's request once; a GPU ask is per GPU, so Kubernetes would charge a container
with ``nvidia.com/gpu: 2, nvidia.com/gpumem: 4096`` 4096 MiB for the 8192 it holds. The extender
charges what the pod's allocation holds: MiB and cores summed over its GPUs, with percentages
resolved against the GPUs chosen (``model.charge_of``), its reservations and binds in flight
included, so two filters cannot both take the last of a quota.

Every quota of the namespace must hold (as Kubernetes requires of several ResourceQuotas); a key no
quota names is not limited. ``Quotas`` is the watched state (``ClusterModel.quotas``); ``refusal``
is the check a filter and a bind make, with the message the pod's Event and reason carry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, Final

from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.quantities import parse_quantity
from hamipy.protocol.resources import ResourceNames

__all__ = ["QUOTA_EXCEEDED", "QuotaLimit", "QuotaProblem", "Quotas"]

QUOTA_EXCEEDED: Final = "ResourceQuotaNotFit"
"""The reason (per node, and the metric label) of a pod its namespace's quota does not admit: HAMi's
name for it."""


@dataclasses.dataclass(frozen=True, slots=True)
class QuotaLimit:
    """One limit of one ResourceQuota: ``key`` is ``limits.nvidia.com/gpumem`` or ``...gpucores``."""

    namespace: str
    name: str
    key: str
    limit: int


@dataclasses.dataclass(frozen=True, slots=True)
class QuotaProblem:
    """A GPU limit that cannot be read: which ResourceQuota, and why."""

    namespace: str
    name: str
    uid: str
    reason: str


class Quotas:
    """The GPU limits of every ResourceQuota, by namespace, kept from the ResourceQuota watch.

    A quota whose limit is not a whole quantity is reported (``problems``) and its other limits
    still hold; the malformed one is ignored rather than read as 0, which would refuse every pod."""

    def __init__(self, names: ResourceNames | None = None) -> None:
        self.memory_key, self.cores_key = (names or ResourceNames()).quota_keys
        self._by_namespace: dict[str, dict[str, tuple[QuotaLimit, ...]]] = {}
        self.synced = False

    def limits(self, namespace: str) -> tuple[QuotaLimit, ...]:
        """Every GPU limit on ``namespace`` (quota name order)."""
        by_name = self._by_namespace.get(namespace)
        if not by_name:
            return ()
        return tuple(limit for name in sorted(by_name) for limit in by_name[name])

    def all_limits(self) -> Iterable[QuotaLimit]:
        for namespace in sorted(self._by_namespace):
            yield from self.limits(namespace)

    def apply(self, event: str, quota: Mapping[str, Any]) -> list[QuotaProblem]:
        """One watch event; returns what was wrong with it (one line each)."""
        meta = quota.get("metadata") or {}
        namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
        by_name = self._by_namespace.setdefault(namespace, {})
        by_name.pop(name, None)
        problems: list[QuotaProblem] = []
        if event != "DELETED":
            limits = self._read(namespace, name, quota, problems)
            if limits:
                by_name[name] = limits
        if not by_name:
            del self._by_namespace[namespace]
        return problems

    def replace(self, quotas: Iterable[Mapping[str, Any]]) -> list[QuotaProblem]:
        """A full list: what is not in it is forgotten."""
        self._by_namespace.clear()
        problems: list[QuotaProblem] = []
        for quota in quotas:
            problems += self.apply("ADDED", quota)
        self.synced = True
        return problems

    def _read(
        self, namespace: str, name: str, quota: Mapping[str, Any], problems: list[QuotaProblem]
    ) -> tuple[QuotaLimit, ...]:
        hard = (quota.get("spec") or {}).get("hard") or {}
        uid = str((quota.get("metadata") or {}).get("uid", ""))
        out = []
        for key in (self.memory_key, self.cores_key):
            if key not in hard:
                continue
            try:
                value = parse_quantity(hard[key], resource=key)
            except ProtocolError as exc:
                problems.append(QuotaProblem(namespace, name, uid, f"{exc}; this limit is not enforced"))
                continue
            out.append(QuotaLimit(namespace, name, key, value))
        return tuple(out)

    def refusal(self, namespace: str, *, used: tuple[int, int], asked: tuple[int, int]) -> str | None:
        """Why a pod asking ``asked`` (MiB, cores) over its GPUs does not fit ``namespace``'s quotas
        while its other pods hold ``used``; None when every limit holds. Names the first quota that
        fails, its limit, what is used and what the pod asks."""
        for limit in self.limits(namespace):
            k = 0 if limit.key == self.memory_key else 1
            if used[k] + asked[k] > limit.limit:
                return (
                    f"quota {namespace}/{limit.name}: {limit.key} is {limit.limit}, {used[k]} used, "
                    f"the pod asks {asked[k]}"
                )
        return None
