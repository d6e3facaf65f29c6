"""What the webhook does to a pod: a pure function from a pod and settings to a decision.

The rules follow HAMi's webhook (``pkg/scheduler/webhook.go``, NVIDIA ``MutateAdmission``) with the
request parsing and defaulting taken from ``hamipy.protocol.resources`` (docs/wire-format.md#resources),
and the places where a GPU pod could bypass our scheduler or choose its own limits closed:

1. A pod that names none of our resources (``requests_any_gpu``) is allowed unchanged.
2. A GPU pod with ``spec.nodeName`` already set is refused, whichever scheduler it names: it would
   reach a node without our scheduler choosing its GPUs. So is a GPU pod with a ``cdi.k8s.io/``
   annotation (``hamipy.protocol.reserved_annotations``): a runtime may take CDI devices from it.
3. A GPU pod naming another scheduler is refused, except ``default-scheduler`` (what the apiserver
   fills in when a pod names none) while ``overwrite_default_scheduler`` is on, which is taken, and
   the ``allowed_schedulers``, whose pods are allowed unchanged (their GPUs come from another
   device plugin) once they pass rule 5.
4. Every container's GPU quantities must be whole, non-negative and in range, or the pod is refused
   with the message ``hamipy.protocol`` gives (naming the container and the value).
5. A container may not set the env ``hamipy.protocol.reserved_env`` reserves (a container asking
   for the GPU count, after the defaults: the limit and interposer variables; any container:
   ``NVIDIA_VISIBLE_DEVICES`` other than ``none``), by ``env`` or by an ``envFrom`` prefix; and a
   container asking for the GPU count may not mount a volume where the device plugin mounts the
   interposer and its limits (``hamipy.protocol.reserved_mounts``: at or under ``hook_path`` or
   ``/etc/ld.so.preload``, at a parent of either, or at a path that is not canonical).
6. A pod that, after the defaults, asks for no GPU is allowed unchanged.
7. A GPU pod with a privileged container is refused: it would see every GPU of its node.
8. Otherwise the patch sets ``schedulerName``, adds the count/exclusive-cores defaults,
   ``NVIDIA_VISIBLE_DEVICES=none`` on containers without a GPU (``overwrite_env``), the runtime
   class (when configured and unset), and the pod's trace context annotation (when absent). It adds
   no other env: the priority and core policy travel with the device plugin's limits, and the
   admission policy refuses pods whose own env sets them.

Unlike upstream, which appends env entries on every admission, each change is made only when the
pod lacks it, so mutating the mutated pod yields an empty patch (``reinvocationPolicy: IfNeeded``
and retried admissions are harmless). Init containers get the same treatment as containers, as in
current upstream: they take device-list slots too (docs/wire-format.md#device-lists).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal, NamedTuple

from hamipy.protocol import keys
from hamipy.protocol.allocation_env import DEFAULT_HOOK_PATH, ENV_VISIBLE_DEVICES
from hamipy.protocol.config import Config
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.reserved_annotations import reserved_annotation_use
from hamipy.protocol.reserved_env import VISIBLE_NONE, reserved_env_use
from hamipy.protocol.reserved_mounts import reserved_mount_paths, reserved_mount_use
from hamipy.protocol.resources import (
    RequestDefaults,
    ResourceNames,
    container_label,
    container_request,
    requests_any_gpu,
    validate_webhook_container,
    webhook_container_defaults,
)
from hamipy.webhook.admission import PatchOp

__all__ = [
    "DEFAULT_SCHEDULER",
    "Decision",
    "MutationSettings",
    "Outcome",
    "Reason",
    "decide",
    "pointer_token",
]

DEFAULT_SCHEDULER: Final = "default-scheduler"

Outcome = Literal["mutated", "allowed", "refused"]
Reason = Literal[
    "not_pod",
    "not_create",
    "not_gpu_pod",
    "other_scheduler",
    "no_gpu_asked",
    "patched",
    "unchanged",
    "invalid_resource",
    "privileged",
    "node_name",
    "scheduler_not_allowed",
    "reserved_env",
    "reserved_mount",
    "reserved_annotation",
]
_CONTAINER_KINDS: Final = ("initContainers", "containers")
_EPHEMERAL: Final = "ephemeralContainers"


@dataclasses.dataclass(frozen=True, slots=True)
class MutationSettings:
    """What the webhook needs of the configuration (``from_config`` builds it from the shared one)."""

    scheduler_name: str = "hami-scheduler"
    """The scheduler GPU pods are sent to (the kube-scheduler profile that calls our extender)."""
    overwrite_default_scheduler: bool = True
    """Take pods naming ``default-scheduler`` too: the apiserver fills it in for pods naming none."""
    allowed_schedulers: frozenset[str] = frozenset()
    """Other schedulers whose GPU pods are allowed unchanged; a GPU pod naming any other is refused."""
    names: ResourceNames = dataclasses.field(default_factory=ResourceNames)
    """Our extended resource names."""
    request_defaults: RequestDefaults = dataclasses.field(default_factory=RequestDefaults)
    """Default memory and cores, used to check a pod's asks the way the scheduler will read them."""
    default_gpu_count: int = 1
    """vGPUs added to a container asking for memory or cores without a count; 0 turns that off."""
    overwrite_env: bool = False
    """Add ``NVIDIA_VISIBLE_DEVICES=none`` to containers of a GPU pod that ask for no GPU, so the
    NVIDIA runtime does not hand them every GPU of the node. Off by default, as in HAMi."""
    runtime_class_name: str | None = None
    """``runtimeClassName`` given to GPU pods that set none (e.g. ``nvidia``); None leaves it."""
    hook_path: str = DEFAULT_HOOK_PATH
    """Where the device plugin mounts the interposer in GPU containers (``nvidia.hookPath``): no
    volume of theirs may go there, nor at a parent of it."""

    @classmethod
    def from_config(
        cls, config: Config, *, overwrite_env: bool = False, runtime_class_name: str | None = None
    ) -> MutationSettings:
        """Settings from the shared configuration; the two webhook-only settings come from flags."""
        nvidia = config.nvidia
        return cls(
            scheduler_name=config.scheduler_name,
            overwrite_default_scheduler=config.force_overwrite_default_scheduler,
            allowed_schedulers=frozenset(config.allowed_schedulers),
            names=nvidia.resource_names,
            request_defaults=nvidia.request_defaults,
            default_gpu_count=nvidia.default_gpu_num,
            overwrite_env=overwrite_env or nvidia.overwrite_env,
            runtime_class_name=runtime_class_name or None,
            hook_path=nvidia.hook_path,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """The answer for one pod: ``outcome`` and a fixed ``reason`` (metric labels), the JSONPatch
    (only when mutated) and, for a refusal, the message shown to the user."""

    outcome: Outcome
    reason: Reason
    patch: tuple[PatchOp, ...] = ()
    message: str = ""

    @property
    def allowed(self) -> bool:
        return self.outcome != "refused"


class _Plan(NamedTuple):
    """One container: where it is, what it is, and what the webhook adds to it."""

    path: str
    container: Mapping[str, Any]
    label: str
    add_limits: Mapping[str, str]
    asks: bool


def pointer_token(key: str) -> str:
    """One JSON Pointer reference token (RFC 6901): ``~`` as ``~0``, then ``/`` as ``~1``."""
    return key.replace("~", "~0").replace("/", "~1")


def _containers(spec: Mapping[str, Any], kind: str) -> Sequence[Mapping[str, Any]]:
    containers: Sequence[Mapping[str, Any]] = spec.get(kind) or ()
    return containers


def _is_privileged(container: Mapping[str, Any]) -> bool:
    return (container.get("securityContext") or {}).get("privileged") is True


class _Patch:
    """Collects JSONPatch operations against the original pod, creating parents once."""

    def __init__(self) -> None:
        self.ops: list[PatchOp] = []

    def set_member(self, parent: str, obj: Mapping[str, Any] | None, key: str, value: Any) -> None:
        """Set ``obj[key] = value`` where ``obj`` is found at pointer ``parent`` (None: absent)."""
        path = f"{parent}/{pointer_token(key)}"
        if obj is not None and obj.get(key) is not None:
            self.ops.append({"op": "replace", "path": path, "value": value})
        else:
            self.ops.append({"op": "add", "path": path, "value": value})

    def add_map_entries(
        self, parent: str, container: Mapping[str, Any], key: str, entries: Mapping[str, Any]
    ) -> None:
        """Add ``entries`` to the map at ``container[key]``, creating the map when absent."""
        if container.get(key) is None:
            self.ops.append({"op": "add", "path": f"{parent}/{pointer_token(key)}", "value": dict(entries)})
            return
        base = f"{parent}/{pointer_token(key)}"
        for name, value in entries.items():
            self.ops.append({"op": "add", "path": f"{base}/{pointer_token(name)}", "value": value})

    def set_env(self, parent: str, container: Mapping[str, Any], wanted: Mapping[str, str]) -> None:
        """Make the container's env hold ``wanted`` (name -> value), touching nothing else."""
        if not wanted:
            return
        env = container.get("env")
        if env is None:
            entries = [{"name": name, "value": value} for name, value in wanted.items()]
            self.ops.append({"op": "add", "path": f"{parent}/env", "value": entries})
            return
        positions = {e["name"]: i for i, e in enumerate(env) if "name" in e}
        for name, value in wanted.items():
            index = positions.get(name)
            entry = {"name": name, "value": value}
            if index is None:
                self.ops.append({"op": "add", "path": f"{parent}/env/-", "value": entry})
            elif env[index] != entry:
                self.ops.append({"op": "replace", "path": f"{parent}/env/{index}", "value": entry})


def _asks_count(container: Mapping[str, Any], names: ResourceNames, added: Mapping[str, str]) -> bool:
    """Whether the container names the GPU count (limits or requests, or among ``added``): what
    makes it a GPU container for the reserved env and mounts, as the admission policies read it."""
    if names.count in added:
        return True
    resources = container.get("resources") or {}
    return any(names.count in (resources.get(section) or {}) for section in ("limits", "requests"))


def _reserved_refusal(
    spec: Mapping[str, Any], settings: MutationSettings, added: Mapping[str, Mapping[str, str]]
) -> Decision | None:
    """The refusal for the first container that sets reserved env or, asking for GPUs, mounts a
    volume over a reserved path (``added``: the limits the webhook adds, by container path), or None."""
    reserved = reserved_mount_paths([settings.hook_path])
    for kind in (*_CONTAINER_KINDS, _EPHEMERAL):
        for index, container in enumerate(_containers(spec, kind)):
            gpu = _asks_count(container, settings.names, added.get(f"/spec/{kind}/{index}", {}))
            label = container_label(kind, index, container)
            problem = reserved_env_use(container, gpu=gpu, label=label)
            if problem is not None:
                return Decision("refused", "reserved_env", message=problem)
            problem = reserved_mount_use(container, reserved=reserved, label=label) if gpu else None
            if problem is not None:
                return Decision("refused", "reserved_mount", message=problem)
    return None


def _scheduler_refusal(scheduler: str, settings: MutationSettings) -> Decision:
    allowed = ", ".join(sorted(settings.allowed_schedulers)) or "none"
    # Without a name the API server fills in default-scheduler: removing it helps only where that is taken.
    remove = " (or remove it)" if settings.overwrite_default_scheduler else ""
    return Decision(
        "refused",
        "scheduler_not_allowed",
        message=(
            f"spec.schedulerName is {scheduler!r}: a pod asking for shared GPUs is placed by "
            f"{settings.scheduler_name}, which chooses its GPUs; set spec.schedulerName to "
            f"{settings.scheduler_name}{remove}, or ask an admin to add {scheduler!r} to allowedSchedulers "
            f"of the hami-py configuration (allowed: {allowed}), for pods whose GPUs come from another "
            "device plugin"
        ),
    )


def decide(
    pod: Mapping[str, Any], settings: MutationSettings, *, trace_context: str | None = None
) -> Decision:
    """The decision for a pod being created (rules in the module docstring); ``pod`` as
    ``hamipy.protocol.kube_objects.plain`` gives it (the fields read, each of its JSON type).

    ``trace_context`` is the W3C ``traceparent`` of the admission span; it is recorded in the pod
    annotation ``keys.TRACE_CONTEXT`` unless the pod already carries one.
    """
    names = settings.names
    if not requests_any_gpu(pod, names):
        return Decision("allowed", "not_gpu_pod")
    spec: Mapping[str, Any] = pod["spec"]  # requests_any_gpu found containers in it

    # Before anything lets the pod through: a GPU pod that names its node bypasses every scheduler.
    node_name = spec.get("nodeName")
    if node_name:
        return Decision(
            "refused",
            "node_name",
            message=(
                f"spec.nodeName is already set ({node_name!r}): a pod asking for shared GPUs must be placed "
                f"by {settings.scheduler_name}, which chooses its GPUs; remove spec.nodeName"
            ),
        )
    problem = reserved_annotation_use(pod)
    if problem is not None:
        return Decision("refused", "reserved_annotation", message=problem)
    scheduler = spec.get("schedulerName")
    if (
        scheduler
        and scheduler != settings.scheduler_name
        and not (scheduler == DEFAULT_SCHEDULER and settings.overwrite_default_scheduler)
    ):
        if scheduler not in settings.allowed_schedulers:
            return _scheduler_refusal(scheduler, settings)
        return _reserved_refusal(spec, settings, {}) or Decision("allowed", "other_scheduler")

    # Validate every container and work out, per container, what it asks after the defaults.
    plans: list[_Plan] = []
    try:
        for kind in _CONTAINER_KINDS:
            for index, container in enumerate(_containers(spec, kind)):
                label = container_label(kind, index, container)
                validate_webhook_container(container, names=names, label=label)
                defaults = webhook_container_defaults(
                    container, names=names, default_gpu_count=settings.default_gpu_count, label=label
                )
                asks = defaults.has_resource or (
                    container_request(container, names=names, defaults=settings.request_defaults, label=label)
                    is not None
                )
                plans.append(_Plan(f"/spec/{kind}/{index}", container, label, defaults.add_limits, asks))
    except ProtocolError as exc:
        return Decision("refused", "invalid_resource", message=f"invalid GPU request: {exc}")

    refusal = _reserved_refusal(spec, settings, {plan.path: plan.add_limits for plan in plans})
    if refusal is not None:
        return refusal
    if not any(plan.asks for plan in plans):
        return Decision("allowed", "no_gpu_asked")

    for plan in plans:
        if _is_privileged(plan.container):
            return Decision(
                "refused",
                "privileged",
                message=(
                    f"container {plan.label} is privileged: a privileged container sees every GPU of "
                    "its node, so a pod asking for shared GPUs may not have one"
                ),
            )

    patch = _Patch()
    if scheduler != settings.scheduler_name:
        patch.set_member("/spec", spec, "schedulerName", settings.scheduler_name)
    if settings.runtime_class_name and not spec.get("runtimeClassName"):
        patch.set_member("/spec", spec, "runtimeClassName", settings.runtime_class_name)
    metadata = pod.get("metadata")
    annotations = (metadata or {}).get("annotations") or {}
    if trace_context and not annotations.get(keys.TRACE_CONTEXT):
        if metadata is None:
            patch.ops.append(
                {
                    "op": "add",
                    "path": "/metadata",
                    "value": {"annotations": {keys.TRACE_CONTEXT: trace_context}},
                }
            )
        else:
            patch.add_map_entries("/metadata", metadata, "annotations", {keys.TRACE_CONTEXT: trace_context})

    for plan in plans:
        path = plan.path
        if plan.add_limits:
            resources = plan.container.get("resources")
            if resources is not None:
                patch.add_map_entries(f"{path}/resources", resources, "limits", plan.add_limits)
            else:
                patch.ops.append(
                    {"op": "add", "path": f"{path}/resources", "value": {"limits": dict(plan.add_limits)}}
                )
        if not plan.asks and settings.overwrite_env:
            patch.set_env(path, plan.container, {ENV_VISIBLE_DEVICES: VISIBLE_NONE})

    if not patch.ops:
        return Decision("allowed", "unchanged")
    return Decision("mutated", "patched", patch=tuple(patch.ops))
