"""The connection cap with eviction: which connections one server holds, which one makes room at
the cap, and which wait for a slot. It keeps the books only; ``http_limits`` times and closes the
connections and tells it what each is doing.

At most ``max_connections`` connections are held, in TLS handshake or not. At the cap a new
connection closes a held one that is not being served: one sending its request (from accept, TLS
handshake included, or from the first byte of a further request, until its body is complete: a
handler waiting for the body counts as not served) or one idle between requests. The one sending
longest goes if the cap's worth of connections have been accepted since it began; else the one
idle longest; else, when none is idle, the one sending longest. Evicting keeps memory at the cap
while a client that sends its request promptly (the kubelet, the API server) still gets in: a
newcomer is the newest sender, so it is cut before the cap's worth of connections have opened
after it only if none is idle and every other held connection is being served or began its
request after it. Refusing new connections at the cap instead would let a client that keeps
reopening them, or trickles its body, starve the probes and the API server. Idle connections go
before a sender younger than that, or a client holding all slots but one idle would leave a
newcomer the only one the next connection can cut; an older sender goes before them because a
client may be writing its next request on an idle one as it is cut, and Go's HTTP client does not
retry a POST it has written.

When every held connection is being served (its whole request in the handler), a new connection
waits for a slot, first come first served, up to ``max_queued`` of them; past that it is refused.
A slot freed goes to the longest queued connection. This is for kube-scheduler over HTTP/1.1: it
sends each bind on a connection of its own and holds it until the extender's Binding is written,
so a burst of binds behind a slow API server fills the cap, and closing its next connection would
fail a pod's filter or bind. The listen backlog cannot be used instead: asyncio only accepts or
closes the listening socket.
"""

from __future__ import annotations

import dataclasses
from typing import Generic, Literal, Protocol, TypeVar

__all__ = ["ConnectionCap", "ConnectionStats", "Evictable"]


@dataclasses.dataclass(slots=True)
class ConnectionStats:
    """What the limits did since the server started (tests read it; ``held`` is current)."""

    accepted: int = 0
    """Given a slot, at once or from the queue."""
    http2: int = 0
    """Of ``accepted``, those that negotiated HTTP/2 (``start_bounded_site(http2=...)``)."""
    held: int = 0
    waiting: int = 0
    """Of ``held``, those the cap may evict: idle, or still sending their request (TLS handshake,
    head or body)."""
    queued: int = 0
    """Waiting for a slot now (not held)."""
    queued_total: int = 0
    """Ever queued (most are then served)."""
    refused: int = 0
    """Closed at accept: at the cap with every held connection serving a request and the queue full."""
    queue_timeouts: int = 0
    """Closed while queued, after the header timeout."""
    evicted: int = 0
    """Closed to make room at the cap (an idle connection, or the longest sender)."""
    header_timeouts: int = 0
    body_timeouts: int = 0
    idle_timeouts: int = 0
    """Closed after ``keepalive_timeout_s`` without a further request (or with the answer unread)."""
    client_gone: int = 0
    """Closed by the client (or its network) while its request was in flight: its body unfinished,
    or its answer not yet sent."""


class Evictable(Protocol):
    def cut(self) -> None:
        """Close now; the connection then ``release``s its slot."""

    def admitted(self) -> None:
        """Out of the queue into a slot (already counted held)."""


C = TypeVar("C", bound=Evictable)


class ConnectionCap(Generic[C]):
    """One server's held, sending, idle and queued connections, counted into ``stats``."""

    def __init__(self, max_connections: int, max_queued: int, stats: ConnectionStats) -> None:
        self.max_connections = max_connections
        self.max_queued = max_queued
        self.stats = stats
        self.held: set[C] = set()
        self.sending: dict[C, int] = {}
        """Held connections whose request has not fully arrived, longest sending first (insertion
        order), each with ``stats.accepted`` as it began: how many connections came after it."""
        self.idle: dict[C, None] = {}
        """Held connections kept alive between requests, longest idle first."""
        self.queue: dict[C, None] = {}
        """Connections waiting for a slot, first come first (insertion order)."""

    def admit(self, conn: C) -> Literal["held", "queued", "refused"]:
        """A new connection: held (at the cap, in place of ``_victim``), queued behind those
        already queued, or refused when the queue is full."""
        if len(self.held) >= self.max_connections:
            victim = self._victim()
            if victim is not None and not self.queue:
                self.stats.evicted += 1
                victim.cut()
            elif len(self.queue) < self.max_queued:
                self.queue[conn] = None
                self.stats.queued_total += 1
                self._count()
                return "queued"
            else:
                self.stats.refused += 1
                return "refused"
        self._hold(conn)
        return "held"

    def _victim(self) -> C | None:
        """Who makes room at the cap (the module docstring says why): the longest sender once the
        cap's worth of connections have been accepted after it began, else the longest idle one,
        else the longest sender."""
        sender, began = next(iter(self.sending.items()), (None, 0))
        if sender is not None and self.stats.accepted - began >= self.max_connections:
            return sender
        return next(iter(self.idle), None) or sender

    def _hold(self, conn: C) -> None:
        self.held.add(conn)
        self.stats.accepted += 1
        self._count()

    def send(self, conn: C) -> None:
        """``conn`` starts sending a request (from accept, or its next request's first byte)."""
        self.idle.pop(conn, None)
        self.sending[conn] = self.stats.accepted
        self._count()

    def rest(self, conn: C) -> None:
        """``conn`` was answered and is kept alive."""
        self.sending.pop(conn, None)
        self.idle[conn] = None
        self._count()

    def busy(self, conn: C) -> None:
        """``conn``'s request is whole and in the handler (or an HTTP/2 stream is open)."""
        self.sending.pop(conn, None)
        self.idle.pop(conn, None)
        self._count()

    def release(self, conn: C) -> None:
        """``conn`` is gone (or was never held): its slot goes to the longest queued connection."""
        self.queue.pop(conn, None)
        self.held.discard(conn)
        self.sending.pop(conn, None)
        self.idle.pop(conn, None)
        while self.queue and len(self.held) < self.max_connections:
            first = next(iter(self.queue))
            del self.queue[first]
            self._hold(first)
            first.admitted()
        self._count()

    def _count(self) -> None:
        self.stats.held = len(self.held)
        self.stats.waiting = len(self.sending) + len(self.idle)
        self.stats.queued = len(self.queue)
