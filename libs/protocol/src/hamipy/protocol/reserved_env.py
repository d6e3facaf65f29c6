"""The environment variables a pod's own spec may not set (docs/security.md, rule 8).

The kubelet gives a container the device plugin's Allocate env first and the container's own env
after it, and the runtime keeps the last value: a container that sets a limit variable itself
chooses its own limit. So two sets of names are reserved, and refused at admission:

- in a container that asks for the GPU count resource (limits or requests): the memory and SM
  limits with their per-device forms (``CUDA_DEVICE_MEMORY_LIMIT_<i>``, ``CUDA_DEVICE_SM_LIMIT_<i>``),
  the task priority, the core policy, the region file path, ``CUDA_OVERSUBSCRIBE``,
  ``CUDA_DISABLE_CONTROL`` (the device plugin leaves the interposer out for it) and ``LD_PRELOAD``
  (another library before the interposer, or in its place);
- in every container of every pod, init and ephemeral ones too: ``NVIDIA_VISIBLE_DEVICES`` with any
  value but ``none`` (what the webhook's ``overwriteEnv`` writes: no GPU). Under the NVIDIA container
  toolkit's default it picks which of the node's GPUs the container gets, whatever it asked for.

An ``envFrom`` source is judged by its ``prefix``: one that a reserved name starts with could set
that name, so it is refused. A source without a prefix cannot be judged at admission (a ConfigMap's
keys are not part of the pod, and may change later); docs/security.md says what keeps that safe.

Checked in two places from these names: the webhook (GPU pods, ``reserved_env_use``) and the
ValidatingAdmissionPolicy of ``hamipy.manifests.reserved_env_policy`` (every pod, in CEL, from
``GPU_CONTAINER_NAMES`` and ``PER_DEVICE_PATTERN``). Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from hamipy.protocol.allocation_env import (
    ENV_CORE_POLICY,
    ENV_DISABLE_CONTROL,
    ENV_MEMORY_LIMIT,
    ENV_OVERSUBSCRIBE,
    ENV_SHARED_CACHE,
    ENV_SM_LIMIT,
    ENV_TASK_PRIORITY,
    ENV_VISIBLE_DEVICES,
)

__all__ = [
    "ENV_LD_PRELOAD",
    "GPU_CONTAINER_NAMES",
    "GPU_RESERVED_REASON",
    "PER_DEVICE_NAMES",
    "PER_DEVICE_PATTERN",
    "PER_DEVICE_PREFIX_PATTERN",
    "VISIBLE_NONE",
    "VISIBLE_RESERVED_REASON",
    "gpu_prefix_reserved",
    "gpu_reserved",
    "reserved_env_use",
    "visible_devices_prefix",
]

ENV_LD_PRELOAD: Final = "LD_PRELOAD"
GPU_CONTAINER_NAMES: Final[tuple[str, ...]] = (
    ENV_MEMORY_LIMIT,
    ENV_SM_LIMIT,
    ENV_TASK_PRIORITY,
    ENV_DISABLE_CONTROL,
    ENV_CORE_POLICY,
    ENV_SHARED_CACHE,
    ENV_OVERSUBSCRIBE,
    ENV_LD_PRELOAD,
)
"""Reserved in a container asking for the GPU count, by exact name."""
PER_DEVICE_NAMES: Final[tuple[str, ...]] = (ENV_MEMORY_LIMIT, ENV_SM_LIMIT)
"""Reserved also as ``<name>_<digits>`` (the per-device limits)."""
PER_DEVICE_PATTERN: Final = f"^({'|'.join(PER_DEVICE_NAMES)})_[0-9]+$"
"""A per-device limit's name, as a regular expression both Python and CEL (RE2) read."""
PER_DEVICE_PREFIX_PATTERN: Final = f"^({'|'.join(PER_DEVICE_NAMES)})_[0-9]*$"
"""An ``envFrom`` prefix past a limit's name that a per-device name still starts with (a source
key of digits completes it); shorter prefixes are caught by ``GPU_CONTAINER_NAMES``."""
VISIBLE_NONE: Final = "none"
"""The one value of ``NVIDIA_VISIBLE_DEVICES`` a pod may set: the NVIDIA runtime hands it no GPU."""
GPU_RESERVED_REASON: Final = (
    "a variable the device plugin sets in a GPU container (the limits of its slice and the interposer "
    "switches), which a pod may not choose"
)
VISIBLE_RESERVED_REASON: Final = (
    "it would choose which GPUs of the node the NVIDIA runtime hands the container; only the device "
    f"plugin sets it (a pod may set only {VISIBLE_NONE}, no GPU)"
)
"""Why a name is refused, as the webhook's and the admission policy's messages say it (no quotes:
the policy writes them into CEL strings)."""

_PER_DEVICE: Final = re.compile(PER_DEVICE_PATTERN)
_PER_DEVICE_PREFIX: Final = re.compile(PER_DEVICE_PREFIX_PATTERN)


def gpu_reserved(name: str) -> bool:
    """Whether a container asking for GPUs may not set ``name`` itself."""
    return name in GPU_CONTAINER_NAMES or _PER_DEVICE.fullmatch(name) is not None


def gpu_prefix_reserved(prefix: str) -> bool:
    """Whether an ``envFrom`` source with this (non-empty) prefix could set a ``gpu_reserved`` name."""
    return bool(prefix) and (
        any(name.startswith(prefix) for name in GPU_CONTAINER_NAMES)
        or _PER_DEVICE_PREFIX.fullmatch(prefix) is not None
    )


def visible_devices_prefix(prefix: str) -> bool:
    """Whether an ``envFrom`` source with this (non-empty) prefix could set ``NVIDIA_VISIBLE_DEVICES``."""
    return bool(prefix) and ENV_VISIBLE_DEVICES.startswith(prefix)


def _source(entry: Mapping[str, Any]) -> str:
    for kind in ("configMapRef", "secretRef"):
        ref = entry.get(kind)
        if isinstance(ref, Mapping):
            name = ref.get("name")
            return f"{kind} {name!r}" if isinstance(name, str) else kind
    return "a source"


def reserved_env_use(container: Mapping[str, Any], *, gpu: bool, label: str) -> str | None:
    """The first reserved variable ``container`` sets (``env`` by name, ``envFrom`` by prefix), as a
    sentence naming the container (``label``, from ``resources.container_label``) and the variable;
    None when it sets none. ``gpu``: the container asks for the GPU count resource.

    Entries that are not objects, or names and prefixes that are not text, set nothing here (the
    API server refuses such a pod anyway).
    """
    env = container.get("env")
    for entry in env if isinstance(env, list) else ():
        name = entry.get("name") if isinstance(entry, Mapping) else None
        if not isinstance(name, str):
            continue
        if name == ENV_VISIBLE_DEVICES and entry.get("value") != VISIBLE_NONE:
            value = entry.get("value")
            shown = (
                f"to {value!r}"
                if isinstance(value, str)
                else "from valueFrom"
                if "valueFrom" in entry
                else "empty"
            )
            return f"container {label} sets {ENV_VISIBLE_DEVICES} {shown}: {VISIBLE_RESERVED_REASON}"
        if gpu and gpu_reserved(name):
            return f"container {label} sets {name}, {GPU_RESERVED_REASON}"
    env_from = container.get("envFrom")
    for entry in env_from if isinstance(env_from, list) else ():
        prefix = entry.get("prefix") if isinstance(entry, Mapping) else None
        if not isinstance(prefix, str):
            continue
        taken = f"container {label} takes env from {_source(entry)} with prefix {prefix!r}, which could set"
        if visible_devices_prefix(prefix):
            return f"{taken} {ENV_VISIBLE_DEVICES}: {VISIBLE_RESERVED_REASON}; use another prefix"
        if gpu and gpu_prefix_reserved(prefix):
            return f"{taken} {GPU_RESERVED_REASON}; use another prefix"
    return None
