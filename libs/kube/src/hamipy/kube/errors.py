"""The one Kubernetes error tree of hami-py: every service catches these, whatever made the call.

    Exception
     └── KubeError            an API call failed or the server could not be reached; ``status`` is
          │                   the HTTP status (0 when no answer came); the message names the call
          ├── NotFound        404: the object does not exist (any more)
          ├── Conflict        409: a precondition (resourceVersion, uid) failed, or it already exists
          └── Gone            410: a watch's resourceVersion is too old: list again

Library errors (aiohttp, kubernetes-asyncio, JSON decoding) are translated at the boundary, in
``hamipy.kube.client``.
"""

from __future__ import annotations

import json

__all__ = ["Conflict", "Gone", "KubeError", "NotFound", "error_for"]


class KubeError(Exception):
    """An API call failed; ``status`` is the HTTP status (0 when no answer came)."""

    def __init__(self, message: str, *, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class NotFound(KubeError):
    """The object does not exist (HTTP 404)."""


class Conflict(KubeError):
    """A write lost a precondition race, or created what exists (HTTP 409)."""


class Gone(KubeError):
    """A watch started from a resourceVersion the server no longer has (HTTP 410): list again."""


_BY_STATUS: dict[int, type[KubeError]] = {404: NotFound, 409: Conflict, 410: Gone}


def error_for(status: int, what: str, body: bytes | str | None = None) -> KubeError:
    """The error for an answer with HTTP ``status`` to the call ``what``; the message is the
    ``Status`` object's message when the body is one, else the start of the body."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else (body or "")
    message = text[:200]
    try:
        decoded = json.loads(text)
        if isinstance(decoded, dict) and isinstance(decoded.get("message"), str):
            message = decoded["message"]
    except ValueError:
        pass
    return _BY_STATUS.get(status, KubeError)(f"{what}: HTTP {status}: {message}", status=status)
