"""``hami.io/mutex.lock``: the node lock held from bind to Allocate (docs/wire-format.md#node-lock).

Upstream (``pkg/util/nodelock/nodelock.go``) writes ``<RFC3339 time>,<namespace>,<pod name>``
(``time.Now().Format(time.RFC3339)``: local time with its offset, ``Z`` for UTC, whole seconds),
for example ``2025-06-18T09:06:27Z,default,ubuntu-684fc95568-2jh7s``, and its ``ParseNodeLock`` reads:

- a value without ``,`` as a legacy lock holding only the time (no owner);
- otherwise exactly three ``,``-separated parts, else an error.

``time.Parse(time.RFC3339, ...)`` also takes a fractional second after the seconds; so does this
module (kept to microseconds). Unlike upstream, an empty namespace or pod name is refused rather
than read as "no owner".

A lock expires once it is *more than* ``NODE_LOCK_TIMEOUT`` old (upstream: ``time.Since(lockTime) >
NodeLockTimeout``, 5 minutes unless ``HAMI_NODELOCK_EXPIRE`` says otherwise); upstream then breaks it,
and also breaks a younger one whose owner pod no longer exists (which needs the API, so it is the
caller's check; ``owned_by`` is the owner comparison upstream's release does). All functions are
pure: the current time is a parameter.
"""

from __future__ import annotations

import dataclasses
import re
from datetime import UTC, datetime, timedelta, timezone
from typing import Final

from hamipy.protocol import keys
from hamipy.protocol.errors import ProtocolError

__all__ = [
    "NODE_LOCK_TIMEOUT",
    "NodeLock",
    "format_node_lock",
    "lock_expired",
    "owned_by",
    "parse_node_lock",
]

# Upstream's default NodeLockTimeout.
NODE_LOCK_TIMEOUT: Final = timedelta(minutes=5)

_KEY: Final = keys.NODE_LOCK
# namespace (63) + pod name (253) + time; anything much longer is not a lock.
_MAX_CHARS: Final = 512
# RFC 3339 as Go's time.RFC3339 layout parses it: 'T' and 'Z' upper case, offset with a colon.
_RFC3339: Final = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})(?:[.,](\d{1,9}))?(?:Z|([+-])(\d{2}):(\d{2}))",
    re.ASCII,
)
_BAD_NAME_CHAR: Final = re.compile(r"[\s,]").search


@dataclasses.dataclass(frozen=True, slots=True)
class NodeLock:
    """A parsed lock: when it was taken (aware) and by which pod (``None`` for a legacy lock)."""

    time: datetime
    namespace: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if (self.namespace is None) != (self.name is None):
            raise ValueError("NodeLock owner needs both namespace and name, or neither")


def parse_node_lock(value: str) -> NodeLock:
    """Parse a lock value, owned or legacy; raises ``ProtocolError`` naming what is wrong."""
    if len(value) > _MAX_CHARS:
        raise ProtocolError(_KEY, value, f"value longer than {_MAX_CHARS} characters")
    if "," not in value:
        return NodeLock(_parse_time(value))
    parts = value.split(",")
    if len(parts) != 3:
        raise ProtocolError(_KEY, value, f"expected '<time>,<namespace>,<pod>', got {len(parts)} parts")
    stamp, namespace, name = parts
    for what, part in (("namespace", namespace), ("name", name)):
        if not part or _BAD_NAME_CHAR(part):
            raise ProtocolError(f"{_KEY}.{what}", part, f"{what} empty or holding a blank")
    return NodeLock(_parse_time(stamp), namespace, name)


def format_node_lock(lock: NodeLock) -> str:
    """``<RFC3339 time>[,<namespace>,<pod>]``, whole seconds, in the lock time's own offset (``Z`` for
    UTC) as Go's ``Format(time.RFC3339)`` writes it."""
    when = lock.time
    offset = when.utcoffset()
    if offset is None:
        raise ProtocolError(_KEY, when, "lock time must be timezone-aware")
    stamp = when.strftime("%Y-%m-%dT%H:%M:%S") + _format_offset(offset)
    if lock.namespace is None or lock.name is None:
        return stamp
    for what, part in (("namespace", lock.namespace), ("name", lock.name)):
        if not part or _BAD_NAME_CHAR(part):
            raise ProtocolError(f"{_KEY}.{what}", part, f"{what} empty or holding a blank or ','")
    return f"{stamp},{lock.namespace},{lock.name}"


def lock_expired(lock: NodeLock, *, now: datetime, timeout: timedelta = NODE_LOCK_TIMEOUT) -> bool:
    """Whether the lock is more than ``timeout`` old at ``now`` (aware), as upstream decides."""
    return now - lock.time > timeout


def owned_by(lock: NodeLock, *, namespace: str, name: str) -> bool:
    """Whether ``namespace/name`` holds the lock; a legacy lock is nobody's."""
    return lock.namespace == namespace and lock.name == name


def _parse_time(text: str) -> datetime:
    match = _RFC3339.fullmatch(text)
    if match is None:
        raise ProtocolError(f"{_KEY}.time", text, "expected an RFC 3339 time like 2025-06-18T09:06:27Z")
    year, month, day, hour, minute, second, frac, sign, off_h, off_m = match.groups()
    zone = UTC
    if sign is not None:
        if int(off_h) > 23 or int(off_m) > 59:
            raise ProtocolError(f"{_KEY}.time", text, "UTC offset out of range")
        delta = timedelta(hours=int(off_h), minutes=int(off_m))
        zone = timezone(-delta if sign == "-" else delta)
    try:
        return datetime(
            int(year),
            int(month),
            int(day),
            int(hour),
            int(minute),
            int(second),
            int((frac or "0").ljust(9, "0")[:6]),
            tzinfo=zone,
        )
    except ValueError as exc:
        raise ProtocolError(f"{_KEY}.time", text, f"not a real time: {exc}") from exc


def _format_offset(offset: timedelta) -> str:
    if not offset:
        return "Z"
    # As Go's zone := offset / 60: whole minutes truncated toward zero, the sign taken after, so
    # -00:25:21 is "-00:25" and -00:00:30 is "+00:00" (flooring gave "-00:26" and "-00:01").
    seconds = int(offset.total_seconds())
    minutes = abs(seconds) // 60
    sign = "-" if seconds < 0 and minutes else "+"
    hours, mins = divmod(minutes, 60)
    return f"{sign}{hours:02d}:{mins:02d}"
