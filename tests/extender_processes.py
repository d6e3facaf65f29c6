"""``hamipy-extender serve`` as users run it, one process per replica, for the benchmarks and for
the integration tests that kill a replica (``kill -9`` cannot be done to one in the test process).

- `start_extender_processes`: plain HTTP on loopback, or with ``tls`` (a `LoopbackPki`) HTTPS that
  demands a client certificate, as the chart serves it, ``/readyz`` and ``/metrics`` then on a plain
  port of their own; the node policy from a ``--config`` file, handshake stamping off; ready once each
  ``/readyz`` answers;
- `ExtenderProcess.stop` sends SIGTERM and waits, SIGKILL only after a timeout; `ExtenderProcess.kill`
  is ``kill -9`` at once (a crash: no Lease released, no request drained).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

import aiohttp

from hamipy.devcluster.config import ExtenderTLS
from hamipy.devcluster.processes import free_port, tail
from hamipy.kube.certs import issue_cert, make_ca

READY_TIMEOUT_S = 120.0
"""An extender is ready once it has listed every Node and Pod: a few seconds at 1,000 nodes."""
STOP_TIMEOUT_S = 15.0
"""SIGTERM drains in-flight requests and stops the watches; SIGKILL after this."""


def extender_command() -> Path:
    """The ``hamipy-extender`` console script of the Python running this benchmark."""
    beside = Path(sys.executable).with_name("hamipy-extender")
    if beside.is_file():
        return beside
    found = shutil.which("hamipy-extender")
    if found is None:
        raise FileNotFoundError(f"no hamipy-extender beside {sys.executable} or on PATH")
    return Path(found)


PKI_VALIDITY = datetime.timedelta(days=1)


@dataclasses.dataclass(frozen=True)
class LoopbackPki:
    """The chart's extender TLS on loopback, as files: one CA (EC P-256, as ``hamipy.kube.certs``
    issues), the extenders' serving certificate for 127.0.0.1, and one client certificate, which
    kube-scheduler and the filter probe present."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def create(cls, directory: Path) -> LoopbackPki:
        ca = make_ca("bench-extender-ca", validity=PKI_VALIDITY)
        server = issue_cert(
            ca, common_name="extender", validity=PKI_VALIDITY, ip_addresses=["127.0.0.1"], server=True
        )
        client = issue_cert(ca, common_name="hami-scheduler", validity=PKI_VALIDITY, client=True)
        directory.mkdir(parents=True, exist_ok=True)
        files = {
            "ca.crt": ca.cert_pem,
            "tls.crt": server.cert_pem,
            "tls.key": server.key_pem,
            "client.crt": client.cert_pem,
            "client.key": client.key_pem,
        }
        for name, data in files.items():
            (directory / name).write_bytes(data)
        return cls(*(directory / name for name in files))

    def serve_args(self) -> list[str]:
        """The extender's flags: HTTPS with this certificate, a client certificate required."""
        return [
            "--tls-cert-file",
            str(self.server_cert),
            "--tls-key-file",
            str(self.server_key),
            "--tls-client-ca-file",
            str(self.ca),
        ]

    def scheduler(self) -> ExtenderTLS:
        """kube-scheduler's extender ``tlsConfig``."""
        return ExtenderTLS(
            ca_file=str(self.ca), cert_file=str(self.client_cert), key_file=str(self.client_key)
        )


@dataclasses.dataclass
class ExtenderProcess:
    """One ``hamipy-extender serve`` child process on 127.0.0.1:``port``: plain HTTP, or HTTPS with
    ``metrics_port`` serving ``/readyz`` and ``/metrics`` plainly."""

    index: int
    port: int
    log_path: Path
    process: asyncio.subprocess.Process
    metrics_port: int | None = None

    @property
    def url(self) -> str:
        """The decision port, where kube-scheduler calls."""
        return f"{'http' if self.metrics_port is None else 'https'}://127.0.0.1:{self.port}"

    @property
    def plain_url(self) -> str:
        """Where ``/readyz`` and ``/metrics`` answer without a client certificate."""
        return f"http://127.0.0.1:{self.port if self.metrics_port is None else self.metrics_port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 30) -> str:
        return tail(self.log_path, lines)

    async def wait_ready(self, session: aiohttp.ClientSession, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Return once ``/readyz`` answers 200; ``RuntimeError`` with the log's tail when the process
        exits first or is not ready after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.returncode is not None:
                raise RuntimeError(
                    f"extender {self.index} exited with status {self.process.returncode} before it was "
                    f"ready; its log ({self.log_path}) ends:\n{self.log_tail()}"
                )
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(
                    f"{self.plain_url}/readyz", timeout=aiohttp.ClientTimeout(total=2)
                ) as resp:
                    if resp.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"extender {self.index} not ready after {timeout_s:g}s; its log ends:\n{self.log_tail()}"
                )
            await asyncio.sleep(0.1)  # a readiness poll, as the kubelet's probe would

    async def metrics(self, session: aiohttp.ClientSession) -> str:
        """Its ``/metrics`` (Prometheus text)."""
        async with session.get(f"{self.plain_url}/metrics", timeout=aiohttp.ClientTimeout(total=30)) as resp:
            resp.raise_for_status()
            return await resp.text()

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait up to ``timeout_s`` for it to exit, else SIGKILL its process group; its exit
        status (0 after a clean stop; negative: killed by that signal)."""
        proc = self.process
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        assert proc.returncode is not None
        return proc.returncode

    async def kill(self) -> int:
        """``kill -9`` its process group now and reap it; its exit status (``-9``)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        return await self.process.wait()


async def start_extender_processes(
    n: int,
    policy: str,
    *,
    kubeconfig: Path,
    workdir: Path,
    extra_args: Sequence[str] = (),
    replica_args: Callable[[int, int], Sequence[str]] | None = None,
    tls: LoopbackPki | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> list[ExtenderProcess]:
    """``n`` extender replicas with ``nodeSchedulerPolicy: policy``, each its own process on a port of
    its own, all ready (``/readyz``) on return; those started are stopped again when one fails.
    ``extra_env``: variables added to every replica's environment.

    ``extra_args`` go to every replica, ``replica_args(index, port)`` to one (flags that differ per
    replica, such as where the others reach it: ``--advertise-url http://127.0.0.1:<port>``). With
    ``tls`` each serves HTTPS demanding a client certificate that CA signed."""
    config = await asyncio.to_thread(_write_config, workdir, policy)
    command = extender_command()
    # Flags come from the command line only: a HAMIPY_EXTENDER_* variable would change the setup.
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAMIPY_EXTENDER_")}
    env.pop("HAMIPY_CONFIG", None)
    env.update(extra_env or {})
    # The kernel kills a replica if this process dies (as the devcluster does with its processes).
    prefix = [setpriv, "--pdeathsig", "KILL", "--"] if (setpriv := shutil.which("setpriv")) else []
    started: list[ExtenderProcess] = []
    try:
        for index in range(n):
            port = free_port()
            metrics_port = free_port() if tls is not None else None
            log_path = workdir / f"extender-{policy}-{index}-{port}.log"
            argv = [
                str(command),
                "serve",
                "--kubeconfig",
                str(kubeconfig),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--config",
                str(config),
                "--handshake-interval",
                "0",
                *([*tls.serve_args(), "--metrics-port", str(metrics_port)] if tls is not None else []),
                *extra_args,
                *(replica_args(index, port) if replica_args is not None else ()),
            ]
            with _open_log(log_path, argv) as log:
                process = await asyncio.create_subprocess_exec(
                    *prefix,
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            started.append(ExtenderProcess(index, port, log_path, process, metrics_port))
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(e.wait_ready(session) for e in started))
    except BaseException:
        await stop_extenders(started)
        raise
    return started


def _write_config(workdir: Path, policy: str) -> Path:
    """The replicas' shared configuration file: the node policy, every other key its default."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / f"extender-{policy}.yaml"
    config.write_text(f"nodeSchedulerPolicy: {policy}\n")
    return config


def _open_log(path: Path, argv: Sequence[str]) -> BinaryIO:
    """A replica's log file (appended to), opening with its command line."""
    log = path.open("ab")
    log.write(f"$ {' '.join(argv)}\n".encode())
    log.flush()
    return log


async def stop_extenders(extenders: Iterable[ExtenderProcess]) -> dict[int, int]:
    """Stop every replica (at once); their exit statuses by index. A status other than 0 is
    reported on stderr with the end of that replica's log."""
    extenders = list(extenders)
    codes = await asyncio.gather(*(e.stop() for e in extenders))
    for extender, code in zip(extenders, codes, strict=True):
        if code != 0:
            print(
                f"warning: extender {extender.index} exited with status {code}; its log ends:\n"
                f"{extender.log_tail()}",
                file=sys.stderr,
            )
    return {e.index: code for e, code in zip(extenders, codes, strict=True)}
