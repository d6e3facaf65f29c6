"""PodDisruptionBudgets (``policy/v1``) as preemption reads them (``hamipy.extender.preemption``):
per namespace, each budget's selector and how many disruptions its status still allows. Pure: fed
by the PodDisruptionBudget watch."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from hamipy.protocol.quantities import is_json_int

__all__ = ["DisruptionBudgets", "selector_matches"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Budget:
    name: str
    selector: Mapping[str, Any]
    allowed: int


class DisruptionBudgets:
    """The PodDisruptionBudgets (``policy/v1``) by namespace, kept from their watch: each one's
    selector and ``status.disruptionsAllowed``."""

    def __init__(self) -> None:
        self._by_namespace: dict[str, dict[str, _Budget]] = {}

    def apply(self, event: str, pdb: Mapping[str, Any]) -> None:
        meta = pdb.get("metadata") or {}
        namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
        budgets = self._by_namespace.setdefault(namespace, {})
        selector = (pdb.get("spec") or {}).get("selector")
        if event == "DELETED" or not isinstance(selector, dict):
            # No selector selects nothing (policy/v1); an empty one selects every pod.
            budgets.pop(name, None)
        else:
            allowed = (pdb.get("status") or {}).get("disruptionsAllowed")
            allowed = allowed if is_json_int(allowed) else 0
            budgets[name] = _Budget(name, selector, allowed)
        if not budgets:
            del self._by_namespace[namespace]

    def replace(self, pdbs: Iterable[Mapping[str, Any]]) -> None:
        self._by_namespace.clear()
        for pdb in pdbs:
            self.apply("ADDED", pdb)

    def allowance(self, namespace: str) -> dict[str, int]:
        """Disruptions each budget of ``namespace`` still allows (a copy, to count victims against)."""
        return {b.name: b.allowed for b in self._by_namespace.get(namespace, {}).values()}

    def matching(self, namespace: str, labels: Mapping[str, str]) -> list[str]:
        """The budgets of ``namespace`` whose selector selects a pod with ``labels``."""
        return [
            b.name
            for b in self._by_namespace.get(namespace, {}).values()
            if selector_matches(b.selector, labels)
        ]


def selector_matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A ``metav1.LabelSelector`` against a pod's labels (an unknown operator matches nothing)."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or ():
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or ()
        present = key in labels
        if op == "In":
            ok = present and labels[key] in values
        elif op == "NotIn":
            ok = not present or labels[key] not in values
        elif op == "Exists":
            ok = present
        elif op == "DoesNotExist":
            ok = not present
        else:
            return False
        if not ok:
            return False
    return True
