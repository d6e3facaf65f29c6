"""The extender verbs over decoded arguments (``hamipy.extender.extender_args``): ExtenderArgs in,
ExtenderFilterResult out (and the same for prioritize, preempt and bind), with reservations,
metrics, Events and spans around the pure decision.

``filter`` and ``prioritize`` are synchronous and make no API call: they read and update the model
only. Events are queued (``hamipy.kube.events.EventRecorder``), never awaited here.

Anyone who can reach ``/filter`` can send any ExtenderArgs, so a filter reserves only for a pod the
pod watch has seen pending for our scheduler, and reads that pod's asks from the watched object,
not from the caller's copy (``_watched``). A filter of a pod our watch has not delivered yet first
waits for the watch (``hamipy.extender.pod_arrivals``, before ``filter`` is called); one the watch
still does not hold is answered as usual but reserves nothing (its bind re-checks the node, so that
costs at worst a bind refused and retried, never an over-full GPU).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Literal

from opentelemetry import trace

from hamipy.extender.binding import Binder
from hamipy.extender.errors import BadRequest, BindRefused
from hamipy.extender.eviction import Evictor
from hamipy.extender.explanations import Explanations
from hamipy.extender.extender_args import ExtenderArgs, ExtenderBindingArgs, ExtenderPreemptionArgs
from hamipy.extender.filtering import (
    Decision,
    LockRule,
    ask_of,
    build_ask,
    decide,
    quota_check,
    summarize,
)
from hamipy.extender.fitting import NodeReasons, PodAsk
from hamipy.extender.loop_turns import OnePerTurn
from hamipy.extender.model import ClusterModel, Nomination, PendingPod, now_epoch
from hamipy.extender.preemption import PREEMPTING, Plan, choose_plan, plan_node, preemptor_of
from hamipy.extender.scoring import prioritize_score
from hamipy.extender.settings import ExtenderSettings
from hamipy.extender.telemetry import Telemetry
from hamipy.kube.errors import KubeError
from hamipy.kube.events import EventRecorder, involved_pod
from hamipy.protocol import keys
from hamipy.protocol.config import Config
from hamipy.protocol.devices import PodDevices
from hamipy.protocol.errors import ProtocolError
from hamipy.protocol.identifiers import NodeName, PodUid
from hamipy.protocol.kube_objects import Node, plain
from hamipy.telemetry import pod_trace_context, traceparent_context

__all__ = ["Scheduler"]

FILTERING_SUCCEED: Final = "FilteringSucceed"
FILTERING_FAILED: Final = "FilteringFailed"
BINDING_FAILED: Final = "BindingFailed"
INVALID_REQUEST: Final = "InvalidRequest"
UNKNOWN_POD: Final = "UnknownPod"
"""The filter's metric reason for a fit that reserved nothing: the pod is not one the watch has
seen pending for our scheduler."""
# Pods filtered but not (yet) bound whose trace context is remembered; oldest dropped beyond it.
_MAX_TRACEPARENTS: Final = 10_000


@dataclasses.dataclass(frozen=True, slots=True)
class _Filtered:
    """A filter's decision: the ExtenderFilterResult, its outcome, a short reason (a metric label)
    and the detail a user reads (the Event's message, the span's status)."""

    answer: dict[str, Any]
    outcome: Literal["fit", "failed", "passthrough"]
    reason: str
    detail: str


def _node_names(args: ExtenderArgs) -> tuple[list[NodeName], list[Node] | None]:
    """The candidate names, and the node objects when the scheduler sent them (not cache-capable)."""
    if args.node_names is not None:
        return args.node_names, None
    items = args.nodes.items if args.nodes is not None else None
    if items is None:
        return [], None
    return [NodeName(n.metadata.name or "") for n in items], items


def _meta_victims(uids: Sequence[str], violations: int) -> dict[str, Any]:
    return {"Pods": [{"UID": u} for u in uids], "NumPDBViolations": violations}


class Scheduler:
    """One extender's decisions: ``filter``, ``prioritize``, ``bind``."""

    def __init__(
        self,
        *,
        model: ClusterModel,
        config: Config,
        settings: ExtenderSettings,
        telemetry: Telemetry,
        events: EventRecorder,
        binder: Binder | None,
        evictor: Evictor | None = None,
        on_refused: Callable[[PodUid], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self.config = config
        self.settings = settings
        self.telemetry = telemetry
        self.events = events
        self.binder = binder
        self.evictor = evictor
        """Carries out preemptions (None: this extender preempts nothing)."""
        self.on_refused = on_refused
        """Told of each watched pod no node fits (``hamipy.extender.requeue.Requeuer.refused``)."""
        self.clock = clock
        self._traceparents: dict[PodUid, str] = {}
        self.explanations = Explanations()
        """Nodes explained for pods that fit nowhere, reused while unchanged (``explanations``)."""
        self.bind_answers = OnePerTurn()
        """Binds whose Binding came back wait here to answer, one a loop turn (``loop_turns``)."""
        # Per pending pod: its last failure's detail and how many identical ones followed it.
        self._last_failure: dict[PodUid, tuple[str, int]] = {}

    # -- filter ----------------------------------------------------------------------------------

    def filter(self, args: ExtenderArgs) -> dict[str, Any]:
        """ExtenderArgs -> ExtenderFilterResult."""
        started, started_ns = time.perf_counter(), time.time_ns()
        names, items = _node_names(args)
        uid = PodUid(args.pod.metadata.uid or "")
        watched = self._watched(uid)
        held = None
        # The watched pod's asks as the API server has them, not as the caller says.
        pod = watched.pod if watched is not None else plain(args.pod)
        if watched is not None:
            current = self.model.contributions.get(uid)
            held = current if current is not None and current.source == "reserved" else None
        try:
            filtered = self._filter(pod, watched, names, items)
        finally:
            # Set aside quietly by ``_filter``. A reservation that expired meanwhile was reported by
            # ``expire`` too: a second nudge costs little, a lost one leaves refused pods waiting.
            if held is not None and (now := self.model.contributions.get(uid)) is not held:
                kept = (now.node, now.devices) if now is not None else (None, None)
                self.model.freed_unless_kept(held, *kept)
        outcome = filtered.outcome
        self._trace_filter(pod, started_ns, nodes=len(names), outcome=outcome, detail=filtered.detail)
        metrics = self.telemetry.metrics
        metrics.filter_seconds.labels(result=outcome).observe(time.perf_counter() - started)
        metrics.decisions.labels(verb="filter", result=outcome, reason=filtered.reason).inc()
        return filtered.answer

    def _trace_filter(
        self, pod: Mapping[str, Any], started_ns: int, *, nodes: int, outcome: str, detail: str
    ) -> None:
        """The filter's span, made once the decision is known: a pending pod is filtered again on
        every retry, so a failure identical to the pod's previous one adds no span (the next span
        that does carries ``hamipy.filter.repeats``, how many it stands for)."""
        meta = pod["metadata"]
        uid = PodUid(str(meta.get("uid", "")))
        last = self._last_failure.pop(uid, None)
        if outcome == "failed":
            if last is not None and last[0] == detail:
                self._last_failure[uid] = (detail, last[1] + 1)
                return
            if len(self._last_failure) >= _MAX_TRACEPARENTS:
                self._last_failure.pop(next(iter(self._last_failure)))
            self._last_failure[uid] = (detail, 0)
        span = self.telemetry.tracer.start_span(
            "extender.filter",
            context=pod_trace_context(pod),
            start_time=started_ns,
            attributes={
                "k8s.pod.name": str(meta.get("name", "")),
                "k8s.namespace.name": str(meta.get("namespace", "")),
                "k8s.pod.uid": uid,
                "hamipy.nodes": nodes,
                "hamipy.outcome": outcome,
                "hamipy.filter.repeats": last[1] if last is not None else 0,
            },
        )
        if outcome == "failed":
            span.set_status(trace.StatusCode.ERROR, detail)
        span.end()

    def _filter(
        self,
        pod: Mapping[str, Any],
        watched: PendingPod | None,
        names: list[NodeName],
        items: list[Node] | None,
    ) -> _Filtered:
        """The filter's decision; ``pod`` is ``watched``'s when there is one."""
        uid = PodUid(str(pod["metadata"].get("uid", "")))
        meta = pod["metadata"]
        involved = involved_pod(pod)
        traceparent = (meta.get("annotations") or {}).get(keys.TRACE_CONTEXT)
        if traceparent is not None:
            if len(self._traceparents) >= _MAX_TRACEPARENTS:
                self._traceparents.pop(next(iter(self._traceparents)))
            self._traceparents[uid] = traceparent
        if items is not None:
            # Not cache-capable: the objects sent are authoritative for nodes we have not seen yet.
            for item in items:
                if (item.metadata.name or "") not in self.model.nodes:
                    self.model.apply_node("ADDED", plain(item))
        try:
            ask = ask_of(watched, self.config) if watched is not None else build_ask(pod, self.config)
        except ProtocolError as exc:
            invalid = NodeReasons.of_node(INVALID_REQUEST, str(exc))
            self.events.emit(involved, FILTERING_FAILED, invalid.text(), warning=True)
            result = self._result(names, items, [], {}, dict.fromkeys(names, invalid))
            return _Filtered(result, "failed", INVALID_REQUEST, invalid.text())
        if not ask.requests.any:
            return _Filtered(self._result(names, items, names, {}, {}), "passthrough", "NoGPURequest", "")
        now_mono = self.clock()
        self.model.expire(now_mono)
        if watched is not None:
            # Being (re)scheduled: its previous reservation is replaced by this decision (not a hold
            # in doubt: its Binding may have placed the pod, ``ClusterModel.hold_in_doubt``). Quietly:
            # a pod retried while it waits usually takes the same GPUs again, and reporting them
            # freed woke every refused pod for nothing (``filter`` reports them when it does not).
            self.model.release(uid, quiet=True)
        locks = LockRule(
            pod=(str(meta.get("namespace", "")), str(meta.get("name", ""))),
            after_s=self.settings.bind_timeout_s,
            expiry_s=self.settings.lock_expiry.total_seconds(),
        )
        decision: Decision = decide(
            self.model,
            ask,
            names,
            now=now_epoch(),
            all_feasible=self.settings.cooperative,
            locks=locks,
            quota=quota_check(self.model, str(meta.get("namespace", "")), ask, uid),
            explained=self.explanations,
        )
        if self.settings.cooperative and decision.feasible:
            chosen = [name for name, _, _ in decision.feasible]
            result = self._result(names, items, chosen, decision.failed, decision.unresolvable)
            return _Filtered(result, "fit", "Fit", f"{len(chosen)} nodes fit")
        if decision.node is not None and decision.devices is not None:
            reason = "Fit"
            if watched is None:
                reason = UNKNOWN_POD
            elif uid not in self.model.contributions:  # a bind of ours in flight is left alone
                expires_at = now_mono + self.settings.reservation_ttl_s
                self._hold(watched, uid, ask, decision.node, decision.devices, expires_at)
            self.model.nominations.pop(uid, None)  # fits now: a preemption for it is over
            chose = f"chose node {decision.node} among {len(names)} ({decision.fitted} fitted)"
            if self.settings.success_events:
                self.events.emit(involved, FILTERING_SUCCEED, chose)
            result = self._result(names, items, [decision.node], decision.failed, decision.unresolvable)
            return _Filtered(result, "fit", reason, chose)
        failed = dict(decision.failed)
        # A pod whose Binding is in doubt may be running already: nothing is evicted for it.
        preempting = None
        if watched is not None and not self.model.in_doubt(uid):
            preempting = self._preempt(watched, uid, ask, names, now_mono)
        if preempting is not None:
            failed[preempting[0]] = NodeReasons.of_node(PREEMPTING, preempting[1])
        if watched is not None and self.on_refused is not None:
            self.on_refused(uid)
        summary = summarize(failed, decision.unresolvable)
        message = f"no node fits the pod's GPU request: {summary.text()}"
        self.events.emit(involved, FILTERING_FAILED, message, warning=True)
        result = self._result(names, items, [], failed, decision.unresolvable)
        return _Filtered(result, "failed", PREEMPTING if preempting else summary.top_cause(), message)

    def _preempt(
        self, watched: PendingPod, uid: PodUid, ask: PodAsk, names: list[NodeName], now_mono: float
    ) -> tuple[NodeName, str] | None:
        """For a pod that fits nowhere: hold on to a preemption under way for it, or plan one and
        start it (docs/extender.md#preemption). The node and the reason text to show there; None
        when there is none."""
        if self.evictor is None:
            return None
        nomination = self.model.nominations.get(uid)
        if nomination is not None and nomination.expires_at > now_mono:
            # Its victims are still stopping: keep its GPUs held, as planned.
            self._hold(watched, uid, ask, nomination.node, nomination.devices, nomination.expires_at)
            left = [v for v in nomination.victims if v in self.model.contributions]
            return nomination.node, f"waiting for {len(left)} preempted pod(s) to stop"
        self.model.nominations.pop(uid, None)
        preemptor = preemptor_of(uid, watched.pod, ask)
        if preemptor is None:
            return None
        now = now_epoch()
        plans: list[Plan] = []
        for name in names:
            state = self.model.nodes.get(name)
            if state is not None and state.usable(now):
                plan = plan_node(self.model, state, preemptor)
                if plan is not None:
                    plans.append(plan)
        plan = choose_plan(plans)
        if plan is None or not plan.victims:
            return None  # nowhere, or pods already stopping make room: it waits for them
        grace = max(self.model.facts[v.uid].grace_s for v in plan.victims)
        expires_at = now_mono + grace + self.settings.preemption_wait_s
        self._hold(watched, uid, ask, plan.node, plan.devices, expires_at)
        self.model.nominations[uid] = Nomination(
            plan.node, plan.devices, tuple(v.uid for v in plan.victims), expires_at
        )
        self.evictor.start(preemptor, plan)
        victims = ", ".join(f"{v.namespace}/{v.name}" for v in plan.victims)
        return plan.node, f"preempting {victims} (lower priority) to free its GPUs for this pod"

    def _hold(
        self,
        watched: PendingPod,
        uid: PodUid,
        ask: PodAsk,
        node: NodeName,
        devices: PodDevices,
        expires_at: float,
    ) -> None:
        """Reserve ``devices`` on ``node`` for the pod until ``expires_at`` (monotonic)."""
        self.model.reserve(
            uid=uid,
            namespace=watched.namespace,
            name=watched.name,
            node=node,
            devices=devices,
            n_init=ask.n_init,
            expires_at=expires_at,
            sidecars=ask.sidecars,
        )

    def _watched(self, uid: PodUid) -> PendingPod | None:
        """The pod of this UID as the watch has it, when it is pending for our scheduler: the only
        pods a filter reserves for."""
        pending = self.model.pending.get(uid)
        if pending is None or pending.scheduler_name != self.config.scheduler_name:
            return None
        return pending

    @staticmethod
    def _result(
        names: list[NodeName],
        items: list[Node] | None,
        chosen: Sequence[NodeName],
        failed: Mapping[NodeName, NodeReasons],
        unresolvable: Mapping[NodeName, NodeReasons],
    ) -> dict[str, Any]:
        """The ExtenderFilterResult; the one place node reasons become the text kube-scheduler shows."""
        result: dict[str, Any] = {
            "FailedNodes": {name: reasons.text() for name, reasons in failed.items()},
            "FailedAndUnresolvableNodes": {name: reasons.text() for name, reasons in unresolvable.items()},
            "Error": "",
        }
        if items is not None:
            keep = set(chosen)
            result["Nodes"] = {"items": [n for n in items if (n.metadata.name or "") in keep]}
            result["NodeNames"] = None
        else:
            result["NodeNames"] = chosen
            result["Nodes"] = None
        return result

    # -- prioritize ------------------------------------------------------------------------------

    def prioritize(self, args: ExtenderArgs) -> list[dict[str, Any]]:
        """ExtenderArgs -> HostPriorityList (0-10 from the node policy)."""
        started = time.perf_counter()
        names, _ = _node_names(args)
        try:
            policy = build_ask(plain(args.pod), self.config).node_policy
        except ProtocolError:
            policy = self.config.node_scheduler_policy
        out = []
        for name in names:
            node = self.model.nodes.get(name)
            score = prioritize_score(node.score, policy) if node is not None else 0
            out.append({"Host": name, "Score": score})
        self.telemetry.metrics.filter_seconds.labels(result="prioritize").observe(
            time.perf_counter() - started
        )
        return out

    # -- preempt ---------------------------------------------------------------------------------

    def preempt(self, args: ExtenderPreemptionArgs) -> dict[str, Any]:
        """ExtenderPreemptionArgs -> ExtenderPreemptionResult (kube-scheduler's ``preemptVerb``).

        kube-scheduler proposes victims per node for its own resources; for a GPU pod of ours each
        node's set becomes those plus the fewest lower-priority GPU pods whose removal lets the pod
        fit a GPU (``plan_node``); a node where it cannot is dropped. Answered by UID
        (``MetaVictims``), as to a ``nodeCacheCapable`` extender. A pod the filter is preempting
        for already gets no nodes: its victims are being evicted."""
        uid = PodUid(args.pod.metadata.uid or "")
        proposed = args.proposed()
        watched = self._watched(uid)
        try:
            ask = (
                ask_of(watched, self.config)
                if watched is not None
                else build_ask(plain(args.pod), self.config)
            )
        except ProtocolError as exc:
            raise BadRequest(f"the pod's GPU request is malformed: {exc}") from None
        preemptor = preemptor_of(uid, watched.pod, ask) if watched is not None else None
        out: dict[str, Any] = {}
        if not ask.requests.any:  # not a GPU pod: kube-scheduler's choice stands
            out = {
                node: _meta_victims(victims.uids(), victims.violations) for node, victims in proposed.items()
            }
        elif preemptor is not None and uid not in self.model.nominations:
            now = now_epoch()
            for node, victims in proposed.items():
                state = self.model.nodes.get(node)
                if state is None or not state.usable(now):
                    continue
                plan = plan_node(self.model, state, preemptor, required=victims.uids())
                if plan is not None:
                    chosen = [*(v.uid for v in plan.victims), *plan.others]
                    out[node] = _meta_victims(chosen, victims.violations + plan.pdb_violations)
        result = "candidates" if out else "none"
        decisions = self.telemetry.metrics.decisions
        decisions.labels(verb="preempt", result=result, reason="ProcessPreemption").inc()
        return {"NodeNameToMetaVictims": out}

    # -- bind ------------------------------------------------------------------------------------

    async def bind(self, args: ExtenderBindingArgs) -> dict[str, Any]:
        """ExtenderBindingArgs -> ExtenderBindingResult."""
        namespace, name, uid, node = args.pod_namespace, args.pod_name, args.pod_uid, args.node
        if self.binder is None:
            return {"Error": "this extender has no API access to bind with"}
        started = time.perf_counter()
        involved = {"kind": "Pod", "name": name, "namespace": namespace, "uid": uid}
        # Bind gets no Pod: its trace context is the one the filter read, remembered per pod UID.
        with self.telemetry.tracer.start_as_current_span(
            "extender.bind", context=traceparent_context(self._traceparents.pop(uid, None))
        ) as span:
            span.set_attribute("k8s.pod.name", name)
            span.set_attribute("k8s.namespace.name", namespace)
            span.set_attribute("k8s.pod.uid", uid)
            span.set_attribute("k8s.node.name", node)
            error, outcome = "", "bound"
            try:
                await self.binder.bind(namespace=namespace, name=name, uid=uid, node=node)
            except BindRefused as exc:
                error, outcome = exc.reason, "refused"
            except KubeError as exc:
                error, outcome = f"API error while binding to {node}: {exc}", "error"
            # The model holds the outcome already. The rest (log line, metrics, the answer) waits
            # its turn: the apiserver answers binds in bursts, and filters must not queue behind one.
            await self.bind_answers.turn()
            # Inside the span, so the lines carry its trace and span ids.
            if error:
                span.set_status(trace.StatusCode.ERROR, error)
                self.telemetry.logger.warning(
                    "bind failed", namespace=namespace, pod=name, uid=uid, node=node, error=error
                )
            else:
                self.telemetry.logger.info("bound", namespace=namespace, pod=name, uid=uid, node=node)
        self.telemetry.metrics.bind_seconds.labels(result=outcome).observe(time.perf_counter() - started)
        self.telemetry.metrics.decisions.labels(verb="bind", result=outcome, reason=outcome).inc()
        if error:
            self.events.emit(involved, BINDING_FAILED, error, warning=True)
        return {"Error": error}
