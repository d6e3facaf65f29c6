"""Settings of the extender beyond the shared configuration (hamipy.protocol.config.Config)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from hamipy.protocol.node_lock import NODE_LOCK_TIMEOUT

__all__ = ["API_CONNECTIONS", "ExtenderSettings"]

API_CONNECTIONS = 64
"""The extender's default ``api_connections`` (docs/benchmarks.md: binds of 1,000-pod bursts at 1,000
nodes took 0.75-2.4 s with 24, 0.42-0.63 s with 64, for about 10 MiB more RSS under churn)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ExtenderSettings:
    """How the extender decides, binds and watches. Times are in seconds."""

    cooperative: bool = False
    """False (HAMi mode): /filter returns the one node chosen and reserves its GPUs at once. True:
    /filter returns every feasible node, /prioritize scores them and GPUs are chosen at bind, so
    kube-scheduler's own scoring (preferred affinity, topology spread) still counts."""
    release_lock_after_bind: bool = True
    """True: on nodes our device plugin serves, hold ``hami.io/mutex.lock`` only for the bind
    critical section (re-check, annotate, Binding), so binds on one node follow each other in
    milliseconds. False: leave it for the device plugin to release after Allocate there too. On
    nodes HAMi's device plugin serves the lock is always left for it (``Binder.releases_after_bind``)."""
    bind_timeout_s: float = 20.0
    """How long a bind may wait in all: for an earlier bind of its pod, then for a node lock held by
    another pod (one deadline). Keep it below the scheduler's extender ``httpTimeout`` (HAMi deploys
    30 s) so the answer, not a timeout, reaches it."""
    lock_expiry: timedelta = NODE_LOCK_TIMEOUT
    """Age past which a lock is broken whoever holds it (upstream: 5 minutes)."""
    lock_sweep_interval_s: float = 2.0
    """How often releases that failed are retried and stuck locks checked
    (``hamipy.extender.lock_sweep``): a lock we owe is gone this long after the API answers again."""
    reservation_ttl_s: float = 60.0
    """How long a filter's reservation counts without a bind confirming it. Longer than a normal
    filter -> bind gap (milliseconds to the bind wait), short enough that a pod the scheduler gave
    up on frees its GPUs soon."""
    watch_wait_s: float = 5.0
    """Longest a filter waits for the pod watch to deliver the pod it names (kube-scheduler's watch
    of the same API server delivered it first): only a pod the watch holds is reserved for
    (``hamipy.extender.pod_arrivals``). Milliseconds behind a burst; the bound matters when the watch
    is stuck, and each filter of a new pod then waits this long. 0 turns the wait off."""
    preemption: bool = True
    """Preempt lower-priority GPU pods for a pod that fits nowhere (``hamipy.extender.preemption``):
    kube-scheduler cannot, as it does not see GPU memory and cores."""
    preemption_wait_s: float = 60.0
    """How long, beyond the victims' longest grace period, a preemptor's GPUs stay held for it
    while the victims stop; then its next filter plans again."""
    requeue_interval_s: float = 1.0
    """Least time between two nudges that make kube-scheduler retry the pods the extender refused,
    once GPUs free up (``hamipy.extender.requeue``); 0 disables them (such pods then wait for
    kube-scheduler's next cluster event, or its 5-minute flush)."""
    heap_trim_interval_s: float = 60.0
    """How often the C heap's free pages are handed back to the kernel (``hamipy.telemetry.heap``):
    without it, RSS creeps up under pod churn while the bytes in use stay flat. 0 disables it."""
    api_timeout_s: float = 10.0
    """Per Kubernetes API call (not watches)."""
    api_connections: int = API_CONNECTIONS
    """Connections to the API server at once: its four watches plus the calls in flight. Every bind
    in flight holds one for its Binding, and kube-scheduler sends binds in parallel: with too few,
    binds wait here for a connection, each holds one of kube-scheduler's connections to us the
    while, and a burst behind a slow API server fills ``max_connections``. Each open connection
    keeps up to about 400 KiB of TLS buffers (hamipy.kube.client.MAX_CONNECTIONS, 24, is the
    node agents' and the webhook's)."""
    watch_timeout_s: float = 300.0
    """Server-side watch duration before a clean reconnect (``timeoutSeconds``)."""
    watch_inactivity_s: float = 330.0
    """A watch that sends nothing (not even a bookmark) this long is dropped and restarted."""
    leader_election: bool = False
    """False: this process is the only extender, and binds on nodes our device plugin serves decide
    from its model. True: replicas elect a leader by a Lease; it decides, the others forward to it
    (``hamipy.extender.leadership``). Never run several replicas without it."""
    follower_redirect: bool = False
    """False: a follower forwards each decision request to the leader and relays its answer. True:
    it answers ``307 Temporary Redirect`` to the leader's ``advertise_url`` without reading the body,
    and kube-scheduler sends the request there itself (Go's client repeats a POST on a 307), which
    spares the follower's hop. Over TLS, kube-scheduler must then check the extenders' certificate
    against a fixed name (its extender ``tlsConfig.serverName``), since the leader's URL is its pod IP."""
    http2: bool = True
    """Over TLS, offer HTTP/2 besides HTTP/1.1 in the handshake (ALPN). kube-scheduler's client then
    sends all its requests on one connection; over HTTP/1.1 it keeps only 2 idle connections and
    opens a new one, a full TLS handshake, for most requests of a burst (docs/extender.md)."""
    cold_standby: bool = False
    """With ``leader_election``: False (hot standby), every replica watches the cluster from the start,
    so a new leader only reads the bound pods before it decides. True, a replica starts its watches
    when it first leads and keeps them from then on: a follower that never led costs the API server
    and its node nothing per pod (no watch of every pod), and a new leader lists the cluster before
    it decides (within the failover bound: docs/extender.md#replicas)."""
    lease_namespace: str = "kube-system"
    lease_name: str = "hami-py-extender"
    identity: str = ""
    """This replica's name in the Lease (empty: the host name); a random suffix makes it unique per
    process."""
    advertise_url: str = ""
    """Where the other replicas reach this one while it leads (``https://<pod IP>:<port>``)."""
    peer_server_name: str = ""
    """TLS name checked on the leader's certificate when forwarding (empty: the URL's host)."""
    own_pod: str = ""
    """``namespace/name`` of this replica's pod: with ``leader_election``, the label
    ``hami-py.io/extender-role`` on it follows the replica's role (``hamipy.extender.role_label``),
    so that a Service can select the leader. Empty: no label is written (``own_pod_ref``)."""
    lease_duration_s: float = 20.0
    """Longer than ``renew_deadline_s`` + ``api_timeout_s``: a leader's last bind has landed or timed
    out before another replica can take the Lease (``hamipy.kube.leader.LeaseSettings`` checks)."""
    renew_deadline_s: float = 8.0
    retry_period_s: float = 2.0
    leader_wait_s: float = 5.0
    """How long a follower holds a request while no leader is known before answering 503."""
    success_events: bool = False
    """A ``FilteringSucceed`` Event per placed pod, as HAMi writes: one more API request a pod, and
    kube-scheduler's own ``Scheduled`` Event already names the node. Failures always get one."""
    handshake_interval_s: float = 30.0
    """How often the ``Requesting_`` handshake is stamped on nodes that need it; 0 disables it."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest request body: ExtenderArgs with ``Nodes`` (nodeCacheCapable false) carries every node
    object, about 5-10 KiB each."""
    event_queue_size: int = 1000
    """Kubernetes Events waiting to be posted; beyond it new ones are dropped (and counted)."""
    # The HTTP server's limits (hamipy.telemetry.http_limits.HttpLimits, whose defaults these are
    # and where they are checked): any pod can reach the extender.
    header_timeout_s: float = 10.0
    """Accept to request headers read, TLS handshake included: kube-scheduler sends its request head
    at once, and its extender ``httpTimeout`` gives up long before a slow client would finish."""
    body_timeout_s: float = 10.0
    """Headers read to the whole body received: 16 MiB crosses a pod network in well under 10 s."""
    keepalive_timeout_s: float = 75.0
    """An idle kept-alive connection is closed after this long."""
    max_connections: int = 256
    """Connections held at once: kube-scheduler (one leader, a few replicas), the kubelet's probes
    and Prometheus keep a handful; the cap bounds what anyone else can make us hold."""
    max_queued_connections: int = 512
    """Connections that wait for a slot when every held one serves a request: kube-scheduler holds
    one per bind in flight, so a burst of binds behind a slow API server can fill the cap."""

    def own_pod_ref(self) -> tuple[str, str] | None:
        """``own_pod`` as (namespace, name); None when empty; ``ValueError`` when it is not
        ``NAMESPACE/NAME``."""
        if not self.own_pod:
            return None
        namespace, _, name = self.own_pod.partition("/")
        if not namespace or not name or "/" in name:
            raise ValueError(f"--own-pod must be NAMESPACE/NAME, not {self.own_pod!r}")
        return namespace, name
