"""A small work queue: each key is processed by one worker at a time, duplicates collapse.

Like client-go's workqueue: a key added while it is being processed is processed again
afterwards (so no event is lost), and never by two workers at once (so one FastPod is
reconciled serially). Delayed adds serve requeue-after; a key waits at most once (the earliest
time asked wins), so requeues do not multiply with every event that adds the key meanwhile.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Hashable


class WorkQueue:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ready: list[Hashable] = []        # FIFO of keys ready to process
        self._queued: set[Hashable] = set()     # keys in _ready
        self._active: set[Hashable] = set()     # keys a worker holds
        self._dirty: set[Hashable] = set()      # added while active: process again after done()
        self._later: list[tuple[float, int, Hashable]] = []   # heap; entries superseded in _waiting skipped
        self._waiting: dict[Hashable, float] = {}  # key -> when its delayed add is due
        self._seq = 0
        self._closed = False

    def add(self, key: Hashable, delay: float = 0.0) -> None:
        with self._cond:
            if self._closed:
                return
            if delay > 0:
                due = time.monotonic() + delay
                if self._waiting.get(key, due + 1) <= due:
                    return   # already waiting, due sooner
                self._waiting[key] = due
                self._seq += 1
                heapq.heappush(self._later, (due, self._seq, key))
            elif key in self._active:
                self._dirty.add(key)
            elif key not in self._queued:
                self._queued.add(key)
                self._ready.append(key)
            self._cond.notify_all()

    def _promote(self) -> float | None:
        """Move due delayed keys to ready; returns seconds until the next one (None: none)."""
        now = time.monotonic()
        while self._later and self._later[0][0] <= now:
            due, _, key = heapq.heappop(self._later)
            if self._waiting.get(key) != due:
                continue   # superseded by an earlier delayed add
            del self._waiting[key]
            if key in self._active:
                self._dirty.add(key)
            elif key not in self._queued:
                self._queued.add(key)
                self._ready.append(key)
        return self._later[0][0] - now if self._later else None

    def get(self, timeout: float | None = None) -> Hashable | None:
        """The next key (now held by the caller), or None when closed or timed out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    return None
                wait = self._promote()
                if self._ready:
                    key = self._ready.pop(0)
                    self._queued.discard(key)
                    self._active.add(key)
                    return key
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    wait = left if wait is None else min(wait, left)
                self._cond.wait(wait)

    def done(self, key: Hashable) -> None:
        with self._cond:
            self._active.discard(key)
            if key in self._dirty:
                self._dirty.discard(key)
                if key not in self._queued:
                    self._queued.add(key)
                    self._ready.append(key)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._ready) + len(self._waiting)
