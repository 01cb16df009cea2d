"""Registrations' reconcile passes: the ones that queue up behind a pass run as one, a failed
pass does not end them, and a stop waits for the pass under way and begins no other."""

from __future__ import annotations

import logging
import threading

from fastshare.controller.registration_passes import RegistrationPasses

from .conftest import wait_for


class _Reconciler:
    """Records each pass's nodes; a pass holds while ``hold`` is clear, and fails while
    ``failing`` is set."""

    def __init__(self) -> None:
        self.passes: list[list[str]] = []
        self.ended: list[list[str]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.failing = False

    def run_once(self, nodes: list[str] | None = None) -> str:
        assert nodes is not None, "a registration's pass names its nodes"
        self.passes.append(nodes)
        self.hold.wait(30)
        self.ended.append(nodes)
        if self.failing:
            raise RuntimeError("the store is gone")
        return "report"


def test_registrations_queued_behind_a_pass_run_together_in_the_next():
    reconciler = _Reconciler()
    passes = RegistrationPasses(reconciler)
    try:
        reconciler.hold.clear()
        passes.add("n00")
        wait_for(lambda: reconciler.passes == [["n00"]], 10, "the first pass under way")
        for i in (*range(49, 0, -1), 7):   # out of order, and one node twice
            passes.add(f"n{i:02d}")
        reconciler.hold.set()
        wait_for(lambda: len(reconciler.ended) == 2, 10, "the second pass ended")
        assert reconciler.passes == [["n00"], [f"n{i:02d}" for i in range(1, 50)]]
        passes.add("n00")   # a registration after them gets a pass of its own
        wait_for(lambda: len(reconciler.ended) == 3, 10, "the third pass ended")
        assert reconciler.passes[2] == ["n00"]
    finally:
        passes.stop()


def test_a_failed_pass_is_logged_and_the_next_registration_gets_its_pass(caplog):
    reconciler = _Reconciler()
    reconciler.failing = True
    passes = RegistrationPasses(reconciler)
    try:
        with caplog.at_level(logging.INFO, "fastshare.controller.registration"):
            passes.add("n1")
            wait_for(lambda: reconciler.ended == [["n1"]], 10, "the failing pass")
            reconciler.failing = False
            passes.add("n2")
            wait_for(lambda: "node n2 reconciled after registering: report" in caplog.text, 10, "n2's pass")
        assert "the pass after node(s) n1 registered failed" in caplog.text
        assert "RuntimeError: the store is gone" in caplog.text
    finally:
        passes.stop()


def test_a_stop_waits_for_the_pass_under_way_and_drops_those_not_begun():
    """The controller closes its store once this stop returns: a pass still running would
    write to a closed store, and one begun later would read it."""
    reconciler = _Reconciler()
    passes = RegistrationPasses(reconciler)
    reconciler.hold.clear()
    passes.add("n1")
    wait_for(lambda: reconciler.passes == [["n1"]], 10, "the pass under way")
    passes.add("n2")
    stopper = threading.Thread(target=passes.stop)
    stopper.start()
    stopper.join(0.5)
    assert stopper.is_alive(), "the stop returned while a pass was still running"
    reconciler.hold.set()
    stopper.join(10)
    assert not stopper.is_alive()
    assert reconciler.passes == reconciler.ended == [["n1"]]   # n2's pass never began
