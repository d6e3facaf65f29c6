"""The Helm chart's values and their schema (``deploy/helm/hami-py/values.schema.json``), as the
tests walk them: which part of the schema governs a value's path, whether it is required, and the
paths ``values.yaml`` sets; and the pinned helm run on the chart.

Any test imports it as ``chart_values``: ``tests/`` is on ``sys.path`` because ``tests/conftest.py``
lives there (pytest's "prepend" import mode).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import yaml

from hamipy.devcluster.binaries import KUBERNETES_VERSION, ensure_helm

__all__ = [
    "CHART",
    "KUBE_VERSION",
    "RELEASE",
    "Schema",
    "ValuePath",
    "helm_lint",
    "helm_template",
    "load_schema",
    "load_values",
    "pointer",
    "value_paths",
]

CHART: Final = Path(__file__).resolve().parents[1] / "deploy" / "helm" / "hami-py"
RELEASE: Final = "hami-py"
KUBE_VERSION: Final = KUBERNETES_VERSION.lstrip("v")
"""What helm is told the cluster runs: the test cluster's Kubernetes."""
HELM_TIMEOUT_S: Final = 120

ValuePath = tuple[str, ...]
"""A value's keys from the top: ("webhook", "replicas")."""


def load_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return values


def pointer(path: Sequence[str]) -> str:
    """The JSON pointer helm names a value by in its refusals (``/webhook/replicas``; ``''`` for
    the root)."""
    return "".join(f"/{key}" for key in path)


class Schema:
    """The chart's values schema, navigable by value path."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document

    def resolve(self, node: dict[str, Any]) -> dict[str, Any]:
        """``node`` with its ``$ref`` (``#/definitions/<name>``) followed."""
        while "$ref" in node:
            name = node["$ref"].removeprefix("#/definitions/")
            node = self.document["definitions"][name]
        return node

    def at(self, path: Sequence[str]) -> dict[str, Any] | None:
        """The schema governing the value at ``path``, or None where the schema allows no such key.
        A map whose keys are free (a nodeSelector, an EnvVar's valueFrom) governs any key under it."""
        node = self.resolve(self.document)
        for key in path:
            properties: dict[str, Any] = node.get("properties", {})
            extra = node.get("additionalProperties", True)
            if key in properties:
                node = self.resolve(properties[key])
            elif isinstance(extra, dict):
                node = self.resolve(extra)
            elif extra is False:
                return None
            else:
                node = {}
        return node

    def required(self, path: Sequence[str]) -> bool:
        """Whether the schema refuses values without the key at ``path``."""
        parent = self.at(path[:-1])
        return parent is not None and path[-1] in parent.get("required", [])


def load_schema() -> Schema:
    return Schema(json.loads((CHART / "values.schema.json").read_text()))


def value_paths(schema: Schema, values: dict[str, Any] | None = None) -> list[ValuePath]:
    """Every path ``values.yaml`` sets, down to the keys the schema names: a map whose keys are
    free (``resources.requests``, ``nodeSelector``) is one value, not one per key."""
    return list(_paths(schema, load_values() if values is None else values, ()))


def _paths(schema: Schema, values: dict[str, Any], prefix: ValuePath) -> Iterator[ValuePath]:
    for key, value in values.items():
        path = (*prefix, key)
        yield path
        node = schema.at(path)
        if isinstance(value, dict) and node is not None and "properties" in node:
            yield from _paths(schema, value, path)


def _helm(*args: str, kube_version: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ensure_helm()), *args, "--kube-version", kube_version],
        capture_output=True,
        text=True,
        timeout=HELM_TIMEOUT_S,
        check=False,
    )


def helm_template(
    *args: str, namespace: str = "hami-system", kube_version: str = KUBE_VERSION
) -> subprocess.CompletedProcess[str]:
    """``helm template`` of the chart as release ``RELEASE`` (it validates the values as ``helm
    install`` does), for a cluster of ``kube_version``."""
    return _helm("template", RELEASE, str(CHART), "--namespace", namespace, *args, kube_version=kube_version)


def helm_lint(*args: str) -> subprocess.CompletedProcess[str]:
    """``helm lint --strict`` of the chart (its findings are on stdout)."""
    return _helm("lint", str(CHART), "--strict", *args, kube_version=KUBE_VERSION)
