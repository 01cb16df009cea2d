"""The controller's work queue: serial per key, duplicates collapse, delayed adds (requeue-after)."""

from __future__ import annotations

import threading
import time

from fastshare.k8s.workqueue import WorkQueue


def test_a_key_added_while_active_is_processed_again_afterwards_and_never_twice_at_once():
    queue = WorkQueue()
    queue.add("a")
    assert queue.get(timeout=1) == "a"
    queue.add("a")
    assert queue.get(timeout=0.1) is None   # held: not handed to a second worker
    queue.done("a")
    assert queue.get(timeout=1) == "a"
    queue.done("a")
    assert queue.get(timeout=0.1) is None


def test_delayed_adds_of_one_key_collapse_so_requeues_do_not_multiply():
    """Every pass of a FastPod that cannot be placed yet requeues it after a delay, and every watch
    event or resync adds it at once: each of those passes requeues it again. Delayed adds of a
    key already waiting must collapse (the earlier time wins, as in client-go), or each event
    starts one more requeue chain that never ends, and a stuck FastPod's passes grow without
    bound."""
    queue = WorkQueue()
    passes = 0
    stop = threading.Event()

    def worker() -> None:
        nonlocal passes
        while not stop.is_set():
            key = queue.get(timeout=0.05)
            if key is None:
                continue
            passes += 1
            queue.done(key)
            queue.add(key, delay=0.2)   # the pass's requeue-after

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        for _ in range(8):   # watch events spread over one requeue period
            queue.add("fp")
            time.sleep(0.025)
        passes_before = passes
        time.sleep(2.0)
        later = passes - passes_before
    finally:
        stop.set()
        queue.close()
        thread.join(5)
    assert later <= 12, f"{later} passes in 2 s for one key requeued every 0.2 s"
    assert len(queue) <= 1


def test_an_earlier_delayed_add_wins_over_a_later_one():
    queue = WorkQueue()
    queue.add("k", delay=30)
    queue.add("k", delay=0.1)
    assert queue.get(timeout=2) == "k"
    queue.done("k")
    assert len(queue) == 0


def _get_in_thread(queue: WorkQueue, timeout: float | None = None) -> tuple[threading.Thread, list]:
    """A worker blocked in get() (no timeout unless given): what it got lands in the list."""
    got: list = []
    thread = threading.Thread(target=lambda: got.append(queue.get(timeout)), daemon=True)
    thread.start()
    time.sleep(0.1)   # let it block
    return thread, got


def test_a_worker_blocked_without_a_timeout_wakes_for_an_add_a_due_key_and_a_done():
    queue = WorkQueue()
    thread, got = _get_in_thread(queue)
    queue.add("now")
    thread.join(2)
    assert got == ["now"]

    thread, got = _get_in_thread(queue)   # waits for the delayed key's time, not for ever
    queue.add("later", delay=0.2)
    thread.join(2)
    assert got == ["later"]

    queue.add("now")                      # "now" is still held: dirty, not ready
    thread, got = _get_in_thread(queue)
    assert got == []
    queue.done("now")                     # its second run is handed to the waiting worker
    thread.join(2)
    assert got == ["now"]


def test_close_wakes_the_waiting_workers_and_later_adds_are_ignored():
    queue = WorkQueue()
    thread, got = _get_in_thread(queue)
    queue.close()
    thread.join(2)
    assert got == [None] and not thread.is_alive()
    queue.add("k")
    queue.add("k", delay=0.01)
    assert len(queue) == 0
    assert queue.get(timeout=0.2) is None


def test_a_due_key_that_is_being_processed_runs_again_after_done_not_beside_it():
    queue = WorkQueue()
    queue.add("k")
    assert queue.get(timeout=1) == "k"
    queue.add("k", delay=0.05)
    time.sleep(0.1)
    assert queue.get(timeout=0.1) is None   # due, but held
    queue.done("k")
    assert queue.get(timeout=1) == "k"
    queue.done("k")
    assert queue.get(timeout=0.2) is None   # once, not twice


def test_a_later_delayed_add_neither_delays_nor_repeats_a_waiting_key():
    queue = WorkQueue()
    queue.add("k", delay=0.1)
    queue.add("k", delay=0.5)               # the earlier time wins ...
    started = time.monotonic()
    assert queue.get(timeout=2) == "k"
    assert time.monotonic() - started < 0.4
    queue.done("k")
    assert queue.get(timeout=0.8) is None   # ... and the later one does not come as well

    queue.add("j", delay=0.5)
    queue.add("j", delay=0.1)               # an earlier time supersedes the waiting one
    assert queue.get(timeout=2) == "j"
    queue.done("j")
    assert queue.get(timeout=0.8) is None   # the superseded entry is skipped


def test_a_delayed_key_already_ready_is_not_queued_twice_and_len_counts_both_kinds():
    queue = WorkQueue()
    queue.add("a")
    queue.add("b", delay=30)
    assert len(queue) == 2
    queue.add("a", delay=0.05)
    time.sleep(0.1)
    assert queue.get(timeout=1) == "a"
    queue.done("a")
    assert queue.get(timeout=0.2) is None   # "a" was ready when its delayed add fell due: once
    assert len(queue) == 1                  # "b" still waits


def test_get_with_a_timeout_returns_none_once_it_has_passed_even_with_a_later_key_waiting():
    queue = WorkQueue()
    queue.add("k", delay=5)
    started = time.monotonic()
    assert queue.get(timeout=0.2) is None
    assert 0.15 < time.monotonic() - started < 2


def test_adds_of_a_queued_key_collapse_and_a_done_key_is_ready_again_at_once():
    queue = WorkQueue()
    queue.add("a")
    queue.add("a")
    started = time.monotonic()
    assert queue.get(timeout=2) == "a"
    assert time.monotonic() - started < 0.5   # an add without delay is ready at once
    queue.done("a")
    assert queue.get(timeout=0.2) is None     # the second add collapsed into the first
    queue.add("a")                            # no longer held: ready, not marked for later
    assert queue.get(timeout=0.5) == "a"


def test_a_delayed_key_made_ready_is_not_queued_again_by_a_plain_add():
    queue = WorkQueue()
    queue.add("a")
    queue.add("b", delay=0.05)
    time.sleep(0.1)
    assert queue.get(timeout=1) == "a"        # "b" fell due and is ready behind it
    queue.add("b")
    assert queue.get(timeout=1) == "b"
    queue.done("b")
    assert queue.get(timeout=0.2) is None     # once
