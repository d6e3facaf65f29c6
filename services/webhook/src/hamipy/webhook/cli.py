"""``hamipy-webhook``: the entry point (wiring only).

    hamipy-webhook [serve] --cert-file tls.crt --key-file tls.key [--config hami-py.yaml] ...
    hamipy-webhook certs --namespace hami-system [--create-webhook-config] [--cert-dir DIR]
    hamipy-webhook manifest [--url https://127.0.0.1:8443/webhook --ca-file ca.crt]
    hamipy-webhook manifest --policy --scheduler-user U --device-plugin-user U [--exempt-namespace NS]
                            [--hook-path DIR]

Every flag may also come from the environment (``HAMIPY_WEBHOOK_<FLAG>``, e.g.
``HAMIPY_WEBHOOK_PORT=9443``, through ``hamipy.kube.options.EnvFlags``); the shared configuration
file from ``--config`` or ``HAMIPY_CONFIG``. Flags beat the environment, which beats the file. A
variable its flag cannot take (``HAMIPY_WEBHOOK_OVERWRITE_ENV=maybe``, a port that is no number) is
refused, naming it.

Exit status: 0 after SIGTERM/SIGINT; 1 when ``serve`` cannot start or one of its supervised tasks
died (logged: "background task died; the service stops"), or ``certs`` cannot reach or write the
API; 2 for a bad flag (a ``--hook-path`` that is not absolute, or holds ``..``, ``'`` or a backslash),
configuration, environment or OpenTelemetry setting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Mapping, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Final

from hamipy.kube.client import API_TIMEOUT_S, RawKube, api_client
from hamipy.kube.errors import KubeError
from hamipy.kube.options import (
    CONFIG_ENV,
    EXIT_FAILED,
    LOG_LEVELS,
    EnvFlags,
    run_command,
    with_default_command,
)
from hamipy.protocol.config import Config, checked_hook_path, load_config_file
from hamipy.telemetry import TracingConfigError
from hamipy.telemetry.limit_options import add_limit_options
from hamipy.telemetry.supervision import serve_until_signal
from hamipy.webhook import certs, registration
from hamipy.webhook.admission_policy import admission_policies
from hamipy.webhook.admitting import Admitter
from hamipy.webhook.certificate_setup import CertificateSetupError, ensure_certificates
from hamipy.webhook.mutation import MutationSettings
from hamipy.webhook.server import CertificateError, ServerSettings, WebhookServer
from hamipy.webhook.telemetry import Telemetry

__all__ = ["build_parser", "main"]

ENV_PREFIX: Final = "HAMIPY_WEBHOOK_"
_SERVER: Final = ServerSettings(cert_file=Path(), key_file=Path())
"""The defaults of the server settings the flags set."""
_COMMANDS: Final = ("serve", "certs", "manifest")


def _hook_path(value: str) -> str:
    """``--hook-path``: what ``nvidia.hookPath`` takes (cleaned as it is)."""
    try:
        return checked_hook_path(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r}: {exc}") from exc


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The argument parser; defaults come from ``env`` (``os.environ`` by default). A variable that
    holds what its flag cannot take raises ``BadEnvironment`` naming it."""
    flags = EnvFlags(os.environ if env is None else env, ENV_PREFIX)
    parser = argparse.ArgumentParser(
        prog="hamipy-webhook",
        description="hami-py admission webhook: routes GPU pods to the hami-py scheduler and fills in "
        "their GPU requests.",
        epilog=flags.epilog("PORT=9443"),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('hamipy-webhook')}")
    commands = parser.add_subparsers(dest="command", metavar="{serve,certs,manifest}")

    def config_flag(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--config",
            type=Path,
            default=flags.env.get(CONFIG_ENV) or flags.get("config"),
            help=f"shared hami-py configuration file (YAML; env {CONFIG_ENV}); defaults apply without one",
        )

    serve = commands.add_parser("serve", help="serve AdmissionReviews over HTTPS (the default command)")
    config_flag(serve)
    serve.add_argument("--host", default=flags.text("host", "0.0.0.0"), help="listen address")
    serve.add_argument("--port", type=int, default=flags.integer("port", 8443), help="HTTPS port")
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=flags.optional_integer("metrics-port"),
        help="also serve /metrics, /healthz, /readyz over plain HTTP on this port",
    )
    serve.add_argument(
        "--cert-file",
        type=Path,
        default=flags.text("cert-file", "/etc/hamipy-webhook/tls/tls.crt"),
        help="PEM serving certificate, reloaded when it changes",
    )
    serve.add_argument(
        "--key-file",
        type=Path,
        default=flags.text("key-file", "/etc/hamipy-webhook/tls/tls.key"),
        help="PEM private key of --cert-file",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=flags.integer("max-body-bytes", 4 * 1024 * 1024),
        help="largest AdmissionReview accepted (larger: HTTP 400)",
    )
    add_limit_options(serve, flags, _SERVER.limits)
    serve.add_argument(
        "--scheduler-name",
        default=flags.get("scheduler-name"),
        help="overrides schedulerName of the configuration",
    )
    flags.switch(
        serve,
        "overwrite-env",
        False,
        help="add NVIDIA_VISIBLE_DEVICES=none to containers of GPU pods that ask for no GPU",
    )
    serve.add_argument(
        "--runtime-class-name",
        default=flags.get("runtime-class-name"),
        help="runtimeClassName given to GPU pods that set none (e.g. nvidia)",
    )
    serve.add_argument("--log-level", default=flags.text("log-level", "info"), choices=LOG_LEVELS)

    cert = commands.add_parser(
        "certs",
        help="create/renew the CA and serving certificate, write the Secret, patch the caBundle",
    )
    config_flag(cert)
    cert.add_argument("--namespace", default=flags.text("namespace", "hami-system"))
    cert.add_argument("--service", default=flags.text("service", "hamipy-webhook"), help="Service name")
    cert.add_argument("--secret", default=flags.text("secret", "hamipy-webhook-tls"), help="Secret name")
    cert.add_argument(
        "--webhook-config",
        default=flags.text("webhook-config", registration.CONFIGURATION_NAME),
        help="MutatingWebhookConfiguration whose caBundle is patched",
    )
    flags.switch(
        cert,
        "create-webhook-config",
        False,
        help="create the MutatingWebhookConfiguration when it does not exist",
    )
    cert.add_argument("--cluster-domain", default=flags.text("cluster-domain", "cluster.local"))
    cert.add_argument("--force", action="store_true", help="renew even when the current certificate is good")
    cert.add_argument("--cert-dir", type=Path, default=None, help="also write tls.crt, tls.key, ca.crt here")
    cert.add_argument(
        "--kubeconfig",
        default=flags.env.get("KUBECONFIG") or flags.get("kubeconfig"),
        help="kubeconfig file; default: in-cluster service account, else ~/.kube/config",
    )
    cert.add_argument(
        "--timeout", type=float, default=flags.number("timeout", API_TIMEOUT_S), help="seconds per API call"
    )

    manifest = commands.add_parser(
        "manifest",
        help="print the MutatingWebhookConfiguration we ship, or with --policy the admission policies "
        "that guard allocation state (YAML, or JSON)",
    )
    config_flag(manifest)
    manifest.add_argument("--namespace", default=flags.text("namespace", "hami-system"))
    manifest.add_argument("--service", default=flags.text("service", "hamipy-webhook"))
    manifest.add_argument("--url", default=None, help="reach the webhook at this URL instead of the Service")
    manifest.add_argument("--ca-file", type=Path, default=None, help="PEM CA to put in caBundle")
    manifest.add_argument("--format", choices=["yaml", "json"], default="yaml")
    manifest.add_argument(
        "--policy",
        action="store_true",
        help="print the ValidatingAdmissionPolicies and bindings instead (docs/security.md)",
    )
    manifest.add_argument(
        "--scheduler-user",
        action="append",
        default=[],
        help="with --policy: a user that writes all allocation state (the extender's service account, "
        "system:serviceaccount:NS:NAME); repeat for more",
    )
    manifest.add_argument(
        "--device-plugin-user",
        action="append",
        default=[],
        help="with --policy: a device plugin's user (writes its keys on its own node only); repeat for more",
    )
    manifest.add_argument(
        "--exempt-namespace",
        action="append",
        default=[],
        help="with --policy: a namespace whose pods may set the reserved env (where the chart's own "
        "DaemonSets run; tenants must not create pods there); repeat for more",
    )
    manifest.add_argument(
        "--hook-path",
        action="append",
        default=[],
        type=_hook_path,
        help="with --policy: a directory where device plugins mount the interposer, which GPU "
        "containers' own volumes may not cover; repeat for more (default: nvidia.hookPath of --config)",
    )
    return parser


def _load_config(path: Path | None) -> Config:
    return Config() if path is None else load_config_file(path)


def _server_settings(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(
        cert_file=args.cert_file,
        key_file=args.key_file,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        max_body_bytes=args.max_body_bytes,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        keepalive_timeout_s=args.keepalive_timeout,
        max_connections=args.max_connections,
        max_queued_connections=args.max_queued_connections,
    )


def _run_serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import logging

    try:
        server_settings = _server_settings(args)
    except ValueError as exc:  # a timeout or connection cap out of range
        parser.error(str(exc))
    config = _load_config(args.config)
    if args.scheduler_name:
        config = config.model_copy(update={"scheduler_name": args.scheduler_name})
    settings = MutationSettings.from_config(
        config, overwrite_env=args.overwrite_env, runtime_class_name=args.runtime_class_name
    )
    telemetry = Telemetry.create(level=getattr(logging, args.log_level.upper()))
    telemetry.logger.info(
        "configuration",
        scheduler_name=settings.scheduler_name,
        overwrite_default_scheduler=settings.overwrite_default_scheduler,
        allowed_schedulers=sorted(settings.allowed_schedulers),
        resources=list(settings.names.gpu_asks),
        default_gpu_count=settings.default_gpu_count,
        overwrite_env=settings.overwrite_env,
        runtime_class_name=settings.runtime_class_name,
    )
    return asyncio.run(_serve(server_settings, Admitter(settings, telemetry)))


async def _serve(settings: ServerSettings, admitter: Admitter) -> int:
    """Serve until SIGTERM/SIGINT (status 0) or until a supervised task dies (status 1)."""
    try:
        server = WebhookServer(settings, admitter)
    except CertificateError as exc:
        admitter.telemetry.logger.error("cannot start", error=str(exc))
        return EXIT_FAILED
    return await serve_until_signal(server, server.supervisor, admitter.telemetry.logger)


async def _certs(args: argparse.Namespace) -> int:
    names = _load_config(args.config).nvidia.resource_names
    create = (
        registration.webhook_configuration(
            names=names, name=args.webhook_config, service_name=args.service, service_namespace=args.namespace
        )
        if args.create_webhook_config
        else None
    )
    try:
        client = await api_client(args.kubeconfig)
    except KubeError as exc:
        raise CertificateSetupError(f"no Kubernetes API to talk to: {exc}") from exc
    async with client:
        bundle, renewed, patched = await ensure_certificates(
            RawKube(client),
            namespace=args.namespace,
            secret_name=args.secret,
            service_name=args.service,
            configuration_name=args.webhook_config,
            cluster_domain=args.cluster_domain,
            create_configuration=create,
            force=args.force,
            timeout_s=args.timeout,
        )
    if args.cert_dir is not None:
        certs.write_files(bundle, args.cert_dir)
    print(
        json.dumps(
            {
                "secret": f"{args.namespace}/{args.secret}",
                "renewed": renewed,
                "webhookConfiguration": args.webhook_config,
                "caBundlePatched": patched,
                "notAfter": bundle.not_after.isoformat(),
            }
        )
    )
    return 0


def _manifest(args: argparse.Namespace) -> int:
    nvidia = _load_config(args.config).nvidia
    names = nvidia.resource_names
    if args.policy:
        docs = admission_policies(
            schedulers=args.scheduler_user,
            device_plugins=args.device_plugin_user,
            names=names,
            exempt_namespaces=args.exempt_namespace,
            hook_paths=args.hook_path or [nvidia.hook_path],
        )
        text = (
            json.dumps(docs, indent=2) + "\n"
            if args.format == "json"
            else "".join(registration.render_yaml(d, header="---\n") for d in docs)
        )
        sys.stdout.write(text)
        return 0
    ca = args.ca_file.read_bytes() if args.ca_file is not None else None
    doc = registration.webhook_configuration(
        names=names, service_name=args.service, service_namespace=args.namespace, url=args.url, ca_bundle=ca
    )
    sys.stdout.write(
        json.dumps(doc, indent=2) + "\n" if args.format == "json" else registration.render_yaml(doc)
    )
    return 0


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run the command line; returns the exit status."""

    def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
        if args.command == "certs":
            return asyncio.run(_certs(args))
        if args.command == "manifest":
            return _manifest(args)
        return _run_serve(parser, args)

    return run_command(
        "hamipy-webhook",
        parser=lambda: build_parser(os.environ if env is None else env),
        argv=with_default_command(sys.argv[1:] if argv is None else argv, _COMMANDS, "serve"),
        run=run,
        usage_errors={TracingConfigError: "bad OpenTelemetry environment"},
        failures=(CertificateSetupError, OSError),
    )


if __name__ == "__main__":
    sys.exit(main())
