"""``hamipy-devcluster``: build the binaries, and run a local control plane in the background.

    hamipy-devcluster binaries     build (first time) and print the control-plane binaries
    hamipy-devcluster up           start etcd, kube-apiserver, kube-schedulers, the extender, the
                                   webhook and 5 GPU nodes (the real kubelet over a fake runtime,
                                   the device plugin and the monitor; as root, else simulated)
    hamipy-devcluster status       say whether it is up and where
    hamipy-devcluster gpus         every GPU's allocation: memory, cores, slots, pods
    hamipy-devcluster trace NS/POD the trace of one pod's journey (admission -> Allocate)
    hamipy-devcluster down         stop everything `up` started and remove its state

`up` starts a detached daemon (``hamipy-devcluster _serve``) that owns the processes (they die with
it) and keeps the simulated nodes' heartbeats going (the GPU nodes' kubelets keep their own); it
records itself in ``<state-dir>/state.json`` (default ``.hamipy/``, ignored by git), with the
cluster files and logs in ``<state-dir>/cluster/`` and the admin kubeconfig at
``<state-dir>/kubeconfig``. `down` stops the daemon (SIGTERM, then SIGKILL of whatever is left,
checked against the recorded pids) and removes those files.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from hamipy.devcluster.binaries import KUBERNETES_VERSION
from hamipy.devcluster.cluster_network import sweep_network_orphans
from hamipy.devcluster.containerd_runtime import sweep_orphans
from hamipy.devcluster.errors import ClusterStateError, DevClusterError
from hamipy.devcluster.processes import kill_group, pid_alive, port_is_listening, tail

log = logging.getLogger("hamipy.devcluster.cli")

STATE_FILE = "state.json"
DEFAULT_STATE_DIR = ".hamipy"
KUBECONFIG_FILE = "kubeconfig"
KUBECTL_FILE = "kubectl"
"""``<state-dir>/kubectl``: the cluster's own kubectl release, already pointed at its kubeconfig."""
DAEMON_LOG = "devcluster.log"
TRACES_FILE = "traces.jsonl"
CLUSTER_DIR = "cluster"
DEFAULT_NODES = 0
DEFAULT_GPU_NODES = 7
# First `up` on a machine may also wait for etcd/apiserver to settle on a loaded box.
UP_TIMEOUT_S = 240.0
# The daemon's graceful stop (nodes, schedulers, apiserver, etcd) takes ~2 s; this is headroom.
DOWN_GRACE_S = 30.0


@dataclasses.dataclass(frozen=True)
class State:
    """What `up` leaves behind for `down` and `status`."""

    daemon_pid: int
    server: str
    kubeconfig: str
    workdir: str
    process_pids: dict[str, int]
    ports: list[int]
    nodes: list[str]
    services: dict[str, str] = dataclasses.field(default_factory=dict)
    examples: list[str] = dataclasses.field(default_factory=list)

    def write(self, state_dir: Path) -> None:
        tmp = state_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")
        os.replace(tmp, state_dir / STATE_FILE)

    @classmethod
    def read(cls, state_dir: Path) -> State | None:
        path = state_dir / STATE_FILE
        try:
            data = json.loads(path.read_text())
            return cls(**data)
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as exc:
            raise ClusterStateError(f"{path} is not a devcluster state file ({exc}); remove it") from exc


def _is_our_daemon(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"hamipy" in cmdline and b"_serve" in cmdline and pid_alive(pid)


def write_kubectl(path: Path, kubectl: Path, kubeconfig: Path) -> None:
    """A script that runs `kubectl` against `kubeconfig` (absolute paths: it works from anywhere)."""
    argv = shlex.join([str(kubectl.resolve()), f"--kubeconfig={kubeconfig.resolve()}"])
    path.write_text(f'#!/bin/sh\n# written by `hamipy-devcluster up`; removed by `down`\nexec {argv} "$@"\n')
    path.chmod(0o755)


def _remove_state(state_dir: Path) -> None:
    for name in (STATE_FILE, KUBECONFIG_FILE, KUBECTL_FILE, DAEMON_LOG):
        (state_dir / name).unlink(missing_ok=True)
    shutil.rmtree(state_dir / CLUSTER_DIR, ignore_errors=True)


# -- up ------------------------------------------------------------------------------------


def cmd_up(
    state_dir: Path,
    *,
    nodes: int,
    gpu_nodes: int,
    native_build: Path,
    examples: Path,
    timeout_s: float,
    chart: bool = False,
) -> int:
    from hamipy.devcluster.binaries import ensure_binaries

    state = State.read(state_dir)
    if state is not None:
        if _is_our_daemon(state.daemon_pid):
            raise ClusterStateError(
                f"devcluster is already up (daemon pid {state.daemon_pid}, {state.server}); "
                f"KUBECONFIG={state.kubeconfig}. Run `make down` first to restart it."
            )
        print(f"[devcluster] removing stale state of a devcluster that is gone (pid {state.daemon_pid})")
        _stop_leftovers(state)
        _remove_state(state_dir)
    # Build in the foreground so the first run's progress shows in the terminal.
    ensure_binaries()
    if chart:
        from hamipy.devcluster.service_images import ensure_service_images

        ensure_service_images(Path.cwd())
    state_dir.mkdir(parents=True, exist_ok=True)
    _remove_state(state_dir)
    daemon_log = state_dir / DAEMON_LOG
    with daemon_log.open("ab") as out:
        daemon = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hamipy.devcluster.cli",
                "--state-dir",
                str(state_dir),
                "_serve",
                "--nodes",
                str(nodes),
                "--gpu-nodes",
                str(gpu_nodes),
                "--native-build",
                str(native_build.resolve()),
                "--examples",
                str(examples.resolve()),
                *(["--chart"] if chart else []),
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    deadline = time.monotonic() + timeout_s
    while True:
        code = daemon.poll()
        if code is not None:
            raise DevClusterError(
                f"devcluster daemon exited with code {code} while starting; its log ({daemon_log}):\n"
                + tail(daemon_log)
            )
        state = State.read(state_dir)
        if state is not None:
            break
        if time.monotonic() > deadline:
            kill_group(daemon.pid, waiter=daemon.wait)
            raise DevClusterError(f"devcluster not up after {timeout_s:g}s; log:\n{tail(daemon_log)}")
        time.sleep(0.1)
    kubeconfig = Path(state.kubeconfig).resolve()
    print(f"devcluster is up: {state.server} with {len(state.nodes)} nodes ({', '.join(state.nodes)})")
    if state.examples:
        print(f"\nexample workloads ({examples}):")
        print(asyncio.run(_examples_table(state)))
    if state.services:
        print("\nendpoints:")
        for service, url in state.services.items():
            print(f"  {service}: {url}")
    print(f"\n  {state_dir / KUBECTL_FILE} get nodes -o wide")
    print(f"  (kubectl {KUBERNETES_VERSION}, with the admin kubeconfig {kubeconfig})")
    print(f"logs: {Path(state.workdir).resolve() / 'logs'} and {daemon_log.resolve()}")
    print("stop it with: make down")
    return 0


# -- the daemon ----------------------------------------------------------------------------


async def _examples_table(state: State) -> str:
    from hamipy.devcluster.errors import WaitTimeout
    from hamipy.devcluster.examples import format_table, pod_rows, wait_settled

    pods = [tuple(p.split("/", 1)) for p in state.examples]
    async with await _api_client(state) as api:
        try:
            await wait_settled(api, pods)  # type: ignore[arg-type]
        except WaitTimeout as exc:
            print(f"  (not every example settled: {exc})")
        rows = await pod_rows(api, pods)  # type: ignore[arg-type]
    return format_table(["POD", "STATUS", "NODE", "GPUS", "MEMORY", "CORES", "WHY"], rows)


async def _api_client(state: State) -> Any:
    """An admin ``ApiClient`` from the kubeconfig `up` wrote (the caller closes it)."""
    from hamipy.kube.client import api_client

    return await api_client(state.kubeconfig)


def cmd_gpus(state_dir: Path) -> int:
    from hamipy.devcluster.examples import format_table, gpu_rows

    state = _running_state(state_dir)

    async def rows() -> list[list[str]]:
        async with await _api_client(state) as api:
            return await gpu_rows(api)

    print(format_table(["NODE", "GPU", "TYPE", "MEMORY", "CORES", "SLOTS", "PODS"], asyncio.run(rows())))
    return 0


def cmd_trace(state_dir: Path, pod: str) -> int:
    from hamipy.devcluster.otlp import load_spans

    namespace, _, name = pod.rpartition("/")
    namespace = namespace or "default"
    spans = load_spans(state_dir / TRACES_FILE)
    mine = [
        s
        for s in spans
        if s.attributes.get("k8s.namespace.name") == namespace and s.attributes.get("k8s.pod.name") == name
    ]
    if not mine:
        print(f"no spans recorded for pod {namespace}/{name} in {state_dir / TRACES_FILE}")
        return 1
    trace_id = max(mine, key=lambda s: s.start_ns).trace_id
    journey = sorted((s for s in spans if s.trace_id == trace_id), key=lambda s: s.start_ns)
    start = journey[0].start_ns
    print(f"trace {trace_id} of pod {namespace}/{name}")
    for span in journey:
        detail = ", ".join(
            f"{label}={span.attributes[key]}" for key, label in _TRACE_DETAILS if key in span.attributes
        )
        print(
            f"  +{(span.start_ns - start) / 1e6:8.1f} ms  {span.duration_ms:7.1f} ms  "
            f"{span.service:<22} {span.name:<24} {detail}"
        )
    return 0


_TRACE_DETAILS = (
    ("hamipy.admission.outcome", "outcome"),
    ("hamipy.outcome", "outcome"),
    ("k8s.node.name", "node"),
    ("k8s.container.name", "container"),
    ("hamipy.devices", "devices"),
)


def _running_state(state_dir: Path) -> State:
    state = State.read(state_dir)
    if state is None or not _is_our_daemon(state.daemon_pid):
        raise ClusterStateError("devcluster is not up: run `make up` first")
    return state


def cmd_serve(
    state_dir: Path, *, nodes: int, gpu_nodes: int, native_build: Path, examples: Path, chart: bool = False
) -> int:
    """Run the cluster in the foreground until SIGTERM/SIGINT; `up` starts this detached."""
    from hamipy.devcluster.cluster import ClusterSettings, DevCluster

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # kubernetes_asyncio takes ~3 s to import; do it while the control plane starts.
    threading.Thread(
        target=importlib.import_module, args=("kubernetes_asyncio.client",), name="import-k8s", daemon=True
    ).start()
    settings = ClusterSettings(workdir=state_dir / CLUSTER_DIR, keep_dir=True, pod_network=chart)
    with DevCluster(settings) as cluster:
        log.info("control plane up in %.1fs at %s", cluster.start_seconds, cluster.access.server)
        shutil.copyfile(cluster.access.kubeconfig, state_dir / KUBECONFIG_FILE)
        (state_dir / KUBECONFIG_FILE).chmod(0o600)
        write_kubectl(state_dir / KUBECTL_FILE, cluster.binaries.kubectl, state_dir / KUBECONFIG_FILE)
        serve = _serve_chart if chart else _serve_nodes
        asyncio.run(serve(cluster, state_dir, nodes, gpu_nodes, native_build, examples))
    log.info("devcluster stopped")
    return 0


def _stop_on_signals() -> asyncio.Event:
    """Set on SIGTERM or SIGINT (``down``, Ctrl-C): the daemon then stops what it started."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def _up_state(
    cluster: Any,
    state_dir: Path,
    node_pids: dict[str, int],
    nodes: list[str],
    services: dict[str, str],
    examples: list[tuple[str, str]],
) -> State:
    """What the daemon records once up: its processes (the control plane's and the nodes'), for
    ``down`` to find any left over, and what ``up`` prints."""
    return State(
        daemon_pid=os.getpid(),
        server=cluster.access.server,
        kubeconfig=str(state_dir / KUBECONFIG_FILE),
        workdir=str(cluster.workdir),
        process_pids={
            **{name: proc.pid for name, proc in cluster.processes.items() if proc.pid},
            **node_pids,
        },
        ports=cluster.ports,
        nodes=nodes,
        services=services,
        examples=[f"{ns}/{name}" for ns, name in examples],
    )


async def _serve_nodes(
    cluster: Any, state_dir: Path, count: int, gpu_count: int, native_build: Path, examples: Path
) -> None:
    from hamipy.devcluster.examples import apply_examples
    from hamipy.devcluster.kubeobjects import wait_for_default_service_account
    from hamipy.devcluster.nodes import NodePool, NodeSpec
    from hamipy.devcluster.otlp import OtlpReceiver
    from hamipy.devcluster.stack import GPU_NODE_MODELS, LocalStack

    stop = _stop_on_signals()
    async with cluster.api_client() as api, NodePool(api) as pool:
        names = [f"hamipy-node-{i}" for i in range(count)]
        for name in names:
            await pool.add(NodeSpec(name=name))
        await wait_for_default_service_account(api, "default")
        # Every service exports its spans here; `hamipy-devcluster trace` reads the file.
        receiver = OtlpReceiver(record=state_dir / TRACES_FILE)
        await receiver.start()
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "200"}
        stack = LocalStack(cluster, api, pool, native_build=native_build, env=env)
        applied: list[tuple[str, str]] = []
        if gpu_count:
            models = [GPU_NODE_MODELS[i % len(GPU_NODE_MODELS)] for i in range(gpu_count)]
            await stack.start(models=models)
            names += stack.gpu_nodes
            stack.endpoints["traces (OTLP/HTTP receiver)"] = f"{receiver.url}/v1/traces"
            applied = await apply_examples(api, examples, quota_enforced=stack.quota_enforced)
        _up_state(cluster, state_dir, stack.kubelet_pids(), names, stack.endpoints, applied).write(state_dir)
        log.info("ready: %d nodes without GPUs, %d GPU nodes", count, len(stack.gpu_nodes))
        await stop.wait()
        log.info("stopping")
        await stack.stop()
        await receiver.stop()


async def _serve_chart(
    cluster: Any, state_dir: Path, count: int, gpu_count: int, native_build: Path, examples: Path
) -> None:
    """The chart's mode: GPU nodes on the cluster's pod network, the chart installed on them."""
    from hamipy.devcluster.chart_stack import ChartStack
    from hamipy.devcluster.examples import apply_examples
    from hamipy.devcluster.otlp import OtlpReceiver
    from hamipy.devcluster.stack import GPU_NODE_MODELS

    if count:
        raise DevClusterError("the chart's mode runs GPU nodes only (--nodes 0)")
    stop = _stop_on_signals()
    async with cluster.api_client() as api:
        # The service pods export their spans here, on the host's end of the pod network.
        receiver = OtlpReceiver(record=state_dir / TRACES_FILE, host=cluster.network.names.host_ip)
        await receiver.start()
        stack = ChartStack(
            cluster, api, root=Path.cwd(), native_build=native_build, otlp_endpoint=receiver.url
        )
        try:
            models = [GPU_NODE_MODELS[i % len(GPU_NODE_MODELS)] for i in range(gpu_count)]
            await stack.start(models)
            applied = await apply_examples(api, examples, quota_enforced=stack.quota_enforced)
            services = {"traces (OTLP/HTTP receiver)": f"{receiver.url}/v1/traces", **await stack.endpoints()}
            _up_state(cluster, state_dir, stack.kubelet_pids(), stack.gpu_nodes, services, applied).write(
                state_dir
            )
            log.info("ready: the chart on %d GPU nodes", len(stack.gpu_nodes))
            await stop.wait()
            log.info("stopping")
        finally:
            await stack.stop()
            await receiver.stop()


# -- down / status -------------------------------------------------------------------------


def _stop_leftovers(state: State) -> None:
    """Kill any recorded control-plane process still alive (only if it still is what we started)."""
    for pid in state.process_pids.values():
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            continue
        if Path(exe).name.startswith(("etcd", "kube-", "kubelet", "fakecri", "containerd")):
            kill_group(pid, grace_s=1.0)


def cmd_down(state_dir: Path) -> int:
    state = State.read(state_dir)
    if state is None:
        print(f"devcluster is not up (no {state_dir / STATE_FILE}); nothing to stop")
        return 0
    if _is_our_daemon(state.daemon_pid):
        kill_group(state.daemon_pid, grace_s=DOWN_GRACE_S)
    _stop_leftovers(state)
    sweep_orphans()
    sweep_network_orphans()  # after the nodes: a namespace lives while a process is in it
    busy = [port for port in state.ports if port_is_listening(port)]
    _remove_state(state_dir)
    if busy:
        raise DevClusterError(f"devcluster stopped but ports {busy} still listen; check `ss -ltnp`")
    print(f"devcluster stopped ({state.server}); state removed from {state_dir}")
    return 0


def cmd_status(state_dir: Path) -> int:
    state = State.read(state_dir)
    if state is None or not _is_our_daemon(state.daemon_pid):
        print("devcluster is not up" + (" (stale state; `down` removes it)" if state else ""))
        return 1
    print(f"devcluster is up: {state.server} (daemon pid {state.daemon_pid})")
    print(f"  export KUBECONFIG={Path(state.kubeconfig).resolve()}")
    for name, pid in sorted(state.process_pids.items()):
        print(f"  {name}: pid {pid} {'running' if pid_alive(pid) else 'GONE'}")
    return 0


def cmd_binaries(native_build: Path) -> int:
    """The control-plane binaries; where real kubelets can run, also what their nodes run:
    Debian's runc and CNI plugins (installed if missing), containerd and the images (CoreDNS's
    for the pod network of the chart's mode)."""
    from hamipy.devcluster import binaries
    from hamipy.devcluster.host_packages import ensure_host_packages
    from hamipy.devcluster.images import ensure_coredns_image, ensure_images
    from hamipy.devcluster.real_kubelet import can_run_real_kubelets

    code = binaries.main([])
    why = can_run_real_kubelets()
    if code != 0 or why is not None:
        if why is not None:
            print(f"real-runtime nodes: not here ({why})")
        return code
    try:
        ensure_host_packages()
        print(f"containerd={binaries.ensure_containerd()}")
        images = ensure_images(native_build)
        dns = ensure_coredns_image()
    except DevClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for image in (images.pause, images.gpu_workload, dns):
        print(f"image {image.ref}={image.archive}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hamipy-devcluster",
        description="A real local Kubernetes control plane (etcd, kube-apiserver, kube-scheduler) "
        "with real kubelets and simulated nodes, for tests and `make up`.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('hamipy-devcluster')}")
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=Path(os.environ.get("HAMIPY_STATE_DIR", DEFAULT_STATE_DIR)),
        help="where `up` keeps its state, kubeconfig and logs (default: .hamipy, or $HAMIPY_STATE_DIR)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    binaries = sub.add_parser(
        "binaries",
        help="build (first time only) and print the control-plane binaries, and the real-runtime nodes' "
        "containerd and images",
    )
    binaries.add_argument(
        "--native-build",
        type=Path,
        default=Path("native/build"),
        help="native/ build holding the GPU workload image's program (default native/build)",
    )
    up = sub.add_parser("up", help="start the cluster, our services and GPU nodes in the background")
    up.add_argument(
        "--nodes", type=int, default=DEFAULT_NODES, help="simulated nodes without GPUs (default 0)"
    )
    up.add_argument(
        "--gpu-nodes",
        type=int,
        default=DEFAULT_GPU_NODES,
        help="GPU nodes (the real kubelet as root, else simulated) with the device plugin and the "
        "monitor, plus the extender and webhook (default 5; 0: none)",
    )
    up.add_argument(
        "--examples",
        type=Path,
        default=Path("deploy/examples"),
        help="example workloads applied once the GPU nodes are up (default deploy/examples)",
    )
    up.add_argument(
        "--native-build",
        type=Path,
        default=Path("native/build"),
        help="native/ build with the fake NVML driver the GPU nodes use (default native/build)",
    )
    up.add_argument(
        "--timeout", type=float, default=UP_TIMEOUT_S, help="seconds to wait for it (default 240)"
    )
    up.add_argument(
        "--chart",
        action="store_true",
        help="deploy as an admin does: build the images, install deploy/helm/hami-py on the GPU "
        "nodes (containerd on a pod network with kube-proxy and CoreDNS), every service a pod",
    )
    sub.add_parser("down", help="stop what `up` started and remove its state")
    sub.add_parser("gpus", help="every GPU's allocation (memory, cores, slots) and the pods holding it")
    trace = sub.add_parser("trace", help="the recorded trace of one pod's journey")
    trace.add_argument("pod", help="NAMESPACE/NAME")
    sub.add_parser("status", help="say whether the cluster is up")
    serve = sub.add_parser("_serve")  # the daemon `up` starts; not for direct use
    serve.add_argument("--nodes", type=int, default=DEFAULT_NODES)
    serve.add_argument("--gpu-nodes", type=int, default=DEFAULT_GPU_NODES)
    serve.add_argument("--native-build", type=Path, default=Path("native/build"))
    serve.add_argument("--examples", type=Path, default=Path("deploy/examples"))
    serve.add_argument("--chart", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    state_dir: Path = args.state_dir.absolute()
    try:
        if args.command == "binaries":
            return cmd_binaries(args.native_build)
        if args.command == "up":
            return cmd_up(
                state_dir,
                nodes=args.nodes,
                gpu_nodes=args.gpu_nodes,
                native_build=args.native_build,
                examples=args.examples,
                timeout_s=args.timeout,
                chart=args.chart,
            )
        if args.command == "down":
            return cmd_down(state_dir)
        if args.command == "status":
            return cmd_status(state_dir)
        if args.command == "gpus":
            return cmd_gpus(state_dir)
        if args.command == "trace":
            return cmd_trace(state_dir, args.pod)
        return cmd_serve(
            state_dir,
            nodes=args.nodes,
            gpu_nodes=args.gpu_nodes,
            native_build=args.native_build,
            examples=args.examples,
            chart=args.chart,
        )
    except DevClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
