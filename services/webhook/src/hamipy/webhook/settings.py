"""The webhook's own settings beside the shared configuration and ``ServerSettings``, each declared
once with its flag and variable (``hamipy.protocol.settings``)."""

from __future__ import annotations

import dataclasses

from hamipy.kube.client import API_TIMEOUT_S
from hamipy.protocol.settings import tuning, user
from hamipy.webhook.registration import CONFIGURATION_NAME

__all__ = ["AdmissionSettings", "CertificateSettings"]


@dataclasses.dataclass(frozen=True, slots=True)
class AdmissionSettings:
    """What ``serve`` adds to the shared configuration's admission settings."""

    scheduler_name: str | None = user(None, "overrides schedulerName of the configuration")
    overwrite_env: bool = user(
        False, "add NVIDIA_VISIBLE_DEVICES=none to containers of GPU pods that ask for no GPU"
    )
    """On when this or the configuration's ``nvidia.overwriteEnv`` says so."""
    runtime_class_name: str | None = user(
        None, "runtimeClassName given to GPU pods that set none (e.g. nvidia)"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class CertificateSettings:
    """Where ``certs`` keeps the serving certificate and which webhook it registers, and the Service
    ``manifest`` points the webhook at."""

    namespace: str = user("hami-system", "namespace of the webhook's Service and Secret")
    service: str = user("hamipy-webhook", "Service name")
    secret: str = user("hamipy-webhook-tls", "Secret name")
    webhook_config: str = user(CONFIGURATION_NAME, "MutatingWebhookConfiguration whose caBundle is patched")
    create_webhook_config: bool = user(
        False, "create the MutatingWebhookConfiguration when it does not exist"
    )
    cluster_domain: str = user("cluster.local", "the cluster's DNS domain, in the certificate's names")
    timeout_s: float = tuning(API_TIMEOUT_S, "seconds per API call")
