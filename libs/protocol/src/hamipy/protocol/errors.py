"""The one error of hamipy.protocol.

    ValueError
     └── ProtocolError        a wire value is malformed; names the field and the value

Callers catch ``ProtocolError`` to report the offending object (log, metric, Event) and treat it
safely; nothing malformed is ever decoded to zeros.
"""

from __future__ import annotations

__all__ = ["ProtocolError"]

_MAX_SHOWN = 200


class ProtocolError(ValueError):
    """A wire value could not be decoded or encoded.

    ``field`` names what was being read (``"node-nvidia-register[2].devmem"``), ``value`` is the
    offending value (shown truncated), ``reason`` says what was wrong with it.
    """

    def __init__(self, field: str, value: object, reason: str) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        shown = repr(value)
        if len(shown) > _MAX_SHOWN:
            shown = shown[:_MAX_SHOWN] + f"... ({len(shown)} chars)"
        super().__init__(f"{field}: {reason} (got {shown})")
