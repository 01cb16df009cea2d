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
