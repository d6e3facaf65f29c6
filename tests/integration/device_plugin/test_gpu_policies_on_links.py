"""The GPU policies on a node with NVLink-bridged pairs, end to end: the device plugin process over
the fake driver's ``pcie-pairs8`` preset publishes the pair scores, kube-scheduler with our extender
places ``topology-aware`` pods on a bridged pair and ``mutex`` pods only on GPUs nothing is on, the
kubelet's Allocate hands the pod those GPUs; ``make up``'s examples of both (``deploy/examples``)
land as their comments say."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from builders import container
from stack_support import NEEDS_REAL_KUBELET, GpuStack, allocated_slots, running_gpu_stack

from hamipy.devcluster import API_TIMEOUT_S, DevCluster, wait_for
from hamipy.devcluster.stack import GPU_NODE_MODELS
from hamipy.device_plugin.devices import gpu_of
from hamipy.protocol import keys
from hamipy.protocol.config import Config
from hamipy.protocol.node_scores import LEVEL_SCORES, NVLINK_SCORE, decode_node_scores

pytestmark = [pytest.mark.integration, NEEDS_REAL_KUBELET]

EXAMPLES = Path(__file__).resolve().parents[3] / "deploy" / "examples"
(MODEL,) = (m for m in GPU_NODE_MODELS if m.topology == "pcie-pairs8")
GPUS = MODEL.gpus(0x1E5)
INDEX = {gpu.uuid: i for i, gpu in enumerate(GPUS)}
PIX, NODE, SYS = 10, 40, 50  # NVML's P2P levels: one PCIe switch, one NUMA node, across them
BRIDGE_LINKS = 12  # three NVLink bridges of four links each


def expected_score(a: int, b: int) -> int:
    """HAMi's pair score on this node: PCIe path plus 100 per NVLink for a bridged pair (2k, 2k+1)."""
    if a ^ 1 == b:
        return LEVEL_SCORES[PIX] + NVLINK_SCORE * BRIDGE_LINKS
    return LEVEL_SCORES[NODE if GPUS[a].numa == GPUS[b].numa else SYS]


def gpus_of(pod: dict[str, Any]) -> list[int]:
    """The NVML indexes of the GPUs allocated to the pod's one container."""
    (slot,) = allocated_slots(pod)
    return sorted(INDEX[d.uuid] for d in slot)


def is_bridged_pair(indexes: Sequence[int]) -> bool:
    return len(indexes) == 2 and indexes[0] ^ 1 == indexes[1]


def example(stack: GpuStack, file: str) -> dict[str, Any]:
    """The one pod of an example manifest, in the stack's namespace and on its node."""
    (pod,) = [doc for doc in yaml.safe_load_all((EXAMPLES / file).read_text()) if doc]
    assert isinstance(pod, dict)
    pod["metadata"]["namespace"] = stack.namespace
    pod["spec"]["nodeSelector"] = {"gpu-test": stack.namespace}
    pod["spec"]["terminationGracePeriodSeconds"] = 0
    return pod


async def placed(stack: GpuStack, body: dict[str, Any]) -> list[int]:
    """Create the pod; the GPUs it was served, once the device plugin has served it."""
    await stack.create(body)
    return gpus_of(await stack.served(body["metadata"]["name"]))


async def assert_allocated_as_placed(stack: GpuStack, pod: dict[str, Any], name: str) -> None:
    """The container the kubelet created sees exactly its allocation's GPUs, and the kubelet's
    device IDs lie on them (GetPreferredAllocation steered them there)."""
    (slot,) = allocated_slots(pod)
    config = await stack.container(pod["metadata"]["name"], name)
    assert config.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(d.uuid for d in slot)
    ids = stack.device_ids(pod["metadata"]["uid"], name)
    assert sorted(gpu_of(i) for i in ids) == sorted(d.uuid for d in slot)


async def failed_scheduling(stack: GpuStack, name: str, cause: str) -> str:
    """The message of the pod's FailedScheduling Event once one names ``cause``."""

    async def event() -> str:
        events = await stack.core.list_namespaced_event(
            stack.namespace, field_selector=f"involvedObject.name={name}", _request_timeout=API_TIMEOUT_S
        )
        return next(
            (
                e.message
                for e in events.items
                if e.reason == "FailedScheduling" and cause in (e.message or "")
            ),
            "",
        )

    message: str = await wait_for(
        event, timeout=60, interval=0.2, what=f"FailedScheduling of {name} naming {cause}"
    )
    return message


async def test_topology_aware_takes_a_bridged_pair_and_mutex_only_an_unused_gpu(
    devcluster: DevCluster, kube_client: Any, namespace: str, hami_scheduler: Callable[..., Any]
) -> None:
    async with running_gpu_stack(
        devcluster, kube_client, namespace, hami_scheduler, gpus=GPUS, topology="pcie-pairs8"
    ) as stack:
        # The plugin read the links over NVML and published HAMi's pair scores on the node.
        async def published() -> str:
            node = await stack.core.read_node(stack.node, _request_timeout=API_TIMEOUT_S)
            return str((node.metadata.annotations or {}).get(keys.NODE_SCORE, ""))

        value = await wait_for(published, timeout=30, interval=0.2, what="pair scores published")
        scores = decode_node_scores(value, node=stack.node)
        assert scores == {
            g.uuid: {h.uuid: expected_score(a, b) for b, h in enumerate(GPUS) if b != a}
            for a, g in enumerate(GPUS)
        }

        # Under the default spread, with one GPU in use, a 2-GPU pod takes the two least used GPUs,
        # across pairs...
        solo = await placed(stack, stack.pod_body("solo", [container(gpu=1, gpumem=8192)]))
        spread = await placed(stack, stack.pod_body("spread", [container(gpu=2, gpumem=16384)]))
        assert not is_bridged_pair(spread), (solo, spread)
        # ...while make up's topology-aware example gets a bridged pair, and Allocate hands it those.
        pair = await placed(stack, example(stack, "gpu-policy-1-topology-aware.yaml"))
        assert is_bridged_pair(pair), pair
        await assert_allocated_as_placed(stack, await stack.pod("nvlink-pair"), "trainer")

        # make up's mutex example skips every GPU in use.
        used = {*solo, *spread, *pair}
        (own,) = await placed(stack, example(stack, "gpu-policy-2-mutex.yaml"))
        assert own not in used, (own, used)
        await assert_allocated_as_placed(stack, await stack.pod("mutex"), "cuda")

        # A pod without mutex may join the GPU the mutex pod holds: with it every GPU has a user, and a
        # mutex pod waits, its FailedScheduling Event saying why.
        assert await placed(stack, stack.pod_body("everywhere", [container(gpu=8, gpumem=1024)])) == list(
            range(8)
        )
        waiting = stack.pod_body(
            "waiting", [container(gpu=1, gpumem=1024)], annotations={keys.GPU_SCHEDULER_POLICY: "mutex"}
        )
        await stack.create(waiting)
        message = await failed_scheduling(stack, "waiting", "ExclusiveDeviceAllocateConflict")
        assert "8/8 ExclusiveDeviceAllocateConflict" in message, message
        assert not (await stack.pod("waiting"))["spec"].get("nodeName")


async def test_a_cluster_default_of_topology_aware_places_pods_without_the_annotation(
    devcluster: DevCluster, kube_client: Any, namespace: str, hami_scheduler: Callable[..., Any]
) -> None:
    config = Config.model_validate({"gpuSchedulerPolicy": "topology-aware"})
    async with running_gpu_stack(
        devcluster, kube_client, namespace, hami_scheduler, gpus=GPUS, topology="pcie-pairs8", config=config
    ) as stack:
        # The same steps as the spread pod above, neither pod annotated: this time a bridged pair.
        (one,) = await placed(stack, stack.pod_body("one", [container(gpu=1, gpumem=8192)]))
        pair = await placed(stack, stack.pod_body("two", [container(gpu=2, gpumem=16384)]))
        assert is_bridged_pair(pair), (one, pair)
        pod = await stack.pod("two")
        assert keys.GPU_SCHEDULER_POLICY not in pod["metadata"]["annotations"]
        await assert_allocated_as_placed(stack, pod, "main")
