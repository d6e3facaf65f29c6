"""The shared configuration schema and its YAML form (hamipy.protocol.config)."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hamipy.protocol import config as config_module
from hamipy.protocol.config import (
    DEFAULT_MIG_PROFILE_ALLOWLIST,
    Config,
    ConfigError,
    FilterDevices,
    MigProfileAllowlistEntry,
    NodeConfig,
    NodeSettings,
    NvidiaConfig,
    load_config,
    load_config_file,
)
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.resources import RequestDefaults, ResourceNames

FULL_YAML = """
schedulerName: gpu-scheduler
forceOverwriteDefaultScheduler: false
allowedSchedulers: [volcano, default-scheduler]
nodeSchedulerPolicy: spread
gpuSchedulerPolicy: binpack,numa
nvidia:
  resourceCountName: nvidia.com/vgpu
  resourceMemoryName: nvidia.com/vgpumem
  resourceMemoryPercentageName: nvidia.com/vgpumem-percentage
  resourceCoreName: nvidia.com/vgpucores
  resourcePriorityName: nvidia.com/vgpupriority
  deviceSplitCount: 4
  deviceMemoryScaling: 1.5
  deviceCoreScaling: 2
  defaultMemory: 5000
  defaultCores: 20
  defaultGPUNum: 2
  gpuCorePolicy: force
  disableCoreLimit: true
  libCudaLogLevel: 3
  hookPath: /opt/hami/vgpu
nodeConfigs:
  - name: gpu-node-7
    deviceSplitCount: 2
    deviceMemoryScaling: 1.0
    deviceCoreScaling: 1.0
    disableCoreLimit: false
    libCudaLogLevel: "0"
    filterDevices:
      uuid: [GPU-0fc3eda5-e98b-a25b-5b0d-cf5c855d1448]
      index: [3]
  - name: gpu-node-8
    deviceSplitCount: 20
"""


def test_defaults() -> None:
    cfg = Config()
    assert cfg.scheduler_name == "hami-scheduler"
    assert cfg.force_overwrite_default_scheduler is True
    assert cfg.allowed_schedulers == ()
    assert cfg.node_scheduler_policy == "binpack"
    assert cfg.gpu_scheduler_policy == ("spread",)
    assert cfg.node_configs == ()
    assert cfg.nvidia == NvidiaConfig(
        resource_count_name="nvidia.com/gpu",
        resource_memory_name="nvidia.com/gpumem",
        resource_memory_percentage_name="nvidia.com/gpumem-percentage",
        resource_core_name="nvidia.com/gpucores",
        resource_priority_name="nvidia.com/priority",
        device_split_count=10,
        device_memory_scaling=1.0,
        device_core_scaling=1.0,
        default_memory=0,
        default_cores=0,
        default_gpu_num=1,
        gpu_core_policy="default",
        disable_core_limit=False,
        lib_cuda_log_level=None,
        hook_path="/usr/local/vgpu",
    )
    assert cfg.nvidia.overwrite_env is False


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "{}", "---\n"], ids=repr)
def test_empty_documents_are_the_defaults(text: str) -> None:
    assert load_config(text) == Config()


def test_full_yaml() -> None:
    cfg = load_config(FULL_YAML)
    assert cfg.scheduler_name == "gpu-scheduler"
    assert cfg.force_overwrite_default_scheduler is False
    assert cfg.allowed_schedulers == ("volcano", "default-scheduler")
    assert cfg.node_scheduler_policy == "spread"
    assert cfg.gpu_scheduler_policy == ("binpack", "numa")
    nv = cfg.nvidia
    assert nv.resource_names == ResourceNames(
        count="nvidia.com/vgpu",
        memory="nvidia.com/vgpumem",
        memory_percentage="nvidia.com/vgpumem-percentage",
        cores="nvidia.com/vgpucores",
        priority="nvidia.com/vgpupriority",
    )
    assert nv.request_defaults == RequestDefaults(memory_mib=5000, cores=20)
    assert (nv.device_split_count, nv.device_memory_scaling, nv.device_core_scaling) == (4, 1.5, 2.0)
    assert (nv.default_gpu_num, nv.gpu_core_policy, nv.disable_core_limit) == (2, "force", True)
    assert (nv.lib_cuda_log_level, nv.hook_path) == (3, "/opt/hami/vgpu")
    assert cfg.node_configs[0] == NodeConfig(
        name="gpu-node-7",
        device_split_count=2,
        device_memory_scaling=1.0,
        device_core_scaling=1.0,
        disable_core_limit=False,
        lib_cuda_log_level=0,
        filter_devices=FilterDevices(uuid=("GPU-0fc3eda5-e98b-a25b-5b0d-cf5c855d1448",), index=(3,)),
    )


def test_for_node_with_override() -> None:
    cfg = load_config(FULL_YAML)
    assert cfg.for_node("gpu-node-7") == NodeSettings(
        device_split_count=2,
        device_memory_scaling=1.0,
        device_core_scaling=1.0,
        disable_core_limit=False,
        lib_cuda_log_level=0,
        filter_uuids=frozenset({"GPU-0fc3eda5-e98b-a25b-5b0d-cf5c855d1448"}),
        filter_indices=frozenset({3}),
    )


def test_for_node_partial_override_inherits() -> None:
    assert load_config(FULL_YAML).for_node("gpu-node-8") == NodeSettings(
        device_split_count=20,
        device_memory_scaling=1.5,
        device_core_scaling=2.0,
        disable_core_limit=True,
        lib_cuda_log_level=3,
    )


def test_for_unlisted_node_is_the_global_settings() -> None:
    assert Config().for_node("any") == NodeSettings(
        device_split_count=10,
        device_memory_scaling=1.0,
        device_core_scaling=1.0,
        disable_core_limit=False,
        lib_cuda_log_level=None,
    )


MIG_YAML = """
nvidia:
  migStrategy: mixed
  migProfileAllowlist:
    - models: [A30]
      profiles: [1g.6gb]
    - models: [A100-SXM4-40GB, A100-PCIE-40GB]
      profiles: [1g.5gb, 3g.20gb]
    - models: [A100]
      profiles: [7g.40gb]
nodeConfigs:
  - {name: dynamic, operatingmode: mig}
  - {name: static, migstrategy: single}
  - {name: shared, operatingmode: hami-core, migstrategy: none}
"""


def test_mig_settings_per_node() -> None:
    cfg = load_config(MIG_YAML)
    assert cfg.nvidia.mig_strategy == "mixed"
    dynamic, static, shared, other = (cfg.for_node(n) for n in ("dynamic", "static", "shared", "other"))
    assert (dynamic.operating_mode, dynamic.mig_strategy) == ("mig", "mixed")
    assert (static.operating_mode, static.mig_strategy) == ("hami-core", "single")
    assert (shared.operating_mode, shared.mig_strategy) == ("hami-core", "none")
    assert (other.operating_mode, other.mig_strategy) == ("hami-core", "mixed")
    assert other.mig_profile_allowlist == cfg.nvidia.mig_profile_allowlist


def test_the_first_allowlist_entry_naming_the_model_wins() -> None:
    """HAMi's rule: a model matches as a substring of the NVML name; only the first match is used."""
    settings = load_config(MIG_YAML).for_node("dynamic")
    assert settings.allowed_mig_profiles("NVIDIA A100-SXM4-40GB") == ("1g.5gb", "3g.20gb")
    assert settings.allowed_mig_profiles("NVIDIA A100-SXM4-80GB") == ("7g.40gb",)
    assert settings.allowed_mig_profiles("NVIDIA A30") == ("1g.6gb",)
    assert settings.allowed_mig_profiles("NVIDIA L40S") == ()


def test_mig_defaults_are_hamis() -> None:
    cfg = Config()
    assert cfg.nvidia.mig_strategy == "none"
    assert cfg.nvidia.mig_profile_allowlist == DEFAULT_MIG_PROFILE_ALLOWLIST
    settings = cfg.for_node("any")
    assert (settings.operating_mode, settings.mig_strategy) == ("hami-core", "none")
    assert settings.allowed_mig_profiles("NVIDIA A100-SXM4-40GB") == (
        "1g.5gb",
        "2g.10gb",
        "3g.20gb",
        "7g.40gb",
    )
    h200 = ("1g.18gb", "2g.35gb", "3g.71gb", "7g.141gb")
    assert settings.allowed_mig_profiles("NVIDIA H200 NVL") == h200  # not H20's, whose name it holds
    assert settings.allowed_mig_profiles("NVIDIA H200") == h200
    assert settings.allowed_mig_profiles("NVIDIA H20") == ("1g.12gb", "2g.24gb", "3g.48gb", "7g.96gb")
    # NVML's names of the A100 80GB PCIe and the H100 SXM (the fake driver's too).
    assert settings.allowed_mig_profiles("NVIDIA A100 80GB PCIe")[-1] == "7g.79gb"
    assert settings.allowed_mig_profiles("NVIDIA H100 80GB HBM3")[-1] == "7g.80gb"
    assert len(DEFAULT_MIG_PROFILE_ALLOWLIST) == 9
    # The default passes the validation a configured list gets.
    for entry in DEFAULT_MIG_PROFILE_ALLOWLIST:
        assert MigProfileAllowlistEntry.model_validate(entry.model_dump()) == entry


def test_node_names_match_exactly() -> None:
    assert load_config(FULL_YAML).for_node("GPU-NODE-7").device_split_count == 4


@pytest.mark.parametrize(
    ("uuid", "index", "filtered"),
    [("GPU-0fc3eda5-e98b-a25b-5b0d-cf5c855d1448", 0, True), ("GPU-other", 3, True), ("GPU-other", 1, False)],
    ids=["by-uuid", "by-index", "kept"],
)
def test_filtered_devices(uuid: str, index: int, filtered: bool) -> None:
    assert load_config(FULL_YAML).for_node("gpu-node-7").filtered(uuid, index) is filtered


def test_python_construction_by_field_name() -> None:
    cfg = Config(
        nvidia=NvidiaConfig(device_split_count=3), node_configs=(NodeConfig(name="n", device_split_count=1),)
    )
    assert cfg.for_node("n").device_split_count == 1
    assert cfg.for_node("m").device_split_count == 3


def test_python_construction_by_yaml_key() -> None:
    # model_validate with no by_alias/by_name (what a service handed a dict does) takes the YAML keys.
    assert NvidiaConfig.model_validate({"deviceSplitCount": 3}) == NvidiaConfig(device_split_count=3)


def test_models_are_frozen() -> None:
    cfg = Config()
    with pytest.raises(pydantic.ValidationError):
        cfg.scheduler_name = "other"
    assert hash(cfg) == hash(Config())


def test_hook_path_trailing_slash_is_dropped() -> None:
    assert load_config("nvidia: {hookPath: /usr/local/vgpu/}").nvidia.hook_path == "/usr/local/vgpu"


def test_gpu_policy_as_list() -> None:
    assert load_config("gpuSchedulerPolicy: [mutex, binpack]").gpu_scheduler_policy == ("mutex", "binpack")


# errors: (id, yaml, key path, reason fragment, value shown)
BAD = [
    (
        "split-count-0",
        "nvidia:\n  deviceSplitCount: 0",
        "nvidia.deviceSplitCount",
        "greater than or equal to 1",
        "0",
    ),
    (
        "split-count-string",
        "nvidia:\n  deviceSplitCount: '10'",
        "nvidia.deviceSplitCount",
        "valid integer",
        "'10'",
    ),
    (
        "split-count-float",
        "nvidia:\n  deviceSplitCount: 2.5",
        "nvidia.deviceSplitCount",
        "valid integer",
        "2.5",
    ),
    (
        "split-count-bool",
        "nvidia:\n  deviceSplitCount: true",
        "nvidia.deviceSplitCount",
        "valid integer",
        "True",
    ),
    (
        "memory-scaling-0",
        "nvidia:\n  deviceMemoryScaling: 0",
        "nvidia.deviceMemoryScaling",
        "greater than 0",
        "0",
    ),
    (
        "memory-scaling-negative",
        "nvidia:\n  deviceMemoryScaling: -1.5",
        "nvidia.deviceMemoryScaling",
        "greater than 0",
        "-1.5",
    ),
    (
        "memory-scaling-nan",
        "nvidia:\n  deviceMemoryScaling: .nan",
        "nvidia.deviceMemoryScaling",
        "finite",
        "nan",
    ),
    ("core-scaling-inf", "nvidia:\n  deviceCoreScaling: .inf", "nvidia.deviceCoreScaling", "finite", "inf"),
    (
        "default-memory-negative",
        "nvidia:\n  defaultMemory: -1",
        "nvidia.defaultMemory",
        "greater than or equal to 0",
        "-1",
    ),
    (
        "default-cores-above-100",
        "nvidia:\n  defaultCores: 101",
        "nvidia.defaultCores",
        "less than or equal to 100",
        "101",
    ),
    (
        "default-gpu-negative",
        "nvidia:\n  defaultGPUNum: -1",
        "nvidia.defaultGPUNum",
        "greater than or equal to 0",
        "-1",
    ),
    (
        "core-policy",
        "nvidia:\n  gpuCorePolicy: always",
        "nvidia.gpuCorePolicy",
        "'default', 'force' or 'disable'",
        "'always'",
    ),
    (
        "log-level-5",
        "nvidia:\n  libCudaLogLevel: 5",
        "nvidia.libCudaLogLevel",
        "less than or equal to 4",
        "5",
    ),
    (
        "log-level-word",
        "nvidia:\n  libCudaLogLevel: debug",
        "nvidia.libCudaLogLevel",
        "valid integer",
        "'debug'",
    ),
    (
        "disable-core-limit-string",
        "nvidia:\n  disableCoreLimit: 'true'",
        "nvidia.disableCoreLimit",
        "valid boolean",
        "'true'",
    ),
    (
        "resource-name-unqualified",
        "nvidia:\n  resourceCountName: gpu",
        "nvidia.resourceCountName",
        "domain-qualified",
        "'gpu'",
    ),
    (
        "resource-names-clash",
        "nvidia:\n  resourceCoreName: nvidia.com/gpu",
        "nvidia",
        "distinct",
        "nvidia.com/gpu",
    ),
    (
        "hook-path-relative",
        "nvidia:\n  hookPath: usr/local/vgpu",
        "nvidia.hookPath",
        "absolute path",
        "'usr/local/vgpu'",
    ),
    (
        "hook-path-dotdot",
        "nvidia:\n  hookPath: /usr/../etc",
        "nvidia.hookPath",
        "without '..'",
        "'/usr/../etc'",
    ),
    (
        "hook-path-quote",
        'nvidia:\n  hookPath: "/opt/it\'s"',
        "nvidia.hookPath",
        "CEL strings",
        "/opt/it's",
    ),
    ("unknown-nvidia-key", "nvidia:\n  deviceSplitcount: 3", "nvidia.deviceSplitcount", "unknown key", "3"),
    ("snake-case-key", "nvidia:\n  device_split_count: 3", "nvidia.device_split_count", "unknown key", "3"),
    ("unknown-top-key", "schedulername: x", "schedulername", "unknown key", "'x'"),
    ("node-policy", "nodeSchedulerPolicy: numa", "nodeSchedulerPolicy", "'binpack' or 'spread'", "'numa'"),
    ("gpu-policy", "gpuSchedulerPolicy: best", "gpuSchedulerPolicy", "unknown policy 'best'", "'best'"),
    ("gpu-policy-empty", "gpuSchedulerPolicy: ''", "gpuSchedulerPolicy", "empty item", "''"),
    ("gpu-policy-empty-list", "gpuSchedulerPolicy: []", "gpuSchedulerPolicy", "at least one policy", "[]"),
    ("scheduler-name-empty", "schedulerName: ''", "schedulerName", "at least 1 character", "''"),
    (
        "overwrite-string",
        "forceOverwriteDefaultScheduler: 'yes'",
        "forceOverwriteDefaultScheduler",
        "valid boolean",
        "'yes'",
    ),
    ("nvidia-not-mapping", "nvidia: 3", "nvidia", "valid dictionary", "3"),
    (
        "node-without-name",
        "nodeConfigs:\n  - deviceSplitCount: 2",
        "nodeConfigs[0].name",
        "Field required",
        "deviceSplitCount",
    ),
    (
        "node-split-0",
        "nodeConfigs:\n  - {name: a}\n  - {name: b, deviceSplitCount: 0}",
        "nodeConfigs[1].deviceSplitCount",
        "greater than or equal to 1",
        "0",
    ),
    (
        "node-unknown-key",
        "nodeConfigs:\n  - {name: a, operatingMode: mig}",
        "nodeConfigs[0].operatingMode",
        "unknown key",
        "'mig'",
    ),
    (
        "node-operating-mode-mps",
        "nodeConfigs:\n  - {name: a, operatingmode: mps}",
        "nodeConfigs[0].operatingmode",
        "'hami-core' or 'mig'",
        "'mps'",
    ),
    (
        "node-mig-strategy-unknown",
        "nodeConfigs:\n  - {name: a, migstrategy: all}",
        "nodeConfigs[0].migstrategy",
        "'none', 'single' or 'mixed'",
        "'all'",
    ),
    (
        "node-dynamic-and-static-mig",
        "nodeConfigs:\n  - {name: a, operatingmode: mig, migstrategy: mixed}",
        "nodeConfigs[0]",
        "migstrategy mixed (pre-made instances) cannot apply",
        "'a'",
    ),
    ("mig-strategy-unknown", "nvidia: {migStrategy: auto}", "nvidia.migStrategy", "'mixed'", "'auto'"),
    (
        "allowlist-no-profiles",
        "nvidia: {migProfileAllowlist: [{models: [A100]}]}",
        "nvidia.migProfileAllowlist[0].profiles",
        "Field required",
        "A100",
    ),
    (
        "allowlist-empty-profiles",
        "nvidia: {migProfileAllowlist: [{models: [A100], profiles: []}]}",
        "nvidia.migProfileAllowlist[0].profiles",
        "at least 1 item",
        "[]",
    ),
    (
        "allowlist-empty-models",
        "nvidia: {migProfileAllowlist: [{models: [], profiles: [1g.5gb]}]}",
        "nvidia.migProfileAllowlist[0].models",
        "at least 1 item",
        "[]",
    ),
    (
        "allowlist-empty-model",
        "nvidia: {migProfileAllowlist: [{models: [''], profiles: [1g.5gb]}]}",
        "nvidia.migProfileAllowlist[0].models[0]",
        "at least 1 character",
        "''",
    ),
    (
        "allowlist-bad-profile",
        "nvidia: {migProfileAllowlist: [{models: [A100], profiles: [1g.5gb, g.5gb]}]}",
        "nvidia.migProfileAllowlist[0].profiles",
        "invalid MIG profile 'g.5gb'",
        "g.5gb",
    ),
    (
        "allowlist-profile-no-dot",
        "nvidia: {migProfileAllowlist: [{models: [A100], profiles: [1g]}]}",
        "nvidia.migProfileAllowlist[0].profiles",
        "invalid MIG profile '1g'",
        "1g",
    ),
    (
        "allowlist-profile-not-g",
        "nvidia: {migProfileAllowlist: [{models: [A100], profiles: [1c.5gb]}]}",
        "nvidia.migProfileAllowlist[0].profiles",
        "invalid MIG profile '1c.5gb'",
        "1c.5gb",
    ),
    (
        "node-filter-index",
        "nodeConfigs:\n  - {name: a, filterDevices: {index: [-1]}}",
        "nodeConfigs[0].filterDevices.index[0]",
        "greater than or equal to 0",
        "-1",
    ),
    (
        "node-duplicate",
        "nodeConfigs:\n  - {name: a}\n  - {name: a}",
        "nodeConfigs",
        "configured twice",
        "'a'",
    ),
    ("node-configs-mapping", "nodeConfigs: {name: a}", "nodeConfigs", "valid tuple", "'name'"),
    (
        "allowed-schedulers-text",
        "allowedSchedulers: volcano",
        "allowedSchedulers",
        "valid tuple",
        "'volcano'",
    ),
    (
        "allowed-scheduler-empty",
        "allowedSchedulers: ['']",
        "allowedSchedulers[0]",
        "at least 1 character",
        "''",
    ),
]


@pytest.mark.parametrize(("text", "path", "reason", "shown"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_values_name_the_key_path_and_value(text: str, path: str, reason: str, shown: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(text)
    assert info.value.field == path
    assert reason in info.value.reason
    assert str(info.value).startswith(f"{path}: ")
    assert shown in str(info.value)


# Each bounded number at its edges: the last value taken, and the first refused (with its key path).
EDGES = {
    "split-count-1024": ("nvidia: {deviceSplitCount: 1024}", None),
    "split-count-1025": ("nvidia: {deviceSplitCount: 1025}", "nvidia.deviceSplitCount"),
    "log-level-0": ("nvidia: {libCudaLogLevel: 0}", None),
    "log-level-minus-1": ("nvidia: {libCudaLogLevel: -1}", "nvidia.libCudaLogLevel"),
    "log-level-4": ("nvidia: {libCudaLogLevel: 4}", None),
    "log-level-5": ("nvidia: {libCudaLogLevel: 5}", "nvidia.libCudaLogLevel"),
    "node-log-level-minus-1": (
        "nodeConfigs: [{name: n, libCudaLogLevel: -1}]",
        "nodeConfigs[0].libCudaLogLevel",
    ),
    "default-cores-0": ("nvidia: {defaultCores: 0}", None),
    "default-cores-minus-1": ("nvidia: {defaultCores: -1}", "nvidia.defaultCores"),
    "default-cores-100": ("nvidia: {defaultCores: 100}", None),
    "default-cores-101": ("nvidia: {defaultCores: 101}", "nvidia.defaultCores"),
    "default-gpu-num-0": ("nvidia: {defaultGPUNum: 0}", None),
    "default-gpu-num-64": ("nvidia: {defaultGPUNum: 64}", None),
    "default-gpu-num-65": ("nvidia: {defaultGPUNum: 65}", "nvidia.defaultGPUNum"),
    "default-memory-minus-1": ("nvidia: {defaultMemory: -1}", "nvidia.defaultMemory"),
    "node-name-one-letter": ("nodeConfigs: [{name: n}]", None),
    "node-name-empty": ("nodeConfigs: [{name: ''}]", "nodeConfigs[0].name"),
    "scheduler-name-empty": ("schedulerName: ''", "schedulerName"),
}


@pytest.mark.parametrize(("text", "refused_at"), EDGES.values(), ids=EDGES.keys())
def test_bounded_numbers_at_their_edges(text: str, refused_at: str | None) -> None:
    if refused_at is None:
        load_config(text)
        return
    with pytest.raises(ConfigError) as info:
        load_config(text)
    assert info.value.field == refused_at


def test_one_problem_is_reported_alone() -> None:
    with pytest.raises(ConfigError) as info:
        load_config("nvidia: {deviceSplitCount: 0}")
    assert info.value.reason == "Input should be greater than or equal to 1"


def test_first_of_several_problems_is_named() -> None:
    with pytest.raises(ConfigError) as info:
        load_config("nvidia: {deviceSplitCount: 0, defaultCores: 200}")
    assert info.value.field == "nvidia.deviceSplitCount"
    assert info.value.reason.endswith("or equal to 1 (and 1 more problem)")


def test_several_problems_are_counted() -> None:
    with pytest.raises(ConfigError, match=r"\(and 2 more problems\)"):
        load_config("nvidia: {deviceSplitCount: 0, defaultCores: 200, defaultMemory: -1}")


def test_duplicate_keys_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"duplicate key \(line 3\)") as info:
        load_config("nvidia:\n  deviceSplitCount: 4\n  deviceSplitCount: 5\n")
    assert info.value.field == "deviceSplitCount"


def test_yaml_merge_keys_still_work() -> None:
    text = "base: &b {deviceSplitCount: 4}\n"
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(text)
    cfg = load_config("nvidia:\n  <<: {deviceSplitCount: 4}\n  defaultCores: 5\n")
    assert (cfg.nvidia.device_split_count, cfg.nvidia.default_cores) == (4, 5)


@pytest.mark.parametrize(
    ("text", "field", "reason"),
    [
        ("- a\n- b", "<root>", "must be a mapping"),
        ("just text", "<root>", "must be a mapping"),
        ("nvidia: [", "<yaml>", "not valid YAML"),
        ("a: b: c", "<yaml>", "not valid YAML"),
        ("? [a]\n: 1", "<yaml>", "unhashable key"),
    ],
    ids=["list", "scalar", "unclosed", "bad-mapping", "list-key"],
)
def test_malformed_documents(text: str, field: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason) as info:
        load_config(text)
    assert info.value.field == field


def test_config_error_is_a_protocol_error() -> None:
    assert issubclass(ConfigError, ProtocolError)
    assert issubclass(ConfigError, ValueError)


# files -------------------------------------------------------------------------------------------


def test_load_config_file(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(FULL_YAML, encoding="utf-8")
    assert load_config_file(path) == load_config(FULL_YAML)
    assert load_config_file(str(path)) == load_config(FULL_YAML)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match="cannot read") as info:
        load_config_file(path)
    assert info.value.field == str(path)


def test_file_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("schedulerName: caf\xe9".encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config_file(path)


def test_file_too_large(tmp_path: Path) -> None:
    path = tmp_path / "huge.yaml"
    path.write_bytes(b"#" * (1 << 20) + b"\n")
    with pytest.raises(ConfigError, match="larger than 1048576 bytes"):
        load_config_file(path)


def test_file_of_one_mib_is_read(tmp_path: Path) -> None:
    path = tmp_path / "large.yaml"
    path.write_bytes(b"#" * ((1 << 20) - 1) + b"\n")
    assert load_config_file(path) == Config()


def test_huge_file_is_not_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "huge.yaml"
    path.write_bytes(b"#" * (4 << 20))
    with pytest.raises(ConfigError) as info:
        load_config_file(path)
    assert info.value.value == (1 << 20) + 1  # bytes read: one past the limit, no more


def test_file_errors_keep_the_key_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("nvidia:\n  deviceSplitCount: -3\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config_file(path)
    assert info.value.field == "nvidia.deviceSplitCount"


# laws --------------------------------------------------------------------------------------------


@given(st.integers(min_value=1, max_value=1024))
def test_split_count_round_trips(n: int) -> None:
    assert load_config(f"nvidia: {{deviceSplitCount: {n}}}").for_node("x").device_split_count == n


@given(st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False))
def test_positive_scalings_are_accepted(scaling: float) -> None:
    cfg = load_config(f"nvidia: {{deviceMemoryScaling: {scaling!r}}}")
    assert cfg.nvidia.device_memory_scaling == scaling


@pytest.mark.parametrize(("text", "value"), [("1e-3", 0.001), ("2E0", 2.0), ("+1e1", 10.0)])
def test_exponent_floats_without_a_dot(text: str, value: float) -> None:
    assert load_config(f"nvidia: {{deviceCoreScaling: {text}}}").nvidia.device_core_scaling == value


def test_every_field_is_documented() -> None:
    for model in (Config, NvidiaConfig, NodeConfig, FilterDevices, MigProfileAllowlistEntry):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"


def test_public_api_is_complete() -> None:
    assert sorted(config_module.__all__) == sorted(
        [
            "Config",
            "ConfigError",
            "DEFAULT_MIG_PROFILE_ALLOWLIST",
            "FilterDevices",
            "MigProfileAllowlistEntry",
            "MigStrategy",
            "NodeConfig",
            "OperatingMode",
            "NodeSettings",
            "NvidiaConfig",
            "checked_hook_path",
            "load_config",
            "load_config_file",
        ]
    )
    for name in config_module.__all__:
        assert hasattr(config_module, name)
