"""The exception tree of the webhook.

    Exception
     └── WebhookError               something the webhook could not do; the message names the object
          ├── BadReview             a request body that is not an AdmissionReview we can answer (400)
          ├── CertificateError      the serving certificate or key could not be loaded
          └── CertificateSetupError the Secret or the MutatingWebhookConfiguration could not be read
                                    or written (``certs``)

Kubernetes API failures are ``hamipy.kube.errors.KubeError``: hami-py's one Kubernetes error tree.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["BadReview", "BadReviewReason", "CertificateError", "CertificateSetupError", "WebhookError"]

BadReviewReason = Literal["not_json", "too_deep", "invalid"]


class WebhookError(Exception):
    """Base of every error raised by the webhook itself."""


class BadReview(WebhookError, ValueError):
    """The request body is not an AdmissionReview we can answer.

    ``reason`` is a short fixed label (metric label, log key); the message says what was wrong.
    """

    def __init__(self, reason: BadReviewReason, message: str) -> None:
        self.reason: BadReviewReason = reason
        super().__init__(message)


class CertificateError(WebhookError):
    """The serving certificate or key could not be loaded."""


class CertificateSetupError(WebhookError):
    """The Secret or the MutatingWebhookConfiguration could not be read or written."""
