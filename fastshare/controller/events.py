"""Allocation change events for Watch: a fan-out to bounded per-subscriber queues.

A slow watcher never blocks the controller: when its queue is full it is dropped (its stream
ends with an error and it can watch again).
"""

from __future__ import annotations

import queue
import threading

from fastshare.controller.model import Allocation

QUEUE_SIZE = 1000


class Subscription:
    def __init__(self, allocation_id: str = "") -> None:
        self.allocation_id = allocation_id
        self.queue: queue.Queue[Allocation | None] = queue.Queue(QUEUE_SIZE)
        self.overflowed = False

    def get(self, timeout: float) -> Allocation | None:
        """The next event, or None after ``timeout`` seconds (or once closed)."""
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None


class EventHub:
    def __init__(self) -> None:
        self._subs: set[Subscription] = set()
        self._lock = threading.Lock()

    def subscribe(self, allocation_id: str = "") -> Subscription:
        sub = Subscription(allocation_id)
        with self._lock:
            self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subs.discard(sub)

    def publish(self, allocation: Allocation) -> None:
        with self._lock:
            subs = list(self._subs)
        for sub in subs:
            if sub.allocation_id and sub.allocation_id != allocation.id:
                continue
            try:
                sub.queue.put_nowait(allocation)
            except queue.Full:
                sub.overflowed = True
                self.unsubscribe(sub)
