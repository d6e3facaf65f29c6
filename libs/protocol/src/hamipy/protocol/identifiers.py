"""Identifiers that must not be mixed up, as distinct types (mypy refuses one where another
belongs): a node's name, a pod's UID, a GPU's UUID. Each is a ``str`` at run time."""

from __future__ import annotations

from typing import NewType

__all__ = ["GpuUuid", "NodeName", "PodUid"]

NodeName = NewType("NodeName", str)
PodUid = NewType("PodUid", str)
GpuUuid = NewType("GpuUuid", str)
