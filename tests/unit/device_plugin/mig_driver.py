"""Scenarios of the MIG manager and discovery over native/'s fake NVML through real pynvml.

The fake driver reads its configuration once per process, so each scenario runs in a process of its
own (``run``): ``python mig_driver.py <scenario>`` with ``LD_LIBRARY_PATH`` on the fake and
``HAMIPY_FAKE_GPU_CONFIG`` on the scenario's GPUs; it prints its findings as one JSON line and
asserts as it goes (a failed assertion is a non-zero exit with the traceback on stderr).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

FAKE_DRIVER: Final = Path(__file__).resolve().parents[3] / "native" / "build" / "fake"
GPU0: Final = "GPU-fa4e0000-0000-4000-8000-000000000000"
GPU1: Final = "GPU-fa4e0000-0000-4000-8000-000000000001"
A100_80: Final = 'name="NVIDIA A100-SXM4-80GB" memory=80g'
TWO_A100: Final = f"gpu uuid={GPU0} {A100_80}\ngpu uuid={GPU1} {A100_80}\n"


def run(tmp_path: Path, config: str, scenario: str) -> Any:
    """Run ``scenario`` in a process over the fake driver configured with ``config``; its JSON."""
    import pytest

    if not (FAKE_DRIVER / "libnvidia-ml.so.1").is_file():
        pytest.skip("needs native/build/fake (make native)")
    (tmp_path / "gpus.conf").write_text(config)
    here = Path(__file__).resolve().parent
    paths = (os.environ.get("PYTHONPATH"), str(here), str(here.parents[1]))
    env = {
        "LD_LIBRARY_PATH": str(FAKE_DRIVER),
        "HAMIPY_FAKE_GPU_CONFIG": str(tmp_path / "gpus.conf"),
        # the test helpers (fake_kube, builders) and whatever this process imports from
        "PYTHONPATH": ":".join(p for p in paths if p),
        "HOOK_DIR": str(tmp_path / "vgpu"),
    }
    proc = subprocess.run(
        [sys.executable, __file__, scenario],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- scenarios (run in the child) ---------------------------------------------------------------------


def _key(gpu: str, profile: str, start: int, size: int) -> Any:
    from hamipy.device_plugin.mig_records import MigKey

    return MigKey(gpu, profile, start, size)


def _live(manager: Any, gpu: str) -> list[list[int]]:
    return [[i.start, i.size] for i in manager.live(gpu)]


def ensure_is_idempotent_and_release_destroys() -> dict[str, Any]:
    import pynvml

    from hamipy.device_plugin.mig_manager import MigManager

    manager = MigManager()
    key = _key(GPU0, "3g.40gb", 4, 4)
    made, new = manager.ensure(key)
    again, new_again = manager.ensure(key)
    assert new
    assert not new_again
    assert again == made
    pynvml.nvmlInit()
    mig = pynvml.nvmlDeviceGetHandleByUUID(made.mig_uuid)
    memory = pynvml.nvmlDeviceGetMemoryInfo(mig).total // (1 << 20)
    mode = pynvml.nvmlDeviceGetMigMode(pynvml.nvmlDeviceGetHandleByUUID(GPU0))
    live = _live(manager, GPU0)
    assert manager.release(key)
    assert not manager.release(key), "a second release finds nothing"
    return {
        "uuid": made.mig_uuid,
        "memory_mib": made.memory_mib,
        "device_memory": memory,
        "mode": mode,
        "live": live,
        "after": _live(manager, GPU0),
    }


def ensure_refuses_bad_placements() -> dict[str, Any]:
    from hamipy.device_plugin.errors import MigError
    from hamipy.device_plugin.mig_manager import MigManager

    manager = MigManager()
    errors = []
    for key in (_key(GPU0, "3g.40gb", 2, 4), _key(GPU0, "9g.99gb", 0, 9)):
        try:
            manager.ensure(key)
        except MigError as exc:
            errors.append(str(exc))
    manager.ensure(_key(GPU0, "3g.40gb", 4, 4))
    try:
        manager.ensure(_key(GPU0, "2g.20gb", 4, 2))  # overlaps the 3g instance
    except MigError as exc:
        errors.append(str(exc))
    return {"errors": errors, "live": _live(manager, GPU0), "managed": len(manager.managed())}


def reconcile_destroys_what_no_pod_holds() -> dict[str, Any]:
    from hamipy.device_plugin.mig_manager import MigManager

    crashed = MigManager()  # a plugin that made an instance and died before recording it
    crashed.ensure(_key(GPU1, "1g.10gb", 6, 1))
    crashed.ensure(_key(GPU1, "1g.10gb", 5, 1))
    manager = MigManager()
    kept = _key(GPU0, "3g.40gb", 4, 4)
    manager.ensure(kept)
    manager.ensure(_key(GPU0, "1g.10gb", 0, 1))
    desired = {kept, _key(GPU1, "1g.10gb", 5, 1)}  # the second: a pod whose Allocate is in flight
    done = manager.reconcile(desired, [GPU0, GPU1])
    again = manager.reconcile(desired, [GPU0, GPU1])
    return {
        "destroyed": sorted(type(d).__name__ for d in done.destroyed),
        "failed": [msg for _, msg in done.failed],
        "again": len(again.destroyed),
        "gpu0": _live(manager, GPU0),
        "gpu1": _live(manager, GPU1),
        "managed": [str(i.key) for i in manager.managed()],
    }


def adopt_checks_the_instance() -> dict[str, Any]:
    from hamipy.device_plugin.errors import MigError
    from hamipy.device_plugin.mig_manager import MigManager

    before = MigManager()
    key = _key(GPU0, "2g.20gb", 2, 2)
    made, _ = before.ensure(key)
    after = MigManager()  # the restarted plugin
    refusals = []
    for uuid, gi, ci in (
        ("MIG-00000000-0000-4000-8000-000000000000", made.gpu_instance_id, made.compute_instance_id),
        (made.mig_uuid, made.gpu_instance_id + 1, made.compute_instance_id),
        (made.mig_uuid, made.gpu_instance_id, made.compute_instance_id + 1),
    ):
        try:
            after.adopt(key, mig_uuid=uuid, gpu_instance_id=gi, compute_instance_id=ci)
        except MigError as exc:
            refusals.append(str(exc))
    assert after.managed() == []
    adopted = after.adopt(
        key,
        mig_uuid=made.mig_uuid,
        gpu_instance_id=made.gpu_instance_id,
        compute_instance_id=made.compute_instance_id,
    )
    again, new = after.ensure(key)
    return {"refusals": refusals, "adopted": adopted == made, "reused": again == made and not new}


def reset_idle_keeps_gpus_in_use() -> dict[str, Any]:
    from hamipy.device_plugin.mig_manager import MigManager

    manager = MigManager()
    manager.ensure(_key(GPU0, "3g.40gb", 0, 4))
    manager.ensure(_key(GPU1, "3g.40gb", 0, 4))
    busy = sorted(manager.busy_gpus([GPU0, GPU1]))
    reset = manager.reset_idle([GPU0, GPU1], {GPU1})
    return {"busy": busy, "reset": reset, "gpu0": _live(manager, GPU0), "gpu1": _live(manager, GPU1)}


def discovery_reads_profiles_and_instances() -> dict[str, Any]:
    from hamipy.device_plugin.discovery import discover_gpus

    dynamic = discover_gpus(lambda model: ["1g.10gb", "3g.40gb", "5x.bad"] if "A100" in model else [])
    static = discover_gpus()
    return {
        "dynamic": [
            {
                "uuid": g.uuid,
                "capacity": g.mig_capacity,
                "profiles": [
                    [p.name, p.memory_mb, p.core, p.slice_count, [[x.start, x.size] for x in p.placements]]
                    for p in g.mig_profiles
                ],
            }
            for g in dynamic
        ],
        "static": [
            {
                "uuid": g.uuid,
                "enabled": g.mig_enabled,
                "devices": [[d.uuid, d.profile, d.memory_mib, d.core] for d in g.mig_devices],
            }
            for g in static
        ],
    }


# -- the plugin's MIG path: Allocate, reconcile, startup, over a fake API server --------------------------


def _record(
    container: int, device: int, gpu: str, profile: str, start: int, size: int, **runtime: Any
) -> dict[str, Any]:
    out = {
        "containerIndex": container,
        "deviceIndex": device,
        "gpuUUID": gpu,
        "profile": profile,
        "placement": {"start": start, "size": size},
    }
    return out | runtime


def _mig_pod(name: str, slots: str, records: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    import builders
    from plugin_fakes import NODE

    from hamipy.protocol import keys

    pod = builders.allocating_pod(name, "main", node=NODE, allocated=slots, to_allocate=slots, **extra)
    pod["metadata"]["annotations"][keys.MIG_ALLOCATIONS] = json.dumps(records, separators=(",", ":"))
    return pod


async def _plugin_parts(api: Any, gpus: list[str]) -> tuple[Any, Any, Any]:
    """An allocator with the MIG lifecycle of ``gpus`` over ``api``; and its event recorder."""
    import io
    import os

    from plugin_fakes import NODE, FakePodResources

    from hamipy.device_plugin.allocator import Allocator
    from hamipy.device_plugin.kube import NodeKube, node_pods_informer
    from hamipy.device_plugin.mig_lifecycle import MigLifecycle
    from hamipy.device_plugin.mig_manager import MigManager
    from hamipy.device_plugin.pod_cache import PodCache
    from hamipy.device_plugin.telemetry import Telemetry
    from hamipy.kube.events import EventRecorder
    from hamipy.kube.informer import InformerSettings
    from hamipy.protocol.config import load_config

    config = load_config(f"nvidia:\n  hookPath: {os.environ['HOOK_DIR']}\n")
    telemetry = Telemetry.create(stream=io.StringIO())
    kube = NodeKube(api, node_name=NODE)
    events = EventRecorder(api, component="test", logger=telemetry.logger, timeout_s=5)
    mig = MigLifecycle(manager=MigManager(), api=kube, gpus=gpus, telemetry=telemetry, events=events)
    cache = PodCache(node_pods_informer(api, NODE, logger=telemetry.logger, settings=InformerSettings()))
    await cache.informer.list_once()
    allocator = Allocator(
        api=kube,
        pods=cache,
        kubelet=FakePodResources(api).pods,
        nvidia=config.nvidia,
        node_settings=config.for_node(NODE),
        telemetry=telemetry,
        mig=mig,
    )
    return allocator, mig, events


def _events(events: Any) -> list[list[str]]:
    return [[e.involved.get("name", ""), e.reason, e.message] for e in events.recorded]


def allocate_makes_records_and_reconcile_destroys() -> dict[str, Any]:
    import asyncio

    from plugin_fakes import node_kube

    from hamipy.protocol import keys
    from hamipy.protocol.mig_allocations import decode_mig_allocations

    async def scenario() -> dict[str, Any]:
        pod = _mig_pod("p", f"{GPU0},NVIDIA,9000,15:;", [_record(0, 0, GPU0, "1g.10gb", 6, 1)])
        api = node_kube(pod)
        allocator, mig, events = await _plugin_parts(api, [GPU0, GPU1])
        async with mig.lock:
            await mig.sync()  # startup: both GPUs idle, reset
        (answer,) = await allocator.allocate([[f"{GPU0}-0"]])
        annotations = api.pod("ns", "p")["metadata"]["annotations"]
        (record,) = decode_mig_allocations(annotations[keys.MIG_ALLOCATIONS])
        live = _live(mig.manager, GPU0)
        (made,) = mig.manager.managed()
        async with mig.lock:
            await mig.sync()
        kept = _live(mig.manager, GPU0)
        api.write("/api/v1/namespaces/ns/pods/p", {"status": {"phase": "Succeeded"}})
        async with mig.lock:
            await mig.sync()
        return {
            "envs": dict(answer.envs),
            "record": [record.mig_uuid, record.gpu_instance_id, record.compute_instance_id],
            "phase": annotations[keys.BIND_PHASE],
            "memory": made.memory_mib,
            "live": live,
            "kept": kept,
            "after": _live(mig.manager, GPU0),
            "events": _events(events),
        }

    return asyncio.run(scenario())


def allocate_rolls_back_what_it_made() -> dict[str, Any]:
    import asyncio

    from plugin_fakes import node_kube

    from hamipy.device_plugin.errors import AllocateError
    from hamipy.protocol import keys

    async def scenario() -> dict[str, Any]:
        slots = f"{GPU0},NVIDIA,9000,15:{GPU1},NVIDIA,9000,15:;"
        records = [_record(0, 0, GPU0, "1g.10gb", 6, 1), _record(0, 1, GPU1, "3g.40gb", 2, 4)]
        api = node_kube(_mig_pod("p", slots, records))
        allocator, mig, _ = await _plugin_parts(api, [GPU0, GPU1])
        try:
            await allocator.allocate([[f"{GPU0}-0", f"{GPU1}-0"]])
        except AllocateError as exc:
            error = str(exc)
        annotations = api.pod("ns", "p")["metadata"]["annotations"]
        short = _mig_pod("q", slots.replace("p", "q"), records[:1], bind_time=2)
        return {
            "error": error,
            "phase": annotations[keys.BIND_PHASE],
            "gpu0": _live(mig.manager, GPU0),
            "gpu1": _live(mig.manager, GPU1),
            "unchanged": keys.MIG_ALLOCATIONS in annotations
            and "migUUID" not in annotations[keys.MIG_ALLOCATIONS],
            "short": await _short(short),
        }

    async def _short(pod: dict[str, Any]) -> str:
        from plugin_fakes import node_kube

        api = node_kube(pod)
        allocator, _mig, _ = await _plugin_parts(api, [GPU0, GPU1])
        try:
            await allocator.allocate([[f"{GPU0}-0", f"{GPU1}-0"]])
        except AllocateError as exc:
            return str(exc)
        return ""

    return asyncio.run(scenario())


def startup_adopts_resets_and_preserves() -> dict[str, Any]:
    import asyncio

    from plugin_fakes import node_kube

    from hamipy.device_plugin.mig_manager import MigManager
    from hamipy.kube.errors import KubeError

    async def scenario() -> dict[str, Any]:
        before = MigManager()  # the plugin before its restart
        live, _ = before.ensure(_key(GPU0, "3g.40gb", 4, 4))
        other, _ = before.ensure(_key(GPU0, "1g.10gb", 0, 1))
        before.ensure(_key(GPU1, "3g.40gb", 0, 4))  # on a GPU no pod uses: reset
        runtime = {
            "migUUID": live.mig_uuid,
            "gpuInstanceID": live.gpu_instance_id,
            "computeInstanceID": live.compute_instance_id,
        }
        forged = {
            "migUUID": "MIG-00000000-0000-4000-8000-000000000000",
            "gpuInstanceID": other.gpu_instance_id,
            "computeInstanceID": other.compute_instance_id,
        }
        done = f"{GPU0},NVIDIA,9000,15:;"
        p = _mig_pod("p", done, [_record(0, 0, GPU0, "3g.40gb", 4, 4, **runtime)], phase="success")
        q = _mig_pod("q", done, [_record(0, 0, GPU0, "1g.10gb", 0, 1, **forged)], phase="success")
        api = node_kube(p, q)
        _, mig, events = await _plugin_parts(api, [GPU0, GPU1])
        api.fail(KubeError("the API server is away"), "GET", "*pods*")
        async with mig.lock:
            await mig.sync()
        unlisted = [_live(mig.manager, GPU0), _live(mig.manager, GPU1), mig.started]
        api.heal()
        async with mig.lock:
            await mig.sync()
        return {
            "unlisted": unlisted,
            "gpu0": _live(mig.manager, GPU0),
            "gpu1": _live(mig.manager, GPU1),
            "managed": [i.mig_uuid for i in mig.manager.managed()],
            "adopted": live.mig_uuid,
            "events": _events(events),
        }

    return asyncio.run(scenario())


SCENARIOS: Final[dict[str, Callable[[], Any]]] = {
    f.__name__: f
    for f in (
        ensure_is_idempotent_and_release_destroys,
        ensure_refuses_bad_placements,
        reconcile_destroys_what_no_pod_holds,
        adopt_checks_the_instance,
        reset_idle_keeps_gpus_in_use,
        discovery_reads_profiles_and_instances,
        allocate_makes_records_and_reconcile_destroys,
        allocate_rolls_back_what_it_made,
        startup_adopts_resets_and_preserves,
    )
}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]]()))
