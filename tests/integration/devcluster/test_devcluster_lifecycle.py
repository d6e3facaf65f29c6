"""Starting and stopping control planes leaves nothing behind: not on stop, not on failure, not on a crash."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from by_path import load

from hamipy.devcluster import ClusterSettings, DevCluster, StartupError, ensure_binaries
from hamipy.devcluster.binaries import CONTAINERD_VERSION, KUBERNETES_VERSION
from hamipy.devcluster.cli import DEFAULT_GPU_NODES
from hamipy.devcluster.cluster import _sweep_stale_workdirs
from hamipy.devcluster.cluster_network import REGISTRY as NETWORKS
from hamipy.devcluster.containerd_runtime import REGISTRY
from hamipy.devcluster.processes import pid_alive, port_is_listening
from hamipy.devcluster.real_kubelet import PROTECTED_SYSCTLS, can_run_real_kubelets
from hamipy.devcluster.workload_log import parse_workload_log

pytestmark = pytest.mark.integration

# Generous: the kernel delivers PDEATHSIG at once, but reaping on a loaded CI box can lag.
GONE_WITHIN_S = 15.0


def _wait_gone(pids: list[int], ports: list[int]) -> tuple[list[int], list[int]]:
    deadline = time.monotonic() + GONE_WITHIN_S
    while True:
        alive = [pid for pid in pids if pid_alive(pid)]
        busy = [p for p in ports if port_is_listening(p)]
        if not (alive or busy) or time.monotonic() > deadline:
            return alive, busy
        time.sleep(0.1)


def test_stop_leaves_no_process_port_or_directory() -> None:
    cluster = DevCluster(binaries=ensure_binaries()).start()
    pids = [p.pid for p in cluster.processes.values() if p.pid]
    ports, workdir = cluster.ports, cluster.workdir
    assert len(pids) == 4  # etcd, kube-apiserver, kube-controller-manager, kube-scheduler
    listening = (cluster.etcd_port, cluster.apiserver_port, cluster.controller_manager_port)
    assert all(port_is_listening(p) for p in listening)

    cluster.stop()

    assert [pid for pid in pids if pid_alive(pid)] == []
    assert [p for p in ports if port_is_listening(p)] == []
    assert not workdir.exists()


def test_failed_start_reports_the_log_tail_and_cleans_up() -> None:
    cluster = DevCluster(
        ClusterSettings(extra_apiserver_args=("--no-such-flag=1",), start_timeout_s=20),
        binaries=ensure_binaries(),
    )
    with pytest.raises(StartupError) as info:
        cluster.start()

    assert info.value.process == "kube-apiserver"
    assert "no-such-flag" in str(info.value)
    assert cluster.processes == {}
    assert [p for p in cluster.ports if port_is_listening(p)] == []


CRASHING_OWNER = textwrap.dedent(
    """
    import json, sys, time
    from hamipy.devcluster import DevCluster
    cluster = DevCluster().start()
    pids = [p.pid for p in cluster.processes.values()]
    print(json.dumps({"pids": pids, "ports": cluster.ports, "workdir": str(cluster.workdir)}), flush=True)
    time.sleep(600)
    """
)


def test_processes_die_and_files_are_swept_when_their_python_owner_is_killed() -> None:
    ensure_binaries()
    owner = subprocess.Popen(
        [sys.executable, "-c", CRASHING_OWNER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert owner.stdout is not None
        started = json.loads(owner.stdout.readline())
        os.kill(owner.pid, signal.SIGKILL)  # no finalizer runs: only PR_SET_PDEATHSIG can clean up
        owner.wait(timeout=10)

        alive, busy = _wait_gone(started["pids"], started["ports"])

        assert alive == []
        assert busy == []
        # Only the files are left; the next cluster start sweeps them.
        assert Path(started["workdir"]).exists()
        _sweep_stale_workdirs()
        assert not Path(started["workdir"]).exists()
    finally:
        if owner.poll() is None:
            os.killpg(owner.pid, signal.SIGKILL)
            owner.wait(timeout=10)
        if owner.stdout is not None:
            owner.stdout.close()


ROOT = Path(__file__).resolve().parents[3]


def _cli(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hamipy.devcluster.cli", "--state-dir", str(state_dir), *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def _as_a_user_types_it(state_dir: Path, command: str) -> subprocess.CompletedProcess[str]:
    """``command`` run by bash in the repository, as a user would after the two set-up commands:
    the workspace's .venv/bin is not on their PATH (nor uv, which make keeps in .hamipy/tools)."""
    venv_bin = str(ROOT / ".venv" / "bin")
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != venv_bin)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return subprocess.run(
        ["bash", "-c", command],
        cwd=ROOT,
        env={**env, "PATH": path, "HAMIPY_STATE_DIR": str(state_dir)},
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )


def _readme_after_up() -> list[str]:
    """The README's block of commands after ``make up`` (read as tests/unit/docs reads it)."""
    commands: list[str] = load("unit/docs/test_documented_commands.py").readme_after_up()
    return commands


def _line(table: str, pod: str) -> str:
    (line,) = [line for line in table.splitlines() if line.startswith(pod + " ")]
    return line


def _row(table: str, pod: str) -> list[str]:
    return _line(table, pod).split()


def _pcie_gpus(table: str, pod: str) -> list[int]:
    """The indexes of the PCIe A100s (the NVLink-pair node's GPUs) the pod's row names."""
    return sorted(int(i) for i in re.findall(r"\b(\d+):A100 80GB PCIe", _line(table, pod)))


def _check_examples(table: str) -> None:
    """The example workloads landed as they should, and the table says so."""
    single = _row(table, "hami-examples/single-slice")
    assert single[1] == "Running"
    assert single[2].startswith("hamipy-gpu-")
    assert "H100" in " ".join(_row(table, "hami-examples/multi-gpu"))
    assert "100%" in _row(table, "hami-examples/exclusive")
    cannot_fit = _row(table, "hami-examples/cannot-fit")
    assert cannot_fit[1] == "Pending"
    assert "CardInsufficientMemory" in " ".join(cannot_fit)
    # The training pod preempted exactly one batch pod, and runs on the A100 it freed.
    batch = [_row(table, f"hami-examples/batch-{i}") for i in range(4)]
    preempted = [row for row in batch if row[1] == "Preempted"]
    assert len(preempted) == 1, table
    assert "Preempted by pod hami-examples/training (priority 1000)" in " ".join(preempted[0])
    training = _row(table, "hami-examples/training")
    assert training[1] == "Running", table
    assert "A100-SXM4" in " ".join(training)
    # The GPU policies: the topology-aware pod on a bridged pair (2k, 2k+1) of the PCIe node, the
    # mutex pod on a GPU of its own there.
    pair, mutex = _row(table, "hami-examples/nvlink-pair"), _row(table, "hami-examples/mutex")
    assert pair[1] == mutex[1] == "Running", table
    assert pair[2] == mutex[2], table
    (low, high), (alone,) = (
        _pcie_gpus(table, "hami-examples/nvlink-pair"),
        _pcie_gpus(table, "hami-examples/mutex"),
    )
    assert (low % 2, high) == (0, low + 1), table
    assert alone not in (low, high), table
    # MIG: the dynamic pod in a 2g.10gb instance made for it on the first slices of an A100 40GB,
    # the static one in the H100's whole 3g.40gb instance made beforehand.
    dynamic, static = _line(table, "hami-examples/mig-dynamic"), _line(table, "hami-examples/mig-static")
    assert dynamic.split()[1:3] == ["Running", "hamipy-gpu-5"], table
    assert "A100-SXM4-40GB MIG 2g.10gb@0" in dynamic, table
    assert static.split()[1:3] == ["Running", "hamipy-gpu-6"], table
    assert "3g.40gb" in static, table
    # The quota admits one of the two 6 GiB pods; the other waits, naming the quota.
    first, second = _row(table, "hami-team-a/quota-first"), _row(table, "hami-team-a/quota-second")
    assert first[1] == "Running"
    assert second[1] == "Pending"
    assert (
        "ResourceQuotaNotFit: quota hami-team-a/gpu: limits.nvidia.com/gpumem is 8192, 6144 used"
        in " ".join(second)
    )


def _check_gpu_nodes(table: str) -> None:
    """`kubectl get nodes -o wide`: the Ready GPU nodes, run by the real kubelet where it can run."""
    rows = [line.split() for line in table.splitlines()[1:] if line.startswith("hamipy-gpu-")]
    expected = [("Ready", f"hamipy-gpu-{i}") for i in range(DEFAULT_GPU_NODES)]
    assert [(row[1], row[0]) for row in rows] == expected, table
    real = can_run_real_kubelets() is None
    assert {row[4] for row in rows} == (
        {KUBERNETES_VERSION} if real else {f"{KUBERNETES_VERSION}-hamipy-sim"}
    )
    if real:  # CONTAINER-RUNTIME, the last column
        assert {row[-1] for row in rows} == {f"containerd://{CONTAINERD_VERSION.removeprefix('v')}"}, table


def _check_held_to_its_slice(logs: str) -> None:
    """The single-slice example's process, in its real container, saw its 4 GiB and no more."""
    log = parse_workload_log(logs)
    assert log.one("device", index=0)["total"] == 4096 << 20
    alloc = log.one("alloc", index=0)
    assert alloc["granted"] == 4096 << 20
    assert alloc["refused_name"] == "CUDA_ERROR_OUT_OF_MEMORY"


def _host() -> tuple[dict[str, str], bool]:
    """What the kubelets must not change on the host: its kernel settings, and whether a
    /var/lib/kubelet exists."""
    sysctls = {name: Path("/proc/sys", name).read_text() for name in PROTECTED_SYSCTLS}
    return sysctls, Path("/var/lib/kubelet").exists()


def _runtime_nodes(owner: int) -> list[dict[str, Any]]:
    """The registry records of the real-runtime nodes ``owner`` runs (their bridges, cgroups)."""
    records = [json.loads(p.read_text()) for p in REGISTRY.glob("*.json")] if REGISTRY.is_dir() else []
    return [r for r in records if r["owner"] == owner]


def _runtime_residue(nodes: list[dict[str, Any]]) -> list[str]:
    """What those nodes left in the host's namespaces: records, bridges, cgroups (with processes)."""
    found = [f"record {n['id']}" for n in nodes if (REGISTRY / f"{n['id']}.json").exists()]
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, timeout=10, check=True)
    found += [f"bridge {n['bridge']}" for n in nodes if n["bridge"] in links.stdout.split()]
    found += [str(d) for n in nodes for d in Path("/sys/fs/cgroup").glob(f"*/{n['cgroup_root'].lstrip('/')}")]
    return found


def _check_gone(state_dir: Path, state: dict[str, Any], nodes: list[dict[str, Any]]) -> None:
    pids = [state["daemon_pid"], *state["process_pids"].values()]
    if can_run_real_kubelets() is None:
        assert any(name.startswith("kubelet-hamipy-gpu-") for name in state["process_pids"])
        assert any(name.startswith("containerd-hamipy-gpu-") for name in state["process_pids"])
        assert len(nodes) == DEFAULT_GPU_NODES
    assert _runtime_residue(nodes) == []
    assert not [line for line in Path("/proc/mounts").read_text().splitlines() if str(state_dir) in line]
    assert _wait_gone(pids, state["ports"]) == ([], [])
    assert not (state_dir / "state.json").exists()
    assert not (state_dir / "kubeconfig").exists()


# Two whole-system starts (each up to the CLI's 240 s on a loaded machine): more than the default.
@pytest.mark.timeout(900)
def test_the_readme_commands_work_as_written_then_up_down_again_leaves_nothing(tmp_path: Path) -> None:
    """``make up``, then the README's follow-up block line by line as a user types it (``make gpus``,
    ``make trace POD=...``, ``make down``); then the CLI's own up once more, killed (SIGKILL), and
    its ``down``: neither way leaves a process, mount, node record, bridge or cgroup behind."""
    state_dir = tmp_path / ".hamipy"
    host = _host()
    try:
        up = _as_a_user_types_it(state_dir, "make up")
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        assert f"{state_dir}/kubectl get nodes -o wide" in up.stdout
        state = json.loads((state_dir / "state.json").read_text())
        nodes = _runtime_nodes(state["daemon_pid"])
        assert (state_dir / "kubeconfig").is_file()
        assert len(state["nodes"]) == DEFAULT_GPU_NODES
        _check_examples(up.stdout)

        outputs = {}
        for command in _readme_after_up():
            # The block names the default state directory; this test's is its own.
            done = _as_a_user_types_it(state_dir, command.replace(".hamipy/", f"{state_dir}/"))
            assert done.returncode == 0, f"{command!r} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            outputs[" ".join(command.split()[:2])] = done.stdout
        assert set(outputs) == {
            ".hamipy/kubectl get",
            ".hamipy/kubectl logs",
            ".hamipy/kubectl create",
            ".hamipy/kubectl set",
            ".hamipy/kubectl rollout",
            "make gpus",
            "make trace",
            "make down",
        }
        _check_gpu_nodes(outputs[".hamipy/kubectl get"])
        _check_held_to_its_slice(outputs[".hamipy/kubectl logs"])
        assert "successfully rolled out" in outputs[".hamipy/kubectl rollout"]
        assert "hami-examples/exclusive" in outputs["make gpus"]
        # Both replicas hold a 4 GiB slice of a GPU.
        demo = [line for line in outputs["make gpus"].splitlines() if "default/gpu-demo-" in line]
        assert sum(line.count("default/gpu-demo-") for line in demo) == 2, outputs["make gpus"]
        spans = ("webhook.", "extender.", "device_plugin.")
        trace = outputs["make trace"]
        names = [w for line in trace.splitlines() for w in line.split() if w.startswith(spans)]
        assert names == ["webhook.admission", "extender.filter", "extender.bind", "device_plugin.allocate"]
        _check_gone(state_dir, state, nodes)
        assert not (state_dir / "kubectl").exists()

        up = _cli(state_dir, "up")
        assert up.returncode == 0, up.stderr
        _check_examples(up.stdout)
        state = json.loads((state_dir / "state.json").read_text())
        nodes = _runtime_nodes(state["daemon_pid"])
        again = _cli(state_dir, "up")
        assert again.returncode == 1
        assert "already up" in again.stderr
        # Killed, it stops nothing itself: its containers outlive it until `down` sweeps them.
        os.kill(state["daemon_pid"], signal.SIGKILL)
        down = _cli(state_dir, "down")
        assert down.returncode == 0, down.stderr
        _check_gone(state_dir, state, nodes)

        not_up = _cli(state_dir, "down")
        assert not_up.returncode == 0
        assert "not up" in not_up.stdout
        assert _host() == host
    finally:
        _cli(state_dir, "down")


def _networks(owner: int) -> list[dict[str, Any]]:
    """The registry records of the pod networks ``owner`` runs."""
    records = [json.loads(p.read_text()) for p in NETWORKS.glob("*.json")] if NETWORKS.is_dir() else []
    return [r for r in records if r["owner"] == owner]


@pytest.mark.timeout(900)
@pytest.mark.skipif(
    os.geteuid() != 0, reason="skipped: the chart's mode builds images and runs containerd as root"
)
def test_the_chart_mode_places_the_examples_through_the_pods_and_a_killed_run_leaves_nothing(
    tmp_path: Path,
) -> None:
    """``make up MODE=chart``: the examples placed through the chart's pods (the same table), every
    service a pod; killed (SIGKILL) then ``down``: no process, node, bridge, cgroup or network
    namespace (with kube-proxy's rules) stays."""
    state_dir = tmp_path / ".hamipy"
    try:
        up = _as_a_user_types_it(state_dir, "make up MODE=chart")
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        _check_examples(up.stdout)
        for component in ("extender", "webhook", "device-plugin", "monitor"):
            assert f"  {component} hami-py-{component}-" in up.stdout, up.stdout
        state = json.loads((state_dir / "state.json").read_text())
        nodes = _runtime_nodes(state["daemon_pid"])
        (network,) = _networks(state["daemon_pid"])
        assert (
            network["netns"]
            in subprocess.run(
                ["ip", "netns", "list"], capture_output=True, text=True, timeout=10, check=True
            ).stdout
        )
        os.kill(state["daemon_pid"], signal.SIGKILL)
        down = _cli(state_dir, "down")
        assert down.returncode == 0, down.stderr
        _check_gone(state_dir, state, nodes)
        assert _networks(state["daemon_pid"]) == []
        assert (
            network["netns"]
            not in subprocess.run(
                ["ip", "netns", "list"], capture_output=True, text=True, timeout=10, check=True
            ).stdout
        )
    finally:
        _cli(state_dir, "down")
