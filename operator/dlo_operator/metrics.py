"""The operator's own Prometheus metrics, served on ``--metrics-port``.

What an operator's user alerts on: passes that fail (the API server refusing or away),
passes that take long, a work queue that does not drain, Events posted by reason. Each
metric has one owner that updates it: the pass wrapper in :mod:`dlo_operator.controller`,
the work queue's length, and :func:`dlo_operator.events.post_event`.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

PASSES = Counter(
    "dlo_operator_reconcile_passes_total",
    "Reconcile passes by outcome: ok, refused (the API server refused an action; the "
    "status says which) or error (the pass raised and is retried).",
    ["outcome"],
)
PASS_SECONDS = Histogram(
    "dlo_operator_reconcile_pass_duration_seconds",
    "Wall time of one reconcile pass.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
QUEUE_DEPTH = Gauge(
    "dlo_operator_work_queue_depth", "Deployments waiting in the work queue for a pass."
)
EVENTS = Counter("dlo_operator_events_total", "Kubernetes Events posted, by reason.", ["reason"])
