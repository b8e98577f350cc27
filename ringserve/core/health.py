"""What ``/health`` and ``/ready`` say about the server, as values (``surfaces/ringserve.py``
spells them).

``/health`` is liveness: the process is up, loading its model, or draining.
``/ready`` is readiness for traffic: loaded, not draining, the decode loop
running, and the stream-log backend reachable (Redis can be down).
"""

from __future__ import annotations

import enum


class Health(enum.StrEnum):
    """``GET /health``: 503 while :attr:`LOADING`, 200 otherwise (also while draining)."""

    LOADING = "loading"
    DRAINING = "draining"
    OK = "ok"


class Readiness(enum.StrEnum):
    """``GET /ready``: 200 only when :attr:`READY`."""

    LOADING = "loading"
    DRAINING = "draining"
    STOPPED = "stopped"
    STORE_UNAVAILABLE = "log store unavailable"
    READY = "ready"


def health(*, loaded: bool, draining: bool) -> Health:
    """The server's liveness: loading until the model is loaded, then draining or ok."""
    if not loaded:
        return Health.LOADING
    return Health.DRAINING if draining else Health.OK


def readiness(*, loaded: bool, draining: bool, running: bool, store_available: bool) -> Readiness:
    """The server's readiness, first failing check first (loaded, draining, decode loop, log store)."""
    if not loaded:
        return Readiness.LOADING
    if draining:
        return Readiness.DRAINING
    if not running:
        return Readiness.STOPPED
    if not store_available:
        return Readiness.STORE_UNAVAILABLE
    return Readiness.READY
