"""Starting and stopping control planes leaves nothing behind: not on stop, not on failure, not on a crash."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hamipy.devcluster import ClusterSettings, DevCluster, StartupError, ensure_binaries
from hamipy.devcluster.cluster import _sweep_stale_workdirs
from hamipy.devcluster.processes import pid_alive, port_is_listening

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
    assert len(pids) == 3
    assert all(port_is_listening(p) for p in (cluster.etcd_port, cluster.apiserver_port))

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


def _cli(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hamipy.devcluster.cli", "--state-dir", str(state_dir), *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def _row(table: str, pod: str) -> list[str]:
    (line,) = [line for line in table.splitlines() if line.startswith(pod + " ")]
    return line.split()


def test_cli_up_down_twice_leaves_nothing_running(tmp_path: Path) -> None:
    state_dir = tmp_path / ".hamipy"
    try:
        for attempt in range(2):
            up = _cli(state_dir, "up")
            assert up.returncode == 0, up.stderr
            assert "KUBECONFIG=" in up.stdout
            state = json.loads((state_dir / "state.json").read_text())
            assert (state_dir / "kubeconfig").is_file()
            assert len(state["nodes"]) == 3
            # The example workloads landed as they should, and the table says so.
            single = _row(up.stdout, "hami-examples/single-slice")
            assert single[1] == "Running"
            assert single[2].startswith("hamipy-gpu-")
            assert "H100" in " ".join(_row(up.stdout, "hami-examples/multi-gpu"))
            assert "100%" in _row(up.stdout, "hami-examples/exclusive")
            cannot_fit = _row(up.stdout, "hami-examples/cannot-fit")
            assert cannot_fit[1] == "Pending"
            assert "CardInsufficientMemory" in " ".join(cannot_fit)
            if attempt == 0:
                gpus = _cli(state_dir, "gpus")
                assert gpus.returncode == 0, gpus.stderr
                assert "hami-examples/exclusive" in gpus.stdout
                trace = _cli(state_dir, "trace", "hami-examples/single-slice")
                assert trace.returncode == 0, trace.stdout + trace.stderr
                spans = ("webhook.", "extender.", "device_plugin.")
                names = [
                    w for line in trace.stdout.splitlines()[1:] for w in line.split() if w.startswith(spans)
                ]
                assert names == [
                    "webhook.admission",
                    "extender.filter",
                    "extender.bind",
                    "device_plugin.allocate",
                ]

            again = _cli(state_dir, "up")
            assert again.returncode == 1
            assert "already up" in again.stderr

            down = _cli(state_dir, "down")
            assert down.returncode == 0, down.stderr
            pids = [state["daemon_pid"], *state["process_pids"].values()]
            assert _wait_gone(pids, state["ports"]) == ([], [])
            assert not (state_dir / "state.json").exists()
            assert not (state_dir / "kubeconfig").exists()

        not_up = _cli(state_dir, "down")
        assert not_up.returncode == 0
        assert "not up" in not_up.stdout
    finally:
        _cli(state_dir, "down")
