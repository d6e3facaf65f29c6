"""Every service runs from the environment its image ships.

The rest of the suite runs in the all-packages workspace, where every library is importable, so a
service that imports a library it does not declare works there and dies in its image with
``ModuleNotFoundError``. Here each service's environment is built as its Dockerfile builds it
(``image_envs``: the Dockerfile's own ``ENV UV_*`` and ``RUN uv sync ...``, over a copy of the
build context) and used ALONE: its console scripts and interpreter, a clean environment (no
PYTHONPATH, no workspace ``.venv`` on PATH, a scratch HOME) and a working directory outside the
checkout. In it each CLI answers ``--help`` and ``--version``, every import of our code resolves
(and the service declares what it imports), and each service starts the way its image starts it
(``ENTRYPOINT`` + ``CMD``): the webhook makes its certificates against the real apiserver and
answers an AdmissionReview over TLS, the extender syncs with the cluster, the device plugin and the
monitor come up over native/'s fake NVML driver.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import ssl
import subprocess
import tempfile
import tomllib
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from image_envs import (
    NATIVE_BUILD,
    ROOT,
    SERVICES,
    ImageEnv,
    ImageEnvError,
    ensure_image_env,
    makefile_uv_version,
    read_dockerfile,
)
from prometheus_client.parser import text_string_to_metric_families
from stack_support import NEEDS_REAL_KUBELET, wait_advertised

from hamipy.devcluster import API_TIMEOUT_S, DevCluster
from hamipy.devcluster.gpu_nodes import FakeGpu, fake_gpu_config
from hamipy.devcluster.kubelet_nodes import KubeletNode
from hamipy.devcluster.processes import ManagedProcess, free_port, http_ok
from hamipy.protocol import decode_node_devices, keys
from hamipy.webhook.registration import webhook_configuration

pytestmark = pytest.mark.integration

IMPORT_CHECKER = Path(__file__).with_name("image_env_imports.py")
CLI_TIMEOUT_S = 60.0
START_TIMEOUT_S = 60.0
GPU = FakeGpu("GPU-1a9e0000-0000-4000-8000-00000000000e", "NVIDIA A100-SXM4-40GB", 40960)
RESOURCE = keys.RESOURCE_COUNT


def service_version(service: str) -> str:
    data = tomllib.loads((ROOT / "services" / service / "pyproject.toml").read_text())
    return str(data["project"]["version"])


class ImageEnvs:
    """Each service's environment, built (or found in the cache) once per session; a failed build
    fails every test that needs it with uv's output, without building again."""

    def __init__(self) -> None:
        self._envs: dict[str, ImageEnv] = {}
        self._errors: dict[str, str] = {}

    def __call__(self, service: str) -> ImageEnv:
        if service in self._errors:
            pytest.fail(self._errors[service], pytrace=False)
        if service not in self._envs:
            try:
                env = ensure_image_env(service)
            except ImageEnvError as exc:
                self._errors[service] = f"building the {service} image environment failed: {exc}"
                pytest.fail(self._errors[service], pytrace=False)
            how = f"built in {env.build_s:.1f}s" if env.build_s is not None else "reused from the cache"
            print(f"[image-env] {service}: {how} (context copied and hashed in {env.prepare_s:.2f}s)")
            self._envs[service] = env
        return self._envs[service]


@pytest.fixture(scope="session")
def image_envs() -> ImageEnvs:
    return ImageEnvs()


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A working directory outside the checkout (and short: unix socket paths live under it); it
    is HOME too, so nothing of the user's (site-packages, ~/.kube) is seen."""
    path = Path(tempfile.mkdtemp(prefix="hamipy-img-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run_cli(env: ImageEnv, argv: Sequence[str], cwd: Path, extra: Mapping[str, str] | None = None) -> str:
    """Run a command of the environment; return its output, failing the test with it otherwise."""
    proc = subprocess.run(
        list(argv),
        cwd=cwd,
        env=env.clean_environ(cwd, extra),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"$ {' '.join(argv)}\nexit {proc.returncode}:\n{output}"
    return proc.stdout


def start(
    env: ImageEnv, name: str, args: Sequence[str], cwd: Path, extra: Mapping[str, str] | None = None
) -> ManagedProcess:
    """The image's ENTRYPOINT + ``args`` (in place of CMD) as a process that dies with us."""
    process = ManagedProcess(
        f"{env.build.service}-image",
        env.command(*args),
        log_path=cwd / f"{name}.log",
        cwd=cwd,
        env=env.clean_environ(cwd, extra),
    )
    process.start()
    return process


async def wait_ok(process: ManagedProcess, url: str, what: str) -> None:
    await asyncio.to_thread(
        process.wait_healthy, http_ok(url, expect=b"ok"), timeout_s=START_TIMEOUT_S, what=what
    )


def fake_driver_env(workdir: Path) -> dict[str, str]:
    """native/'s fake NVML first on the library path, configured with one GPU (as the devcluster's
    GPU nodes run the device plugin and the monitor)."""
    fake = NATIVE_BUILD / "fake"
    if not (fake / "libnvidia-ml.so.1").is_file():
        pytest.fail(f"{fake}/libnvidia-ml.so.1 is missing: run `make native` first", pytrace=False)
    config = workdir / "gpus.conf"
    config.write_text(fake_gpu_config([GPU]))
    return {"HAMIPY_FAKE_GPU_CONFIG": str(config), "LD_LIBRARY_PATH": str(fake), "PYTHONFAULTHANDLER": "1"}


# -- the Dockerfiles --------------------------------------------------------------------------------


@pytest.mark.parametrize("service", SERVICES)
def test_dockerfile_installs_the_uv_of_the_makefile(service: str) -> None:
    """The image's `uv sync --frozen` reads uv.lock with the uv that wrote it."""
    build = read_dockerfile(service)
    assert build.uv_pin == makefile_uv_version(), build.dockerfile
    assert build.package == f"hamipy-{service}"
    assert "--frozen" in build.sync_argv
    assert "--no-dev" in build.sync_argv


# -- the environments alone -------------------------------------------------------------------------


@pytest.mark.parametrize("service", SERVICES)
def test_cli_answers_help_and_version(image_envs: ImageEnvs, service: str, scratch: Path) -> None:
    env = image_envs(service)
    script = env.script(env.build.entrypoint[0])
    assert script.read_text().splitlines()[0].startswith(f"#!{env.bin}/python"), "not this env's Python"
    assert f"usage: hamipy-{service}" in run_cli(env, [str(script), "--help"], scratch)
    assert run_cli(env, [str(script), "--version"], scratch).strip() == (
        f"hamipy-{service} {service_version(service)}"
    )


@pytest.mark.parametrize("service", SERVICES)
def test_every_import_resolves_in_the_image(image_envs: ImageEnvs, service: str, scratch: Path) -> None:
    """Every module of our packages in the image imports, every import in their source (lazy ones
    too) is installed there, and the service declares each distribution it imports itself."""
    env = image_envs(service)
    out = run_cli(env, [str(env.python), "-I", str(IMPORT_CHECKER), env.build.package], scratch)
    report = json.loads(out)
    assert report["checked"].get(env.build.package), report
    assert report["unresolved"] == [], "imports the image lacks:\n" + "\n".join(report["unresolved"])
    errors = report["import_errors"]
    assert errors == [], "modules that fail to import:\n" + "\n".join(errors)
    assert report["undeclared"] == [], (
        f"{env.build.package} imports distributions it does not declare (present only as another "
        "package's dependency):\n" + "\n".join(report["undeclared"])
    )


# -- each service starts as its image starts it ----------------------------------------------------


def _env_fixture(service: str) -> Any:
    """A fixture ``<service>_env``: the environment, built before the (async) test starts."""

    def fixture(image_envs: ImageEnvs) -> ImageEnv:
        return image_envs(service)

    return pytest.fixture(name=f"{service.replace('-', '_')}_env")(fixture)


webhook_env = _env_fixture("webhook")
extender_env = _env_fixture("extender")
device_plugin_env = _env_fixture("device-plugin")
monitor_env = _env_fixture("monitor")


async def test_webhook_image_makes_certificates_and_admits_a_gpu_pod(
    webhook_env: ImageEnv, devcluster: DevCluster, kube_client: Any, namespace: str, scratch: Path
) -> None:
    from kubernetes_asyncio import client

    kubeconfig = str(devcluster.access.kubeconfig)
    name = f"hamipy-webhook-image-{namespace}"
    # The configuration `certs` patches; it never matches a pod (its Service does not exist here).
    doc = webhook_configuration(name=name, service_name="hamipy-webhook", service_namespace=namespace)
    doc["webhooks"][0]["objectSelector"] = {"matchLabels": {"hami-py.io/never": "true"}}
    doc["webhooks"][0]["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    admission: Any = client.AdmissionregistrationV1Api(kube_client)
    await admission.create_mutating_webhook_configuration(doc, _request_timeout=API_TIMEOUT_S)
    process: ManagedProcess | None = None
    try:
        certs = scratch / "tls"
        out = await asyncio.to_thread(
            run_cli,
            webhook_env,
            webhook_env.command(
                "certs",
                "--namespace",
                namespace,
                "--webhook-config",
                name,
                "--cert-dir",
                str(certs),
                "--kubeconfig",
                kubeconfig,
            ),
            scratch,
        )
        result = json.loads(out)
        assert (result["renewed"], result["caBundlePatched"]) == (True, True), result
        ca = (certs / "ca.crt").read_bytes()
        stored = await admission.read_mutating_webhook_configuration(name, _request_timeout=API_TIMEOUT_S)
        assert base64.b64decode(stored.webhooks[0].client_config.ca_bundle) == ca

        port, metrics_port = free_port(), free_port()
        process = start(
            webhook_env,
            "webhook",
            [
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--metrics-port",
                str(metrics_port),
                "--cert-file",
                str(certs / "tls.crt"),
                "--key-file",
                str(certs / "tls.key"),
            ],
            scratch,
        )
        await wait_ok(process, f"http://127.0.0.1:{metrics_port}/readyz", "ready")

        uid = str(uuid.uuid4())
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "gpu", "namespace": namespace},
            "spec": {
                "containers": [
                    {
                        "name": "main",
                        "image": "registry.k8s.io/pause:3.10",
                        "resources": {"limits": {RESOURCE: "1"}},
                    }
                ]
            },
        }
        review = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": uid,
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": namespace,
                "operation": "CREATE",
                "object": pod,
            },
        }
        # As the apiserver calls it: TLS to the Service name, trusting the caBundle `certs` set.
        context = ssl.create_default_context(cadata=ca.decode())
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
            session.post(
                f"https://127.0.0.1:{port}/webhook",
                json=review,
                ssl=context,
                server_hostname=f"hamipy-webhook.{namespace}.svc",
            ) as response,
        ):
            assert response.status == 200, await response.text()
            answer = await response.json()
        assert answer["kind"] == "AdmissionReview"
        assert answer["response"]["uid"] == uid
        assert answer["response"]["allowed"] is True
        assert answer["response"]["patchType"] == "JSONPatch"
        patch = json.loads(base64.b64decode(answer["response"]["patch"]))
        assert any(
            op["path"] == "/spec/schedulerName" and op.get("value") == "hami-scheduler" for op in patch
        ), patch
    finally:
        if process is not None:
            await asyncio.to_thread(process.stop)
        await admission.delete_mutating_webhook_configuration(name, _request_timeout=API_TIMEOUT_S)


async def test_extender_image_serves_and_syncs_with_the_cluster(
    extender_env: ImageEnv, devcluster: DevCluster, scratch: Path
) -> None:
    port = free_port()
    process = start(
        extender_env,
        "extender",
        [
            "serve",
            "--kubeconfig",
            str(devcluster.access.kubeconfig),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--handshake-interval",
            "0",  # stamps no handshake on the shared cluster's nodes
        ],
        scratch,
    )
    try:
        await wait_ok(process, f"http://127.0.0.1:{port}/healthz", "serving /healthz")
        await wait_ok(process, f"http://127.0.0.1:{port}/readyz", "synced with the cluster (/readyz)")
    finally:
        await asyncio.to_thread(process.stop)


@pytest.mark.native
@NEEDS_REAL_KUBELET
async def test_device_plugin_image_registers_the_fake_gpu(
    device_plugin_env: ImageEnv,
    devcluster: DevCluster,
    kube_client: Any,
    namespace: str,
    scratch: Path,
) -> None:
    extra = fake_driver_env(scratch)
    hook = scratch / "vgpu"
    config = scratch / "hami-py.yaml"
    config.write_text(yaml.safe_dump({"nvidia": {"hookPath": str(hook)}}))
    # The real kubelet's device manager; its unix sockets want a short directory.
    sockets = Path(tempfile.mkdtemp(prefix="hamipy-img-", dir="/tmp"))
    taint = f"hami-py.io/image-test={namespace}:NoSchedule"
    async with KubeletNode(devcluster, kube_client, f"{namespace}-image", sockets, taints=[taint]) as node:
        metrics_port = free_port()
        process = start(
            device_plugin_env,
            "device-plugin",
            [
                "--node-name",
                node.name,
                "--kubeconfig",
                str(devcluster.access.kubeconfig),
                "--config",
                str(config),
                "--plugin-dir",
                str(node.kubelet.plugin_dir),
                "--metrics-host",
                "127.0.0.1",
                "--metrics-port",
                str(metrics_port),
            ],
            scratch,
            extra,
        )
        try:
            await wait_ok(process, f"http://127.0.0.1:{metrics_port}/healthz", "serving /healthz")
            await wait_ok(process, f"http://127.0.0.1:{metrics_port}/readyz", "registered (/readyz)")
            read = await wait_advertised(kube_client, node.name)
            devices = decode_node_devices(read["metadata"]["annotations"][keys.NODE_REGISTER])
            assert [(d.id, d.devmem, d.type) for d in devices] == [(GPU.uuid, GPU.memory_mib, GPU.name)]
            # the ENTRYPOINT's --interposer put libvgpu.so and its ld.so.preload into the hook path
            assert (hook / "libvgpu.so").read_bytes() == (NATIVE_BUILD / "libvgpu.so").read_bytes()
            assert (hook / "ld.so.preload").read_text().strip() == str(hook / "libvgpu.so")
        finally:
            await asyncio.to_thread(process.stop)
            shutil.rmtree(sockets, ignore_errors=True)


@pytest.mark.native
async def test_monitor_image_reports_the_fake_gpu(
    monitor_env: ImageEnv, devcluster: DevCluster, namespace: str, scratch: Path
) -> None:
    extra = fake_driver_env(scratch)
    hook = scratch / "vgpu"
    (hook / "containers").mkdir(parents=True)
    port = free_port()
    process = start(
        monitor_env,
        "monitor",
        [
            "--node-name",
            f"{namespace}-image",
            "--kubeconfig",
            str(devcluster.access.kubeconfig),
            "--hook-path",
            str(hook),
            "--metrics-host",
            "127.0.0.1",
            "--metrics-port",
            str(port),
        ],
        scratch,
        extra,
    )
    try:
        await wait_ok(process, f"http://127.0.0.1:{port}/healthz", "serving /healthz")
        await wait_ok(process, f"http://127.0.0.1:{port}/readyz", "listing its node's pods (/readyz)")
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
            session.get(f"http://127.0.0.1:{port}/metrics") as response,
        ):
            assert response.status == 200
            text = await response.text()
        totals = {
            s.labels["device_uuid"]: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "hamipy_monitor_host_gpu_memory_total_bytes"
        }
        assert totals == {GPU.uuid: GPU.memory_mib * 2**20}, text
    finally:
        await asyncio.to_thread(process.stop)
