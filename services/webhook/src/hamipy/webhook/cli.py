"""``hamipy-webhook``: the entry point (wiring only).

    hamipy-webhook [serve] --cert-file tls.crt --key-file tls.key [--config hami-py.yaml] ...
    hamipy-webhook certs --namespace hami-system [--create-webhook-config] [--cert-dir DIR]
    hamipy-webhook manifest [--url https://127.0.0.1:8443/webhook --ca-file ca.crt]

Every flag may also come from the environment (``HAMIPY_WEBHOOK_<FLAG>``, e.g.
``HAMIPY_WEBHOOK_PORT=9443``); the shared configuration file from ``--config`` or ``HAMIPY_CONFIG``.
Flags beat the environment, which beats the file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any, Final

from hamipy.protocol.config import Config, ConfigError, load_config_file
from hamipy.telemetry import TracingConfigError
from hamipy.webhook import certs, registration
from hamipy.webhook.admitting import Admitter
from hamipy.webhook.mutation import MutationSettings
from hamipy.webhook.server import CertificateError, ServerSettings, WebhookServer
from hamipy.webhook.telemetry import Telemetry

__all__ = ["build_parser", "main"]

ENV_PREFIX: Final = "HAMIPY_WEBHOOK_"
CONFIG_ENV: Final = "HAMIPY_CONFIG"
_COMMANDS: Final = ("serve", "certs", "manifest")
EXIT_USAGE: Final = 2
EXIT_FAILED: Final = 1


def _env_default(env: Mapping[str, str], flag: str, default: Any) -> Any:
    return env.get(ENV_PREFIX + flag.upper().replace("-", "_"), default)


def _bool_env(env: Mapping[str, str], flag: str) -> bool:
    return str(_env_default(env, flag, "")).strip().lower() in ("1", "true", "yes", "on")


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The argument parser; defaults come from ``env`` (``os.environ`` by default)."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(
        prog="hamipy-webhook",
        description="hami-py admission webhook: routes GPU pods to the hami-py scheduler and fills in "
        "their GPU requests.",
        epilog=f"Every flag can also be set as {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}PORT=9443).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('hamipy-webhook')}")
    commands = parser.add_subparsers(dest="command", metavar="{serve,certs,manifest}")

    def config_flag(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--config",
            type=Path,
            default=env.get(CONFIG_ENV) or _env_default(env, "config", None),
            help=f"shared hami-py configuration file (YAML; env {CONFIG_ENV}); defaults apply without one",
        )

    serve = commands.add_parser("serve", help="serve AdmissionReviews over HTTPS (the default command)")
    config_flag(serve)
    serve.add_argument("--host", default=_env_default(env, "host", "0.0.0.0"), help="listen address")
    serve.add_argument("--port", type=int, default=_env_default(env, "port", "8443"), help="HTTPS port")
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=_env_default(env, "metrics-port", None),
        help="also serve /metrics, /healthz, /readyz over plain HTTP on this port",
    )
    serve.add_argument(
        "--cert-file",
        type=Path,
        default=_env_default(env, "cert-file", "/etc/hamipy-webhook/tls/tls.crt"),
        help="PEM serving certificate, reloaded when it changes",
    )
    serve.add_argument(
        "--key-file",
        type=Path,
        default=_env_default(env, "key-file", "/etc/hamipy-webhook/tls/tls.key"),
        help="PEM private key of --cert-file",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=_env_default(env, "max-body-bytes", str(4 * 1024 * 1024)),
        help="largest AdmissionReview accepted (larger: HTTP 400)",
    )
    serve.add_argument(
        "--scheduler-name",
        default=_env_default(env, "scheduler-name", None),
        help="overrides schedulerName of the configuration",
    )
    serve.add_argument(
        "--overwrite-env",
        action=argparse.BooleanOptionalAction,
        default=_bool_env(env, "overwrite-env"),
        help="add NVIDIA_VISIBLE_DEVICES=none to containers of GPU pods that ask for no GPU",
    )
    serve.add_argument(
        "--runtime-class-name",
        default=_env_default(env, "runtime-class-name", None),
        help="runtimeClassName given to GPU pods that set none (e.g. nvidia)",
    )
    serve.add_argument(
        "--log-level",
        default=_env_default(env, "log-level", "info"),
        choices=["debug", "info", "warning", "error"],
    )

    cert = commands.add_parser(
        "certs",
        help="create/renew the CA and serving certificate, write the Secret, patch the caBundle",
    )
    config_flag(cert)
    cert.add_argument("--namespace", default=_env_default(env, "namespace", "hami-system"))
    cert.add_argument(
        "--service", default=_env_default(env, "service", "hamipy-webhook"), help="Service name"
    )
    cert.add_argument(
        "--secret", default=_env_default(env, "secret", "hamipy-webhook-tls"), help="Secret name"
    )
    cert.add_argument(
        "--webhook-config",
        default=_env_default(env, "webhook-config", registration.CONFIGURATION_NAME),
        help="MutatingWebhookConfiguration whose caBundle is patched",
    )
    cert.add_argument(
        "--create-webhook-config",
        action=argparse.BooleanOptionalAction,
        default=_bool_env(env, "create-webhook-config"),
        help="create the MutatingWebhookConfiguration when it does not exist",
    )
    cert.add_argument("--cluster-domain", default=_env_default(env, "cluster-domain", "cluster.local"))
    cert.add_argument("--force", action="store_true", help="renew even when the current certificate is good")
    cert.add_argument("--cert-dir", type=Path, default=None, help="also write tls.crt, tls.key, ca.crt here")
    cert.add_argument(
        "--kubeconfig", default=env.get("KUBECONFIG"), help="default: in-cluster, else ~/.kube/config"
    )
    cert.add_argument("--timeout", type=float, default=certs.API_TIMEOUT_S, help="seconds per API call")

    manifest = commands.add_parser(
        "manifest", help="print the MutatingWebhookConfiguration we ship (YAML, or JSON)"
    )
    config_flag(manifest)
    manifest.add_argument("--namespace", default=_env_default(env, "namespace", "hami-system"))
    manifest.add_argument("--service", default=_env_default(env, "service", "hamipy-webhook"))
    manifest.add_argument("--url", default=None, help="reach the webhook at this URL instead of the Service")
    manifest.add_argument("--ca-file", type=Path, default=None, help="PEM CA to put in caBundle")
    manifest.add_argument("--format", choices=["yaml", "json"], default="yaml")
    return parser


def _load_config(path: Path | None) -> Config:
    return Config() if path is None else load_config_file(path)


def _run_serve(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    import logging

    config = _load_config(args.config)
    if args.scheduler_name:
        config = config.model_copy(update={"scheduler_name": args.scheduler_name})
    settings = MutationSettings.from_config(
        config, overwrite_env=args.overwrite_env, runtime_class_name=args.runtime_class_name
    )
    telemetry = Telemetry.create(level=getattr(logging, args.log_level.upper()))
    server_settings = ServerSettings(
        cert_file=args.cert_file,
        key_file=args.key_file,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        max_body_bytes=args.max_body_bytes,
    )
    telemetry.logger.info(
        "configuration",
        scheduler_name=settings.scheduler_name,
        overwrite_default_scheduler=settings.overwrite_default_scheduler,
        resources=list(settings.names.gpu_asks),
        default_gpu_count=settings.default_gpu_count,
        gpu_core_policy=settings.gpu_core_policy,
        overwrite_env=settings.overwrite_env,
        runtime_class_name=settings.runtime_class_name,
    )
    return asyncio.run(_serve(server_settings, Admitter(settings, telemetry)))


async def _serve(settings: ServerSettings, admitter: Admitter) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        server = WebhookServer(settings, admitter)
    except CertificateError as exc:
        admitter.telemetry.logger.error("cannot start", error=str(exc))
        return EXIT_FAILED
    async with server:
        await stop.wait()
        admitter.telemetry.logger.info("stopping on signal")
    return 0


async def _certs(args: argparse.Namespace) -> int:
    from kubernetes_asyncio import client, config

    names = _load_config(args.config).nvidia.resource_names
    if args.kubeconfig:
        await config.load_kube_config(config_file=args.kubeconfig)
    else:
        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        except config.ConfigException:
            await config.load_kube_config()
    create = (
        registration.webhook_configuration(
            names=names, name=args.webhook_config, service_name=args.service, service_namespace=args.namespace
        )
        if args.create_webhook_config
        else None
    )
    async with client.ApiClient() as api:
        bundle, renewed, patched = await certs.ensure_certificates(
            api,
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
                "notAfter": bundle.certificate.not_valid_after_utc.isoformat(),
            }
        )
    )
    return 0


def _manifest(args: argparse.Namespace) -> int:
    names = _load_config(args.config).nvidia.resource_names
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
    env = os.environ if env is None else env
    arguments = list(sys.argv[1:] if argv is None else argv)
    if not arguments or (arguments[0] not in _COMMANDS and arguments[0] not in ("-h", "--help", "--version")):
        arguments.insert(0, "serve")
    args = build_parser(env).parse_args(arguments)
    try:
        if args.command == "certs":
            return asyncio.run(_certs(args))
        if args.command == "manifest":
            return _manifest(args)
        return _run_serve(args, env)
    except ConfigError as exc:
        print(f"hamipy-webhook: bad configuration: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TracingConfigError as exc:
        print(f"hamipy-webhook: bad OpenTelemetry environment: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (certs.CertificateSetupError, OSError) as exc:
        print(f"hamipy-webhook: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
