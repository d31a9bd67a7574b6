"""Logs, Prometheus metrics and host-memory accounting; imports nothing of the worker."""
