"""The operator's controller: one object holding what the operator knows and does.

A :class:`Controller` is constructed once per process with its API client and handed to
kopf's handlers (:mod:`dlo_operator.kopf_handlers`), which only translate kopf's calls
into its methods. Every trigger runs the same idempotent pass over one deployment:

- read the deployment, its Pods and its other children from kopf's watch-fed indexes
  (no LIST per pass; :mod:`dlo_operator.expectations` covers what the watch has not shown
  yet), and its status from what this controller last wrote;
- call :func:`dlo_operator.reconcile.reconcile` (pure: desired against observed);
- apply (server-side, one field manager), create and delete what it says (409/404 on
  Pods are success: another pass did it),
  patch the status, and post the Events whose actions took effect
  (:mod:`dlo_operator.events`).

Passes over one deployment run one at a time (:mod:`dlo_operator.coalesce`). Child events
only queue the deployment (:mod:`dlo_operator.workqueue`): a burst of them costs one pass.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from kubernetes import client
from pydantic import ValidationError

from dlo_operator import metrics
from dlo_operator.api import (
    GROUP,
    PLURAL,
    VERSION,
    DiffusionDeploymentSpec,
    DiffusionDeploymentStatus,
)
from dlo_operator.apicalls import APPLY, write
from dlo_operator.coalesce import Coalescer
from dlo_operator.events import post_event
from dlo_operator.expectations import PodExpectations
from dlo_operator.failures import MOUNT_REPORT_AFTER_S, mount_problem, parse_time
from dlo_operator.reconcile import (
    Actions,
    ApplyFailure,
    Event,
    ObservedChild,
    ObservedPod,
    deletion_order,
    invalid_spec_conditions,
    reconcile,
    report_apply_failures,
)
from dlo_operator.render import GPU_RESOURCE, LABEL_DEPLOYMENT, Owner
from dlo_operator.warming import ObservedJob, ObservedNode, warming_enabled
from dlo_operator.workqueue import WorkQueue, start_workers

logger = logging.getLogger(__name__)

TIMER_INTERVAL_S = 10.0
"""How often each deployment's timer asks whether a pass is due."""
RESYNC_S = 300.0
"""A full pass at least this often without any event (drift the watches did not see)."""
QUEUE_WORKERS = 4
"""Threads running queued passes: each pass waits on a handful of API calls, so a few
in flight keep the API server, not the operator, the limit."""
MOUNT_RECHECK_S = 30.0
"""How often a deployment's stuck Pods have their Events read again."""


class DeploymentKey(NamedTuple):
    """A DiffusionDeployment's identity everywhere in the controller (and in the queue)."""

    namespace: str
    name: str


@dataclass(frozen=True)
class ChildKind:
    """How the operator reaches one kind of child besides Pods."""

    api_class: type
    suffix: str
    """Of the API class's methods: ``patch_{suffix}`` (server-side apply), ``delete_...``."""
    resource: tuple[str, str, str]
    """Group, version and plural, for the watch."""
    index: str
    """The kopf index of these children, keyed by (namespace, deployment)."""


CHILD_KINDS = {
    "Service": ChildKind(
        client.CoreV1Api, "namespaced_service", ("", "v1", "services"), "deployment_services"
    ),
    "PodDisruptionBudget": ChildKind(
        client.PolicyV1Api,
        "namespaced_pod_disruption_budget",
        ("policy", "v1", "poddisruptionbudgets"),
        "deployment_budgets",
    ),
    "NetworkPolicy": ChildKind(
        client.NetworkingV1Api,
        "namespaced_network_policy",
        ("networking.k8s.io", "v1", "networkpolicies"),
        "deployment_policies",
    ),
    "Job": ChildKind(
        client.BatchV1Api, "namespaced_job", ("batch", "v1", "jobs"), "deployment_jobs"
    ),
}
POD_INDEX = "deployment_pods"
DEPLOYMENT_INDEX = "deployments"
INDEXES = (DEPLOYMENT_INDEX, POD_INDEX, *(kind.index for kind in CHILD_KINDS.values()))


@dataclass(frozen=True)
class LastPass:
    at: float
    """``time.monotonic()`` when it ended."""
    refused: bool


def pass_due(
    last: LastPass | None,
    now: float,
    *,
    first_tick: float,
    running: bool,
    warming: bool,
    lapsed: bool,
) -> bool:
    """Whether the timer runs a pass: events (the resource, its Pods, Jobs and children)
    trigger passes as things change, so a steady deployment needs one only every
    :data:`RESYNC_S`; sooner after a refusal or an error (the retry), once a Pod
    expectation has ``lapsed`` (no event will trigger the pass it held back), and every
    tick while warm Jobs track the nodes (a new node is not an event of this
    deployment). None while a pass is ``running`` (its end is recorded, the next tick
    decides). The create or resume handler runs the first pass: the timer's first tick
    (``first_tick``, right after the resource appears) adds none, but if a whole interval
    went by without a pass, that handler has not run (kopf's own request failed, the
    API server restarting, say, and no new event of the resource came) and the timer
    runs the first pass."""
    if running:
        return False
    if last is None:
        return now - first_tick >= TIMER_INTERVAL_S
    return last.refused or warming or lapsed or now - last.at >= RESYNC_S


_Seen = TypeVar("_Seen", ObservedPod, ObservedChild)


def event_needs_pass(seen: dict[str, _Seen], event_type: str, uid: str, observed: _Seen) -> bool:
    """Whether a child's event changes what a pass would read (and records what it saw).

    The first sight of a child is the operator's own creation (or the watch's initial
    list when the operator starts, which the resume pass covers); a deleted child always
    counts; otherwise only a change of what reconcile reads does: for a Pod its phase,
    readiness, termination, spec hash or placement labels, not a binding, an IP or a
    status heartbeat; for another child its configuration hash, not the status its own
    controller writes (a budget's allowed disruptions, for one).
    """
    if event_type == "DELETED":
        seen.pop(uid, None)
        return True
    previous = seen.get(uid)
    seen[uid] = observed
    return previous is not None and previous != observed


def mount_suspect(pod: ObservedPod, now: datetime.datetime) -> bool:
    """Still creating its containers well after it was scheduled, for no reason its
    status gives: the kubelet may be failing to mount a volume."""
    since = pod.creating_since
    return (
        pod.problem is None
        and since is not None
        and (now - since).total_seconds() >= MOUNT_REPORT_AFTER_S
    )


def _api_message(error: client.ApiException) -> str:
    """The API server's own message (its Status body), else the HTTP reason."""
    try:
        return json.loads(error.body or "")["message"]
    except (TypeError, ValueError, KeyError):
        return f"{error.status} {error.reason}"


def _refused(
    verb: str, kind: str, namespace: str, name: str, error: client.ApiException
) -> ApplyFailure:
    """The API server refused an action: logged once here, reported by the status."""
    failure = ApplyFailure(verb, kind, name, _api_message(error))
    logger.warning(
        "the API server refused to %s %s %s/%s: %s", verb, kind, namespace, name, failure.message
    )
    return failure


class Controller:
    """The API client, kopf's indexes, the expectations of writes the watches have not
    shown yet, the queue and what each deployment's last pass did."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self.indexes: dict[str, Any] = {}
        """kopf's live indexes by id, set by :meth:`start`. kopf fills them from the watches
        it runs anyway (for the event handlers) and holds every handler back until their
        first listing is in, so a pass reads Pods and children without a LIST."""
        self.expectations = PodExpectations()
        self.creating_children: set[tuple[str, str, str]] = set()
        """(namespace, kind, name) of children a pass is creating: their ADDED event needs
        no pass, where a child someone else adds (an older release's budget, say) does."""
        self.passes = Coalescer()
        """kopf runs the resource's handlers and the queue's workers concurrently; passes
        over one deployment must not overlap, and requests during a pass fold into one."""
        self.queue = WorkQueue()
        """Deployments whose children changed (:mod:`dlo_operator.workqueue`)."""
        metrics.QUEUE_DEPTH.set_function(lambda: len(self.queue))
        self.written: dict[DeploymentKey, tuple[str, dict[str, Any]]] = {}
        """The status this controller last wrote per deployment, with the deployment's
        uid. It is the status's only writer, so this is the current status even when the
        watch has not delivered it yet (the deployment's body comes from the watch)."""
        self.last_passes: dict[DeploymentKey, LastPass] = {}
        self.first_ticks: dict[DeploymentKey, float] = {}
        """When the timer first saw each deployment (``time.monotonic()``)."""
        self.backoff_ends: dict[DeploymentKey, float] = {}
        """When the earliest backing-off engine of each deployment is due: no event will
        come then, so the timer runs that pass."""
        self.mount_checks: dict[DeploymentKey, float] = {}
        """When each deployment's stuck Pods last had their Events read."""
        self.seen_pods: dict[str, ObservedPod] = {}
        """What the last event of each child Pod (by uid) showed of what reconcile reads."""
        self.seen_children: dict[str, ObservedChild] = {}
        """Likewise for Services, budgets and policies: their name and configuration hash."""

    def start(self, indexes: Mapping[str, Any]) -> None:
        """Take kopf's live indexes and start the queue's workers (kopf's startup)."""
        self.indexes.update({index: indexes[index] for index in INDEXES})
        start_workers(self.queue, self._sync_queued, QUEUE_WORKERS, name="dlo-reconcile")

    def _sync_queued(self, key: Hashable) -> None:
        if not isinstance(key, DeploymentKey):
            raise TypeError(f"the work queue holds deployment keys, not {key!r}")
        self.sync(key)

    # -- passes ----------------------------------------------------------------------

    def sync(self, key: DeploymentKey) -> list[ApplyFailure]:
        """Bring one DiffusionDeployment's children and status in line with its spec;
        returns what the API server refused (already in the status and the log), or
        nothing when a pass over it was running (that pass runs once more, after this)."""

        def one_pass() -> list[ApplyFailure]:
            started = time.monotonic()
            try:
                failures = self._pass(key)
            except Exception:
                # The timer's next tick retries (as after a refusal).
                self.last_passes[key] = LastPass(time.monotonic(), refused=True)
                metrics.PASSES.labels(outcome="error").inc()
                raise
            finally:
                metrics.PASS_SECONDS.observe(time.monotonic() - started)
            self.last_passes[key] = LastPass(time.monotonic(), bool(failures))
            metrics.PASSES.labels(outcome="refused" if failures else "ok").inc()
            return failures

        return self.passes.run(key, one_pass) or []

    def pass_due_now(self, key: DeploymentKey, *, warming: bool) -> bool:
        """The timer's question for ``key`` (:func:`pass_due`) with this controller's state."""
        now = time.monotonic()
        return pass_due(
            self.last_passes.get(key),
            now,
            first_tick=self.first_ticks.setdefault(key, now),
            running=self.passes.running(key),
            warming=warming,
            lapsed=self.expectations.lapsed(key, now)
            or now >= self.backoff_ends.get(key, float("inf"))
            or self._mount_check_due(key, now),
        )

    def _pass(self, key: DeploymentKey) -> list[ApplyFailure]:
        """One pass. The deployment is read from the watch (kopf indexes it before any
        handler sees its event, so the spec is never older than the event that queued the
        pass); its status from what this controller last wrote (:attr:`written`)."""
        bodies = self._indexed(DEPLOYMENT_INDEX, key)
        if not bodies:
            return []  # deleted
        body = bodies[-1]
        metadata = body["metadata"]
        if metadata.get("deletionTimestamp"):
            return []
        generation = metadata.get("generation", 0)
        current = self._current_status(key, body)
        try:
            previous = DiffusionDeploymentStatus.model_validate(current)
        except ValidationError:
            previous = DiffusionDeploymentStatus()
        try:
            spec = DiffusionDeploymentSpec.model_validate(body["spec"])
        except ValidationError as error:
            message = f"spec does not match the API models: {error.errors()[0]['msg']}"
            conditions, events = invalid_spec_conditions(previous, generation, message)
            self._patch_status(
                key,
                metadata["uid"],
                DiffusionDeploymentStatus(observed_generation=generation, conditions=conditions),
                current,
            )
            self._post(body, events, set())
            return []
        observed = self._observe_pods(key)
        owner = Owner(name=key.name, namespace=key.namespace, uid=metadata["uid"])
        children = self._observe_children(key)
        nodes, jobs = self._observe_warming(spec, key)
        actions = reconcile(
            owner, spec, generation, observed, previous, children=children, nodes=nodes, jobs=jobs
        )
        changed, failures, pods_held_back = self._apply(key, actions)
        status, failure_events = report_apply_failures(
            actions.status, previous, failures, generation, pods_held_back=pods_held_back
        )
        self._patch_status(key, metadata["uid"], status, current)
        self._post(body, [*actions.events, *failure_events], changed)
        self._note_backoff(key, status)
        return failures

    def delete(self, key: DeploymentKey) -> bool:
        """Drain every engine (leaders first, see :func:`deletion_order`); True once every
        Pod is gone, when everything known about the deployment is forgotten."""
        core = client.CoreV1Api(self.api)
        pods = [
            ObservedPod.from_manifest(self.api.sanitize_for_serialization(pod))
            for pod in core.list_namespaced_pod(
                key.namespace, label_selector=f"{LABEL_DEPLOYMENT}={key.name}"
            ).items
        ]
        for pod_name in deletion_order(pods):
            try:
                core.delete_namespaced_pod(pod_name, key.namespace)
            except client.ApiException as error:
                if error.status != 404:
                    raise
        if pods:
            return False
        self.passes.forget(key)
        for known in (
            self.last_passes,
            self.first_ticks,
            self.backoff_ends,
            self.mount_checks,
            self.written,
        ):
            known.pop(key, None)
        self.expectations.forget(key)
        return True

    # -- events of children ------------------------------------------------------------

    def pod_event(self, event_type: str, uid: str, key: DeploymentKey, pod: ObservedPod) -> None:
        self.expectations.observed(key, event_type, pod)
        if event_needs_pass(self.seen_pods, event_type, uid, pod):
            self.queue.add(key)

    def child_event(
        self, event_type: str, uid: str, key: DeploymentKey, child: ObservedChild
    ) -> None:
        """Someone added, changed or deleted a child: restore or remove it now, not at the
        next resync."""
        created = (key.namespace, child.kind, child.name)
        foreign = event_type == "ADDED" and created not in self.creating_children
        self.creating_children.discard(created)
        if event_needs_pass(self.seen_children, event_type, uid, child) or foreign:
            self.queue.add(key)

    def job_event(self, key: DeploymentKey, job_name: str) -> None:
        """A warm Job started, finished or failed: report the node's cache state."""
        self.creating_children.discard((key.namespace, "Job", job_name))
        self.queue.add(key)

    # -- what a pass reads -------------------------------------------------------------

    def _indexed(self, index: str, key: DeploymentKey) -> list[Any]:
        """The values of ``key`` in a kopf index. kopf mutates its indexes on the event
        loop's thread; ``list`` copies a store's values in one C call, which the GIL
        keeps whole."""
        store = self.indexes[index].get(tuple(key))
        return list(store) if store is not None else []

    def _observe_pods(self, key: DeploymentKey) -> list[ObservedPod]:
        pods = self.expectations.overlay(key, self._indexed(POD_INDEX, key), time.monotonic())
        now = datetime.datetime.now(datetime.UTC)
        if any(mount_suspect(pod, now) for pod in pods):
            self.mount_checks[key] = time.monotonic()
            pods = [
                self._with_mount_problem(key.namespace, pod) if mount_suspect(pod, now) else pod
                for pod in pods
            ]
        return pods

    def _mount_check_due(self, key: DeploymentKey, now: float) -> bool:
        """Whether the timer runs a pass to read stuck Pods' Events: their status will not
        change, so no event triggers it."""
        wall = datetime.datetime.now(datetime.UTC)
        if not any(mount_suspect(pod, wall) for pod in self._indexed(POD_INDEX, key)):
            return False
        return now - self.mount_checks.get(key, -MOUNT_RECHECK_S) >= MOUNT_RECHECK_S

    def _with_mount_problem(self, namespace: str, pod: ObservedPod) -> ObservedPod:
        """The Pod with the volume failure its Events report, if any."""
        found = client.CoreV1Api(self.api).list_namespaced_event(
            namespace, field_selector=f"involvedObject.kind=Pod,involvedObject.name={pod.name}"
        )
        problem = mount_problem(self.api.sanitize_for_serialization(found.items))
        return dataclasses.replace(pod, problem=problem) if problem else pod

    def _observe_children(self, key: DeploymentKey) -> list[ObservedChild]:
        return [
            child for kind in CHILD_KINDS.values() for child, _ in self._indexed(kind.index, key)
        ]

    def _observe_warming(
        self, spec: DiffusionDeploymentSpec, key: DeploymentKey
    ) -> tuple[list[ObservedNode], list[ObservedJob]]:
        """The cluster's nodes and this deployment's warm Jobs (only with the runtime cache)."""
        if not warming_enabled(spec):
            return [], []
        sanitize = self.api.sanitize_for_serialization
        nodes = [
            ObservedNode.from_manifest(sanitize(node), GPU_RESOURCE)
            for node in client.CoreV1Api(self.api).list_node().items
        ]
        jobs = [job for _, job in self._indexed(CHILD_KINDS["Job"].index, key)]
        return nodes, jobs

    def _current_status(self, key: DeploymentKey, body: dict[str, Any]) -> dict[str, Any]:
        written = self.written.get(key)
        if written is not None and written[0] == body["metadata"]["uid"]:
            return written[1]
        return body.get("status") or {}

    # -- what a pass writes ------------------------------------------------------------

    def _child_call(self, kind: str, verb: str) -> Any:
        child = CHILD_KINDS[kind]
        return getattr(child.api_class(self.api), f"{verb}_{child.suffix}")

    def _apply(
        self, key: DeploymentKey, actions: Actions
    ) -> tuple[set[str], list[ApplyFailure], bool]:
        """Carry out the actions for the deployment. Returns the Pods this call created or
        deleted (also remembered as expectations until the watch shows them), what the API
        server refused (each logged once), and whether Pod creation was held back because
        a Service could not be applied (a Pod must not start without its rendezvous and
        client Services). An error other than a refusal (no answer) ends the pass: it is
        retried."""
        children = [
            *(self._apply_child(key.namespace, item) for item in actions.apply_children),
            *(
                self._delete_child(key.namespace, kind, name)
                for kind, name in actions.delete_children
            ),
        ]
        failures = [failure for failure in children if failure is not None]
        hold_pods = any(failure.kind == "Service" for failure in failures)
        outcomes = [
            (pod["metadata"]["name"], self._create_pod(key, pod))
            for pod in ([] if hold_pods else actions.create_pods)
        ]
        outcomes += [(name, self._delete_pod(key, name)) for name in actions.delete_pods]
        changed: set[str] = set()
        for name, outcome in outcomes:
            if isinstance(outcome, ApplyFailure):
                failures.append(outcome)
            elif outcome:
                changed.add(name)
        return changed, failures, hold_pods and bool(actions.create_pods)

    def _apply_child(self, namespace: str, item: dict[str, Any]) -> ApplyFailure | None:
        """Server-side apply of the child's rendering under the operator's field manager:
        created where it is missing, brought to the rendering where it exists (a field the
        rendering no longer sets is removed; fields other managers own are kept)."""
        name, kind = item["metadata"]["name"], item["kind"]
        created = (namespace, kind, name)
        self.creating_children.add(created)
        try:
            status = write(self._child_call(kind, "patch"), name, namespace, item, **APPLY)
        except client.ApiException as error:
            self.creating_children.discard(created)
            return _refused("apply", kind, namespace, name, error)
        except BaseException:
            # No answer (the API server restarts, say): an ADDED event of this name may
            # then read as someone else's, which costs one extra pass.
            self.creating_children.discard(created)
            raise
        if status != 201:  # it existed: no ADDED event of this apply will come
            self.creating_children.discard(created)
        return None

    def _delete_child(self, namespace: str, kind: str, name: str) -> ApplyFailure | None:
        try:
            # Background: a Job's Pods go with it (a Job's default is to orphan them).
            write(
                self._child_call(kind, "delete"), name, namespace, propagation_policy="Background"
            )
        except client.ApiException as error:
            if error.status != 404:  # 404: gone already
                return _refused("delete", kind, namespace, name, error)
        return None

    def _create_pod(self, key: DeploymentKey, pod: dict[str, Any]) -> ApplyFailure | bool:
        """The failure, else whether this call created the Pod (a 409 means it exists and
        its event will come)."""
        name = pod["metadata"]["name"]
        self.expectations.creating(key, ObservedPod.from_manifest(pod), time.monotonic())
        try:
            write(client.CoreV1Api(self.api).create_namespaced_pod, key.namespace, pod)
        except client.ApiException as error:
            if error.status == 409:
                return False
            self.expectations.failed(key, name)
            return _refused("create", "Pod", key.namespace, name, error)
        except BaseException:
            # No answer (the API server restarts, say): whether the Pod exists is unknown,
            # and creating it again is safe (an existing name is answered 409).
            self.expectations.failed(key, name)
            raise
        return True

    def _delete_pod(self, key: DeploymentKey, name: str) -> ApplyFailure | bool:
        """The failure, else whether this call deleted the Pod (a 404: it was gone).

        A deletion that gets no answer stays expected until it lapses: deleting again at
        once could count an engine's restart twice."""
        self.expectations.deleting(key, name, time.monotonic())
        try:
            write(client.CoreV1Api(self.api).delete_namespaced_pod, name, key.namespace)
        except client.ApiException as error:
            if error.status == 404:  # gone already, as the expectation says
                return False
            self.expectations.failed(key, name)
            return _refused("delete", "Pod", key.namespace, name, error)
        return True

    def _patch_status(
        self,
        key: DeploymentKey,
        uid: str,
        status: DiffusionDeploymentStatus,
        current: dict[str, Any] | None = None,
    ) -> None:
        """Patch the status unless it equals ``current`` (the status as last written or
        read): a steady deployment then costs no write per timer tick."""
        body = status.model_dump(mode="json", by_alias=True, exclude_none=True)
        if current is not None and body == current:
            return
        write(
            client.CustomObjectsApi(self.api).patch_namespaced_custom_object_status,
            GROUP,
            VERSION,
            key.namespace,
            PLURAL,
            key.name,
            {"status": body},
        )
        self.written[key] = (uid, body)

    def _post(self, body: dict[str, Any], events: list[Event], changed: set[str]) -> None:
        """Post the Events of this pass; one that reports actions only if one took effect."""
        for event in events:
            if event.subjects and not changed.intersection(event.subjects):
                continue
            post_event(self.api, body, event.reason, event.message, warning=event.warning)

    def _note_backoff(self, key: DeploymentKey, status: DiffusionDeploymentStatus) -> None:
        ends = [
            end
            for e in status.engines
            if e.next_restart_time and (end := parse_time(e.next_restart_time)) is not None
        ]
        if not ends:
            self.backoff_ends.pop(key, None)
            return
        wait = (min(ends) - datetime.datetime.now(datetime.UTC)).total_seconds()
        self.backoff_ends[key] = time.monotonic() + max(wait, 0.0)
