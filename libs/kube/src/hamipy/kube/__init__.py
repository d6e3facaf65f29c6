"""hami-py's Kubernetes plumbing, shared by every service and the dev cluster.

- ``client``: the API client from a kubeconfig or the pod's service account (``api_client``,
  ``connect``), and ``KubeApi``/``RawKube``: raw JSON calls and watches, each with a timeout.
- ``errors``: the one error tree (``KubeError``, ``NotFound``, ``Conflict``, ``Gone``).
- ``resources``: typed calls on nodes, pods and bindings; paged lists; object paths.
- ``informer``: one list+watch kept current (bookmarks, 410 re-list, backoff with jitter, paging,
  a cache by UID, ``listed`` readiness, change notifications).
- ``events``: Events aggregated as client-go's recorder does (one per object and reason).
- ``node_lock``: releasing HAMi's node lock, never another pod's.
- ``leader``: leader election over a Lease as client-go's (expiry by local observation, fencing by
  the renew deadline, release on shutdown).
- ``certs``: a CA and the certificates it signs (pure).
- ``options``: flags from ``HAMIPY_<SERVICE>_<FLAG>``, strict booleans, the node agents' options.
"""

from __future__ import annotations

from hamipy.kube.client import API_TIMEOUT_S, KubeApi, RawKube, api_client, connect
from hamipy.kube.errors import Conflict, Gone, KubeError, NotFound
from hamipy.kube.informer import Informer, InformerSettings
from hamipy.kube.leader import LeaderElector, LeaderInfo, LeaseSettings

__all__ = [
    "API_TIMEOUT_S",
    "Conflict",
    "Gone",
    "Informer",
    "InformerSettings",
    "KubeApi",
    "KubeError",
    "LeaderElector",
    "LeaderInfo",
    "LeaseSettings",
    "NotFound",
    "RawKube",
    "api_client",
    "connect",
]
