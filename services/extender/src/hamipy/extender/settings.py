"""Settings of the extender beyond the shared configuration (hamipy.protocol.config.Config),
each declared once with its flag and variable (``hamipy.protocol.settings``)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path

from hamipy.protocol.node_lock import NODE_LOCK_TIMEOUT
from hamipy.protocol.settings import OWN, tuning, user

__all__ = ["ExtenderSettings", "ListenSettings"]


@dataclasses.dataclass(frozen=True, slots=True)
class ListenSettings:
    """Where ``hamipy-extender serve`` listens, and with which certificates."""

    host: str = user("0.0.0.0", "listen address")
    port: int = user(8888, "listen port")
    tls_cert_file: Path | None = user(None, "PEM certificate: serve HTTPS")
    tls_key_file: Path | None = user(None, "PEM key of --tls-cert-file")
    tls_client_ca_file: Path | None = user(
        None,
        "PEM CA: with HTTPS, a request to the decision port must come with a client certificate "
        "it signed (kube-scheduler's, from its extender tlsConfig)",
    )
    metrics_port: int | None = user(
        None,
        "also serve /metrics, /healthz, /readyz over plain HTTP on this port (for the kubelet's "
        "probes and Prometheus when the decision port demands client certificates)",
    )


@dataclasses.dataclass(frozen=True, slots=True)
class ExtenderSettings:
    """How the extender decides, binds and watches. Times are in seconds."""

    cooperative: bool = user(
        False, "/filter returns every feasible node and /prioritize scores them (GPUs chosen at bind)"
    )
    """False (HAMi mode): /filter returns the one node chosen and reserves its GPUs at once. True:
    /filter returns every feasible node, /prioritize scores them and GPUs are chosen at bind, so
    kube-scheduler's own scoring (preferred affinity, topology spread) still counts."""
    release_lock_after_bind: bool = user(
        True,
        "on nodes our device plugin serves, hold the node lock only while binding; --no-... leaves "
        "it for the device plugin to release after Allocate there too (as always on nodes HAMi's "
        "device plugin serves)",
    )
    """True: on nodes our device plugin serves, hold ``hami.io/mutex.lock`` only for the bind
    critical section (re-check, annotate, Binding), so binds on one node follow each other in
    milliseconds. False: leave it for the device plugin to release after Allocate there too. On
    nodes HAMi's device plugin serves the lock is always left for it (``Binder.releases_after_bind``)."""
    bind_timeout_s: float = user(
        20.0,
        "seconds a bind waits in all, for an earlier bind of its pod and a locked node (keep below "
        "the scheduler's httpTimeout)",
    )
    """How long a bind may wait in all: for an earlier bind of its pod, then for a node lock held by
    another pod (one deadline). Keep it below the scheduler's extender ``httpTimeout`` (HAMi deploys
    30 s) so the answer, not a timeout, reaches it."""
    lock_expiry: timedelta = tuning(NODE_LOCK_TIMEOUT, "seconds after which any node lock is broken")
    """Whoever holds it (upstream: 5 minutes)."""
    lock_sweep_interval_s: float = tuning(
        2.0, "seconds between retries of failed lock releases and checks of stuck locks"
    )
    """How often releases that failed are retried and stuck locks checked
    (``hamipy.extender.lock_sweep``): a lock we owe is gone this long after the API answers again."""
    reservation_ttl_s: float = tuning(60.0, "seconds a filter's reservation counts without a bind")
    """How long a filter's reservation counts without a bind confirming it. Longer than a normal
    filter -> bind gap (milliseconds to the bind wait), short enough that a pod the scheduler gave
    up on frees its GPUs soon."""
    watch_wait_s: float = tuning(
        5.0, "longest seconds a filter waits for the pod watch to deliver the pod it names (0: no wait)"
    )
    """Longest a filter waits for the pod watch to deliver the pod it names (kube-scheduler's watch
    of the same API server delivered it first): only a pod the watch holds is reserved for
    (``hamipy.extender.pod_arrivals``). Milliseconds behind a burst; the bound matters when the watch
    is stuck, and each filter of a new pod then waits this long. 0 turns the wait off."""
    preemption: bool = user(
        True, "preempt lower-priority GPU pods for a pod that fits nowhere (docs/extender.md#preemption)"
    )
    """Here (``hamipy.extender.preemption``): kube-scheduler cannot, as it does not see GPU memory and
    cores."""
    preemption_wait_s: float = tuning(
        60.0, "seconds beyond the victims' grace period a preemptor's GPUs stay held for it"
    )
    """Beyond the victims' longest grace period; then the preemptor's next filter plans again."""
    requeue_interval_s: float = tuning(
        1.0, "least seconds between nudges making kube-scheduler retry refused pods once GPUs free (0: off)"
    )
    """Least time between two nudges that make kube-scheduler retry the pods the extender refused,
    once GPUs free up (``hamipy.extender.requeue``); 0 disables them (such pods then wait for
    kube-scheduler's next cluster event, or its 5-minute flush)."""
    heap_trim_interval_s: float = tuning(
        60.0, "seconds between hand-backs of the C heap's free pages to the kernel (0: off)"
    )
    """How often the C heap's free pages are handed back to the kernel (``hamipy.serving.heap``):
    without it, RSS creeps up under pod churn while the bytes in use stay flat. 0 disables it."""
    api_timeout_s: float = tuning(10.0, "seconds per Kubernetes API call")
    """Not watches: theirs is ``watch_inactivity_s``."""
    watch_timeout_s: float = 300.0
    """Server-side watch duration before a clean reconnect (``timeoutSeconds``)."""
    watch_inactivity_s: float = 330.0
    """A watch that sends nothing (not even a bookmark) this long is dropped and restarted."""
    leader_election: bool = user(
        False,
        "replicas elect a leader by a Lease; it decides and the others forward or redirect to it "
        "(needed with more than one replica: docs/extender.md#replicas)",
        flag="leader-elect",
    )
    """False: this process is the only extender, and binds on nodes our device plugin serves decide
    from its model. True: replicas elect a leader by a Lease; it decides, the others forward to it
    (``hamipy.extender.leadership``). Never run several replicas without it."""
    follower_redirect: bool = user(
        False,
        "a follower answers 307 to the leader instead of forwarding (kube-scheduler needs a fixed "
        "TLS serverName)",
    )
    """False: a follower forwards each decision request to the leader and relays its answer. True:
    it answers ``307 Temporary Redirect`` to the leader's ``advertise_url`` without reading the body,
    and kube-scheduler sends the request there itself (Go's client repeats a POST on a 307), which
    spares the follower's hop. Over TLS, kube-scheduler must then check the extenders' certificate
    against a fixed name (its extender ``tlsConfig.serverName``), since the leader's URL is its pod IP."""
    http2: bool = user(
        True, "over TLS, offer HTTP/2 (kube-scheduler then sends every request on one connection)"
    )
    """Over TLS, offer HTTP/2 besides HTTP/1.1 in the handshake (ALPN). kube-scheduler's client then
    sends all its requests on one connection; over HTTP/1.1 it keeps only 2 idle connections and
    opens a new one, a full TLS handshake, for most requests of a burst (docs/extender.md)."""
    cold_standby: bool = user(
        False,
        "with --leader-elect, a replica watches the cluster only once it first leads (followers "
        "cost nothing per pod; a new leader lists the cluster before deciding)",
    )
    """With ``leader_election``: False (hot standby), every replica watches the cluster from the start,
    so a new leader only reads the bound pods before it decides. True, a replica starts its watches
    when it first leads and keeps them from then on: a follower that never led costs the API server
    and its node nothing per pod (no watch of every pod), and a new leader lists the cluster before
    it decides (within the failover bound: docs/extender.md#replicas)."""
    lease_namespace: str = user(
        "kube-system", "namespace of the leader Lease (else $POD_NAMESPACE)", env=(OWN, "POD_NAMESPACE")
    )
    lease_name: str = user("hami-py-extender", "name of the leader Lease")
    identity: str = user(
        "",
        "this replica's name in the Lease (else $POD_NAME, else the host name), made unique per "
        "process with a random suffix",
        env=(OWN, "POD_NAME"),
    )
    advertise_url: str = user(
        "", "where the other replicas reach this one while it leads, e.g. https://$(POD_IP):8888"
    )
    peer_server_name: str = user(
        "", "TLS name checked on the leader's certificate when forwarding (default: the URL's host)"
    )
    own_pod: str = user(
        "",
        "NAMESPACE/NAME of this replica's pod: with --leader-elect, its label "
        "hami-py.io/extender-role says leader or follower, for a Service that selects the leader",
    )
    """``namespace/name`` of this replica's pod: with ``leader_election``, the label
    ``hami-py.io/extender-role`` on it follows the replica's role (``hamipy.extender.role_label``),
    so that a Service can select the leader. Empty: no label is written (``own_pod_ref``)."""
    lease_duration_s: float = tuning(20.0, "seconds: how long a silent leader's Lease stands")
    """Longer than ``renew_deadline_s`` + ``api_timeout_s``: a leader's last bind has landed or timed
    out before another replica can take the Lease (``hamipy.kube.leader.LeaseSettings`` checks)."""
    renew_deadline_s: float = tuning(8.0, "seconds: a leader that could not renew this long stops")
    retry_period_s: float = tuning(2.0, "seconds between Lease reads and renewals")
    leader_wait_s: float = 5.0
    """How long a follower holds a request while no leader is known before answering 503."""
    success_events: bool = user(
        False, "a FilteringSucceed Event per placed pod, as HAMi writes (one more API request a pod)"
    )
    """Off: kube-scheduler's own ``Scheduled`` Event already names the node. Failures always get one."""
    handshake_interval_s: float = tuning(
        30.0, "seconds between Requesting_ handshake stamps on nodes (0: off)"
    )
    max_body_bytes: int = tuning(16 * 1024 * 1024, "largest request body (larger: HTTP 400)")
    """Largest request body: ExtenderArgs with ``Nodes`` (nodeCacheCapable false) carries every node
    object, about 5-10 KiB each."""
    event_queue_size: int = 1000
    """Kubernetes Events waiting to be posted; beyond it new ones are dropped (and counted)."""

    def own_pod_ref(self) -> tuple[str, str] | None:
        """``own_pod`` as (namespace, name); None when empty; ``ValueError`` when it is not
        ``NAMESPACE/NAME``."""
        if not self.own_pod:
            return None
        namespace, _, name = self.own_pod.partition("/")
        if not namespace or not name or "/" in name:
            raise ValueError(f"--own-pod must be NAMESPACE/NAME, not {self.own_pod!r}")
        return namespace, name
