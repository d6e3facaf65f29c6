"""The container paths a GPU container's own volumes may not cover (docs/security.md, rule 8).

The device plugin's Allocate mounts (``allocation_env.allocation_mounts``) put the interposer, the
container's region directory and its limits file at ``<hook>`` and the loader's preload list at
``/etc/ld.so.preload``. The kubelet passes the device plugin's mounts first and the pod's own after
them, and the runtime mounts them sorted by the depth of the cleaned path, keeping that order
between equals: a pod volume at one of those paths lands on top of ours. Over the limits file it
chooses the container's limits; over ``/etc/ld.so.preload`` or ``<hook>`` it leaves the interposer
out. A volume at a parent (``/``, ``/etc``, ``/usr/local``) is mounted before ours, but the pod
chooses what is in it, and the runtime follows links in a mount's destination: a link
``ld.so.preload -> /a/b/c/d`` in a volume at ``/etc`` sends our ``/etc/ld.so.preload`` to
``/a/b/c/d``, where the pod's deeper volume at ``/a/b/c`` lands on top of it.

So in a container that asks for the GPU count resource (limits or requests: the containers the
device plugin's mounts go to) a ``volumeMounts`` entry is refused when its ``mountPath``

- is a reserved path (``<hook>``, ``/etc/ld.so.preload``) or under one (it starts with the path and
  ``/``);
- is a parent of one (the path and ``/`` starts with it, a ``/`` added where it has none; ``/`` is
  a parent of every path); or
- is not canonical: relative (the kubelet makes ``etc/ld.so.preload`` absolute), holding ``//``,
  ``/./`` or ``/../``, or ending in ``/.`` or ``/..``. The runtime cleans the path, so such a path
  may be another spelling of a reserved one (``/usr/local//vgpu/limits``, ``/etc/./ld.so.preload``),
  and the API server checks neither.

The rule takes only equality, prefix, suffix and substring tests, so the ValidatingAdmissionPolicy
(``hamipy.manifests.reserved_mount_policy``) writes it in CEL from these constants, test for test.
Several hook paths may be reserved at once (nodes whose device plugins use different ones). Pure.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from typing import Any, Final

from hamipy.protocol.allocation_env import LD_SO_PRELOAD

__all__ = [
    "HOOK_REASON",
    "NOT_CANONICAL_ENDS",
    "NOT_CANONICAL_PARTS",
    "NOT_CANONICAL_REASON",
    "PARENT_REASON",
    "PRELOAD_REASON",
    "canonical",
    "folder",
    "reserved_mount_paths",
    "reserved_mount_use",
    "reserved_mount_why",
]

NOT_CANONICAL_PARTS: Final = ("//", "/./", "/../")
"""What a canonical ``mountPath`` holds nowhere."""
NOT_CANONICAL_ENDS: Final = ("/.", "/..")
"""What a canonical ``mountPath`` does not end with."""
HOOK_REASON: Final = (
    "it is in the interposer directory, where the device plugin mounts the interposer, the limits "
    "file of the container and its region directory; a volume of the pod there could replace them"
)
PRELOAD_REASON: Final = (
    f"it would cover {LD_SO_PRELOAD}, which the device plugin mounts to load the interposer into every "
    "process of the container; a pod may not replace it"
)
PARENT_REASON: Final = (
    "it is a parent of a path the device plugin mounts (the interposer directory or /etc/ld.so.preload), "
    "and the pod chooses what is in that volume: a link there could send that mount under another volume "
    "of the pod"
)
NOT_CANONICAL_REASON: Final = (
    "the path is not canonical (relative, or holding //, /./ or /..), and the container runtime cleans "
    "it, so it could be another spelling of a path the device plugin mounts; write it absolute, without them"
)
"""Why a ``mountPath`` is refused, as the webhook's and the admission policy's messages say it (no
quotes: the policy writes them into CEL strings)."""


def _clean(path: str) -> str:
    """An absolute path as the runtime cleans it (Go's ``filepath.Clean``: one leading ``/``)."""
    return "/" + posixpath.normpath(path).lstrip("/")


def reserved_mount_paths(hook_paths: Sequence[str]) -> tuple[str, ...]:
    """The reserved container paths for these hook paths (each cleaned; duplicates once): the hook
    directories, then ``/etc/ld.so.preload``."""
    return tuple(dict.fromkeys([*(_clean(hook) for hook in hook_paths), LD_SO_PRELOAD]))


def folder(path: str) -> str:
    """``path`` with a ``/`` added where it does not end in one: what every canonical path under it
    starts with (``/`` for ``/``). The admission policy writes the same in CEL."""
    return path if path.endswith("/") else path + "/"


def canonical(mount_path: str) -> bool:
    """Whether ``mount_path`` is absolute and spelled as the runtime would clean it (a trailing
    ``/`` aside)."""
    return (
        mount_path.startswith("/")
        and not any(part in mount_path for part in NOT_CANONICAL_PARTS)
        and not mount_path.endswith(NOT_CANONICAL_ENDS)
    )


def reserved_mount_why(mount_path: str, reserved: Sequence[str]) -> str | None:
    """Why a GPU container may not mount at ``mount_path`` (``reserved``: ``reserved_mount_paths``),
    or None when it may."""
    for path in reserved:
        if mount_path == path or mount_path.startswith(folder(path)):
            return PRELOAD_REASON if path == LD_SO_PRELOAD else HOOK_REASON
    if any(folder(path).startswith(folder(mount_path)) for path in reserved):
        return PARENT_REASON
    if not canonical(mount_path):
        return NOT_CANONICAL_REASON
    return None


def reserved_mount_use(container: Mapping[str, Any], *, reserved: Sequence[str], label: str) -> str | None:
    """The first ``volumeMounts`` entry of a GPU container that covers a reserved path, as a
    sentence naming the container (``label``, from ``resources.container_label``), the volume and
    the path; None when none does. Entries that are not objects, or paths that are not text, mount
    nothing here (the API server refuses such a pod anyway)."""
    mounts = container.get("volumeMounts")
    for entry in mounts if isinstance(mounts, list) else ():
        path = entry.get("mountPath") if isinstance(entry, Mapping) else None
        if not isinstance(path, str):
            continue
        why = reserved_mount_why(path, reserved)
        if why is not None:
            return f"container {label} mounts volume {entry.get('name')!r} at {path!r}: {why}"
    return None
