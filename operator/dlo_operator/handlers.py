"""kopf wiring: every trigger runs the same idempotent sync; all decisions live in reconcile.

Triggers: the DiffusionDeployment's create/resume/update, a 10 s timer, and any
event of a child Pod (a failed or deleted rank restarts its engine promptly) or of a
warm Job (a node's cache state is reported promptly).
I/O only: read the object, read its Pods and its other children from kopf's watch-fed
indexes (no LIST per pass; :mod:`dlo_operator.expectations` covers what the watch has
not shown yet), call :func:`dlo_operator.reconcile.reconcile`, create, patch and delete
what it says (409/404 are success: another sync did it), patch status and post the
Events whose actions took effect (:mod:`dlo_operator.events`: from kopf's handlers and
the queue's threads alike). Passes over one deployment run one at a time. Child
events only queue the deployment (:mod:`dlo_operator.workqueue`): a burst of them costs
one pass.

Run it with ``dlo-operator`` (:mod:`dlo_operator.__main__`).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import kopf
from kubernetes import client
from kubernetes import config as kube_config
from pydantic import ValidationError

from dlo_operator import metrics
from dlo_operator.api import (
    GROUP,
    PLURAL,
    VERSION,
    DiffusionDeploymentSpec,
    DiffusionDeploymentStatus,
)
from dlo_operator.apicalls import write
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

ANNOTATION_PREFIX = GROUP
TIMER_INTERVAL_S = 10.0
"""How often each deployment's timer asks whether a pass is due."""
RESYNC_S = 300.0
"""A full pass at least this often without any event (drift the watches did not see)."""
MAX_RETRY_DELAY_S = 60.0
REQUEST_TIMEOUT_S = (5.0, 30.0)
"""Connect and read timeouts of every API call a pass makes. Without them a call the
API server never answers (it restarted mid-request, or a partition dropped the
connection) blocks its pass for good, and with it every later pass over the deployment."""

logger = logging.getLogger(__name__)


class TimedApiClient(client.ApiClient):
    """The kubernetes client with :data:`REQUEST_TIMEOUT_S` on every call that sets none
    (the client's own default is to wait forever)."""

    def call_api(self, *args: Any, _request_timeout: Any = None, **kwargs: Any) -> Any:
        kwargs["_request_timeout"] = (
            REQUEST_TIMEOUT_S if _request_timeout is None else _request_timeout
        )
        return super().call_api(*args, **kwargs)


_api: client.ApiClient | None = None


def api() -> client.ApiClient:
    """One client per process: in-cluster credentials, else the kubeconfig."""
    global _api  # noqa: PLW0603 (process-wide client, created on first use)
    if _api is None:
        try:
            kube_config.load_incluster_config()
        except kube_config.ConfigException:
            kube_config.load_kube_config()
        _api = TimedApiClient()
    return _api


DRAIN_WAIT = "waiting for the engines to drain"


class DrainWaitIsNotAnError(logging.Filter):
    """kopf logs every retry of a handler at ERROR (and posts it as an Event); the deletion
    handler retries while the engines drain, which is how every normal delete goes. Those
    records become INFO: shown with ``--verbose``, never posted, never an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        if DRAIN_WAIT not in record.getMessage():
            return True
        record.levelno, record.levelname = logging.INFO, "INFO"
        return logging.getLogger("dlo_operator").isEnabledFor(logging.INFO)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **kwargs: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    objects = logging.getLogger("kopf.objects")
    if not any(isinstance(f, DrainWaitIsNotAnError) for f in objects.filters):
        objects.addFilter(DrainWaitIsNotAnError())
    # kopf hands its (live) indexes to every handler; the queue's threads read them here.
    _indexes.update({index: kwargs[index] for index in INDEXES})
    start_workers(_queue, _sync_key, QUEUE_WORKERS, name="dlo-reconcile")


def _post(body: dict[str, Any], events: list[Event], changed: set[str]) -> None:
    """Post the Events of this pass; one that reports actions only if one took effect."""
    for event in events:
        if event.subjects and not changed.intersection(event.subjects):
            continue
        post_event(api(), body, event.reason, event.message, warning=event.warning)


@dataclass(frozen=True)
class _ChildKind:
    """How the operator reaches one kind of child besides Pods."""

    api_class: type
    suffix: str
    """Of the API class's methods: ``create_{suffix}``, ``patch_...``, ``delete_...``."""
    resource: tuple[str, str, str]
    """Group, version and plural, for the watch."""
    index: str
    """The kopf index of these children, keyed by (namespace, deployment)."""


_CHILD_KINDS = {
    "Service": _ChildKind(
        client.CoreV1Api, "namespaced_service", ("", "v1", "services"), "deployment_services"
    ),
    "PodDisruptionBudget": _ChildKind(
        client.PolicyV1Api,
        "namespaced_pod_disruption_budget",
        ("policy", "v1", "poddisruptionbudgets"),
        "deployment_budgets",
    ),
    "NetworkPolicy": _ChildKind(
        client.NetworkingV1Api,
        "namespaced_network_policy",
        ("networking.k8s.io", "v1", "networkpolicies"),
        "deployment_policies",
    ),
    "Job": _ChildKind(
        client.BatchV1Api, "namespaced_job", ("batch", "v1", "jobs"), "deployment_jobs"
    ),
}
POD_INDEX = "deployment_pods"
DEPLOYMENT_INDEX = "deployments"
INDEXES = (DEPLOYMENT_INDEX, POD_INDEX, *(kind.index for kind in _CHILD_KINDS.values()))
_indexes: dict[str, Any] = {}
"""kopf's live indexes by id, set at startup. kopf fills them from the watches it runs
anyway (for the event handlers below) and holds every handler back until their first
listing is in, so a pass reads Pods and children without a LIST."""
_expectations = PodExpectations()
_creating_children: set[tuple[str, str, str]] = set()
"""(namespace, kind, name) of children a pass is creating: their ADDED event needs no
pass, where a child someone else adds (an older release's budget, say) does."""


def _child_call(kind: str, verb: str) -> Any:
    child = _CHILD_KINDS[kind]
    return getattr(child.api_class(api()), f"{verb}_{child.suffix}")


async def _index_pod(namespace: str, labels: dict[str, str], body: Any, **_: Any) -> dict:
    return {(namespace, labels[LABEL_DEPLOYMENT]): ObservedPod.from_manifest(body)}


async def _index_child(
    namespace: str, labels: dict[str, str], body: Any, param: str, **_: Any
) -> dict:
    child = ObservedChild.from_manifest(param, body)
    job = ObservedJob.from_manifest(body) if param == "Job" else None
    return {(namespace, labels[LABEL_DEPLOYMENT]): (child, job)}


async def _index_deployment(namespace: str, name: str, body: Any, **_: Any) -> dict:
    """What a pass reads of the deployment, copied (not its managedFields)."""
    metadata = body["metadata"]
    kept = ("name", "namespace", "uid", "generation", "resourceVersion", "deletionTimestamp")
    return {
        (namespace, name): {
            "apiVersion": body["apiVersion"],
            "kind": body["kind"],
            "metadata": {key: metadata[key] for key in kept if key in metadata},
            "spec": copy.deepcopy(dict(body.get("spec") or {})),
            "status": copy.deepcopy(dict(body.get("status") or {})),
        }
    }


kopf.index(GROUP, VERSION, PLURAL, id=DEPLOYMENT_INDEX)(_index_deployment)
kopf.index("", "v1", "pods", id=POD_INDEX, labels={LABEL_DEPLOYMENT: kopf.PRESENT})(_index_pod)
for _kind, _child in _CHILD_KINDS.items():
    kopf.index(
        *_child.resource, id=_child.index, param=_kind, labels={LABEL_DEPLOYMENT: kopf.PRESENT}
    )(_index_child)


def _indexed(index: str, key: tuple[str, str]) -> list[Any]:
    """The values of ``key`` in a kopf index. kopf mutates its indexes on the event loop's
    thread; ``list`` copies a store's values in one C call, which the GIL keeps whole."""
    store = _indexes[index].get(key)
    return list(store) if store is not None else []


def _observe_pods(name: str, namespace: str) -> list[ObservedPod]:
    key = (namespace, name)
    pods = _expectations.overlay(key, _indexed(POD_INDEX, key), time.monotonic())
    now = datetime.datetime.now(datetime.UTC)
    if any(_mount_suspect(pod, now) for pod in pods):
        _mount_checks[key] = time.monotonic()
        pods = [
            _with_mount_problem(namespace, pod) if _mount_suspect(pod, now) else pod for pod in pods
        ]
    return pods


_mount_checks: dict[tuple[str, str], float] = {}
"""When each deployment's stuck Pods last had their Events read (``time.monotonic()``)."""
MOUNT_RECHECK_S = 30.0


def _mount_suspect(pod: ObservedPod, now: datetime.datetime) -> bool:
    """Still creating its containers well after it was scheduled, for no reason its
    status gives: the kubelet may be failing to mount a volume."""
    since = pod.creating_since
    return (
        pod.problem is None
        and since is not None
        and (now - since).total_seconds() >= MOUNT_REPORT_AFTER_S
    )


def _mount_check_due(key: tuple[str, str], now: float) -> bool:
    """Whether the timer runs a pass to read stuck Pods' Events: their status will not
    change, so no event triggers it."""
    wall = datetime.datetime.now(datetime.UTC)
    if not any(_mount_suspect(pod, wall) for pod in _indexed(POD_INDEX, key)):
        return False
    return now - _mount_checks.get(key, -MOUNT_RECHECK_S) >= MOUNT_RECHECK_S


def _with_mount_problem(namespace: str, pod: ObservedPod) -> ObservedPod:
    """The Pod with the volume failure its Events report, if any."""
    found = client.CoreV1Api(api()).list_namespaced_event(
        namespace, field_selector=f"involvedObject.kind=Pod,involvedObject.name={pod.name}"
    )
    problem = mount_problem(api().sanitize_for_serialization(found.items))
    return dataclasses.replace(pod, problem=problem) if problem else pod


def _observe_children(name: str, namespace: str) -> list[ObservedChild]:
    key = (namespace, name)
    return [child for kind in _CHILD_KINDS.values() for child, _ in _indexed(kind.index, key)]


def _observe_warming(
    spec: DiffusionDeploymentSpec, name: str, namespace: str
) -> tuple[list[ObservedNode], list[ObservedJob]]:
    """The cluster's nodes and this deployment's warm Jobs (only with the runtime cache)."""
    if not warming_enabled(spec):
        return [], []
    sanitize = api().sanitize_for_serialization
    nodes = [
        ObservedNode.from_manifest(sanitize(node), GPU_RESOURCE)
        for node in client.CoreV1Api(api()).list_node().items
    ]
    jobs = [job for _, job in _indexed(_CHILD_KINDS["Job"].index, (namespace, name))]
    return nodes, jobs


def _sync_key(key: Hashable) -> None:
    """A pass for a queued ``(namespace, name)`` key."""
    namespace, name = cast(tuple[str, str], key)
    sync(name, namespace)


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


def _apply_child(namespace: str, item: dict[str, Any]) -> ApplyFailure | None:
    """Create the child, or patch it to this rendering where it exists."""
    name, kind = item["metadata"]["name"], item["kind"]
    _creating_children.add((namespace, kind, name))
    try:
        write(_child_call(kind, "create"), namespace, item)
        return None
    except client.ApiException as error:
        _creating_children.discard((namespace, kind, name))
        if error.status != 409:  # 409: it exists, patch it below
            return _refused("apply", kind, namespace, name, error)
    except BaseException:
        # No answer (the API server restarts, say): an ADDED event of this name may then
        # read as someone else's, which costs one extra pass.
        _creating_children.discard((namespace, kind, name))
        raise
    try:
        write(
            _child_call(kind, "patch"),
            name,
            namespace,
            item,
            _content_type="application/merge-patch+json",
        )
    except client.ApiException as error:
        return _refused("apply", kind, namespace, name, error)
    return None


def _delete_child(namespace: str, kind: str, name: str) -> ApplyFailure | None:
    try:
        # Background: a Job's Pods go with it (a Job's default is to orphan them).
        write(_child_call(kind, "delete"), name, namespace, propagation_policy="Background")
    except client.ApiException as error:
        if error.status != 404:  # 404: gone already
            return _refused("delete", kind, namespace, name, error)
    return None


def _create_pod(key: tuple[str, str], pod: dict[str, Any]) -> ApplyFailure | bool:
    """The failure, else whether this call created the Pod (a 409 means it exists and
    its event will come)."""
    namespace, name = key[0], pod["metadata"]["name"]
    _expectations.creating(key, ObservedPod.from_manifest(pod), time.monotonic())
    try:
        write(client.CoreV1Api(api()).create_namespaced_pod, namespace, pod)
    except client.ApiException as error:
        if error.status == 409:
            return False
        _expectations.failed(key, name)
        return _refused("create", "Pod", namespace, name, error)
    except BaseException:
        # No answer (the API server restarts, say): whether the Pod exists is unknown,
        # and creating it again is safe (an existing name is answered 409).
        _expectations.failed(key, name)
        raise
    return True


def _delete_pod(key: tuple[str, str], name: str) -> ApplyFailure | bool:
    """The failure, else whether this call deleted the Pod (a 404: it was gone).

    A deletion that gets no answer stays expected until it lapses: deleting again at
    once could count an engine's restart twice."""
    _expectations.deleting(key, name, time.monotonic())
    try:
        write(client.CoreV1Api(api()).delete_namespaced_pod, name, key[0])
    except client.ApiException as error:
        if error.status == 404:  # gone already, as the expectation says
            return False
        _expectations.failed(key, name)
        return _refused("delete", "Pod", key[0], name, error)
    return True


def _apply(
    namespace: str, deployment: str, actions: Actions
) -> tuple[set[str], list[ApplyFailure], bool]:
    """Carry out the actions for ``deployment``. Returns the Pods this call
    created or deleted (also remembered as expectations until the watch shows them), what the API
    server refused (each logged once), and whether Pod creation was held back because a
    Service could not be applied (a Pod must not start without its rendezvous and client
    Services). An error other than a refusal (no answer) ends the pass: it is retried."""
    children = [
        *(_apply_child(namespace, item) for item in actions.apply_children),
        *(_delete_child(namespace, kind, name) for kind, name in actions.delete_children),
    ]
    failures = [failure for failure in children if failure is not None]
    hold_pods = any(failure.kind == "Service" for failure in failures)
    key = (namespace, deployment)
    outcomes = [
        (pod["metadata"]["name"], _create_pod(key, pod))
        for pod in ([] if hold_pods else actions.create_pods)
    ]
    outcomes += [(name, _delete_pod(key, name)) for name in actions.delete_pods]
    changed: set[str] = set()
    for name, outcome in outcomes:
        if isinstance(outcome, ApplyFailure):
            failures.append(outcome)
        elif outcome:
            changed.add(name)
    return changed, failures, hold_pods and bool(actions.create_pods)


_passes = Coalescer()
"""kopf runs the resource's handlers and the queue's workers concurrently; passes over
one deployment must not overlap, and requests during a pass fold into one more."""
_queue = WorkQueue()
"""Deployments whose children changed (:mod:`dlo_operator.workqueue`)."""
metrics.QUEUE_DEPTH.set_function(lambda: len(_queue))
QUEUE_WORKERS = 4
"""Threads running queued passes: each pass waits on a handful of API calls, so a few
in flight keep the API server, not the operator, the limit."""


_written: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}
"""The status this operator last wrote per deployment, with the deployment's uid. The
operator is the status's only writer, so this is the current status even when the watch
has not delivered it yet (the deployment's body comes from the watch, not a GET)."""


def _current_status(key: tuple[str, str], body: dict[str, Any]) -> dict[str, Any]:
    written = _written.get(key)
    if written is not None and written[0] == body["metadata"]["uid"]:
        return written[1]
    return body.get("status") or {}


def _patch_status(
    key: tuple[str, str],
    uid: str,
    status: DiffusionDeploymentStatus,
    current: dict[str, Any] | None = None,
) -> None:
    """Patch the status unless it equals ``current`` (the status as last written or
    read): a steady deployment then costs no write per timer tick."""
    body = status.model_dump(mode="json", by_alias=True, exclude_none=True)
    if current is not None and body == current:
        return
    namespace, name = key
    write(
        client.CustomObjectsApi(api()).patch_namespaced_custom_object_status,
        GROUP,
        VERSION,
        namespace,
        PLURAL,
        name,
        {"status": body},
    )
    _written[key] = (uid, body)


@dataclass(frozen=True)
class _LastPass:
    at: float
    """``time.monotonic()`` when it ended."""
    refused: bool


_last_passes: dict[tuple[str, str], _LastPass] = {}
_first_ticks: dict[tuple[str, str], float] = {}
"""When the timer first saw each deployment (``time.monotonic()``)."""


def sync(name: str, namespace: str) -> list[ApplyFailure]:
    """Bring one DiffusionDeployment's children and status in line with its spec; returns
    what the API server refused (already in the status and the log), or nothing when a
    pass over it was running (that pass runs once more, after this request)."""
    key = (namespace, name)

    def one_pass() -> list[ApplyFailure]:
        started = time.monotonic()
        try:
            failures = _sync(name, namespace)
        except Exception:
            # The timer's next tick retries (as after a refusal).
            _last_passes[key] = _LastPass(time.monotonic(), refused=True)
            metrics.PASSES.labels(outcome="error").inc()
            raise
        finally:
            metrics.PASS_SECONDS.observe(time.monotonic() - started)
        _last_passes[key] = _LastPass(time.monotonic(), bool(failures))
        metrics.PASSES.labels(outcome="refused" if failures else "ok").inc()
        return failures

    return _passes.run(key, one_pass) or []


def pass_due(
    last: _LastPass | None,
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


def _sync(name: str, namespace: str) -> list[ApplyFailure]:
    """One pass. The deployment is read from the operator's watch (kopf indexes it before
    any handler sees its event, so the spec is never older than the event that queued the
    pass); its status from what this operator last wrote (:data:`_written`)."""
    key = (namespace, name)
    bodies = _indexed(DEPLOYMENT_INDEX, key)
    if not bodies:
        return []  # deleted
    body = bodies[-1]
    metadata = body["metadata"]
    if metadata.get("deletionTimestamp"):
        return []
    generation = metadata.get("generation", 0)
    current = _current_status(key, body)
    try:
        previous = DiffusionDeploymentStatus.model_validate(current)
    except ValidationError:
        previous = DiffusionDeploymentStatus()
    try:
        spec = DiffusionDeploymentSpec.model_validate(body["spec"])
    except ValidationError as error:
        message = f"spec does not match the API models: {error.errors()[0]['msg']}"
        conditions, events = invalid_spec_conditions(previous, generation, message)
        _patch_status(
            key,
            metadata["uid"],
            DiffusionDeploymentStatus(observed_generation=generation, conditions=conditions),
            current,
        )
        _post(body, events, set())
        return []
    observed = _observe_pods(name, namespace)
    owner = Owner(name=name, namespace=namespace, uid=metadata["uid"])
    children = _observe_children(name, namespace)
    nodes, jobs = _observe_warming(spec, name, namespace)
    actions = reconcile(
        owner, spec, generation, observed, previous, children=children, nodes=nodes, jobs=jobs
    )
    changed, failures, pods_held_back = _apply(namespace, name, actions)
    status, failure_events = report_apply_failures(
        actions.status, previous, failures, generation, pods_held_back=pods_held_back
    )
    _patch_status(key, metadata["uid"], status, current)
    _post(body, [*actions.events, *failure_events], changed)
    _note_backoff((namespace, name), status)
    return failures


_backoff_ends: dict[tuple[str, str], float] = {}
"""When the earliest backing-off engine of each deployment is due (``time.monotonic()``):
no event will come then, so the timer runs that pass."""


def _note_backoff(key: tuple[str, str], status: DiffusionDeploymentStatus) -> None:
    ends = [
        end
        for e in status.engines
        if e.next_restart_time and (end := parse_time(e.next_restart_time)) is not None
    ]
    if not ends:
        _backoff_ends.pop(key, None)
        return
    wait = (min(ends) - datetime.datetime.now(datetime.UTC)).total_seconds()
    _backoff_ends[key] = time.monotonic() + max(wait, 0.0)


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def on_change(name: str, namespace: str, retry: int, **_: Any) -> None:
    """Retried with a growing delay while the API server refuses something (the status,
    an Event and one log line per refusal already say what); the timer and Pod events
    keep reconciling meanwhile."""
    if failures := sync(name, namespace):
        delay = min(MAX_RETRY_DELAY_S, 2.0 ** min(retry + 1, 6))
        raise kopf.TemporaryError(f"{len(failures)} action(s) refused", delay=delay)


@kopf.timer(GROUP, VERSION, PLURAL, interval=TIMER_INTERVAL_S)
def on_timer(name: str, namespace: str, spec: Any, **_: Any) -> None:
    cache = ((spec.get("offload") or {}).get("runtimeCache") or {}).get("enabled", False)
    key, now = (namespace, name), time.monotonic()
    if pass_due(
        _last_passes.get(key),
        now,
        first_tick=_first_ticks.setdefault(key, now),
        running=_passes.running(key),
        warming=bool(cache),
        lapsed=_expectations.lapsed(key, now)
        or now >= _backoff_ends.get(key, float("inf"))
        or _mount_check_due(key, now),
    ):
        sync(name, namespace)


@kopf.on.delete(GROUP, VERSION, PLURAL)
def on_delete(name: str, namespace: str, **_: Any) -> None:
    """Drain every engine (leaders first, see :func:`deletion_order`), and hold kopf's
    finalizer until every Pod is gone, so ``kubectl delete`` returns once the engines have
    drained; the garbage collector then removes Services and budgets."""
    core = client.CoreV1Api(api())
    pods = [
        ObservedPod.from_manifest(api().sanitize_for_serialization(pod))
        for pod in core.list_namespaced_pod(
            namespace, label_selector=f"{LABEL_DEPLOYMENT}={name}"
        ).items
    ]
    for pod_name in deletion_order(pods):
        try:
            core.delete_namespaced_pod(pod_name, namespace)
        except client.ApiException as error:
            if error.status != 404:
                raise
    if pods:
        raise kopf.TemporaryError(DRAIN_WAIT, delay=2)
    _passes.forget((namespace, name))
    _last_passes.pop((namespace, name), None)
    _first_ticks.pop((namespace, name), None)
    _backoff_ends.pop((namespace, name), None)
    _mount_checks.pop((namespace, name), None)
    _written.pop((namespace, name), None)
    _expectations.forget((namespace, name))


_seen_pods: dict[str, ObservedPod] = {}
"""What the last event of each child Pod (by uid) showed of what reconcile reads."""
_seen_children: dict[str, ObservedChild] = {}
"""Likewise for Services, budgets and policies: their name and configuration hash."""
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


@kopf.on.event("", "v1", "pods", labels={LABEL_DEPLOYMENT: kopf.PRESENT})
async def on_pod_event(
    labels: dict[str, str], namespace: str, body: Any, uid: str, **kwargs: Any
) -> None:
    observed = ObservedPod.from_manifest(body)
    key = (namespace, labels[LABEL_DEPLOYMENT])
    _expectations.observed(key, kwargs["type"], observed)
    if event_needs_pass(_seen_pods, kwargs["type"], uid, observed):
        _queue.add((namespace, labels[LABEL_DEPLOYMENT]))


@kopf.on.event("", "v1", "services", labels={LABEL_DEPLOYMENT: kopf.PRESENT})
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels={LABEL_DEPLOYMENT: kopf.PRESENT})
@kopf.on.event(
    "networking.k8s.io", "v1", "networkpolicies", labels={LABEL_DEPLOYMENT: kopf.PRESENT}
)
async def on_child_event(
    labels: dict[str, str], namespace: str, body: Any, uid: str, **kwargs: Any
) -> None:
    """Someone added, changed or deleted a child: restore or remove it now, not at the
    next resync."""
    observed = ObservedChild.from_manifest(body["kind"], body)
    created = (namespace, observed.kind, observed.name)
    foreign = kwargs["type"] == "ADDED" and created not in _creating_children
    _creating_children.discard(created)
    if event_needs_pass(_seen_children, kwargs["type"], uid, observed) or foreign:
        _queue.add((namespace, labels[LABEL_DEPLOYMENT]))


@kopf.on.event("batch", "v1", "jobs", labels={LABEL_DEPLOYMENT: kopf.PRESENT})
async def on_warm_job_event(labels: dict[str, str], namespace: str, name: str, **_: Any) -> None:
    """A warm Job started, finished or failed: report the node's cache state."""
    _creating_children.discard((namespace, "Job", name))
    _queue.add((namespace, labels[LABEL_DEPLOYMENT]))
