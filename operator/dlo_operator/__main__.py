"""``dlo-operator`` (or ``python -m dlo_operator``): run the kopf operator.

Watches every namespace unless ``--namespace`` is given; ``--liveness`` serves
kopf's health endpoint for the Deployment's liveness probe, ``--metrics-port`` the
operator's Prometheus metrics (:mod:`dlo_operator.metrics`).
"""

from __future__ import annotations

import argparse
import logging

import kopf
import prometheus_client


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dlo-operator", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="Watch only this namespace (repeatable; default: all).",
    )
    parser.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="Liveness endpoint URL (default: %(default)s).",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=8081,
        help="Port of the Prometheus /metrics endpoint; 0 turns it off (default: %(default)s).",
    )
    parser.add_argument("--verbose", action="store_true", help="Log every handler run.")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)r",
    )
    from dlo_operator.apicalls import api_client
    from dlo_operator.controller import Controller
    from dlo_operator.kopf_handlers import register

    registry = kopf.OperatorRegistry()
    register(Controller(api_client()), registry)

    if args.metrics_port:
        # The process's own collectors (python_info, gc, process) stay: they are the
        # operator's, where the worker drops them as noise in every engine's scrape.
        prometheus_client.start_http_server(args.metrics_port)

    kopf.run(
        registry=registry,
        standalone=True,
        # kopf wants a collection here even when cluster-wide (None crashes its
        # namespace fallback); an empty one with clusterwide=True watches everything.
        namespaces=args.namespace,
        clusterwide=not args.namespace,
        liveness_endpoint=args.liveness,
    )


if __name__ == "__main__":
    main()
