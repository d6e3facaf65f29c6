"""The exception tree of the extender.

    Exception
     └── ExtenderError            something the extender could not do; the message names the object
          ├── KubeError           the API server answered an error or could not be reached
          │    ├── NotFound       404: the object is gone
          │    ├── Conflict       409: a resourceVersion precondition failed (someone wrote first)
          │    └── Gone           410: a watch's resourceVersion is too old (relist)
          └── BindRefused         a bind cannot go ahead; ``reason`` is what the user is told
               └── LockTimeout    the node stayed locked by another pod past the bind deadline

Library errors (aiohttp, kubernetes-asyncio) are translated at the boundary in ``kube``.
"""

from __future__ import annotations

__all__ = ["BindRefused", "Conflict", "ExtenderError", "Gone", "KubeError", "LockTimeout", "NotFound"]


class ExtenderError(Exception):
    """Base of every error raised by the extender."""


class KubeError(ExtenderError):
    """An API call failed; ``status`` is the HTTP status (0 when no answer came)."""

    def __init__(self, message: str, *, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class NotFound(KubeError):
    """The object does not exist (HTTP 404)."""


class Conflict(KubeError):
    """A write lost a resourceVersion race (HTTP 409)."""


class Gone(KubeError):
    """A watch started from a resourceVersion the server no longer has (HTTP 410)."""


class BindRefused(ExtenderError):
    """A bind that cannot go ahead; ``reason`` is a short cause a user can act on."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class LockTimeout(BindRefused):
    """The node lock was held by another pod for longer than the bind may wait."""
