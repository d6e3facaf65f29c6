"""The extender's GPU gauges are rendered on the event loop in steps: filters and watch events run
between the steps, the model may change under a scrape without breaking it, and every GPU and
container listed when the scrape began is in it, each GPU's seven values read together."""

from __future__ import annotations

import asyncio

from builders import gpu_node, gpu_pod
from prometheus_client.parser import text_string_to_metric_families

from hamipy.extender.model import ClusterModel
from hamipy.extender.telemetry import Metrics, gpu_gauges
from hamipy.protocol import keys

NODES = 20


def allocated(name: str, on: str, uuid: str) -> dict[str, object]:
    return gpu_pod(
        name,
        node_name=on,
        phase="Running",
        annotations={keys.DEVICES_ALLOCATED: f"{uuid},NVIDIA,1000,10:;", keys.VGPU_NODE: on},
    )


def cluster() -> ClusterModel:
    model = ClusterModel()
    model.replace_nodes([gpu_node(f"n{i}") for i in range(NODES)])  # two GPUs each
    model.replace_pods([allocated(f"p{i}", f"n{i}", f"GPU-n{i}-0") for i in range(NODES)])
    return model


async def test_the_loop_runs_between_steps_while_the_model_changes() -> None:
    model = cluster()
    steps = 0
    rendering = True

    async def churn() -> None:
        # What the watches do mid-scrape: nodes and pods come and go, allocations change.
        nonlocal steps
        while rendering:
            steps += 1
            model.apply_node("DELETED", gpu_node(f"n{steps}"))
            model.apply_node("ADDED", gpu_node(f"new{steps}"))
            model.apply_pod("DELETED", allocated(f"p{steps}", f"n{steps}", f"GPU-n{steps}-0"))
            model.apply_pod("ADDED", allocated(f"q{steps}", "n0", "GPU-n0-1"))
            await asyncio.sleep(0)

    churning = asyncio.create_task(churn())
    try:
        text = b"".join(await gpu_gauges(model, rows_per_step=4)).decode()
    finally:
        rendering = False
        await churning
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # 40 GPUs and 20 containers at 4 rows a step: the loop ran at least 14 times in between.
    assert steps >= 14
    limits = families["hami_gpu_memory_limit_bytes"].samples
    assert {s.labels["node"] for s in limits} == {f"n{i}" for i in range(NODES)}
    assert len(limits) == 2 * NODES
    assert {s.labels["pod"] for s in families["hami_vgpu_memory_allocated_bytes"].samples} == {
        f"p{i}" for i in range(NODES)
    }
    # Each GPU's values agree with one another although pods kept arriving on n0's second GPU.
    by_gpu = {
        name: {s.labels["device_uuid"]: s.value for s in families[name].samples}
        for name in ("hami_gpu_memory_allocated_bytes", "hami_node_gpu_overview", "hami_gpu_shared_count")
    }
    assert by_gpu["hami_gpu_memory_allocated_bytes"] == by_gpu["hami_node_gpu_overview"]
    shared = by_gpu["hami_gpu_shared_count"]["GPU-n0-1"]
    assert by_gpu["hami_gpu_memory_allocated_bytes"]["GPU-n0-1"] == shared * 1000 * 1024 * 1024


async def test_the_scrape_carries_the_registry_then_the_gpu_gauges() -> None:
    metrics = Metrics()
    metrics.attach(cluster())
    names = [f.name for f in text_string_to_metric_families((await metrics.render()).decode())]
    assert "hamipy_extender_filter_duration_seconds" in names
    assert names[-9:] == [
        "hami_gpu_memory_limit_bytes",
        "hami_gpu_core_limit_ratio",
        "hami_gpu_memory_allocated_bytes",
        "hami_gpu_shared_count",
        "hami_gpu_core_allocated_ratio",
        "hami_node_gpu_overview",
        "hami_node_gpu_memory_allocated_ratio",
        "hami_vgpu_memory_allocated_bytes",
        "hami_vgpu_core_allocated_ratio",
    ]
    assert len(names) == len(set(names)), "each family once"
