"""The scheduling preferences users set as pod annotations (docs/wire-format.md#user-annotations).

Parsed once into a frozen ``PodPreferences``; the extender then asks the predicates
(``type_allowed``, ``uuid_allowed``, ``mode_allowed``) per device. Every bad value is a
``ProtocolError`` naming the annotation and the value: upstream silently ignores most of them
(a ``numa-bind: "yes"`` is quietly false), which leaves users wondering why a pod went where it did.

Where upstream reads a list, items are trimmed and empty items dropped. Upstream does neither, so
``use-gputype: "A100,"`` holds an empty item that matches every type, and the documented example
``"Tesla V100-PCIE-32GB, NVIDIA A10"`` never matches ``NVIDIA A10`` because of the space; here both
do what they say.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Final, Literal, get_args

from hamipy.protocol import keys
from hamipy.protocol.devices import DEVICE_MODES, DeviceMode
from hamipy.protocol.errors import ProtocolError

__all__ = [
    "GPU_POLICIES",
    "NODE_POLICIES",
    "GpuPolicy",
    "NodePolicy",
    "PodPreferences",
    "ScoringWeights",
    "mode_allowed",
    "parse_gpu_policy",
    "parse_node_policy",
    "parse_preferences",
    "parse_scoring_weights",
    "preferences_of",
    "type_allowed",
    "uuid_allowed",
]

NodePolicy = Literal["binpack", "spread"]
GpuPolicy = Literal["binpack", "spread", "topology-aware", "mutex", "numa"]
NODE_POLICIES: Final[tuple[NodePolicy, ...]] = get_args(NodePolicy)
GPU_POLICIES: Final[tuple[GpuPolicy, ...]] = get_args(GpuPolicy)

# Go's strconv.ParseBool spellings, which upstream accepts for numa-bind; anything else is refused.
_TRUE: Final = frozenset({"1", "t", "T", "TRUE", "true", "True"})
_FALSE: Final = frozenset({"0", "f", "F", "FALSE", "false", "False"})
_WEIGHT_KEYS: Final = ("slot", "core", "memory")
# Weights are relative; a bound keeps the score arithmetic small and refuses typos like 1e9.
_MAX_WEIGHT: Final = 1_000_000


@dataclasses.dataclass(frozen=True, slots=True)
class ScoringWeights:
    """``hami.io/device-scoring-weights``: relative weights of slot, core and memory utilization in
    a device's score. Upstream's default (no annotation) is 1 each."""

    slot: int = 1
    core: int = 1
    memory: int = 1


@dataclasses.dataclass(frozen=True, slots=True)
class PodPreferences:
    """A pod's placement preferences. Empty/None fields mean "not asked": the configured default
    applies (policies) or nothing is filtered (types, UUIDs, mode)."""

    use_types: tuple[str, ...] = ()
    """Upper-cased substrings; a device must contain one of them (empty: any type)."""
    nouse_types: tuple[str, ...] = ()
    """Upper-cased substrings; a device containing any of them is refused."""
    use_uuids: frozenset[str] = frozenset()
    """Exact UUIDs; a device must be one of them (empty: any UUID)."""
    nouse_uuids: frozenset[str] = frozenset()
    """Exact UUIDs that are refused."""
    numa_bind: bool = False
    """All GPUs of a container on one NUMA node."""
    vgpu_mode: DeviceMode | None = None
    """Only devices registered in this mode."""
    node_policy: NodePolicy | None = None
    gpu_policy: tuple[GpuPolicy, ...] = ()
    """Policy chain in the order written, duplicates dropped (first one kept)."""
    scoring_weights: ScoringWeights | None = None


def _text(annotation: str, value: object) -> str:
    if not isinstance(value, str):
        raise ProtocolError(annotation, value, "an annotation value must be a string")
    return value


def _items(annotation: str, value: object) -> list[str]:
    return [item.strip() for item in _text(annotation, value).split(",") if item.strip()]


def parse_node_policy(value: object, *, field: str = keys.NODE_SCHEDULER_POLICY) -> NodePolicy:
    """``binpack`` or ``spread`` (surrounding whitespace ignored, as upstream)."""
    text = _text(field, value).strip()
    for policy in NODE_POLICIES:
        if text == policy:
            return policy
    raise ProtocolError(field, value, f"must be one of {', '.join(NODE_POLICIES)}")


def parse_gpu_policy(value: object, *, field: str = keys.GPU_SCHEDULER_POLICY) -> tuple[GpuPolicy, ...]:
    """A policy or a comma chain of them (``binpack,numa``), as upstream's
    ``IsValidGPUSchedulerPolicy``: items trimmed, every item known, none empty; duplicates dropped."""
    text = _text(field, value)
    chain: list[GpuPolicy] = []
    for raw in text.split(","):
        item = raw.strip()
        policy = next((p for p in GPU_POLICIES if p == item), None)
        if policy is None:
            reason = "has an empty item" if not item else f"has unknown policy {item!r}"
            raise ProtocolError(field, value, f"{reason}; known: {', '.join(GPU_POLICIES)}")
        if policy not in chain:
            chain.append(policy)
    return tuple(chain)


def parse_scoring_weights(value: object, *, field: str = keys.DEVICE_SCORING_WEIGHTS) -> ScoringWeights:
    """``slot=<n>,core=<n>,memory=<n>``: all three keys once, in any order, whitespace ignored;
    non-negative integers, not all zero."""
    weights: dict[str, int] = {}
    for raw in _text(field, value).split(","):
        key, sep, number = (part.strip() for part in raw.partition("="))
        if not sep or key not in _WEIGHT_KEYS:
            raise ProtocolError(field, value, f"items must be slot=<n>, core=<n> and memory=<n>; got {raw!r}")
        if key in weights:
            raise ProtocolError(field, value, f"names {key!r} twice")
        if not (number.isascii() and number.isdigit()) or int(number) > _MAX_WEIGHT:
            raise ProtocolError(field, value, f"{key} must be an integer 0-{_MAX_WEIGHT}; got {number!r}")
        weights[key] = int(number)
    missing = [k for k in _WEIGHT_KEYS if k not in weights]
    if missing:
        raise ProtocolError(field, value, f"misses {', '.join(missing)}")
    if not any(weights.values()):
        raise ProtocolError(field, value, "at least one weight must be positive")
    return ScoringWeights(**weights)


def _numa_bind(value: object) -> bool:
    text = _text(keys.NUMA_BIND, value).strip()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ProtocolError(keys.NUMA_BIND, value, 'must be "true" or "false"')


def _vgpu_mode(value: object) -> DeviceMode:
    text = _text(keys.VGPU_MODE, value).strip()
    for mode in DEVICE_MODES:
        if text == mode:
            return mode
    raise ProtocolError(keys.VGPU_MODE, value, f"must be one of {', '.join(DEVICE_MODES)}")


def parse_preferences(annotations: Mapping[str, Any] | None) -> PodPreferences:
    """The preferences in a pod's ``metadata.annotations`` (None or empty: no preferences)."""
    if not annotations:
        return PodPreferences()
    if not isinstance(annotations, Mapping):
        raise ProtocolError("metadata.annotations", annotations, "must be an object")
    get = annotations.get
    return PodPreferences(
        use_types=tuple(t.upper() for t in _items(keys.USE_GPU_TYPE, get(keys.USE_GPU_TYPE, ""))),
        nouse_types=tuple(t.upper() for t in _items(keys.NOUSE_GPU_TYPE, get(keys.NOUSE_GPU_TYPE, ""))),
        use_uuids=frozenset(_items(keys.USE_GPU_UUID, get(keys.USE_GPU_UUID, ""))),
        nouse_uuids=frozenset(_items(keys.NOUSE_GPU_UUID, get(keys.NOUSE_GPU_UUID, ""))),
        numa_bind=_numa_bind(annotations[keys.NUMA_BIND]) if keys.NUMA_BIND in annotations else False,
        vgpu_mode=_vgpu_mode(annotations[keys.VGPU_MODE]) if keys.VGPU_MODE in annotations else None,
        node_policy=(
            parse_node_policy(annotations[keys.NODE_SCHEDULER_POLICY])
            if keys.NODE_SCHEDULER_POLICY in annotations
            else None
        ),
        gpu_policy=(
            parse_gpu_policy(annotations[keys.GPU_SCHEDULER_POLICY])
            if keys.GPU_SCHEDULER_POLICY in annotations
            else ()
        ),
        scoring_weights=(
            parse_scoring_weights(annotations[keys.DEVICE_SCORING_WEIGHTS])
            if keys.DEVICE_SCORING_WEIGHTS in annotations
            else None
        ),
    )


def preferences_of(pod: Mapping[str, Any]) -> PodPreferences:
    """The preferences of a pod given as its raw JSON dict."""
    if not isinstance(pod, Mapping):
        raise ProtocolError("pod", pod, "must be an object")
    metadata = pod.get("metadata")
    if metadata is None:
        return PodPreferences()
    if not isinstance(metadata, Mapping):
        raise ProtocolError("metadata", metadata, "must be an object")
    return parse_preferences(metadata.get("annotations"))


def type_allowed(prefs: PodPreferences, device_type: str) -> bool:
    """Whether a device ``type`` (e.g. ``NVIDIA-Tesla V100-PCIE-32GB``) passes use/nouse-gputype:
    case-insensitive substring match, as upstream's ``checkGPUtype``."""
    upper = device_type.upper()
    if prefs.use_types and not any(t in upper for t in prefs.use_types):
        return False
    return not any(t in upper for t in prefs.nouse_types)


def uuid_allowed(prefs: PodPreferences, uuid: str) -> bool:
    """Whether a device UUID passes use/nouse-gpuuuid (exact match).

    Upstream ignores ``nouse-gpuuuid`` when ``use-gpuuuid`` is present; here both apply, so a UUID
    named in both is refused (the stricter reading of a contradictory pod).
    """
    if prefs.use_uuids and uuid not in prefs.use_uuids:
        return False
    return uuid not in prefs.nouse_uuids


def mode_allowed(prefs: PodPreferences, device_mode: str) -> bool:
    """Whether a device registered in ``device_mode`` passes ``nvidia.com/vgpu-mode``.

    A MIG device (an instance made beforehand, or a GPU carved per pod) goes only to a pod that
    asks for MIG. Upstream gives it to a pod that names no mode too; but such a pod asked for a
    slice held to its memory and cores ask, and an instance is neither: a 1g instance has a
    seventh of the SMs whatever ``gpucores`` says, and the profile's memory, not the ask."""
    if prefs.vgpu_mode is None:
        return device_mode != "mig"
    return prefs.vgpu_mode == device_mode
