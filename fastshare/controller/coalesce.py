"""Coalescing calls to one node agent: calls that queue up go out together as one batch RPC.

While fewer than ``max_in_flight`` calls to an agent are out, a call is sent at once, alone:
an idle controller adds no delay. Calls made beyond that wait, and the next free slot sends
every waiting call (up to ``max_batch``) in one RPC. Under load the per-RPC costs (a gRPC
round trip on both sides, the thread switches around it, the agent's durability barrier) are
then paid once per batch instead of once per call, so the cost of a request falls as the
queue grows instead of the queue growing without bound.

No thread of its own: the caller whose call opens a batch sends it (leader/follower); when a
batch returns and calls are waiting, the first of them becomes the next batch's sender.

A waiting call has a deadline of its own (``max_wait``): one still queued when it passes is
taken out and fails with :class:`QueueTimeout`, never sent, so a hung agent cannot hold callers
for the sum of every batch ahead of them. A call already sent waits for its batch, whose RPC
has its own deadline.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class QueueTimeout(TimeoutError):
    """The call waited ``max_wait`` seconds behind earlier calls and was not sent."""


class _Call(Generic[T, R]):
    """One caller's call: its item, then its outcome or the batch it must send."""

    __slots__ = ("_wake", "batch", "error", "item", "result")

    def __init__(self, item: T) -> None:
        self.item = item
        self.result: R | None = None
        self.error: BaseException | None = None
        self.batch: list[_Call[T, R]] | None = None
        self._wake = threading.Lock()
        self._wake.acquire()

    def wait(self, timeout: float) -> bool:
        return self._wake.acquire(timeout=timeout)

    def wake(self) -> None:
        self._wake.release()

    def outcome(self) -> R:
        if self.error is not None:
            raise self.error
        return self.result  # type: ignore[return-value]


class Coalescer(Generic[T, R]):
    """``call(item)`` as if alone; ``send(items)`` returns one result or exception per item."""

    def __init__(self, send: Callable[[list[T]], Sequence[R | BaseException]],
                 max_in_flight: int = 2, max_batch: int = 64, max_wait: float = 10.0) -> None:
        if max_in_flight < 1 or max_batch < 1:
            raise ValueError("max_in_flight and max_batch must be at least 1")
        if max_wait <= 0:
            raise ValueError("max_wait must be more than 0 seconds")
        self._send = send
        self._max_in_flight = max_in_flight
        self._max_batch = max_batch
        self._max_wait = max_wait
        self._lock = threading.Lock()
        self._in_flight = 0           # batches out
        self._waiting: list[_Call[T, R]] = []
        self.batches = 0              # RPCs sent (tests, benchmarks)
        self.calls = 0

    def call(self, item: T) -> R:
        me: _Call[T, R] = _Call(item)
        with self._lock:
            if self._in_flight < self._max_in_flight:
                self._in_flight += 1
                me.batch = [me]
            else:
                self._waiting.append(me)
        if me.batch is None and not me.wait(self._max_wait):
            with self._lock:
                if me in self._waiting:   # still queued: give up without sending
                    self._waiting.remove(me)
                    raise QueueTimeout(f"waited {self._max_wait:g} s behind earlier calls; not sent")
            me.wait(-1)               # taken into a batch just now: its outcome (or the batch) comes
        if me.batch is not None:
            self._run(me.batch)
        return me.outcome()

    def _run(self, batch: list[_Call[T, R]]) -> None:
        """Send ``batch``, hand out the outcomes, then pass the slot on (or free it)."""
        try:
            outcomes = list(self._send([c.item for c in batch]))
            if len(outcomes) != len(batch):
                raise RuntimeError(f"a batch of {len(batch)} calls got {len(outcomes)} results")
        except BaseException as exc:   # the RPC as a whole failed: every call in it did
            outcomes = [exc] * len(batch)
        with self._lock:
            self.batches += 1
            self.calls += len(batch)
            following = self._waiting[:self._max_batch]
            del self._waiting[:self._max_batch]
            if not following:
                self._in_flight -= 1
        for call, outcome in zip(batch, outcomes, strict=True):
            call.batch = None
            if isinstance(outcome, BaseException):
                call.error = outcome
            else:
                call.result = outcome
            if call is not batch[0]:
                call.wake()
        if following:
            following[0].batch = following
            following[0].wake()
