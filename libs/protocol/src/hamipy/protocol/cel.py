"""The CEL the API server evaluates for us: string and list literals, and the test of a pod asking
for our GPUs (``resources.requests_any_gpu`` in CEL), which the webhook's registration and the
admission policies (``hamipy.manifests``) both select pods by. Pure: no I/O."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Final

from hamipy.protocol.resources import ResourceNames

__all__ = ["cel_list", "cel_string", "container_asks", "gpu_pod_expression"]

_DEFAULT_NAMES: Final = ResourceNames()


def cel_string(text: str) -> str:
    """``text`` as a CEL string literal. What goes in (paths from the configuration, reasons from
    code) needs no escaping: ValueError for text holding ``'`` or ``\\``."""
    if "'" in text or "\\" in text:
        raise ValueError(f"{text!r}: may not hold ' or \\ (it goes into a CEL string)")
    return f"'{text}'"


def cel_list(items: Sequence[str]) -> str:
    """``items`` as a CEL list of string literals (``['a', 'b']``; the chart writes the same form)."""
    return json.dumps(list(items)).replace('"', "'")


def container_asks(var: str, names: Sequence[str]) -> str:
    """CEL: the container ``var`` names one of ``names`` in its limits or requests."""
    wanted = cel_list(names)
    return (
        f"has({var}.resources) && ("
        f"(has({var}.resources.limits) && {wanted}.exists(r, r in {var}.resources.limits)) || "
        f"(has({var}.resources.requests) && {wanted}.exists(r, r in {var}.resources.requests)))"
    )


def gpu_pod_expression(names: ResourceNames = _DEFAULT_NAMES) -> str:
    """CEL that is true for a pod naming any of our GPU resources (as ``requests_any_gpu``)."""
    clause = container_asks("c", names.gpu_asks)
    return (
        f"object.spec.containers.exists(c, {clause}) || "
        f"(has(object.spec.initContainers) && object.spec.initContainers.exists(c, {clause}))"
    )
