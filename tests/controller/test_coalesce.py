"""Coalescing calls to one agent: alone when idle, batched behind calls in flight, each caller
gets its own outcome, and a failed batch leaves the coalescer usable."""

import threading
import time

import pytest

from fastshare.controller.coalesce import Coalescer, QueueTimeout


class Recorder:
    """A ``send`` that records its batches; while ``gate`` is set to an unset Event, the
    first batch blocks until the test lets it go."""

    def __init__(self, fail_item=None, raise_on=None) -> None:
        self.batches: list[list[int]] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.fail_item = fail_item
        self.raise_on = raise_on

    def __call__(self, items: list[int]) -> list:
        self.batches.append(list(items))
        gate, self.gate = self.gate, None
        self.entered.set()
        if gate is not None:
            assert gate.wait(30)
        if self.raise_on is not None and self.raise_on in items:
            raise ConnectionError(f"batch with {self.raise_on} lost")
        return [ValueError(f"item {i} refused") if i == self.fail_item else i * 10 for i in items]


def _start(coalescer: Coalescer, items: list[int], outcomes: dict) -> list[threading.Thread]:
    def run(item: int) -> None:
        try:
            outcomes[item] = coalescer.call(item)
        except Exception as exc:   # the test looks at it
            outcomes[item] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in items]
    for t in threads:
        t.start()
    return threads


def _wait_waiting(coalescer: Coalescer, count: int) -> None:
    deadline = time.monotonic() + 30
    while len(coalescer._waiting) < count:
        assert time.monotonic() < deadline, "callers did not queue"
        time.sleep(0.005)


def _blocked_first_call(send: Recorder, coalescer: Coalescer, outcomes: dict) -> threading.Event:
    gate = threading.Event()
    send.entered.clear()
    send.gate = gate
    _start(coalescer, [1], outcomes)
    assert send.entered.wait(30)
    return gate


def _behind_a_blocked_call(send: Recorder, coalescer: Coalescer, items: list[int], outcomes: dict) -> None:
    """Call 1 blocks in ``send`` while ``items`` queue behind it; then all are let go."""
    gate = _blocked_first_call(send, coalescer, outcomes)
    threads = _start(coalescer, items, outcomes)
    _wait_waiting(coalescer, len(items))
    gate.set()
    for t in threads:
        t.join(30)


def test_an_idle_coalescer_sends_each_call_alone_at_once():
    send = Recorder()
    coalescer = Coalescer(send, max_in_flight=1)
    assert [coalescer.call(i) for i in (1, 2, 3)] == [10, 20, 30]
    assert send.batches == [[1], [2], [3]]


def test_calls_behind_one_in_flight_go_out_together_and_each_gets_its_own_result():
    send, outcomes = Recorder(), {}
    coalescer = Coalescer(send, max_in_flight=1)
    gate = _blocked_first_call(send, coalescer, outcomes)
    threads = _start(coalescer, [2, 3, 4, 5], outcomes)
    _wait_waiting(coalescer, 4)
    assert send.batches == [[1]]          # nothing else went out meanwhile
    gate.set()
    for t in threads:
        t.join(30)
    assert outcomes == {1: 10, 2: 20, 3: 30, 4: 40, 5: 50}
    assert sorted(send.batches[1]) == [2, 3, 4, 5] and len(send.batches) == 2
    assert (coalescer.batches, coalescer.calls) == (2, 5)


def test_a_refused_call_fails_alone_and_a_lost_batch_fails_all_of_its_calls():
    send, outcomes = Recorder(fail_item=3, raise_on=6), {}
    coalescer = Coalescer(send, max_in_flight=1)
    _behind_a_blocked_call(send, coalescer, [2, 3], outcomes)
    assert outcomes[2] == 20 and isinstance(outcomes[3], ValueError)
    _behind_a_blocked_call(send, coalescer, [6, 7], outcomes)
    assert isinstance(outcomes[6], ConnectionError) and isinstance(outcomes[7], ConnectionError)
    assert coalescer.call(8) == 80         # the slot was given back
    assert coalescer._in_flight == 0


def test_batches_are_capped_and_slots_beyond_one_send_at_once():
    send, outcomes = Recorder(), {}
    coalescer = Coalescer(send, max_in_flight=1, max_batch=3)
    _behind_a_blocked_call(send, coalescer, list(range(10, 17)), outcomes)
    assert [len(b) for b in send.batches] == [1, 3, 3, 1]
    assert outcomes == {1: 10, **{i: i * 10 for i in range(10, 17)}}

    two = Coalescer(Recorder(), max_in_flight=2)
    send2: Recorder = two._send
    gate = _blocked_first_call(send2, two, outcomes)
    assert two.call(20) == 200              # a second slot: not held up by the first call
    gate.set()


@pytest.mark.parametrize("field", ["max_in_flight", "max_batch"])
def test_limits_must_be_positive(field):
    with pytest.raises(ValueError, match="at least 1"):
        Coalescer(Recorder(), **{field: 0})


def test_a_call_still_queued_at_its_deadline_fails_unsent_and_the_coalescer_goes_on():
    send, outcomes = Recorder(), {}
    coalescer = Coalescer(send, max_in_flight=1, max_wait=0.2)
    gate = _blocked_first_call(send, coalescer, outcomes)
    threads = _start(coalescer, [2, 3], outcomes)
    for t in threads:
        t.join(30)                         # they give up while call 1 still holds the agent
    assert all(isinstance(outcomes[i], QueueTimeout) for i in (2, 3))
    assert "not sent" in str(outcomes[2]) and coalescer._waiting == []
    gate.set()
    assert coalescer.call(4) == 40         # call 1's slot came back; nothing queued was sent
    assert outcomes[1] == 10 and send.batches == [[1], [4]]


def test_max_wait_must_be_positive():
    with pytest.raises(ValueError, match="max_wait must be more than 0"):
        Coalescer(Recorder(), max_wait=0)


def test_a_refused_call_raises_its_own_error_rather_than_returning_it():
    coalescer = Coalescer(Recorder(fail_item=1), max_in_flight=1)
    with pytest.raises(ValueError, match="item 1 refused"):
        coalescer.call(1)
    assert coalescer.call(2) == 20


def test_a_send_that_answers_a_batch_with_the_wrong_number_of_results_fails_each_call():
    coalescer = Coalescer(lambda items: [0] * (len(items) + 1), max_in_flight=1)
    with pytest.raises(RuntimeError, match="a batch of 1 calls got 2 results"):
        coalescer.call(1)
    assert coalescer._in_flight == 0


def test_limits_of_one_are_allowed_and_a_batch_of_one_sends_calls_one_by_one():
    send, outcomes = Recorder(), {}
    coalescer = Coalescer(send, max_in_flight=1, max_batch=1)
    _behind_a_blocked_call(send, coalescer, [2, 3], outcomes)
    assert [len(b) for b in send.batches] == [1, 1, 1]
    assert outcomes == {1: 10, 2: 20, 3: 30}
