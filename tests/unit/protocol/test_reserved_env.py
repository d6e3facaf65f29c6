"""hamipy.protocol.reserved_env: which names a pod's own env may not set, and how a prefix reaches one."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hamipy.protocol import allocation_env
from hamipy.protocol.devices import ContainerDevice
from hamipy.protocol.reserved_env import (
    GPU_CONTAINER_NAMES,
    PER_DEVICE_NAMES,
    gpu_prefix_reserved,
    gpu_reserved,
    reserved_env_use,
    visible_devices_prefix,
)

_ENV_NAME = st.text(st.sampled_from("ABCDEFGLMNOPRSTUVX_0123456789"), min_size=1, max_size=40)


NOT_GPU_RESERVED = {allocation_env.ENV_VISIBLE_DEVICES, allocation_env.ENV_LOG_LEVEL}
"""The Allocate env a GPU container may set among its own: ``NVIDIA_VISIBLE_DEVICES`` is reserved in
every container instead, and the log level is the pod's own to raise."""


def test_every_variable_of_the_allocate_answer_is_reserved() -> None:
    """Taken from the Allocate env with every option on (per-device SM limits, oversubscription,
    a core policy, a priority, a log level), so a variable added there is reserved or listed above."""
    uneven = [ContainerDevice("GPU-a", "NVIDIA", 1000, 30), ContainerDevice("GPU-b", "NVIDIA", 2000, 60)]
    env = allocation_env.allocation_env(
        uneven, cache_id="c", memory_scaling=2.0, core_policy="force", log_level=3, task_priority=0
    )
    assert {name for name in env if not gpu_reserved(name)} == NOT_GPU_RESERVED
    assert allocation_env.ENV_VISIBLE_DEVICES not in GPU_CONTAINER_NAMES


def test_the_switches_the_interposer_reads_are_reserved_too() -> None:
    """Not in the Allocate answer: HAMi's opt-out of the interposer, and another preloaded library."""
    assert gpu_reserved(allocation_env.ENV_DISABLE_CONTROL)
    assert gpu_reserved("LD_PRELOAD")


@pytest.mark.parametrize(
    ("name", "reserved"),
    [
        ("CUDA_DEVICE_MEMORY_LIMIT_0", True),
        ("CUDA_DEVICE_MEMORY_LIMIT_15", True),
        ("CUDA_DEVICE_SM_LIMIT_007", True),
        ("CUDA_DEVICE_MEMORY_LIMIT_", False),
        ("CUDA_DEVICE_MEMORY_LIMIT_0X", False),
        ("CUDA_DEVICE_MEMORY_LIMIT_0\n", False),
        ("XCUDA_DEVICE_SM_LIMIT_1", False),
        ("CUDA_VISIBLE_DEVICES", False),
        ("LD_LIBRARY_PATH", False),
    ],
)
def test_per_device_names(name: str, reserved: bool) -> None:
    assert gpu_reserved(name) is reserved


@given(st.sampled_from(GPU_CONTAINER_NAMES), st.integers(0, 64), st.data())
def test_every_prefix_of_a_reserved_name_is_refused(base: str, index: int, data: st.DataObject) -> None:
    names = [base] + ([f"{base}_{index}"] if base in PER_DEVICE_NAMES else [])
    name = data.draw(st.sampled_from(names))
    prefix = name[: data.draw(st.integers(1, len(name)))]
    assert gpu_prefix_reserved(prefix)


@given(_ENV_NAME, _ENV_NAME)
def test_no_source_key_after_an_accepted_prefix_makes_a_reserved_name(prefix: str, key: str) -> None:
    if not gpu_prefix_reserved(prefix):
        assert not gpu_reserved(prefix + key)
    if not visible_devices_prefix(prefix):
        assert prefix + key != allocation_env.ENV_VISIBLE_DEVICES


def test_an_empty_prefix_cannot_be_judged() -> None:
    assert not gpu_prefix_reserved("")
    assert not visible_devices_prefix("")


@pytest.mark.parametrize(
    ("container", "gpu", "found"),
    [
        pytest.param({"env": [{"name": "LD_PRELOAD", "value": "/x.so"}]}, True, "sets LD_PRELOAD,", id="gpu"),
        pytest.param({"env": [{"name": "LD_PRELOAD", "value": "/x.so"}]}, False, None, id="not-gpu"),
        pytest.param(
            {"env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]},
            False,
            "sets NVIDIA_VISIBLE_DEVICES to 'all':",
            id="visible",
        ),
        pytest.param({"env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]}, True, None, id="none"),
        pytest.param(
            {"envFrom": [{"prefix": "NVIDIA_VISIBLE", "configMapRef": {"name": "c"}}]},
            False,
            "from configMapRef 'c' with prefix 'NVIDIA_VISIBLE', which could set NVIDIA_VISIBLE_DEVICES",
            id="visible-prefix",
        ),
        pytest.param(
            {"env": [{"name": 3}, "x", None], "envFrom": [{"prefix": []}]}, True, None, id="not-text"
        ),
        pytest.param(
            {"env": [{"name": 3}, "x", {"name": "LD_PRELOAD", "value": "/x.so"}]},
            True,
            "sets LD_PRELOAD,",
            id="after-an-entry-that-is-not-text",
        ),
        pytest.param(
            {"envFrom": [{"prefix": []}, {"prefix": "CUDA_"}]},
            True,
            "takes env from a source with prefix 'CUDA_', which could set a variable the device plugin sets",
            id="after-a-prefix-that-is-not-text",
        ),
        pytest.param({"env": {"LD_PRELOAD": "x"}}, True, None, id="env-not-a-list"),
    ],
)
def test_reserved_env_use(container: dict[str, Any], gpu: bool, found: str | None) -> None:
    problem = reserved_env_use(container, gpu=gpu, label="containers[0] 'main'")
    if found is None:
        assert problem is None
    else:
        assert problem is not None
        assert problem.startswith("container containers[0] 'main' ")
        assert found in problem
