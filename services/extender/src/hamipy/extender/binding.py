"""``/bind``: where correctness is enforced (docs/design.md#5-bind-enforces-correctness).

For one pod and the node kube-scheduler chose (binds of one pod take turns on this replica,
``PodTurns``; a pod the model counts as bound is answered from the model, its count left as is, and
one whose earlier Binding lost its answer is read once to learn whether it is bound, ``_settle``):

1. take the pod as the watch last saw it pending (read it from the API only when the watch has not
   delivered it) and refuse it unless it is the one kube-scheduler means (the UID of the bind), asks
   for our scheduler (``spec.schedulerName``) and names a GPU resource of ours: ``/bind`` binds only
   pods the ``hami-scheduler`` profile hands to this extender. A pod already bound there is a
   retried bind and succeeds;
2. choose the path (docs/extender.md#two-bind-paths). **From the model** when this replica alone
   writes allocations (``exclusive``: the only replica, or the leader caught up), our device plugin
   serves the node (its last report carries our marker) and no one else holds the node's lock: the
   filter's devices are re-checked against the model, with no read and no lock, and the decision and
   the in-flight record run with no await between them, so this replica's binds count each other.
   **Locked** otherwise (HAMi's discipline): steps 3 and 4;
3. take the node lock ``hami.io/mutex.lock`` in HAMi's format with a resourceVersion-guarded patch.
   A lock held by another pod is waited for (bounded by ``bind_timeout_s``, below the scheduler's
   httpTimeout) instead of failing; one that is expired, malformed, or whose owner pod is gone,
   finished or already served (``bind-phase`` success/failed) is broken. Binds of one replica on
   one node also queue on an in-process mutex, so they do not poll each other;
4. under the lock, rebuild the node's usage from *fresh* API state: the Node, and every pod bound to
   it (``spec.nodeName``), so that binds by other schedulers and pods the watch has not delivered
   yet are counted; re-check the filter's devices there and re-plan on that node if they no longer
   fit. As in the model, a pod that is not bound holds nothing (anyone may annotate their own pod):
   our bind writes the allocation with the Binding itself, before it lets the lock go, so under the
   lock no bind of ours is half-done. The one exception is a lock we broke whose holder patches the
   pod before binding it (HAMi's scheduler does; the ``hami.io/vgpu-node`` label it writes with the
   allocation finds that pod): it is counted as if bound;
5. on either path, record the bind in flight in the model (``begin_bind``), so a filter meanwhile
   counts it; then one write binds the pod and records its allocation: the Binding carries
   ``hami.io/vgpu-node``, ``vgpu-time``, ``vgpu-devices-to-allocate``, ``vgpu-devices-allocated``,
   ``bind-phase=allocating`` and ``bind-time`` as annotations, and ``vgpu-mig-allocations`` (the
   profile and placement of each device on a dynamic MIG GPU, planned on the state decided on),
   which the API server copies onto the pod with ``spec.nodeName``, guarded by the pod's UID and the
   resourceVersion the bind read. On a Conflict the pod is read (``_after_conflict``): bound by
   another bind of it, it is left as that bind wrote it, the model takes what it holds, and the bind
   succeeds if it is bound to this node; still unbound and asking the same, it is written again with
   its new resourceVersion. On the locked path (a node HAMi's device plugin serves) the
   ``hami.io/vgpu-node`` label HAMi's monitor selects on follows, best effort; our own components
   never read it;
6. on the locked path, release the lock at once where our device plugin serves the node
   (``releases_after_bind``: ``release_lock_after_bind``, the default), or leave it for the device
   plugin to release after Allocate: always on a node HAMi's device plugin serves, which hands the
   devices of the pod its lock names (HAMi's discipline), and everywhere with
   ``--no-release-lock-after-bind``.

A lock session (where locks last only for the bind): when more binds of this replica wait for the
same node, the lock is not released but handed to the next one with the fresh state, updated with
what was just written. The next bind re-stamps the lock with its own pod (a resourceVersion-guarded
patch against the node as last written, so the lock is always named after the pod being bound and
never looks "done" to other replicas); if the node changed meanwhile, it checks the lock is still
ours and re-reads the fresh state before going on, and if the lock was lost it takes the full path.
That saves the lock round trips and the pod list per bind when pods queue on one node.

On failure the lock (if ours), the reservation and the bind's own record in flight are released, and
``BindRefused``/``KubeError`` tells the caller why; an allocation the model counts for the pod
stays (only the API frees it), and a Binding whose answer was lost keeps its GPUs reserved
(``ClusterModel.hold_in_doubt``): it may have bound the pod.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import random
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Final, NamedTuple

from hamipy.extender.errors import BindRefused, LockTimeout
from hamipy.extender.filtering import ask_of, build_ask, quota_check
from hamipy.extender.fitting import CARD_MIG_TOPOLOGY_INFEASIBLE, PodAsk, fit_pod
from hamipy.extender.lock_sweep import LockSweeper, LockVerdict
from hamipy.extender.mig_placement import plan_allocations
from hamipy.extender.model import (
    ClusterModel,
    NodeName,
    NodeState,
    PendingPod,
    PodUid,
    lock_held_too_long,
    mig_gpus,
    now_epoch,
    pod_leaving,
)
from hamipy.extender.pod_turns import PodTurns
from hamipy.extender.quota import QUOTA_EXCEEDED
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.kube.client import KubeApi
from hamipy.kube.errors import Conflict, KubeError, NotFound
from hamipy.kube.node_lock import release_node_lock
from hamipy.kube.resources import (
    create_binding,
    get_node,
    get_pod,
    list_all,
    node_pods_query,
    patch_node_annotations,
    patch_pod,
    pod_path,
)
from hamipy.protocol import keys
from hamipy.protocol.config import Config
from hamipy.protocol.devices import PodDevices
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.mig_allocations import MigAllocation, encode_mig_allocations
from hamipy.protocol.node_lock import NodeLock, format_node_lock, lock_expired, owned_by, parse_node_lock
from hamipy.protocol.pod_devices import encode_pod_devices
from hamipy.protocol.resources import requests_any_gpu

__all__ = ["Binder"]

_FIRST_DELAY_S: Final = 0.02
_MAX_DELAY_S: Final = 0.25
_DONE_PHASES: Final = frozenset({"success", "failed"})
_LABEL_MAX: Final = 63
_BINDING_ATTEMPTS: Final = 3
"""Bindings written for one bind when the pod keeps changing (not bound) between them."""


class _Target(NamedTuple):
    """The pod a bind is for and the node kube-scheduler chose."""

    namespace: str
    name: str
    uid: PodUid
    node: NodeName


@dataclasses.dataclass
class _Session:
    """The node lock this replica still holds after a bind, and the fresh state as it wrote it."""

    node_obj: dict[str, Any]
    fresh: ClusterModel
    owner: tuple[str, str]


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta: Mapping[str, Any] = obj.get("metadata") or {}
    return meta


def _lock_owner(value: str) -> tuple[str, str] | None:
    """The pod named by a lock value, None for a malformed or legacy (time-only) lock."""
    try:
        lock = parse_node_lock(value)
    except ProtocolError:
        return None
    if lock.namespace is None or lock.name is None:
        return None
    return lock.namespace, lock.name


class Binder:
    """Binds pods; one per extender instance (it holds the per-node in-process mutexes)."""

    def __init__(
        self,
        *,
        api: KubeApi,
        model: ClusterModel,
        config: Config,
        settings: ExtenderSettings,
        telemetry: Telemetry,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        exclusive: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.model = model
        self.config = config
        self.settings = settings
        self.telemetry = telemetry
        self.wall_clock = wall_clock
        self.exclusive = exclusive
        """Whether this replica alone writes allocations now (one replica, or the leader whose
        model has caught up): only then may a bind decide from the model."""
        self.clock = clock
        """Monotonic seconds, as the scheduler's (a reservation's expiry)."""
        self._mutexes: dict[NodeName, asyncio.Lock] = {}
        self._waiting: collections.Counter[NodeName] = collections.Counter()
        self._sessions: dict[NodeName, _Session] = {}
        self._turns = PodTurns()
        self.sweeper = LockSweeper(
            api=api,
            model=model,
            settings=settings,
            telemetry=telemetry,
            busy=self.busy,
            breakable=self.breakable,
            deciding=exclusive,
        )
        """Retries the lock releases that failed and frees stuck locks (its ``run`` is a task)."""

    def busy(self, node: NodeName) -> bool:
        """Whether a bind of this replica holds or waits for ``node``'s lock now."""
        mutex = self._mutexes.get(node)
        return (mutex is not None and mutex.locked()) or self._waiting[node] > 0

    async def bind(self, *, namespace: str, name: str, uid: PodUid, node: NodeName) -> None:
        """Bind ``namespace/name`` to ``node``; raises ``BindRefused`` or ``KubeError``.

        Binds of one pod run one at a time here (``PodTurns``): a second one (kube-scheduler retrying
        after its timeout, unelected kube-schedulers each binding the pod) waits for the first, then
        finds the pod bound or, when the first failed, goes ahead. It never decides while the first
        one's GPUs are in flight, nor replaces what the model counts.

        Waiting for the pod's turn and for the node's lock share one deadline, ``bind_timeout_s``
        from now: the bind is answered before kube-scheduler's ``httpTimeout`` gives up on it."""
        deadline = asyncio.get_running_loop().time() + self.settings.bind_timeout_s
        async with self._turns.turn(uid, self.settings.bind_timeout_s) as turn:
            if not turn:
                raise BindRefused(
                    f"another bind of pod {namespace}/{name} is in flight on this extender for more "
                    f"than {self.settings.bind_timeout_s:g}s; kube-scheduler retries"
                )
            await self._bind(_Target(namespace, name, uid, node), deadline)

    async def _bind(self, target: _Target, deadline: float) -> None:
        namespace, name, uid, node = target
        timeout = self.settings.api_timeout_s
        counted = self.model.contributions.get(uid)
        named = counted is not None and (counted.namespace, counted.name) == (namespace, name)
        bound_to: str | None = None
        if counted is not None and named and counted.in_doubt:
            bound_to = await self._settle(namespace, name, uid)
        elif counted is not None and named and counted.source == "allocated":
            # Bound already (this replica's Binding, or the watch said so): answered from what the
            # model counts, which stays as it is.
            bound_to = counted.node
        if bound_to is not None:
            self.telemetry.metrics.bind_races.inc()
            if bound_to == node:
                return  # a retried bind that already happened
            raise BindRefused(f"pod {namespace}/{name} is already bound to {bound_to}")
        pending = self._watched(namespace, name, uid)
        if pending is not None:
            pod = pending.pod
        else:
            # Not (yet) seen by the watch, or seen under another UID: ask the API.
            try:
                pod = await get_pod(self.api, namespace, name, timeout_s=timeout)
            except NotFound:
                # Its reservation goes with its watch event; the UID of a made-up bind frees nothing.
                raise BindRefused(f"pod {namespace}/{name} no longer exists") from None
        refusal = self._not_ours(pod, uid)
        if refusal is not None:
            if _meta(pod).get("uid") == uid:
                self.model.release(uid)
            raise BindRefused(f"pod {namespace}/{name} {refusal}")
        bound = (pod.get("spec") or {}).get("nodeName")
        if bound:
            if bound == node:
                return  # a retried bind that already happened
            raise BindRefused(f"pod {namespace}/{name} is already bound to {bound}")
        try:
            ask = ask_of(pending, self.config) if pending is not None else build_ask(pod, self.config)
        except ProtocolError as exc:
            self.model.release(uid)
            raise BindRefused(f"pod asks malformed resources: {exc}") from exc
        if not ask.requests.any:
            # It names a GPU resource but asks no GPU (a count of 0): kube-scheduler hands it to us
            # (managedResources), and it takes nothing on the node.
            await create_binding(self.api, namespace, name, uid, node, timeout_s=timeout)
            return
        if self._fast(node):
            self.telemetry.metrics.bind_paths.labels(path="model").inc()
            await self._bind_from_model(target, pod, ask)
        else:
            self.telemetry.metrics.bind_paths.labels(path="locked").inc()
            await self._bind_locked(target, pod, ask, deadline)

    async def _settle(self, namespace: str, name: str, uid: PodUid) -> NodeName | None:
        """An earlier bind of this pod lost its Binding's answer, so it may be bound (the model holds
        its GPUs in doubt, ``ClusterModel.hold_in_doubt``): one read says. Bound, the model takes
        what the pod holds and its node is returned; not bound (or gone), the hold is an ordinary
        reservation again, which this bind takes over or drops, and None is returned."""
        try:
            current: Mapping[str, Any] | None = await get_pod(
                self.api, namespace, name, timeout_s=self.settings.api_timeout_s
            )
        except NotFound:
            current = None
        if (
            current is None
            or _meta(current).get("uid") != uid
            or not (current.get("spec") or {}).get("nodeName")
        ):
            self.model.clear_doubt(uid)
            return None
        self._count_bound(uid, current)
        return NodeName(str(current["spec"]["nodeName"]))

    def _count_bound(self, uid: PodUid, current: Mapping[str, Any]) -> None:
        """The model counts what ``current``, the pod read bound from the API, holds, in place of
        whatever it counted for it."""
        self.model.release(uid, source=None)
        self.model.apply_pod("MODIFIED", current)

    def _watched(self, namespace: str, name: str, uid: PodUid) -> PendingPod | None:
        """The pod as the watch last saw it pending, if that is the pod this bind names."""
        pending = self.model.pending.get(uid)
        if pending is None or (pending.namespace, pending.name) != (namespace, name):
            return None
        return pending

    def releases_after_bind(self, node: NodeName) -> bool:
        """Whether a lock of ours on ``node`` lasts only for the bind: ``release_lock_after_bind``
        and our device plugin serves the node (its last report carries our marker). HAMi's device
        plugin serves the pod its node lock names, so where it serves, the lock is held until its
        Allocate releases it: a lock released at bind lets the next bind re-lock the node, and a
        container of the first pod is then handed the second pod's GPUs."""
        state = self.model.nodes.get(node)
        return self.settings.release_lock_after_bind and state is not None and state.ours

    def _fast(self, node: NodeName) -> bool:
        """Whether this bind may decide from the model alone: this replica is the only one writing
        allocations (``exclusive``), our device plugin serves the node (it needs no lock), and no
        one else holds the node's lock (HAMi's scheduler beside us): docs/extender.md#two-bind-paths."""
        state = self.model.nodes.get(node)
        if state is None or not state.ours or not self.exclusive():
            return False
        value = state.lock_value
        if not value:
            return True
        try:
            lock = parse_node_lock(value)
        except ProtocolError:
            return False  # the locked path breaks it
        return lock_expired(lock, now=self.wall_clock(), timeout=self.settings.lock_expiry)

    async def _bind_from_model(self, target: _Target, pod: Mapping[str, Any], ask: PodAsk) -> None:
        """Decide on the model's node and write one Binding: no lock, no read. Safe because this
        replica alone writes allocations (``exclusive``) and the model counts every bind it made,
        in flight ones included; the decision and ``begin_bind`` run with no await between them."""
        uid = target.uid
        state = self.model.nodes.get(target.node)
        if state is None:
            self.model.release(uid)
            raise BindRefused(f"node {target.node} no longer exists")
        reservation = self.model.contributions.get(uid)
        held = reservation if reservation is not None and reservation.source == "reserved" else None
        preferred = held.devices if held is not None and held.node == target.node else None
        # Its own reservation must not count against it. Quietly: the bind takes those GPUs again at
        # once, and reporting them freed would wake every refused pod for nothing (a node PATCH a
        # second during a burst, docs/extender.md#requeueing-refused-pods).
        self.model.release(uid, quiet=True)
        try:
            devices, mig = self._choose(state, ask, preferred)
            self._within_quota(target, ask, devices)
        except BaseException:
            if held is not None:
                self.model.freed(held.node)  # refused: what it held is free after all
            raise
        if held is not None:
            self.model.freed_unless_kept(held, target.node, devices)
        # No ``hami.io/vgpu-node`` label here: only HAMi's components read it, and they do not
        # serve this node; a second write of every pod was a third of the API cost of a bind.
        await self._write(target, pod, ask, devices, mig, fresh=None, fenced=True)

    async def _bind_locked(
        self, target: _Target, pod: Mapping[str, Any], ask: PodAsk, deadline: float
    ) -> None:
        """HAMi's discipline: take the node lock, rebuild the node from fresh API state, decide
        there and write the Binding under the lock (see the module docstring). The waits for this
        replica's binds on the node and for the lock end at ``deadline`` (the bind's, ``bind``)."""
        namespace, name, uid, node = target
        mutex = self._mutexes.setdefault(node, asyncio.Lock())
        self._waiting[node] += 1
        try:
            async with asyncio.timeout_at(deadline):
                await mutex.acquire()
        except TimeoutError:
            self._waiting[node] -= 1
            self.model.release(uid)
            raise LockTimeout(
                f"node {node} is busy binding other pods; gave up after {self.settings.bind_timeout_s:g}s"
            ) from None
        self._waiting[node] -= 1
        locked = False
        release = False
        written = False
        try:
            continued = await self._continue(self._sessions.pop(node, None), node, namespace, name, uid)
            if continued is None:
                node_obj, displaced = await self._acquire(node, namespace, name, deadline)
                locked = True
                fresh = await self._fresh_model(node_obj, exclude=uid, displaced=displaced)
            else:
                node_obj, fresh = continued
                locked = True
            reservation = self.model.contributions.get(uid)
            preferred = reservation.devices if reservation is not None and reservation.node == node else None
            devices, mig = self._choose(fresh.nodes[node], ask, preferred)
            self._within_quota(target, ask, devices)
            written = await self._write(target, pod, ask, devices, mig, fresh=fresh)
            if self.releases_after_bind(node):
                # Decided before the mutex is released, so the next bind finds the session.
                if self._waiting[node] > 0:
                    self._sessions[node] = _Session(node_obj, fresh, (namespace, name))
                else:
                    release = True
        except BaseException:
            # Its reservation goes; ``_write`` left what the API may hold (an allocation read after
            # a Conflict, a hold in doubt), which ``release`` never drops.
            self.model.release(uid)
            if locked:
                await self._release(node, namespace, name)
                locked = False
            raise
        finally:
            mutex.release()
        if release:
            await self._release(node, namespace, name)
        if written:
            await self._label(namespace, name, uid, node)

    def _within_quota(self, target: _Target, ask: PodAsk, devices: PodDevices) -> None:
        """``BindRefused`` when the namespace's GPU quota no longer admits these devices. Checked
        against this replica's model with no await before ``_write`` records the bind, so binds
        of one namespace count each other (only the leader binds: docs/extender.md#replicas).
        A quota spans nodes, so no node's fresh state can stand in for the model: until a new
        leader's model has every bound pod, a namespace with a quota waits."""
        check = quota_check(self.model, target.namespace, ask, target.uid)
        if check is not None and not self.exclusive():
            raise BindRefused(
                f"{QUOTA_EXCEEDED}: namespace {target.namespace} has a GPU quota and this extender "
                "is still counting the cluster's bound pods (a new leader); kube-scheduler retries"
            )
        why = check(devices) if check is not None else None
        if why is not None:
            raise BindRefused(f"{QUOTA_EXCEEDED}: {why}")

    def _choose(
        self, state: NodeState, ask: PodAsk, preferred: PodDevices | None
    ) -> tuple[PodDevices, tuple[MigAllocation, ...]]:
        """The pod's devices on ``state`` (the filter's when they still fit) and the MIG instances
        of those on dynamic MIG GPUs; ``BindRefused`` when the node cannot take GPU pods or the pod
        no longer fits."""
        if not state.usable(now_epoch()):
            why = state.problem or (
                f"a pod on it has a malformed {keys.DEVICES_ALLOCATED}"
                if state.bad_pods
                else f"no {keys.NODE_REGISTER} annotation"
                if not state.registered
                else "handshake timed out"
            )
            raise BindRefused(f"node {state.name} cannot take GPU pods now: {why}")
        fit = fit_pod(state, ask, preferred=preferred)
        if fit.devices is None:
            raise BindRefused(f"pod no longer fits node {state.name}: {fit.why().text()}")
        mig = plan_allocations(fit.devices, mig_gpus(state)) if state.has_mig else ()
        if mig is None:  # the fit found room for each: only a planner at odds with it gets here
            raise BindRefused(f"pod no longer fits node {state.name}: {CARD_MIG_TOPOLOGY_INFEASIBLE}")
        return fit.devices, mig

    async def _write(
        self,
        target: _Target,
        pod: Mapping[str, Any],
        ask: PodAsk,
        devices: PodDevices,
        mig: tuple[MigAllocation, ...],
        *,
        fresh: ClusterModel | None,
        fenced: bool = False,
    ) -> bool:
        """Record the bind in flight, write the Binding carrying the allocation, then record it as
        made (in ``fresh`` too: the next bind of a lock session counts it). True when this bind
        wrote it, False when another bind of the pod had bound it here. On any failure this bind's
        record in flight goes; what the API says the pod holds stays counted (``release``)."""
        namespace, name, uid, node = target
        encoded = encode_pod_devices(devices, field=keys.DEVICES_ALLOCATED)
        stamp = str(int(self.wall_clock().timestamp()))
        annotations = {
            keys.VGPU_NODE: node,
            keys.VGPU_TIME: stamp,
            keys.DEVICES_TO_ALLOCATE: encoded,
            keys.DEVICES_ALLOCATED: encoded,
            keys.BIND_PHASE: "allocating",
            keys.BIND_TIME: stamp,
        }
        mig_raw = encode_mig_allocations(mig) if mig else None
        if mig_raw is not None:
            annotations[keys.MIG_ALLOCATIONS] = mig_raw

        def record(model: ClusterModel, *, in_flight: bool = False) -> None:
            (model.begin_bind if in_flight else model.allocate)(
                uid=uid,
                namespace=namespace,
                name=name,
                node=node,
                devices=devices,
                n_init=ask.n_init,
                raw=encoded,
                sidecars=ask.sidecars,
                mig=mig,
                mig_raw=mig_raw,
            )

        # In flight: counted by filters meanwhile, whatever the pod's watch events say.
        record(self.model, in_flight=True)
        try:
            twin = await self._create_binding(target, pod, ask, annotations, fenced=fenced)
        except BaseException:
            # Not written by this bind: its own record goes. What the model holds otherwise stays:
            # the pod's allocation when a Conflict showed another bind of it wrote first
            # (``_after_conflict``) or the watch reported it bound meanwhile, and the GPUs of a
            # Binding whose answer was lost (``hold_in_doubt``).
            self.model.release(uid, source="binding")
            raise
        if twin is not None:
            if fresh is not None:
                fresh.apply_pod("MODIFIED", twin)  # the next bind of a session counts it
            return False
        if fresh is not None:
            record(fresh)
        record(self.model)
        return True

    async def _create_binding(
        self,
        target: _Target,
        pod: Mapping[str, Any],
        ask: PodAsk,
        annotations: Mapping[str, str],
        *,
        fenced: bool,
    ) -> dict[str, Any] | None:
        """One write binds the pod and records its allocation, only if the pod is still as read.
        Returns None when written, or the pod as another bind of it wrote it (bound to this node);
        a pod changed in some other way (a label, a status) is re-read and written again when it is
        still the same unbound pod asking the same. ``fenced``: a decision from the model, written
        again only while this replica still alone writes allocations."""
        namespace, name, uid, node = target
        version = str(_meta(pod).get("resourceVersion") or "")
        for attempt in range(_BINDING_ATTEMPTS):
            if attempt and fenced and not self.exclusive():
                raise BindRefused(
                    f"pod {namespace}/{name} not bound: this extender stopped leading meanwhile"
                )
            try:
                await create_binding(
                    self.api,
                    namespace,
                    name,
                    uid,
                    node,
                    annotations=annotations,
                    resource_version=version or None,
                    timeout_s=self.settings.api_timeout_s,
                )
                return None
            except NotFound:
                raise BindRefused(f"pod {namespace}/{name} was deleted while being bound") from None
            except Conflict:
                current = await self._after_conflict(target)
                if (current.get("spec") or {}).get("nodeName"):
                    return current  # bound here by another bind of it (else _after_conflict raised)
                if self._not_ours(current, uid) is not None or self._ask_of(current) != ask:
                    raise BindRefused(
                        f"pod {namespace}/{name} changed while being bound; kube-scheduler retries it"
                    ) from None
                version = str(_meta(current).get("resourceVersion") or "")
            except BaseException as exc:
                if self.exclusive() and not (isinstance(exc, KubeError) and 400 <= exc.status < 500):
                    # No answer (a timeout, a cut connection, this bind cancelled) or the storage's
                    # failure (500, 504: etcd may still commit it): the pod may be bound all the
                    # same, so its GPUs stay counted until the API says. A 4xx wrote nothing. Only
                    # while binds trust this model: otherwise they count fresh API state.
                    expires_at = self.clock() + self.settings.reservation_ttl_s
                    self.model.hold_in_doubt(uid, expires_at=expires_at)
                raise
        raise BindRefused(f"pod {namespace}/{name} kept changing while being bound; kube-scheduler retries")

    # -- the node lock ---------------------------------------------------------------------------

    async def _continue(
        self, session: _Session | None, node: NodeName, namespace: str, name: str, pod_uid: PodUid
    ) -> tuple[dict[str, Any], ClusterModel] | None:
        """Take over a session's lock for this pod: (node as written, fresh state), or None when
        there is no session or its lock was lost (then the full path runs)."""
        if session is None:
            return None
        timeout = self.settings.api_timeout_s
        node_obj, owner = session.node_obj, session.owner
        fresh: ClusterModel | None = session.fresh
        try:
            for _ in range(5):
                mine = format_node_lock(NodeLock(self.wall_clock().replace(microsecond=0), namespace, name))
                try:
                    written = await patch_node_annotations(
                        self.api,
                        node,
                        {keys.NODE_LOCK: mine},
                        resource_version=str(_meta(node_obj).get("resourceVersion")),
                        timeout_s=timeout,
                    )
                except Conflict:
                    # The node changed since we wrote it (a heartbeat, the device plugin): still ours?
                    try:
                        node_obj = await get_node(self.api, node, timeout_s=timeout)
                    except NotFound:
                        return None
                    value = (_meta(node_obj).get("annotations") or {}).get(keys.NODE_LOCK) or ""
                    try:
                        held = parse_node_lock(value)
                    except ProtocolError:
                        return None
                    if not owned_by(held, namespace=owner[0], name=owner[1]):
                        return None  # broken by someone: the full path decides
                    fresh = None  # re-read below: the node may have changed
                    continue
                if fresh is None:
                    fresh = await self._fresh_model(written, exclude=pod_uid)
                return written, fresh
        except BaseException:
            # The lock is ours, named after the previous pod or already after this one: free it.
            await self._release(node, namespace, name)
            await self._release(node, *owner)
            raise
        # Every hand-over lost a race: the lock still names the previous pod, which the full path
        # would wait for as another pod's (it is bound, not served). Free it first.
        await self._release(node, *owner)
        return None

    async def _acquire(
        self, node: NodeName, namespace: str, name: str, deadline: float
    ) -> tuple[dict[str, Any], tuple[str, str] | None]:
        """Take the node lock: (the node as written, the pod whose lock was broken, if one was)."""
        loop = asyncio.get_running_loop()
        timeout = self.settings.api_timeout_s
        delay = _FIRST_DELAY_S
        waited = False
        while True:
            try:
                obj = await get_node(self.api, node, timeout_s=timeout)
            except NotFound:
                raise BindRefused(f"node {node} no longer exists") from None
            meta = _meta(obj)
            value = (meta.get("annotations") or {}).get(keys.NODE_LOCK)
            verdict = await self.breakable(value, namespace, name, node) if value else None
            if verdict is not None and verdict.kind == "mine":
                self.sweeper.forget(node)  # the lock is this bind's now, not one we owe
                return obj, None
            if verdict is None or verdict.breaks:
                mine = format_node_lock(NodeLock(self.wall_clock().replace(microsecond=0), namespace, name))
                try:
                    obj = await patch_node_annotations(
                        self.api,
                        node,
                        {keys.NODE_LOCK: mine},
                        resource_version=str(meta.get("resourceVersion")),
                        timeout_s=timeout,
                    )
                except Conflict:
                    continue  # someone wrote the node first: look again
                self.sweeper.forget(node)  # the lock is this bind's now, not one we owe
                if verdict is not None:
                    reason = verdict.kind
                    self.telemetry.metrics.lock_breaks.labels(reason=reason).inc()
                    self.telemetry.logger.info("node lock broken", node=node, lock=value, reason=reason)
                    return obj, _lock_owner(str(value))
                return obj, None
            holder = verdict.holder  # held: wait for it
            stuck = self._stuck_since(str(value))
            if stuck is not None:
                # Held longer than any bind waits: waiting would end in the same timeout. The filter
                # passes such a node over; the lock sweep frees it once its owner is done.
                raise LockTimeout(f"node {node} has been locked by {holder} since {stuck}")
            if not waited:
                waited = True
                self.telemetry.metrics.lock_waits.inc()
            if loop.time() + delay >= deadline:
                raise LockTimeout(
                    f"node {node} stayed locked by {holder} for {self.settings.bind_timeout_s:g}s"
                )
            await asyncio.sleep(delay * (0.5 + random.random()))  # backoff, jittered across binders
            delay = min(delay * 2, _MAX_DELAY_S)

    def _stuck_since(self, value: str) -> str | None:
        """The lock's time when it has been held longer than a bind waits (and not expired)."""
        try:
            lock = parse_node_lock(value)
        except ProtocolError:
            return None
        return lock.time.isoformat() if self._held_too_long(lock) else None

    def _held_too_long(self, lock: NodeLock) -> bool:
        """Held longer than a bind waits for it, and not expired (``lock_held_too_long``)."""
        after, expiry = self.settings.bind_timeout_s, self.settings.lock_expiry.total_seconds()
        return lock_held_too_long(lock, self.wall_clock().timestamp(), after_s=after, expiry_s=expiry)

    async def breakable(self, value: str, namespace: str, name: str, node: NodeName) -> LockVerdict:
        """The verdict on the lock value on ``node`` for a bind of ``namespace/name``."""
        try:
            lock = parse_node_lock(value)
        except ProtocolError:
            return LockVerdict("malformed", value)
        if owned_by(lock, namespace=namespace, name=name):
            return LockVerdict("mine", value)
        holder = f"{lock.namespace}/{lock.name}" if lock.namespace else f"a lock taken at {value}"
        if lock_expired(lock, now=self.wall_clock(), timeout=self.settings.lock_expiry):
            return LockVerdict("expired", holder)
        if lock.namespace is None or lock.name is None:
            return LockVerdict("held", holder)
        try:
            owner = await get_pod(self.api, lock.namespace, lock.name, timeout_s=self.settings.api_timeout_s)
        except NotFound:
            return LockVerdict("owner-gone", holder)
        if pod_leaving(owner):
            return LockVerdict("owner-gone", holder)
        if (_meta(owner).get("annotations") or {}).get(keys.BIND_PHASE) in _DONE_PHASES:
            return LockVerdict("owner-done", holder)
        if self._bound_and_left(lock, owner, node):
            return LockVerdict("owner-bound", holder)
        return LockVerdict("held", holder)

    def _bound_and_left(self, lock: NodeLock, owner: Mapping[str, Any], node: NodeName) -> bool:
        """Whether the lock outlived its bind, held longer than a bind waits: its owner is bound
        and locks on ``node`` last only for the bind (``releases_after_bind``: a binder killed
        between its Binding and its release leaves this; a lock session re-stamps the lock for
        each pod, so a live one never looks so old), or its owner is bound to another node (no
        device plugin here will serve it). An owner bound here on a node HAMi's device plugin
        serves keeps the lock until that plugin's Allocate releases it."""
        bound = (owner.get("spec") or {}).get("nodeName")
        if not bound or (bound == node and not self.releases_after_bind(node)):
            return False
        return self._held_too_long(lock)

    async def _release(self, node: NodeName, namespace: str, name: str) -> None:
        """Remove our lock, if it is still ours; best effort (an expired lock is broken anyway)."""
        try:
            outcome = await release_node_lock(
                self.api, node, namespace=namespace, name=name, timeout_s=self.settings.api_timeout_s
            )
        except KubeError as exc:
            self.telemetry.logger.warning("node lock not released; retrying", node=node, error=str(exc))
            self.sweeper.owe(node, namespace, name)
            return
        if outcome == "contended":
            self.telemetry.logger.warning(
                "node lock not released; retrying", node=node, error="every attempt lost a write race"
            )
            self.sweeper.owe(node, namespace, name)

    # -- fresh state -----------------------------------------------------------------------------

    async def _fresh_model(
        self, node_obj: Mapping[str, Any], *, exclude: PodUid, displaced: tuple[str, str] | None = None
    ) -> ClusterModel:
        """A model of just this node, from the Node and every pod bound to it; and ``displaced``,
        the holder of a lock we broke, if it is annotated and labelled for this node but not bound
        (a bind that may still create its Binding)."""
        node = NodeName(str(_meta(node_obj).get("name")))
        timeout = self.settings.api_timeout_s
        queries: list[list[tuple[str, str]]] = [node_pods_query(node)]
        if displaced is not None and len(node) <= _LABEL_MAX:
            queries.append([("labelSelector", f"{keys.VGPU_NODE_LABEL}={node}")])
        results = await asyncio.gather(
            *(list_all(self.api, pod_path(), query=q, timeout_s=timeout) for q in queries)
        )
        fresh = ClusterModel(count_resource=self.model.count_resource)
        fresh.apply_node("ADDED", node_obj)
        seen: set[str] = {exclude}
        for pods, _ in results:
            for pod in pods:
                meta = _meta(pod)
                uid = str(meta.get("uid", ""))
                if uid in seen:
                    continue
                seen.add(uid)
                spec = pod.get("spec") or {}
                if (
                    not spec.get("nodeName")
                    and (meta.get("namespace"), meta.get("name")) == displaced
                    and (meta.get("annotations") or {}).get(keys.VGPU_NODE) == node
                ):
                    pod = {**pod, "spec": {**spec, "nodeName": node}}  # counted as if bound
                fresh.apply_pod("ADDED", pod)
        # Other nodes registering the same GPUs: the whole cluster's model knows them.
        self.model.claims.overlay(fresh.nodes[node])
        return fresh

    def _not_ours(self, pod: Mapping[str, Any], uid: PodUid) -> str | None:
        """Why ``/bind`` refuses this pod (the end of a sentence naming it), None when it may bind:
        the bind's UID, our schedulerName and a GPU resource of ours named by some container."""
        actual = _meta(pod).get("uid")
        if not uid:
            return "cannot be bound without its PodUID"
        if actual != uid:
            return f"was replaced (uid {actual}, not {uid})"
        scheduler = (pod.get("spec") or {}).get("schedulerName")
        if scheduler != self.config.scheduler_name:
            return f"is not for {self.config.scheduler_name} (schedulerName {scheduler})"
        if not requests_any_gpu(pod, self.config.nvidia.resource_names):
            return "asks for no GPU resource this extender manages"
        return None

    def _ask_of(self, pod: Mapping[str, Any]) -> PodAsk | None:
        try:
            return build_ask(pod, self.config)
        except ProtocolError:
            return None

    async def _after_conflict(self, target: _Target) -> dict[str, Any]:
        """Our Binding met a Conflict: the pod changed since it was read. Returns it when it is
        still unbound (the caller may write again) or bound to our node by another bind of it (a
        retry after kube-scheduler's timeout, a leader hand-over: the bind asked for has happened,
        and the pod is left exactly as that bind wrote it). Raises ``BindRefused`` when it is gone
        or replaced, or when another bind bound it elsewhere. Once bound, the model takes what the
        pod really holds."""
        namespace, name, uid, node = target
        try:
            current = await get_pod(self.api, namespace, name, timeout_s=self.settings.api_timeout_s)
        except NotFound:
            raise BindRefused(f"pod {namespace}/{name} was deleted while being bound") from None
        if _meta(current).get("uid") != uid:
            raise BindRefused(f"pod {namespace}/{name} was replaced while being bound")
        bound = (current.get("spec") or {}).get("nodeName")
        if not bound:
            return current
        self._count_bound(uid, current)
        self.telemetry.metrics.bind_races.inc()
        if bound != node:
            raise BindRefused(f"pod {namespace}/{name} was bound to {bound} by another bind meanwhile")
        self.telemetry.logger.info(
            "pod bound by another bind of it", namespace=namespace, pod=name, node=node
        )
        return current

    async def _label(self, namespace: str, name: str, uid: PodUid, node: NodeName) -> None:
        """The ``hami.io/vgpu-node`` label HAMi's monitor selects on (a Binding sets annotations
        only), where HAMi's components serve the node. Best effort, after the bind: nothing here
        depends on it."""
        state = self.model.nodes.get(node)
        if len(node) > _LABEL_MAX or (state is not None and state.ours):
            return
        body = {"metadata": {"uid": uid, "labels": {keys.VGPU_NODE_LABEL: node}}}
        try:
            await patch_pod(self.api, namespace, name, body, timeout_s=self.settings.api_timeout_s)
        except KubeError as exc:
            self.telemetry.logger.warning(
                "vgpu-node label not set", namespace=namespace, pod=name, error=str(exc)
            )
