"""The servers' interpreter settings: the heap frozen after each pass, cycles still collected."""

import gc
import sys
import weakref

import pytest

from fastshare import server_runtime


class _Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def restored():
    """These settings are the process's own: each test starts in a process that is no server
    yet (an in-process `controller serve` of an earlier test may have made it one), and the test
    session gets its settings back."""
    thresholds, interval = gc.get_threshold(), sys.getswitchinterval()
    gc.unfreeze()
    server_runtime._last_unfreeze = None
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)
    sys.setswitchinterval(interval)
    server_runtime._last_unfreeze = None


def test_before_a_server_starts_a_pass_changes_nothing(restored):
    frozen = gc.get_freeze_count()
    garbage = weakref.ref(_Cycle())
    server_runtime.settle_after_pass()
    assert gc.get_freeze_count() == frozen
    gc.collect()
    assert garbage() is None


def test_a_server_collects_what_a_pass_left_and_freezes_what_lives_on(restored):
    thresholds = gc.get_threshold()
    server_runtime.settle_startup()
    assert gc.get_threshold() == thresholds   # a server without passes (the agent) keeps them
    assert sys.getswitchinterval() == pytest.approx(server_runtime.SWITCH_INTERVAL_S)
    frozen_at_start = gc.get_freeze_count()
    kept = [_Cycle() for _ in range(1000)]          # the cluster's state, grown since the start
    dropped = weakref.ref(_Cycle())                  # a pass's cyclic garbage
    server_runtime.settle_after_pass(now=server_runtime._last_unfreeze + 1)
    assert gc.get_threshold()[2] == server_runtime.FULL_PASS_THRESHOLD
    assert dropped() is None
    assert gc.get_freeze_count() >= frozen_at_start + len(kept)
    walked = {id(o) for o in gc.get_objects()}   # what a collection still looks at
    assert not any(id(c) in walked for c in kept)


def test_a_cycle_frozen_and_dropped_is_collected_at_the_hourly_full_collection(restored):
    server_runtime.settle_startup()
    started = server_runtime._last_unfreeze
    frozen_cycle = _Cycle()
    server_runtime.settle_after_pass(now=started + 1)
    gone = weakref.ref(frozen_cycle)
    del frozen_cycle
    server_runtime.settle_after_pass(now=started + 2)
    assert gone() is not None, "frozen: no collection looks at it until the hourly one"
    server_runtime.settle_after_pass(now=started + 1 + server_runtime.UNFREEZE_EVERY_S)
    assert gone() is None


def test_a_paused_build_runs_no_collection_and_outside_a_server_only_resumes_it(restored):
    frozen, collections = gc.get_freeze_count(), []
    callback = lambda phase, info: collections.append(phase)  # noqa: E731
    gc.callbacks.append(callback)
    try:
        with server_runtime.collection_paused():
            built = [_Cycle() for _ in range(20_000)]   # some 30 young collections' worth
            during = len(collections)
    finally:
        gc.callbacks.remove(callback)
    assert during == 0 and len(built) == 20_000
    assert gc.isenabled() and gc.get_freeze_count() == frozen


def test_a_server_collects_what_its_paused_build_left_and_freezes_the_rest_before_resuming(restored):
    server_runtime.settle_startup()
    frozen = gc.get_freeze_count()
    with pytest.raises(RuntimeError), server_runtime.collection_paused():
        kept = [_Cycle() for _ in range(1000)]
        dropped = weakref.ref(_Cycle())
        raise RuntimeError("a start that failed half-way")
    assert dropped() is None
    assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(kept)


def test_a_collector_turned_off_before_stays_off(restored):
    gc.disable()
    try:
        with server_runtime.collection_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
