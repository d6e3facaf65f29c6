"""``hamipy-webhook``: the entry point (wiring only).

    hamipy-webhook [serve] --cert-file tls.crt --key-file tls.key [--config hami-py.yaml] ...
    hamipy-webhook certs --namespace hami-system [--create-webhook-config] [--cert-dir DIR]
    hamipy-webhook manifest [--url https://127.0.0.1:8443/webhook --ca-file ca.crt]
    hamipy-webhook manifest --policy --scheduler-user U --device-plugin-user U [--exempt-namespace NS]
                            [--hook-path DIR]

The flags are the settings declared in ``ServerSettings``, ``hamipy.webhook.settings`` and
``ProcessSettings``; each may also come from the environment (``HAMIPY_WEBHOOK_<FLAG>``, e.g.
``HAMIPY_WEBHOOK_PORT=9443``), the shared configuration file from ``--config`` or
``HAMIPY_CONFIG``. Flags beat the environment, which beats the file. A variable its flag cannot take
(``HAMIPY_WEBHOOK_OVERWRITE_ENV=maybe``, a port that is no number) is refused, naming it.

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
from pathlib import Path
from typing import Final

from hamipy.kube.client import RawKube, api_client
from hamipy.kube.errors import KubeError
from hamipy.kube.options import (
    EXIT_FAILED,
    Command,
    ProcessSettings,
    command_line,
    run_command,
    with_default_command,
)
from hamipy.manifests.admission_policy import admission_policies
from hamipy.protocol.config import Config, checked_hook_path, load_config_file
from hamipy.protocol.settings import Group, settings_from
from hamipy.serving.supervision import serve_until_signal
from hamipy.telemetry import TracingConfigError
from hamipy.webhook import certs, registration
from hamipy.webhook.admitting import Admitter
from hamipy.webhook.certificate_setup import CertificateSetupError, ensure_certificates
from hamipy.webhook.mutation import MutationSettings
from hamipy.webhook.server import CertificateError, ServerSettings, WebhookServer
from hamipy.webhook.settings import AdmissionSettings, CertificateSettings
from hamipy.webhook.telemetry import Telemetry

__all__ = ["COMMANDS", "ENV_PREFIX", "build_parser", "main"]

ENV_PREFIX: Final = "HAMIPY_WEBHOOK_"
COMMANDS: Final = {
    "serve": Command(
        "serve AdmissionReviews over HTTPS (the default command)",
        (
            Group(ProcessSettings, only=("config", "log_level")),
            Group(ServerSettings),
            Group(AdmissionSettings),
        ),
    ),
    "certs": Command(
        "create/renew the CA and serving certificate, write the Secret, patch the caBundle",
        (Group(ProcessSettings, only=("config", "kubeconfig")), Group(CertificateSettings)),
    ),
    "manifest": Command(
        "print the MutatingWebhookConfiguration we ship, or with --policy the admission policies "
        "that guard allocation state (YAML, or JSON)",
        (Group(ProcessSettings, only=("config",)), Group(CertificateSettings, only=("namespace", "service"))),
    ),
}


def _hook_path(value: str) -> str:
    """``--hook-path``: what ``nvidia.hookPath`` takes (cleaned as it is)."""
    try:
        return checked_hook_path(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r}: {exc}") from exc


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The argument parser; defaults come from ``env`` (``os.environ`` by default). A variable that
    holds what its flag cannot take raises ``BadEnvironment`` naming it."""
    parser, commands = command_line(
        "hamipy-webhook",
        description="hami-py admission webhook: routes GPU pods to the hami-py scheduler and fills in "
        "their GPU requests.",
        prefix=ENV_PREFIX,
        env=os.environ if env is None else env,
        commands=COMMANDS,
    )
    # One-off arguments of a command, not settings: never from the environment.
    cert = commands["certs"]
    cert.add_argument("--force", action="store_true", help="renew even when the current certificate is good")
    cert.add_argument("--cert-dir", type=Path, default=None, help="also write tls.crt, tls.key, ca.crt here")
    manifest = commands["manifest"]
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


def _run_serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import logging

    try:
        server_settings = settings_from(ServerSettings, args)
    except ValueError as exc:  # a timeout or connection cap out of range
        parser.error(str(exc))
    process = settings_from(ProcessSettings, args)
    admission = settings_from(AdmissionSettings, args)
    config = _load_config(process.config)
    if admission.scheduler_name:
        config = config.model_copy(update={"scheduler_name": admission.scheduler_name})
    settings = MutationSettings.from_config(
        config, overwrite_env=admission.overwrite_env, runtime_class_name=admission.runtime_class_name
    )
    telemetry = Telemetry.create(level=getattr(logging, process.log_level.upper()))
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
    process = settings_from(ProcessSettings, args)
    cs = settings_from(CertificateSettings, args)
    names = _load_config(process.config).nvidia.resource_names
    create = (
        registration.webhook_configuration(
            names=names, name=cs.webhook_config, service_name=cs.service, service_namespace=cs.namespace
        )
        if cs.create_webhook_config
        else None
    )
    try:
        client = await api_client(process.kubeconfig)
    except KubeError as exc:
        raise CertificateSetupError(f"no Kubernetes API to talk to: {exc}") from exc
    async with client:
        bundle, renewed, patched = await ensure_certificates(
            RawKube(client),
            namespace=cs.namespace,
            secret_name=cs.secret,
            service_name=cs.service,
            configuration_name=cs.webhook_config,
            cluster_domain=cs.cluster_domain,
            create_configuration=create,
            force=args.force,
            timeout_s=cs.timeout_s,
        )
    if args.cert_dir is not None:
        certs.write_files(bundle, args.cert_dir)
    print(
        json.dumps(
            {
                "secret": f"{cs.namespace}/{cs.secret}",
                "renewed": renewed,
                "webhookConfiguration": cs.webhook_config,
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
        argv=with_default_command(sys.argv[1:] if argv is None else argv, tuple(COMMANDS), "serve"),
        run=run,
        usage_errors={TracingConfigError: "bad OpenTelemetry environment"},
        failures=(CertificateSetupError, OSError),
    )


if __name__ == "__main__":
    sys.exit(main())
