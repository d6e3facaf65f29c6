"""``hami.io/node-handshake``: the scheduler <-> device plugin liveness stamp (docs/wire-format.md#handshake).

Values seen in the wild, all parsed here:

- ``Requesting_2025-06-18 09:06:27``: written by the scheduler (current upstream, layout
  ``2006-01-02 15:04:05``; older releases used ``2006.01.02 15:04:05``). It asks the device plugin
  to prove itself alive by registering again.
- ``Reported <time>`` / ``Reported_<time>``: written by older device plugins when they registered.
  HAMi's NVIDIA plugin wrote Go's ``time.Now().String()`` (``2025-06-18 09:06:27.123456789 +0800 CST
  m=+1.5``, which carries its own UTC offset); other vendors' plugins write ``Reported_`` with the
  dotted layout.
- ``Deleted_<time>``: written by older schedulers once they dropped a dead node's devices
  (``NodeCleanUp``); current upstream removes the annotation instead.

The times are wall-clock times of the writer's local zone with no zone in the value. Upstream
writes ``time.Now()`` of its process and reads with ``time.Local``; its images set no ``TZ``, so that
zone is UTC in practice. Hence every function takes a ``tz`` (the zone the writer of the cluster's
stamps runs in) that defaults to UTC. Stamps have second precision.

The liveness rule, from upstream's ``CheckHealth`` (``pkg/device/devices.go``), as pure functions:

- a ``Requesting_`` stamp at least 60 s old on a node whose allocatable GPU count is 0 means the
  device plugin is gone: the node is dead and its devices leave the scheduler's model
  (``node_is_dead``). With GPUs still allocatable, upstream keeps the node (the kubelet still
  advertises them), and so does this rule;
- any other value (``Reported``, ``Deleted``, or no annotation) means healthy, and the scheduler
  stamps a fresh ``Requesting_<now>`` (``needs_request``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from typing import Final, Literal, get_args

from hamipy.protocol import keys
from hamipy.protocol.errors import ProtocolError

__all__ = [
    "HANDSHAKE_TIMEOUT",
    "LAYOUT_DASH",
    "LAYOUT_DOT",
    "Handshake",
    "HandshakeKind",
    "Layout",
    "format_handshake",
    "needs_request",
    "node_is_dead",
    "parse_handshake",
    "plugin_report",
    "reported_by_us",
    "requesting",
]

HandshakeKind = Literal["Requesting", "Reported", "Deleted"]
# Go reference layouts, named as upstream spells them.
Layout = Literal["2006-01-02 15:04:05", "2006.01.02 15:04:05"]
LAYOUT_DASH: Final[Layout] = "2006-01-02 15:04:05"
LAYOUT_DOT: Final[Layout] = "2006.01.02 15:04:05"
# Upstream's CheckHealth: a Requesting_ stamp is answered within 60 s or the node may be dead.
HANDSHAKE_TIMEOUT: Final = timedelta(seconds=60)

_KEY: Final = keys.NODE_HANDSHAKE
_KINDS: Final[tuple[HandshakeKind, ...]] = get_args(HandshakeKind)
_STRFTIME: Final[dict[Layout, str]] = {LAYOUT_DASH: "%Y-%m-%d %H:%M:%S", LAYOUT_DOT: "%Y.%m.%d %H:%M:%S"}
# Longest real value is Go's time.String() (~70 chars); anything far longer is not a stamp.
_MAX_CHARS: Final = 256
_VALUE: Final = re.compile(
    r"(?P<kind>Requesting|Reported|Deleted)(?P<sep>[_ ])"
    r"(?P<y>\d{4})(?P<d1>[-.])(?P<mo>\d{2})(?P=d1)(?P<d>\d{2}) (?P<h>\d{2}):(?P<mi>\d{2}):(?P<s>\d{2})"
    # Go's time.String() only: fraction, numeric offset and zone name, monotonic reading.
    r"(?:\.(?P<frac>\d{1,9}))?(?: (?P<off>[+-]\d{4}) [A-Za-z0-9+-]+)?(?: m=[+-]\d+\.\d+)?",
    re.ASCII,
)


@dataclasses.dataclass(frozen=True, slots=True)
class Handshake:
    """A parsed stamp: who wrote it (``kind``) and when (``time``, timezone-aware)."""

    kind: HandshakeKind
    time: datetime


def parse_handshake(value: str, *, tz: tzinfo = UTC) -> Handshake:
    """Parse any stamp form listed in the module docstring; times without offset are read in ``tz``.

    Raises ``ProtocolError`` for anything else, including impossible dates. (Upstream treats an
    unparsable ``Requesting`` stamp as healthy; a caller here decides that explicitly.)
    """
    match = _VALUE.fullmatch(value) if len(value) <= _MAX_CHARS else None
    if match is None:
        raise ProtocolError(
            _KEY, value, "expected Requesting_/Reported/Deleted_ and a 'YYYY-MM-DD hh:mm:ss' time"
        )
    kind = match["kind"]
    if match["sep"] == " " and kind != "Reported":
        raise ProtocolError(_KEY, value, f"expected '{kind}_' before the time")
    if (match["frac"] or match["off"]) and match["sep"] != " ":
        raise ProtocolError(_KEY, value, "fraction and zone only come in 'Reported <Go time>' values")
    zone = tz
    if match["off"]:
        off = match["off"]
        hours, minutes = int(off[1:3]), int(off[3:5])
        if hours > 23 or minutes > 59:
            raise ProtocolError(_KEY, value, "UTC offset out of range")
        delta = timedelta(hours=hours, minutes=minutes)
        zone = timezone(-delta if off[0] == "-" else delta)
    try:
        when = datetime(
            int(match["y"]),
            int(match["mo"]),
            int(match["d"]),
            int(match["h"]),
            int(match["mi"]),
            int(match["s"]),
            int((match["frac"] or "0").ljust(9, "0")[:6]),
            tzinfo=zone,
        )
    except ValueError as exc:
        raise ProtocolError(_KEY, value, f"not a real time: {exc}") from exc
    return Handshake(_as_kind(kind), when)


def format_handshake(handshake: Handshake, *, tz: tzinfo = UTC, layout: Layout = LAYOUT_DASH) -> str:
    """``<kind>_<time in tz>``, second precision. The dash layout is what current upstream writes;
    ``Reported`` is written with ``_`` (as upstream's newer plugins do), which every reader accepts."""
    when = handshake.time
    if when.tzinfo is None or when.utcoffset() is None:
        raise ProtocolError(_KEY, when, "time must be timezone-aware")
    return f"{handshake.kind}_{when.astimezone(tz).strftime(_STRFTIME[layout])}"


def requesting(now: datetime, *, tz: tzinfo = UTC) -> str:
    """The ``Requesting_<now>`` stamp the scheduler writes."""
    return format_handshake(Handshake("Requesting", now), tz=tz)


def plugin_report(now: datetime) -> dict[str, str]:
    """The handshake our device plugin writes with its register: ``Reported_<now>`` and our marker
    (``keys.DEVICE_PLUGIN_MARKER``) equal to it (docs/wire-format.md#other-node-annotations)."""
    stamp = format_handshake(Handshake("Reported", now))
    return {keys.NODE_HANDSHAKE: stamp, keys.DEVICE_PLUGIN_MARKER: stamp}


def reported_by_us(annotations: Mapping[str, object]) -> bool | None:
    """Whether our device plugin made the node's last report: True when the handshake is a
    ``Reported_`` stamp our marker equals, False for any other report (HAMi's plugin rewrites the
    handshake and leaves our marker behind), None when the handshake is no report (a pending
    ``Requesting_`` stamp, nothing, or unreadable): then what was known before still holds."""
    handshake = annotations.get(keys.NODE_HANDSHAKE)
    if not isinstance(handshake, str):
        return None
    try:
        kind = parse_handshake(handshake).kind
    except ProtocolError:
        return None
    if kind != "Reported":
        return None
    return annotations.get(keys.DEVICE_PLUGIN_MARKER) == handshake


def needs_request(handshake: Handshake | None) -> bool:
    """Whether the scheduler should stamp ``Requesting_<now>``: on anything but a pending request."""
    return handshake is None or handshake.kind != "Requesting"


def node_is_dead(
    handshake: Handshake | None,
    *,
    allocatable_gpus: int,
    now: datetime,
    timeout: timedelta = HANDSHAKE_TIMEOUT,
) -> bool:
    """Upstream's rule: a ``Requesting_`` stamp unanswered for ``timeout`` (60 s; "unanswered" being
    not before ``stamp + timeout``) on a node with no allocatable GPU. ``now`` must be aware."""
    return (
        handshake is not None
        and handshake.kind == "Requesting"
        and now >= handshake.time + timeout
        and allocatable_gpus <= 0
    )


def _as_kind(text: str) -> HandshakeKind:
    for kind in _KINDS:
        if kind == text:
            return kind
    raise ProtocolError(_KEY, text, "unknown handshake kind")  # pragma: no cover (regex admits only these)
