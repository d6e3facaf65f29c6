"""``hamipy-extender``: the entry point (wiring only).

    hamipy-extender [serve] [--config hami-py.yaml] [--kubeconfig FILE] [--port 8888] [--cooperative]
                    [--release-lock-after-bind | --no-release-lock-after-bind] [--tls-cert-file ...]
    hamipy-extender check [--kubeconfig FILE]      # the invariant against the cluster; exit 1 if broken

The flags are the settings declared in ``hamipy.extender.settings``, ``ProcessSettings`` and
``HttpLimits``; each may also come from the environment (``HAMIPY_EXTENDER_<FLAG>``, e.g.
``HAMIPY_EXTENDER_PORT=9443``; a value its setting cannot take is refused with exit status 2), the
shared configuration file from ``--config`` or ``HAMIPY_CONFIG``. Without ``--kubeconfig`` the
in-cluster service account is used, else ``~/.kube/config``.

``serve`` runs until SIGTERM or SIGINT (exit status 0) or until a background task dies (logged by
name; exit status 1, so the pod restarts instead of deciding from a model no longer kept current).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import ssl
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

from hamipy.extender.invariant import check_cluster
from hamipy.extender.server import ExtenderServer, lease_settings
from hamipy.extender.settings import ExtenderSettings, ListenSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.kube.client import connect
from hamipy.kube.errors import KubeError
from hamipy.kube.options import (
    EXIT_FAILED,
    Command,
    ProcessSettings,
    command_line,
    run_command,
    with_default_command,
)
from hamipy.protocol.config import Config, load_config_file
from hamipy.protocol.settings import Group, settings_from
from hamipy.serving.http_limits import HttpLimits
from hamipy.serving.supervision import serve_until_signal
from hamipy.serving.tls import serving_context
from hamipy.telemetry import TracingConfigError

__all__ = ["COMMANDS", "ENV_PREFIX", "build_parser", "main", "serve"]

ENV_PREFIX: Final = "HAMIPY_EXTENDER_"
COMMANDS: Final = {
    "serve": Command(
        "serve the extender (the default command)",
        (Group(ProcessSettings), Group(ListenSettings), Group(ExtenderSettings), Group(HttpLimits)),
    ),
    "check": Command(
        "check the GPU invariant against the cluster (JSON; exit 1 if broken)",
        (
            Group(ProcessSettings, only=("config", "kubeconfig")),
            Group(ExtenderSettings, only=("api_timeout_s",)),
        ),
    ),
}


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The argument parser; defaults come from ``env`` (``os.environ`` by default).
    ``BadEnvironment`` when a variable holds a value its flag cannot take."""
    parser, _ = command_line(
        "hamipy-extender",
        description="hami-py scheduler extender: GPU-aware /filter, /prioritize and /bind.",
        prefix=ENV_PREFIX,
        env=os.environ if env is None else env,
        commands=COMMANDS,
    )
    return parser


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


Serving = tuple[ListenSettings, HttpLimits, ssl.SSLContext | None, ssl.SSLContext | None]
"""What ``serve`` takes beside the extender's settings: where, its limits, its TLS and its peers'."""


def _serving(args: argparse.Namespace, settings: ExtenderSettings) -> Serving:
    listen = settings_from(ListenSettings, args)
    certs = (listen.tls_cert_file, listen.tls_key_file, listen.tls_client_ca_file)
    return listen, settings_from(HttpLimits, args), server_tls(*certs), peer_tls(settings, *certs)


async def _serve(process: ProcessSettings, settings: ExtenderSettings, serving: Serving) -> int:
    listen, limits, context, peer = serving
    config = Config() if process.config is None else load_config_file(process.config)
    telemetry = Telemetry.create(level=getattr(logging, process.log_level.upper()))
    api_client, api = await connect(process.kubeconfig, max_connections=process.api_connections)
    async with api_client:
        server = ExtenderServer(
            config=config,
            settings=settings,
            telemetry=telemetry,
            api=api,
            host=listen.host,
            port=listen.port,
            ssl_context=context,
            metrics_port=listen.metrics_port,
            forward_ssl=peer,
            limits=limits,
        )
        return await serve(server)


async def _check(process: ProcessSettings, settings: ExtenderSettings) -> int:
    api_client, api = await connect(process.kubeconfig, max_connections=process.api_connections)
    async with api_client:
        report = await check_cluster(api, timeout_s=settings.api_timeout_s * 3)
    print(json.dumps(report.as_dict(), indent=2))
    return 0 if report.ok else EXIT_FAILED


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run the command line; returns the exit status."""

    def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
        try:
            process = settings_from(ProcessSettings, args)
            settings = settings_from(ExtenderSettings, args)
            serving = _serving(args, settings) if args.command == "serve" else None
        except ValueError as exc:
            parser.error(str(exc))
        if serving is None:
            return asyncio.run(_check(process, settings))
        return asyncio.run(_serve(process, settings, serving))

    return run_command(
        "hamipy-extender",
        parser=lambda: build_parser(os.environ if env is None else env),
        argv=with_default_command(sys.argv[1:] if argv is None else argv, tuple(COMMANDS), "serve"),
        run=run,
        usage_errors={TracingConfigError: "bad OpenTelemetry environment"},
        failures=(KubeError, OSError, ssl.SSLError),
    )


if __name__ == "__main__":
    sys.exit(main())
