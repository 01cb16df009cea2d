"""The reconcile pass a node's registration starts, coalesced across registrations.

A controller restart has every agent register again within a heartbeat interval. One thread per
registration, each with its own pass, made 1,000 threads at 1,000 nodes, queued on the
reconciler's lock and never waited for at stop (so they could write to a closed store); while
each pass also read the whole cluster, they took 218 s, and the housekeeping waited 105 s among
them (bench/registration_storm.py). Here one thread runs the passes, each taking every node
registered since the last one began, and the controller's stop waits for it.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

log = logging.getLogger("fastshare.controller.registration")


class _Reconciler(Protocol):
    def run_once(self, nodes: list[str] | None = None) -> object: ...


class RegistrationPasses:
    """A pass adopts the shares a node holds that are newer than the store and settles its
    allocations; its log line tells the operator (and tests) the node is taken in.

    ``add(node)`` after a node registered; ``stop()`` waits for a pass under way and drops the
    ones not begun (the next controller's start reconciles every node)."""

    def __init__(self, reconciler: _Reconciler) -> None:
        self._reconciler = reconciler
        self._pending: set[str] = set()
        self._stopping = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="registration-passes", daemon=True)
        self._thread.start()

    def add(self, node: str) -> None:
        with self._changed:
            self._pending.add(node)
            self._changed.notify()

    def stop(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify()
        self._thread.join()

    def _next(self) -> list[str] | None:
        with self._changed:
            while not self._pending and not self._stopping:
                self._changed.wait()
            if self._stopping:
                return None
            nodes = sorted(self._pending)
            self._pending.clear()
            return nodes

    def _run(self) -> None:
        while (nodes := self._next()) is not None:
            try:
                report = self._reconciler.run_once(nodes)
            except Exception:
                # the periodic pass reconciles these nodes in a few seconds anyway
                log.exception("the pass after node(s) %s registered failed", ", ".join(nodes))
                continue
            if len(nodes) == 1:
                log.info("node %s reconciled after registering: %s", nodes[0], report)
            else:
                log.info("nodes %s reconciled after registering, in one pass: %s", ", ".join(nodes), report)
