"""What each container of a pod asks of the GPUs (docs/wire-format.md#resources), and the webhook's defaults.

A container asks through five extended resources (names configurable): a vGPU count, memory in
MiB or as a percentage of the device, a percentage of the device's SMs, and a task priority. Values
come from ``limits``, falling back to ``requests``, as upstream's ``GenerateResourceRequests``
(``pkg/device/nvidia/device.go``) reads them. The rules, kept exactly:

- no count (or count 0): the container asks for no GPU, whatever else it names;
- memory: ``gpumem`` if > 0; else the percentage of the device's ``devmem`` (integer division, so
  it is resolved per device by ``memory_for_device``); with neither, the configured default memory
  if non-zero, else 100 %;
- a percentage above 100 is clamped to 100; cores above 100 are clamped to 100; cores default to
  the configured default cores;
- cores = 100 asks for the GPU alone; a cores = 0 request is not placed on a GPU whose cores are
  all taken (``exclusive_conflict``, ``zero_core_conflict``, ``cores_fit``).

Where upstream silently reads a malformed value as "no GPU" or as zero, this module raises
``ProtocolError`` naming the container and the resource: negative values, fractions, garbage, and a
memory percentage of 0 without ``gpumem`` (upstream would hand out 0 MiB, which the interposer reads
as *no limit*).

The webhook rules (``webhook_container_defaults``) follow upstream's ``MutateAdmission``:
``mutateContainerResource`` and ``defaultExclusiveCoreIfNeeded``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Final

from hamipy.protocol import keys
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.quantities import parse_quantity, quantity_field

__all__ = [
    "FULL_CORES",
    "FULL_PERCENT",
    "ContainerRequest",
    "PodRequests",
    "RequestDefaults",
    "ResourceNames",
    "WebhookDefaults",
    "container_label",
    "container_request",
    "cores_fit",
    "exclusive_conflict",
    "is_exclusive",
    "memory_for_device",
    "pod_requests",
    "requests_any_gpu",
    "sidecar_positions",
    "validate_webhook_container",
    "webhook_container_defaults",
    "zero_core_conflict",
]

FULL_PERCENT: Final = 100
"""A memory percentage of the whole device."""
FULL_CORES: Final = 100
"""Cores asking for the whole GPU, and the clamp for larger asks."""


@dataclasses.dataclass(frozen=True, slots=True)
class ResourceNames:
    """The extended resource names of the five asks (HAMi's ``resource*Name`` settings).

    Upstream knows the count also as ``nvidia.com/vgpu`` only because clusters configure it that
    way (``resourceCountName: nvidia.com/vgpu``); it is never read alongside ``nvidia.com/gpu``.
    Configure ``count`` for such a cluster.
    """

    count: str = keys.RESOURCE_COUNT
    memory: str = keys.RESOURCE_MEMORY
    memory_percentage: str = keys.RESOURCE_MEMORY_PERCENTAGE
    cores: str = keys.RESOURCE_CORES
    priority: str = keys.RESOURCE_PRIORITY

    @property
    def gpu_asks(self) -> tuple[str, str, str, str]:
        """The names that ask for GPU capacity (priority alone asks for none)."""
        return (self.count, self.memory, self.memory_percentage, self.cores)

    @property
    def quota_keys(self) -> tuple[str, str]:
        """HAMi's ResourceQuota ``spec.hard`` keys limiting a namespace's GPU memory (MiB) and
        cores (percent), summed over the GPUs its pods hold: ``limits.<memory>``, ``limits.<cores>``."""
        return f"limits.{self.memory}", f"limits.{self.cores}"


@dataclasses.dataclass(frozen=True, slots=True)
class RequestDefaults:
    """Configured defaults (``nvidia.defaultMemory``, ``nvidia.defaultCores``).

    ``memory_mib`` 0 means "the whole device" (100 %); ``cores`` 0 means no compute share is
    reserved, so the container may land on any GPU with memory left.
    """

    memory_mib: int = 0
    cores: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class ContainerRequest:
    """One container's ask, per GPU, for ``count`` GPUs.

    Exactly one of ``memory_mib`` (MiB on each GPU) and ``memory_percentage`` (1-100 % of each GPU's
    ``devmem``) is set; ``memory_for_device`` turns either into MiB. ``cores`` is 0-100 percent of
    each GPU's SMs. ``priority`` is ``nvidia.com/priority`` (0 high, 1 low) or None when not asked.
    """

    count: int
    memory_mib: int | None
    memory_percentage: int | None
    cores: int
    priority: int | None = None

    def __post_init__(self) -> None:
        if (self.memory_mib is None) == (self.memory_percentage is None):
            raise ValueError("exactly one of memory_mib and memory_percentage must be set")


@dataclasses.dataclass(frozen=True, slots=True)
class PodRequests:
    """Per-container asks of a pod, positionally aligned with ``spec.initContainers`` and
    ``spec.containers``; None for a container that asks for no GPU."""

    init: tuple[ContainerRequest | None, ...]
    containers: tuple[ContainerRequest | None, ...]
    sidecars: frozenset[int] = frozenset()
    """Positions in ``init`` of native sidecars (``sidecar_positions``)."""

    @property
    def slots(self) -> tuple[ContainerRequest | None, ...]:
        """All containers in device-list slot order: init containers first
        (docs/wire-format.md#device-lists)."""
        return self.init + self.containers

    @property
    def any(self) -> bool:
        """Whether any container asks for a GPU."""
        return any(r is not None for r in self.slots)


@dataclasses.dataclass(frozen=True, slots=True)
class WebhookDefaults:
    """What the webhook adds to one container.

    ``add_limits`` maps resource names to quantity strings to add to ``resources.limits``;
    ``has_resource`` says whether the container asks for a GPU afterwards (the webhook then sets the
    pod's scheduler).
    """

    add_limits: Mapping[str, str]
    has_resource: bool


def container_label(kind: str, index: int, container: Mapping[str, Any]) -> str:
    """How errors name a container: ``containers[1] "train"``."""
    name = container.get("name")
    return f"{kind}[{index}] {name!r}" if isinstance(name, str) else f"{kind}[{index}]"


def _or_empty(value: Any) -> Any:
    # JSON null and an absent key mean the same; an empty list where an object belongs does not.
    return {} if value is None else value


def _resource_maps(container: Mapping[str, Any], label: str) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    resources = _or_empty(container.get("resources"))
    if not isinstance(resources, Mapping):
        raise ProtocolError(f"{label}.resources", resources, "must be an object")
    limits = _or_empty(resources.get("limits"))
    requests = _or_empty(resources.get("requests"))
    if not isinstance(limits, Mapping):
        raise ProtocolError(f"{label}.resources.limits", limits, "must be an object")
    if not isinstance(requests, Mapping):
        raise ProtocolError(f"{label}.resources.requests", requests, "must be an object")
    return limits, requests


def _value(limits: Mapping[str, Any], requests: Mapping[str, Any], name: str, label: str) -> int | None:
    """The named resource from limits, else requests, else None."""
    if name in limits:
        return parse_quantity(limits[name], resource=name, container=label)
    if name in requests:
        return parse_quantity(requests[name], resource=name, container=label)
    return None


def container_request(
    container: Mapping[str, Any],
    *,
    names: ResourceNames = ResourceNames(),
    defaults: RequestDefaults = RequestDefaults(),
    label: str = "container",
) -> ContainerRequest | None:
    """One container's ask (rules in the module docstring); None when it asks for no GPU.

    ``label`` names the container in errors (``container_label`` makes one).
    """
    limits, requests = _resource_maps(container, label)
    count = _value(limits, requests, names.count, label)
    if not count:
        return None
    memory = _value(limits, requests, names.memory, label) or 0
    percentage = _value(limits, requests, names.memory_percentage, label)
    cores = _value(limits, requests, names.cores, label)
    priority = _value(limits, requests, names.priority, label)

    memory_mib: int | None = None
    memory_percentage: int | None = None
    if memory > 0:
        memory_mib = memory
    elif percentage is not None:
        if percentage == 0:
            raise ProtocolError(
                quantity_field(names.memory_percentage, label),
                percentage,
                "must be 1-100 (0 % would leave the container with no memory limit at all)",
            )
        memory_percentage = min(percentage, FULL_PERCENT)
    elif defaults.memory_mib:
        memory_mib = defaults.memory_mib
    else:
        memory_percentage = FULL_PERCENT
    return ContainerRequest(
        count=count,
        memory_mib=memory_mib,
        memory_percentage=memory_percentage,
        cores=min(defaults.cores if cores is None else cores, FULL_CORES),
        priority=priority,
    )


def _containers(pod: Mapping[str, Any], kind: str) -> Sequence[Mapping[str, Any]]:
    spec = _or_empty(pod.get("spec"))
    if not isinstance(spec, Mapping):
        raise ProtocolError("spec", spec, "must be an object")
    containers = spec.get(kind)
    if containers is None:
        return []
    if not isinstance(containers, list) or not all(isinstance(c, Mapping) for c in containers):
        raise ProtocolError(f"spec.{kind}", containers, "must be a list of objects")
    return containers


def pod_requests(
    pod: Mapping[str, Any],
    *,
    names: ResourceNames = ResourceNames(),
    defaults: RequestDefaults = RequestDefaults(),
) -> PodRequests:
    """Per-container asks of a pod (the raw JSON dict), init containers and containers apart."""
    if not isinstance(pod, Mapping):
        raise ProtocolError("pod", pod, "must be an object")

    def asks(kind: str) -> tuple[ContainerRequest | None, ...]:
        return tuple(
            container_request(c, names=names, defaults=defaults, label=container_label(kind, i, c))
            for i, c in enumerate(_containers(pod, kind))
        )

    return PodRequests(
        init=asks("initContainers"), containers=asks("containers"), sidecars=sidecar_positions(pod)
    )


def sidecar_positions(pod: Mapping[str, Any]) -> frozenset[int]:
    """Positions in ``spec.initContainers`` of native sidecars (``restartPolicy: Always``, stable
    since Kubernetes 1.33): each starts in its turn among the init containers and then runs beside
    every later init container and the app containers for the pod's whole life, so what it holds is
    held with theirs (Kubernetes' effective requests, KEP-753), not only while it runs alone."""
    return frozenset(
        i for i, c in enumerate(_containers(pod, "initContainers")) if c.get("restartPolicy") == "Always"
    )


def requests_any_gpu(pod: Mapping[str, Any], names: ResourceNames = ResourceNames()) -> bool:
    """Whether any container (init or regular) names any of count, memory, percentage or cores in
    its limits or requests. Cheap: reads no values, so it never raises on a malformed quantity."""
    if not isinstance(pod, Mapping):
        raise ProtocolError("pod", pod, "must be an object")
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        return False
    asks = names.gpu_asks
    for kind in ("initContainers", "containers"):
        containers = spec.get(kind)
        if not isinstance(containers, list):
            continue
        for container in containers:
            resources = container.get("resources") if isinstance(container, Mapping) else None
            if not isinstance(resources, Mapping):
                continue
            for section in ("limits", "requests"):
                values = resources.get(section)
                if isinstance(values, Mapping) and any(name in values for name in asks):
                    return True
    return False


def memory_for_device(request: ContainerRequest, devmem: int) -> int:
    """MiB this request takes on a GPU with ``devmem`` MiB: ``memory_mib``, or the percentage of
    ``devmem`` rounded down (upstream: ``Totalmem * MemPercentagereq / 100``)."""
    if request.memory_mib is not None:
        return request.memory_mib
    percentage = request.memory_percentage
    if percentage is None:  # unreachable: ContainerRequest sets exactly one of the two
        raise ValueError("request has neither memory_mib nor memory_percentage")
    return devmem * percentage // FULL_PERCENT


def is_exclusive(cores: int) -> bool:
    """Whether a cores ask means "this GPU alone"."""
    return cores == FULL_CORES


def exclusive_conflict(cores: int, *, device_used: int, device_totalcore: int) -> bool:
    """Whether an exclusive ask is refused: the GPU already has a user.

    As upstream (``Fit``: ``Totalcore == 100 && Coresreq == 100 && Used > 0``), this applies only
    where ``devcore`` is 100: with core scaling above 1, 100 cores is one GPU's worth of an
    oversubscribed device, not the whole of it.
    """
    return is_exclusive(cores) and device_totalcore == FULL_CORES and device_used > 0


def zero_core_conflict(cores: int, *, device_usedcores: int, device_totalcore: int) -> bool:
    """Whether a cores = 0 ask is refused: every core of the GPU is taken (e.g. by an exclusive
    user), and a container with no compute share would starve there."""
    return cores == 0 and device_totalcore != 0 and device_usedcores >= device_totalcore


def cores_fit(cores: int, *, device_used: int, device_usedcores: int, device_totalcore: int) -> bool:
    """Whether a cores ask fits a GPU: enough cores left, no exclusivity conflict, no zero-core
    conflict (upstream ``Fit``'s three core checks, in its order)."""
    if device_totalcore - device_usedcores < cores:
        return False
    if exclusive_conflict(cores, device_used=device_used, device_totalcore=device_totalcore):
        return False
    return not zero_core_conflict(cores, device_usedcores=device_usedcores, device_totalcore=device_totalcore)


def validate_webhook_container(
    container: Mapping[str, Any],
    *,
    names: ResourceNames = ResourceNames(),
    label: str = "container",
) -> None:
    """Refuse, at admission, values the scheduler could only guess at.

    Every one of our resources present must be a whole, non-negative quantity, and a memory
    percentage must be 1-100 (upstream clamps above 100 when scheduling; at admission the user is
    told instead). Cores above 100 are clamped when scheduling, as upstream does, so they pass.
    """
    limits, requests = _resource_maps(container, label)
    for name in (names.count, names.memory, names.cores, names.priority):
        _value(limits, requests, name, label)
    percentage = _value(limits, requests, names.memory_percentage, label)
    if percentage is not None and not 1 <= percentage <= FULL_PERCENT:
        raise ProtocolError(quantity_field(names.memory_percentage, label), percentage, "must be 1-100")


def webhook_container_defaults(
    container: Mapping[str, Any],
    *,
    names: ResourceNames = ResourceNames(),
    default_gpu_count: int = 1,
    label: str = "container",
) -> WebhookDefaults:
    """The resources the webhook adds to one container (upstream ``MutateAdmission``).

    1. A count in ``limits`` means the container asks for a GPU. Without one, if ``limits`` names
       cores, memory or percentage and ``default_gpu_count`` > 0, the count is added as
       ``default_gpu_count`` (upstream looks at ``limits`` only here: extended resources must be
       in limits anyway).
    2. Then, where a count is present (limits or requests) and cores are not, cores = 100 is added
       if the percentage is present and equals 100, or, with no percentage, if no memory is asked:
       a whole-GPU ask gets the GPU alone. (Upstream adds 100, not the configured default cores.)

    The upstream webhook runs this for ``spec.containers`` only (not init containers) and skips
    privileged containers; that choice is the caller's. Only the value read here (percentage) is
    parsed; ``validate_webhook_container`` refuses malformed ones first.
    """
    limits, requests = _resource_maps(container, label)
    add: dict[str, str] = {}

    has_resource = names.count in limits
    other_asks = (names.cores, names.memory, names.memory_percentage)
    if not has_resource and default_gpu_count > 0 and any(name in limits for name in other_asks):
        add[names.count] = str(default_gpu_count)
        has_resource = True

    count_present = names.count in add or names.count in limits or names.count in requests
    cores_present = names.cores in limits or names.cores in requests
    if count_present and not cores_present:
        percentage = _value(limits, requests, names.memory_percentage, label)
        if percentage is not None:
            exclusive = percentage == FULL_PERCENT
        else:
            exclusive = names.memory not in limits and names.memory not in requests
        if exclusive:
            add[names.cores] = str(FULL_CORES)
            has_resource = True
    return WebhookDefaults(add_limits=add, has_resource=has_resource)
