"""The exception tree of the extender.

    Exception
     └── ExtenderError            something the extender could not do; the message names the object
          ├── BadRequest          a request body is not the extender argument it should be (HTTP 400)
          └── BindRefused         a bind cannot go ahead; ``reason`` is what the user is told
               └── LockTimeout    the node stayed locked by another pod past the bind deadline

Kubernetes API failures are ``hamipy.kube.errors.KubeError`` (``NotFound``, ``Conflict``,
``Gone``): hami-py's one Kubernetes error tree, translated from the libraries in
``hamipy.kube.client``.
"""

from __future__ import annotations

__all__ = ["BadRequest", "BindRefused", "ExtenderError", "LockTimeout"]


class ExtenderError(Exception):
    """Base of every error raised by the extender itself."""


class BadRequest(ExtenderError):
    """The body is not the extender argument it should be (answered with HTTP 400)."""


class BindRefused(ExtenderError):
    """A bind that cannot go ahead; ``reason`` is a short cause a user can act on."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class LockTimeout(BindRefused):
    """The node lock was held by another pod for longer than the bind may wait."""
