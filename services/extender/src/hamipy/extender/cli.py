"""``hamipy-extender``: the entry point (wiring only).

    hamipy-extender [serve] [--config hami-py.yaml] [--kubeconfig FILE] [--port 8888] [--cooperative]
                    [--release-lock-after-bind | --no-release-lock-after-bind] [--tls-cert-file ...]
    hamipy-extender check [--kubeconfig FILE]      # the invariant against the cluster; exit 1 if broken

Every flag may also come from the environment (``HAMIPY_EXTENDER_<FLAG>``, e.g.
``HAMIPY_EXTENDER_PORT=9443``; booleans strictly ``true``/``false`` and the like, anything else is
refused with exit status 2); the shared configuration file from ``--config`` or ``HAMIPY_CONFIG``.
Without ``--kubeconfig`` the in-cluster service account is used, else ``~/.kube/config``.

``serve`` runs until SIGTERM or SIGINT (exit status 0) or until a background task dies (logged by
name; exit status 1, so the pod restarts instead of deciding from a model no longer kept current).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import ssl
import sys
from collections.abc import Mapping, Sequence
from datetime import timedelta
from importlib.metadata import version
from pathlib import Path
from typing import Final

from hamipy.extender.invariant import check_cluster
from hamipy.extender.server import ExtenderServer, http_limits, lease_settings
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.kube.client import connect
from hamipy.kube.errors import KubeError
from hamipy.kube.options import (
    CONFIG_ENV,
    EXIT_FAILED,
    LOG_LEVELS,
    BadEnvironment,
    EnvFlags,
    run_command,
    with_default_command,
)
from hamipy.protocol.config import Config, load_config_file
from hamipy.telemetry import TracingConfigError
from hamipy.telemetry.limit_options import add_limit_options
from hamipy.telemetry.supervision import serve_until_signal
from hamipy.telemetry.tls import serving_context

__all__ = ["build_parser", "main", "serve", "settings_from_args"]

ENV_PREFIX: Final = "HAMIPY_EXTENDER_"
_COMMANDS: Final = ("serve", "check")
_DEFAULTS: Final = ExtenderSettings()


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The argument parser; defaults come from ``env`` (``os.environ`` by default).
    ``BadEnvironment`` when a variable holds a value its flag cannot take."""
    env = os.environ if env is None else env
    flags = EnvFlags(env, ENV_PREFIX)
    log_level = flags.text("log-level", "info")
    if log_level not in LOG_LEVELS:
        raise BadEnvironment(
            f"{flags.name('log-level')}={log_level!r}: expected one of {', '.join(LOG_LEVELS)}"
        )
    parser = argparse.ArgumentParser(
        prog="hamipy-extender",
        description="hami-py scheduler extender: GPU-aware /filter, /prioritize and /bind.",
        epilog=flags.epilog("PORT=9443"),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('hamipy-extender')}")
    commands = parser.add_subparsers(dest="command", metavar="{serve,check}")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--config",
            type=Path,
            default=env.get(CONFIG_ENV) or flags.get("config"),
            help=f"shared hami-py configuration (YAML; env {CONFIG_ENV}); defaults apply without one",
        )
        p.add_argument(
            "--kubeconfig",
            default=env.get("KUBECONFIG") or flags.get("kubeconfig"),
            help="kubeconfig file; default: in-cluster service account, else ~/.kube/config",
        )
        p.add_argument(
            "--api-timeout",
            type=float,
            default=flags.number("api-timeout", _DEFAULTS.api_timeout_s),
            help="seconds per Kubernetes API call",
        )

    serve = commands.add_parser("serve", help="serve the extender (the default command)")
    common(serve)
    serve.add_argument("--host", default=flags.text("host", "0.0.0.0"), help="listen address")
    serve.add_argument("--port", type=int, default=flags.integer("port", 8888), help="listen port")
    serve.add_argument(
        "--tls-cert-file", type=Path, default=flags.get("tls-cert-file"), help="PEM cert (HTTPS)"
    )
    serve.add_argument("--tls-key-file", type=Path, default=flags.get("tls-key-file"), help="PEM key (HTTPS)")
    serve.add_argument(
        "--tls-client-ca-file",
        type=Path,
        default=flags.get("tls-client-ca-file"),
        help="PEM CA: with HTTPS, a request to the decision port must come with a client certificate "
        "it signed (kube-scheduler's, from its extender tlsConfig)",
    )
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=flags.optional_integer("metrics-port"),
        help="also serve /metrics, /healthz, /readyz over plain HTTP on this port (for the kubelet's "
        "probes and Prometheus when the decision port demands client certificates)",
    )
    flags.switch(
        serve,
        "cooperative",
        _DEFAULTS.cooperative,
        help="/filter returns every feasible node and /prioritize scores them (GPUs chosen at bind)",
    )
    flags.switch(
        serve,
        "release-lock-after-bind",
        _DEFAULTS.release_lock_after_bind,
        help="on nodes our device plugin serves, hold the node lock only while binding (default); "
        "--no-... leaves it for the device plugin to release after Allocate there too (as always on "
        "nodes HAMi's device plugin serves)",
    )
    serve.add_argument(
        "--bind-timeout",
        type=float,
        default=flags.number("bind-timeout", _DEFAULTS.bind_timeout_s),
        help="seconds a bind waits in all, for an earlier bind of its pod and a locked node "
        "(keep below the scheduler's httpTimeout)",
    )
    serve.add_argument(
        "--lock-expiry",
        type=float,
        default=flags.number("lock-expiry", _DEFAULTS.lock_expiry.total_seconds()),
        help="seconds after which any node lock is broken",
    )
    serve.add_argument(
        "--lock-sweep-interval",
        type=float,
        default=flags.number("lock-sweep-interval", _DEFAULTS.lock_sweep_interval_s),
        help="seconds between retries of failed lock releases and checks of stuck locks",
    )
    serve.add_argument(
        "--reservation-ttl",
        type=float,
        default=flags.number("reservation-ttl", _DEFAULTS.reservation_ttl_s),
        help="seconds a filter's reservation counts without a bind",
    )
    serve.add_argument(
        "--watch-wait",
        type=float,
        default=flags.number("watch-wait", _DEFAULTS.watch_wait_s),
        help="longest seconds a filter waits for the pod watch to deliver the pod it names, so that"
        " it reserves for it (0: off)",
    )
    serve.add_argument(
        "--handshake-interval",
        type=float,
        default=flags.number("handshake-interval", _DEFAULTS.handshake_interval_s),
        help="seconds between Requesting_ handshake stamps on nodes (0: off)",
    )
    serve.add_argument(
        "--requeue-interval",
        type=float,
        default=flags.number("requeue-interval", _DEFAULTS.requeue_interval_s),
        help="least seconds between nudges making kube-scheduler retry refused pods once GPUs free (0: off)",
    )
    serve.add_argument(
        "--api-connections",
        type=int,
        default=flags.integer("api-connections", _DEFAULTS.api_connections),
        help="connections to the API server at once (its watches and the calls in flight, a bind's"
        " Binding among them)",
    )
    serve.add_argument(
        "--heap-trim-interval",
        type=float,
        default=flags.number("heap-trim-interval", _DEFAULTS.heap_trim_interval_s),
        help="seconds between hand-backs of the C heap's free pages to the kernel (0: off)",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=flags.integer("max-body-bytes", _DEFAULTS.max_body_bytes),
        help="largest request body (larger: HTTP 400)",
    )
    flags.switch(
        serve,
        "success-events",
        _DEFAULTS.success_events,
        help="a FilteringSucceed Event per placed pod, as HAMi writes (one more API request a pod)",
    )
    flags.switch(
        serve,
        "preemption",
        _DEFAULTS.preemption,
        help="preempt lower-priority GPU pods for a pod that fits nowhere (docs/extender.md#preemption)",
    )
    serve.add_argument(
        "--preemption-wait",
        type=float,
        default=flags.number("preemption-wait", _DEFAULTS.preemption_wait_s),
        help="seconds beyond the victims' grace period a preemptor's GPUs stay held for it",
    )
    flags.switch(
        serve,
        "leader-elect",
        _DEFAULTS.leader_election,
        help="replicas elect a leader by a Lease; it decides and the others forward or redirect to it "
        "(needed with more than one replica: docs/extender.md#replicas)",
    )
    serve.add_argument(
        "--lease-namespace",
        default=flags.text("lease-namespace", env.get("POD_NAMESPACE") or _DEFAULTS.lease_namespace),
        help="namespace of the leader Lease (default: $POD_NAMESPACE, else kube-system)",
    )
    serve.add_argument("--lease-name", default=flags.text("lease-name", _DEFAULTS.lease_name))
    serve.add_argument(
        "--identity",
        default=flags.text("identity", env.get("POD_NAME") or ""),
        help="this replica's name in the Lease (default: $POD_NAME, else the host name), made "
        "unique per process with a random suffix",
    )
    serve.add_argument(
        "--advertise-url",
        default=flags.text("advertise-url", ""),
        help="where the other replicas reach this one while it leads, e.g. https://$(POD_IP):8888",
    )
    serve.add_argument(
        "--own-pod",
        default=flags.text("own-pod", ""),
        help="NAMESPACE/NAME of this replica's pod: with --leader-elect, its label "
        "hami-py.io/extender-role says leader or follower, for a Service that selects the leader",
    )
    serve.add_argument(
        "--peer-server-name",
        default=flags.text("peer-server-name", ""),
        help="TLS name checked on the leader's certificate when forwarding (default: the URL's host)",
    )
    flags.switch(
        serve,
        "follower-redirect",
        _DEFAULTS.follower_redirect,
        help="a follower answers 307 to the leader instead of forwarding (kube-scheduler needs a fixed "
        "TLS serverName)",
    )
    flags.switch(
        serve,
        "http2",
        _DEFAULTS.http2,
        help="over TLS, offer HTTP/2 (kube-scheduler then sends every request on one connection)",
    )
    flags.switch(
        serve,
        "cold-standby",
        _DEFAULTS.cold_standby,
        help="with --leader-elect, a replica watches the cluster only once it first leads (followers "
        "cost nothing per pod; a new leader lists the cluster before deciding)",
    )
    for flag, default, what in (
        ("lease-duration", _DEFAULTS.lease_duration_s, "how long a silent leader's Lease stands"),
        ("renew-deadline", _DEFAULTS.renew_deadline_s, "a leader that could not renew this long stops"),
        ("retry-period", _DEFAULTS.retry_period_s, "between Lease reads and renewals"),
    ):
        serve.add_argument(
            f"--{flag}", type=float, default=flags.number(flag, default), help=f"seconds: {what}"
        )
    add_limit_options(serve, flags, http_limits(_DEFAULTS))
    serve.add_argument("--log-level", default=log_level, choices=LOG_LEVELS)

    check = commands.add_parser(
        "check", help="check the GPU invariant against the cluster (JSON; exit 1 if broken)"
    )
    common(check)
    return parser


def settings_from_args(args: argparse.Namespace) -> ExtenderSettings:
    """The serve flags as ``ExtenderSettings``."""
    return dataclasses.replace(
        _DEFAULTS,
        cooperative=bool(args.cooperative),
        release_lock_after_bind=bool(args.release_lock_after_bind),
        bind_timeout_s=float(args.bind_timeout),
        lock_expiry=timedelta(seconds=float(args.lock_expiry)),
        lock_sweep_interval_s=float(args.lock_sweep_interval),
        reservation_ttl_s=float(args.reservation_ttl),
        watch_wait_s=float(args.watch_wait),
        handshake_interval_s=float(args.handshake_interval),
        requeue_interval_s=float(args.requeue_interval),
        heap_trim_interval_s=float(args.heap_trim_interval),
        api_timeout_s=float(args.api_timeout),
        api_connections=int(args.api_connections),
        max_body_bytes=int(args.max_body_bytes),
        header_timeout_s=float(args.header_timeout),
        body_timeout_s=float(args.body_timeout),
        keepalive_timeout_s=float(args.keepalive_timeout),
        max_connections=int(args.max_connections),
        max_queued_connections=int(args.max_queued_connections),
        success_events=bool(args.success_events),
        preemption=bool(args.preemption),
        preemption_wait_s=args.preemption_wait,
        leader_election=bool(args.leader_elect),
        lease_namespace=str(args.lease_namespace),
        lease_name=str(args.lease_name),
        identity=str(args.identity),
        advertise_url=str(args.advertise_url),
        own_pod=str(args.own_pod),
        peer_server_name=str(args.peer_server_name),
        follower_redirect=bool(args.follower_redirect),
        http2=bool(args.http2),
        cold_standby=bool(args.cold_standby),
        lease_duration_s=float(args.lease_duration),
        renew_deadline_s=float(args.renew_deadline),
        retry_period_s=float(args.retry_period),
    )


def peer_tls(
    settings: ExtenderSettings, cert: Path | None, key: Path | None, ca: Path | None
) -> ssl.SSLContext | None:
    """How a follower reaches the leader: with HTTPS, the leader's certificate checked against the CA
    and this replica's own certificate presented as the client's (one CA signs kube-scheduler's and
    the extenders' certificates: the chart makes them so). ``ValueError`` for settings that cannot
    elect or fence."""
    if not settings.leader_election:
        return None
    if not settings.advertise_url:
        raise ValueError("--leader-elect needs --advertise-url (where the others reach the leader)")
    settings.own_pod_ref()  # NAMESPACE/NAME or nothing
    lease_settings(settings)  # times that cannot fence are refused here
    if cert is None or key is None:
        return None
    context = ssl.create_default_context(cafile=str(ca) if ca is not None else None)
    context.load_cert_chain(cert, key)
    return context


async def serve(server: ExtenderServer) -> int:
    """Run ``server`` until SIGTERM or SIGINT (0) or until one of its background tasks dies (1:
    the supervisor has logged which and why); either way readiness fails first and in-flight
    requests drain."""
    return await serve_until_signal(server, server.supervisor, server.telemetry.logger)


def server_tls(cert: Path | None, key: Path | None, client_ca: Path | None) -> ssl.SSLContext | None:
    """The decision port's TLS: none without a certificate; with ``client_ca`` a client must
    present a certificate that CA signed, or the handshake fails. ``ValueError`` for flags that do
    not go together."""
    if cert is None and key is None:
        if client_ca is not None:
            raise ValueError("--tls-client-ca-file needs --tls-cert-file and --tls-key-file (HTTPS)")
        return None
    if cert is None or key is None:
        raise ValueError("--tls-cert-file and --tls-key-file go together")
    return serving_context(cert, key, client_ca=client_ca)


async def _serve(
    args: argparse.Namespace,
    settings: ExtenderSettings,
    context: ssl.SSLContext | None,
    peer: ssl.SSLContext | None,
) -> int:
    config = Config() if args.config is None else load_config_file(args.config)
    telemetry = Telemetry.create(level=getattr(logging, args.log_level.upper()))
    api_client, api = await connect(args.kubeconfig, max_connections=settings.api_connections)
    async with api_client:
        server = ExtenderServer(
            config=config,
            settings=settings,
            telemetry=telemetry,
            api=api,
            host=args.host,
            port=args.port,
            ssl_context=context,
            metrics_port=args.metrics_port,
            forward_ssl=peer,
        )
        return await serve(server)


async def _check(args: argparse.Namespace) -> int:
    api_client, api = await connect(args.kubeconfig)
    async with api_client:
        report = await check_cluster(api, timeout_s=float(args.api_timeout) * 3)
    print(json.dumps(report.as_dict(), indent=2))
    return 0 if report.ok else EXIT_FAILED


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run the command line; returns the exit status."""

    def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
        if args.command == "check":
            return asyncio.run(_check(args))
        settings = settings_from_args(args)
        try:
            http_limits(settings)  # a timeout or connection cap out of range
            if settings.api_connections < 1:
                raise ValueError(f"--api-connections must be at least 1 (got {settings.api_connections})")
            context = server_tls(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file)
            peer = peer_tls(settings, args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file)
        except ValueError as exc:
            parser.error(str(exc))
        return asyncio.run(_serve(args, settings, context, peer))

    return run_command(
        "hamipy-extender",
        parser=lambda: build_parser(os.environ if env is None else env),
        argv=with_default_command(sys.argv[1:] if argv is None else argv, _COMMANDS, "serve"),
        run=run,
        usage_errors={TracingConfigError: "bad OpenTelemetry environment"},
        failures=(KubeError, OSError, ssl.SSLError),
    )


if __name__ == "__main__":
    sys.exit(main())
