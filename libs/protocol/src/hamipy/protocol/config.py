"""The shared configuration of every hami-py service, and its YAML form.

One schema for the webhook, the extender, the device plugin and the monitor, so that they cannot
disagree about a resource name or a split count. The YAML keys are camelCase and, where HAMi has the
same setting, spelled as in HAMi's ``hami-scheduler-device`` ConfigMap (``nvidia.deviceSplitCount``,
``nvidia.defaultGPUNum``, ...), so a HAMi config carries over with few edits::

    schedulerName: hami-scheduler
    nodeSchedulerPolicy: binpack
    gpuSchedulerPolicy: spread
    nvidia:
      deviceSplitCount: 10
      deviceMemoryScaling: 1.0
    nodeConfigs:
      - name: gpu-node-7
        deviceSplitCount: 4
        filterDevices: {uuid: [GPU-0fc3eda5-e98b-a25b-5b0d-cf5c855d1448], index: [3]}

Every model is frozen and refuses unknown keys: a misspelt key is an error, not a silently ignored
setting. Errors are ``ConfigError`` (a ``ProtocolError``) naming the key path
(``nvidia.deviceSplitCount``, ``nodeConfigs[0].name``) and the value. ``Config()`` is the all-defaults
configuration. Reading a file is the only I/O here (``load_config_file``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Hashable
from typing import Annotated, Any, Final, Literal, Self, TypeVar

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from hamipy.protocol import keys
from hamipy.protocol.allocation_env import DEFAULT_HOOK_PATH, CorePolicy
from hamipy.protocol.cdi import DEFAULT_SPEC_DIR, DeviceListStrategy
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.pod_preferences import GpuPolicy, NodePolicy, parse_gpu_policy
from hamipy.protocol.resources import RequestDefaults, ResourceNames

__all__ = [
    "DEFAULT_MIG_PROFILE_ALLOWLIST",
    "Config",
    "ConfigError",
    "FilterDevices",
    "MigProfileAllowlistEntry",
    "MigStrategy",
    "NodeConfig",
    "NodeSettings",
    "NvidiaConfig",
    "OperatingMode",
    "checked_hook_path",
    "load_config",
    "load_config_file",
]

# Extended resource names must be domain-qualified (Kubernetes: "<domain>/<name>").
_RESOURCE_NAME: Final = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
# A config file is a few kilobytes; this bounds what a mistaken path could make us read.
_MAX_FILE_BYTES: Final = 1 << 20

StrictInt = Annotated[int, pydantic.Strict()]
StrictBool = Annotated[bool, pydantic.Strict()]
Scaling = Annotated[float, pydantic.Strict(), Field(gt=0, allow_inf_nan=False)]
SplitCount = Annotated[int, pydantic.Strict(), Field(ge=1, le=1024)]
LogLevel = Annotated[int, pydantic.Strict(), Field(ge=0, le=4)]


class ConfigError(ProtocolError):
    """The configuration is malformed; ``field`` is the key path (``nvidia.deviceSplitCount``)."""


def _absolute_path(value: str) -> str:
    """``value`` as a host directory setting takes it: an absolute path without ``..``, its
    trailing ``/`` dropped; ValueError otherwise."""
    if not value.startswith("/") or "/../" in f"{value}/" or "\0" in value:
        raise ValueError("must be an absolute path without '..'")
    return value.rstrip("/") or "/"


def checked_hook_path(value: str) -> str:
    """``value`` as ``nvidia.hookPath`` takes it: an absolute path without ``..``, ``'`` or ``\\``
    (the admission policies hold it in CEL strings), its trailing ``/`` dropped; ValueError
    otherwise. ``hamipy-webhook manifest --hook-path`` takes the same."""
    path = _absolute_path(value)
    if "'" in value or "\\" in value:
        raise ValueError("may not hold ' or \\ (the admission policies hold it in CEL strings)")
    return path


def _log_level(value: Any) -> Any:
    # Upstream's libCudaLogLevel is a string ("0", "3"); YAML users write either form.
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return value


class _Model(BaseModel):
    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        alias_generator=to_camel,
        validate_by_alias=True,
        validate_by_name=True,
        use_attribute_docstrings=True,
    )


OperatingMode = Literal["hami-core", "mig"]
"""How a node shares its GPUs (HAMi's ``operatingmode``): ``hami-core``, slices limited by the
interposer, or ``mig``, dynamic MIG. HAMi's third mode, ``mps``, is not served by hami-py."""
MigStrategy = Literal["none", "single", "mixed"]
"""How a node that is not in ``mig`` operating mode serves GPUs already split into MIG instances
(NVIDIA's and HAMi's ``--mig-strategy``): ``none`` leaves a MIG-enabled GPU unregistered;
``single`` registers every instance as a device and needs every GPU MIG-enabled; ``mixed``
registers the instances of MIG-enabled GPUs and the other GPUs as shared GPUs."""


class MigProfileAllowlistEntry(_Model):
    """The MIG profiles a dynamic MIG GPU of these models publishes (HAMi's ``AllowedMigProfiles``)."""

    models: Annotated[tuple[Annotated[str, Field(min_length=1)], ...], Field(min_length=1)]
    """Model names, each matched as a substring of the GPU's NVML name (``A100-SXM4-40GB`` matches
    ``NVIDIA A100-SXM4-40GB``)."""
    profiles: Annotated[tuple[str, ...], Field(min_length=1)]
    """Profile names as NVIDIA writes them (``1g.5gb``): the slice count (``<n>g``), a dot, the rest.
    Memory, SM share and placements come from NVML on the node, never from here."""

    @field_validator("profiles")
    @classmethod
    def _profile_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for profile in value:
            # HAMi's ValidateMigProfileAllowlist: "<at least one character>g.<anything>".
            prefix, dot, _ = profile.partition(".")
            if not dot or len(prefix) < 2 or not prefix.endswith("g"):
                raise ValueError(f"invalid MIG profile {profile!r}: expected a name like 1g.5gb")
        return value


def _allowlist(*entries: tuple[tuple[str, ...], tuple[str, ...]]) -> tuple[MigProfileAllowlistEntry, ...]:
    return tuple(MigProfileAllowlistEntry(models=models, profiles=profiles) for models, profiles in entries)


DEFAULT_MIG_PROFILE_ALLOWLIST: Final = _allowlist(
    (("A30",), ("1g.6gb", "2g.12gb", "4g.24gb")),
    (("A100-SXM4-40GB", "A100-40GB-PCIe", "A100-PCIE-40GB"), ("1g.5gb", "2g.10gb", "3g.20gb", "7g.40gb")),
    (
        ("A100-SXM4-80GB", "A100-80GB-PCIe", "A100-PCIE-80GB", "A100 80GB PCIe"),
        ("1g.10gb", "2g.20gb", "3g.40gb", "7g.79gb"),
    ),
    (
        ("H100-PCIE-80GB", "H100-SXM5-80GB", "H100 80GB HBM3", "H100 PCIe"),
        ("1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"),
    ),
    (("H100-PCIE-94GB", "H100-SXM5-94GB"), ("1g.12gb", "2g.24gb", "3g.47gb", "7g.94gb")),
    (("H200 NVL", "H200-SXM5", "H200"), ("1g.18gb", "2g.35gb", "3g.71gb", "7g.141gb")),
    (("H20", "H100 on GH200"), ("1g.12gb", "2g.24gb", "3g.48gb", "7g.96gb")),
    (("B200",), ("1g.23gb", "2g.45gb", "3g.90gb", "7g.180gb")),
    (("RTX PRO 6000 Blackwell Server Edition",), ("1g.24gb", "2g.48gb", "4g.96gb")),
)
"""HAMi's chart default (``nvidia.migProfileAllowlist`` of its ``hami-scheduler-device`` ConfigMap)
with two corrections. The names NVML reports for an A100 80GB PCIe, an H100 SXM or PCIe and an
H200 SXM (``NVIDIA A100 80GB PCIe``, ``NVIDIA H100 80GB HBM3``, ``NVIDIA H100 PCIe``,
``NVIDIA H200``) contain none of HAMi's model strings, so they are added. And the H200 entry comes
before the H20 one: ``H20`` is part of every H200's name, and the first match wins."""


class NvidiaConfig(_Model):
    """Device settings (HAMi's ``nvidia`` section). Node-level ones may be overridden per node."""

    resource_count_name: str = keys.RESOURCE_COUNT
    """Resource counting vGPUs. HAMi's name; some clusters use ``nvidia.com/vgpu``."""
    resource_memory_name: str = keys.RESOURCE_MEMORY
    """Resource asking for MiB of device memory per GPU."""
    resource_memory_percentage_name: str = keys.RESOURCE_MEMORY_PERCENTAGE
    """Resource asking for a percentage of each GPU's memory."""
    resource_core_name: str = keys.RESOURCE_CORES
    """Resource asking for a percentage of each GPU's SMs."""
    resource_priority_name: str = keys.RESOURCE_PRIORITY
    """Resource carrying the task priority (0 high, 1 low) into ``CUDA_TASK_PRIORITY``."""

    device_split_count: SplitCount = 10
    """Containers that may share one GPU (fake devices advertised per GPU). 10 is HAMi's default:
    enough sharing for inference pods without a GPU's context overhead dominating its memory."""
    device_memory_scaling: Scaling = 1.0
    """Factor on each GPU's registered memory (``devmem``). Above 1 oversubscribes memory: slices
    placed on a GPU may together ask for more than it has. Nothing spills to host memory (neither
    our interposer nor HAMi-core does; ``CUDA_OVERSUBSCRIBE`` is set for HAMi and read by neither):
    once the card is full, an allocation within a container's own limit fails with out-of-memory.
    1 promises only what exists."""
    device_core_scaling: Scaling = 1.0
    """Factor on each GPU's registered cores (``devcore`` = 100 x scaling). 1 promises exactly one
    GPU's SMs; above 1 lets core asks add up to more than 100 %."""
    default_memory: Annotated[StrictInt, Field(ge=0, alias="defaultMemory")] = 0
    """MiB given to a container that asks for neither memory nor a percentage. 0 means the whole
    GPU (100 %), HAMi's default: a container that says nothing gets no surprise limit."""
    default_cores: Annotated[StrictInt, Field(ge=0, le=100)] = 0
    """Percent of SMs given to a container that asks for no cores. 0 reserves none, so such a
    container fits any GPU with memory left (HAMi's default)."""
    default_gpu_num: Annotated[StrictInt, Field(ge=0, le=64, alias="defaultGPUNum")] = 1
    """vGPUs the webhook adds to a container asking for memory or cores but no count. 1 is HAMi's
    default; 0 turns the rule off."""
    gpu_core_policy: CorePolicy = "default"
    """``GPU_CORE_UTILIZATION_POLICY``: ``default`` limits SMs only while others compete, ``force``
    always limits, ``disable`` never does. HAMi's default is ``default``."""
    disable_core_limit: StrictBool = False
    """Turn SM limiting off on the node (``GPU_CORE_UTILIZATION_POLICY=disable``); off by default
    because a cores ask should mean something."""
    lib_cuda_log_level: LogLevel | None = None
    """``LIBCUDA_LOG_LEVEL`` for the interposer, 0 (errors) to 4 (debug); unset leaves the
    interposer's own default, as HAMi does."""
    overwrite_env: StrictBool = False
    """Whether the webhook sets ``NVIDIA_VISIBLE_DEVICES=none`` in containers that ask for no GPU,
    so the NVIDIA runtime hands them none even on a GPU node (HAMi's ``overwriteEnv``). Off by
    default, as upstream: it changes containers that are not ours."""
    hook_path: str = DEFAULT_HOOK_PATH
    """Host directory holding ``libvgpu.so``, ``ld.so.preload`` and ``containers/`` (HAMi's
    ``HOOK_PATH`` + ``/vgpu``); the same path inside containers. HAMi's location, so nodes prepared
    for HAMi work unchanged."""
    device_list_strategy: DeviceListStrategy = "envvar"
    """How the device plugin hands a container its slot (named as NVIDIA's device plugin names its
    strategies): ``envvar`` answers Allocate with the env and mounts; ``cdi-cri`` with CDI device
    names, the slot's (its env and mounts in a spec file the plugin writes into ``cdiSpecDir``)
    and its GPUs' (``nvidia.com/gpu=<UUID>``, from the NVIDIA container toolkit's spec), for
    runtimes that take devices by CDI (the NVIDIA GPU operator's CDI mode). ``envvar`` by
    default: it needs nothing of the runtime but the NVIDIA toolkit's usual hook."""
    cdi_spec_dir: str = DEFAULT_SPEC_DIR
    """Host directory the container runtime reads CDI specs from, where the device plugin writes
    each slot's spec in ``cdi-cri`` mode (containerd's and CRI-O's default)."""
    mig_strategy: MigStrategy = "none"
    """How nodes not in ``mig`` operating mode serve pre-made MIG instances (``MigStrategy``).
    ``none``, NVIDIA's and HAMi's default: a GPU in MIG mode is left alone unless asked for."""
    mig_profile_allowlist: tuple[MigProfileAllowlistEntry, ...] = DEFAULT_MIG_PROFILE_ALLOWLIST
    """The profiles a dynamic MIG GPU (a node in ``mig`` operating mode) publishes: the first entry
    one of whose models is part of the GPU's NVML name. A GPU no entry names is not registered.
    HAMi's chart default, so its configuration carries over."""

    @field_validator("lib_cuda_log_level", mode="before")
    @classmethod
    def _log_level_text(cls, value: Any) -> Any:
        return _log_level(value)

    @field_validator(
        "resource_count_name",
        "resource_memory_name",
        "resource_memory_percentage_name",
        "resource_core_name",
        "resource_priority_name",
    )
    @classmethod
    def _resource_name(cls, value: str) -> str:
        if _RESOURCE_NAME.fullmatch(value) is None:
            raise ValueError("must be a domain-qualified resource name like nvidia.com/gpu")
        return value

    @field_validator("hook_path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        return checked_hook_path(value)

    @field_validator("cdi_spec_dir")
    @classmethod
    def _absolute_dir(cls, value: str) -> str:
        return _absolute_path(value)

    @model_validator(mode="after")
    def _distinct_names(self) -> Self:
        names = self.resource_names
        if len({*names.gpu_asks, names.priority}) != 5:
            raise ValueError("the five resource names must be distinct")
        return self

    @property
    def resource_names(self) -> ResourceNames:
        """The resource names, as ``hamipy.protocol.resources`` takes them."""
        return ResourceNames(
            count=self.resource_count_name,
            memory=self.resource_memory_name,
            memory_percentage=self.resource_memory_percentage_name,
            cores=self.resource_core_name,
            priority=self.resource_priority_name,
        )

    @property
    def request_defaults(self) -> RequestDefaults:
        """The default memory and cores, as ``hamipy.protocol.resources`` takes them."""
        return RequestDefaults(memory_mib=self.default_memory, cores=self.default_cores)


class FilterDevices(_Model):
    """GPUs of a node the device plugin leaves unregistered (HAMi's ``filterdevices``)."""

    uuid: tuple[str, ...] = ()
    """GPU UUIDs to leave out."""
    index: tuple[Annotated[StrictInt, Field(ge=0)], ...] = ()
    """NVML indices to leave out."""


class NodeConfig(_Model):
    """Per-node overrides (HAMi's device plugin ``nodeconfig``); unset fields inherit ``nvidia``."""

    name: Annotated[str, Field(min_length=1)]
    """Node name, matched exactly."""
    device_split_count: SplitCount | None = None
    """Overrides ``nvidia.deviceSplitCount`` on this node."""
    device_memory_scaling: Scaling | None = None
    """Overrides ``nvidia.deviceMemoryScaling`` on this node."""
    device_core_scaling: Scaling | None = None
    """Overrides ``nvidia.deviceCoreScaling`` on this node."""
    disable_core_limit: StrictBool | None = None
    """Overrides ``nvidia.disableCoreLimit`` on this node."""
    lib_cuda_log_level: LogLevel | None = None
    """Overrides ``nvidia.libCudaLogLevel`` on this node."""
    filter_devices: FilterDevices | None = None
    """GPUs of this node not to register."""
    operating_mode: OperatingMode | None = Field(default=None, alias="operatingmode")
    """How this node's GPUs are shared (HAMi's ``operatingmode``): ``hami-core`` (the default:
    slices limited by the interposer) or ``mig`` (dynamic MIG: each MIG-capable GPU is carved into
    MIG instances on demand, with the profiles of ``nvidia.migProfileAllowlist``)."""
    mig_strategy: MigStrategy | None = Field(default=None, alias="migstrategy")
    """Overrides ``nvidia.migStrategy`` on this node (HAMi's ``migstrategy``)."""

    @field_validator("lib_cuda_log_level", mode="before")
    @classmethod
    def _log_level_text(cls, value: Any) -> Any:
        return _log_level(value)

    @model_validator(mode="after")
    def _one_kind_of_mig(self) -> Self:
        if self.operating_mode == "mig" and self.mig_strategy not in (None, "none"):
            raise ValueError(
                "a node in operatingmode mig makes its own MIG instances; migstrategy "
                f"{self.mig_strategy} (pre-made instances) cannot apply to it"
            )
        return self


@dataclasses.dataclass(frozen=True, slots=True)
class NodeSettings:
    """The effective device settings of one node (``Config.for_node``)."""

    device_split_count: int
    device_memory_scaling: float
    device_core_scaling: float
    disable_core_limit: bool
    lib_cuda_log_level: int | None
    filter_uuids: frozenset[str] = frozenset()
    filter_indices: frozenset[int] = frozenset()
    operating_mode: OperatingMode = "hami-core"
    mig_strategy: MigStrategy = "none"
    mig_profile_allowlist: tuple[MigProfileAllowlistEntry, ...] = DEFAULT_MIG_PROFILE_ALLOWLIST

    def filtered(self, uuid: str, index: int) -> bool:
        """Whether the GPU with this UUID or NVML index is left unregistered."""
        return uuid in self.filter_uuids or index in self.filter_indices

    def allowed_mig_profiles(self, model: str) -> tuple[str, ...]:
        """The MIG profile names a dynamic MIG GPU whose NVML name is ``model`` publishes: those of
        the first allow-list entry with a model that is part of ``model`` (HAMi's rule), else none."""
        for entry in self.mig_profile_allowlist:
            if any(name in model for name in entry.models):
                return entry.profiles
        return ()


class Config(_Model):
    """The whole configuration."""

    scheduler_name: Annotated[str, Field(min_length=1)] = "hami-scheduler"
    """``schedulerName`` the webhook gives GPU pods: the kube-scheduler profile that calls our
    extender. HAMi's name, so its KubeSchedulerConfiguration carries over."""
    force_overwrite_default_scheduler: StrictBool = True
    """Whether the webhook also takes pods that name ``default-scheduler`` (which the API server
    fills in when a pod names none). On, as HAMi: otherwise almost no GPU pod would be taken."""
    allowed_schedulers: tuple[Annotated[str, Field(min_length=1)], ...] = ()
    """Other schedulers whose GPU pods the webhook admits untouched. Their GPUs must come from
    another device plugin: ours serves only pods of ``schedulerName``. A GPU pod naming a scheduler
    that is neither ours, nor ``default-scheduler`` taken over, nor listed here is refused: it would
    reach a node without our scheduler choosing its GPUs. Empty by default."""
    node_scheduler_policy: NodePolicy = "binpack"
    """How nodes are ranked: ``binpack`` fills busy nodes first, keeping whole nodes free for big
    jobs (HAMi's default); ``spread`` prefers idle nodes."""
    gpu_scheduler_policy: tuple[GpuPolicy, ...] = ("spread",)
    """How GPUs of a node are ranked (a policy or chain like ``binpack,numa``): ``spread`` (HAMi's
    default) puts each pod on the least used GPU, so co-tenants disturb each other least."""
    nvidia: NvidiaConfig = Field(default_factory=NvidiaConfig)
    """Device settings."""
    node_configs: tuple[NodeConfig, ...] = ()
    """Per-node overrides, at most one per node name."""

    @field_validator("gpu_scheduler_policy", mode="before")
    @classmethod
    def _gpu_policy(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return parse_gpu_policy(value, field="gpuSchedulerPolicy")
            except ProtocolError as exc:
                raise ValueError(exc.reason) from None
        return value

    @field_validator("gpu_scheduler_policy")
    @classmethod
    def _gpu_policy_not_empty(cls, value: tuple[GpuPolicy, ...]) -> tuple[GpuPolicy, ...]:
        if not value:
            raise ValueError("must name at least one policy")
        return tuple(dict.fromkeys(value))

    @field_validator("node_configs")
    @classmethod
    def _unique_nodes(cls, value: tuple[NodeConfig, ...]) -> tuple[NodeConfig, ...]:
        seen: set[str] = set()
        for node in value:
            if node.name in seen:
                raise ValueError(f"node {node.name!r} is configured twice")
            seen.add(node.name)
        return value

    def for_node(self, name: str) -> NodeSettings:
        """The effective device settings of node ``name``: its ``nodeConfigs`` entry over ``nvidia``."""
        nv = self.nvidia
        node = next((n for n in self.node_configs if n.name == name), None)
        if node is None:
            return NodeSettings(
                device_split_count=nv.device_split_count,
                device_memory_scaling=nv.device_memory_scaling,
                device_core_scaling=nv.device_core_scaling,
                disable_core_limit=nv.disable_core_limit,
                lib_cuda_log_level=nv.lib_cuda_log_level,
                mig_strategy=nv.mig_strategy,
                mig_profile_allowlist=nv.mig_profile_allowlist,
            )
        filters = node.filter_devices or FilterDevices()
        return NodeSettings(
            device_split_count=_pick(node.device_split_count, nv.device_split_count),
            device_memory_scaling=_pick(node.device_memory_scaling, nv.device_memory_scaling),
            device_core_scaling=_pick(node.device_core_scaling, nv.device_core_scaling),
            disable_core_limit=_pick(node.disable_core_limit, nv.disable_core_limit),
            lib_cuda_log_level=_pick(node.lib_cuda_log_level, nv.lib_cuda_log_level),
            filter_uuids=frozenset(filters.uuid),
            filter_indices=frozenset(filters.index),
            operating_mode=_pick(node.operating_mode, "hami-core"),
            mig_strategy=_pick(node.mig_strategy, nv.mig_strategy),
            mig_profile_allowlist=nv.mig_profile_allowlist,
        )


_T = TypeVar("_T")


def _pick(override: _T | None, default: _T) -> _T:
    return default if override is None else override


def _path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "<root>"


def _config_error(exc: pydantic.ValidationError) -> ConfigError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    reason = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
    reason = reason.removeprefix("Value error, ")
    if len(errors) > 1:
        reason += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return ConfigError(_path(first["loc"]), first.get("input"), reason)


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (YAML keeps the last one silently)."""


def _mapping(loader: _Loader, node: yaml.MappingNode) -> dict[Hashable, Any]:
    loader.flatten_mapping(node)
    result: dict[Hashable, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node)
        if not isinstance(key, Hashable):
            raise ConfigError("<yaml>", key, f"unhashable key (line {key_node.start_mark.line + 1})")
        if key in result:
            raise ConfigError(str(key), key, f"duplicate key (line {key_node.start_mark.line + 1})")
        result[key] = loader.construct_object(value_node)
    return result


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)
# PyYAML follows YAML 1.1, where "1e-3" (no dot) is a string; YAML 1.2 and Go's yaml read a float.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def load_config(text: str) -> Config:
    """Parse and validate a YAML configuration; empty text is the all-defaults ``Config()``."""
    try:
        data = yaml.load(text, Loader=_Loader)  # a SafeLoader
    except yaml.YAMLError as exc:
        raise ConfigError("<yaml>", text, f"not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("<root>", data, "the configuration must be a mapping")
    try:
        return Config.model_validate(data, by_alias=True, by_name=False)
    except pydantic.ValidationError as exc:
        raise _config_error(exc) from exc


def load_config_file(path: str | os.PathLike[str]) -> Config:
    """``load_config`` on a file's contents (UTF-8)."""
    try:
        with open(path, "rb") as file:
            raw = file.read(_MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(os.fspath(path), os.fspath(path), f"cannot read: {exc.strerror}") from exc
    if len(raw) > _MAX_FILE_BYTES:
        raise ConfigError(os.fspath(path), len(raw), f"larger than {_MAX_FILE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(os.fspath(path), exc.start, "not UTF-8") from exc
    return load_config(text)
