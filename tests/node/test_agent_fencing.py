"""Fencing tokens: every call that changes a GPU may carry the controller's leader term (call
metadata ``fastshare-term``); the agent remembers the highest term it has seen, in its journal,
and refuses calls from an older term: a deposed controller's call that lands late cannot undo
or redo what the new leader did meanwhile. Calls without a term (the standalone controller,
the node's own CLI) are accepted as before."""

import threading
import time

import grpc
import pytest

from fastshare.controller import agent_client
from fastshare.node import terms
from fastshare.node.agent import AgentError, Deadline
from fastshare.node.journal import Journal
from fastshare.node.terms import LeaderTerms, StaleTerm
from fastshare.v1 import agent_pb2

from .harness import GPU_A, GPU_B, GPU_MIG, fastpod, share

INV = agent_pb2.GetInventoryRequest()


def _term(n):
    return (("fastshare-term", str(n)),)


def _refused(call, request, term):
    with pytest.raises(grpc.RpcError) as caught:
        call(request, timeout=60, metadata=_term(term))
    return caught.value


def _uuids(agent):
    return [g.uuid for g in agent.unix().GetInventory(INV, timeout=30).gpus]


def _shares(agent):
    return sorted(s.id for s in agent.unix().GetInventory(INV, timeout=30).shares)


def test_a_call_from_an_older_term_is_refused_and_changes_nothing(agent, devices):
    agent.start()
    mig_gpu, gpu_a, gpu_b = (_uuids(agent)[i] for i in (GPU_MIG, GPU_A, GPU_B))
    stub = agent.mtls()
    stub.PrepareShare(fastpod("new", gpu_a), timeout=60, metadata=_term(4))

    err = _refused(stub.PrepareShare, share("old", "exclusive", [mig_gpu], mig_profile="1g.10gb"), 3)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == "request from leader term 3; this agent has seen term 4: a newer controller leads"
    assert dict(err.trailing_metadata())["fastshare-term-seen"] == "4"
    assert devices.mig_instances(GPU_MIG) == []   # no slice made on the (simulated) GPU

    err = _refused(stub.ReleaseShare, agent_pb2.ReleaseShareRequest(share_id="new"), 3)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    batch = agent_pb2.PrepareSharesRequest(calls=[fastpod("b1", gpu_b), fastpod("b2", gpu_b)])
    assert _refused(stub.PrepareShares, batch, 3).code() == grpc.StatusCode.FAILED_PRECONDITION
    batch = agent_pb2.ReleaseSharesRequest(calls=[agent_pb2.ReleaseShareRequest(share_id="new")])
    assert _refused(stub.ReleaseShares, batch, 2).code() == grpc.StatusCode.FAILED_PRECONDITION
    mode = agent_pb2.SetMigModeRequest(gpu_uuid=mig_gpu, enabled=False)
    assert _refused(stub.SetMigMode, mode, 0).code() == grpc.StatusCode.FAILED_PRECONDITION
    layout = agent_pb2.MigLayoutRequest(gpu_uuid=mig_gpu, profiles={"1g.10gb": 1})
    assert _refused(stub.ApplyMigLayout, layout, 3).code() == grpc.StatusCode.FAILED_PRECONDITION

    assert _shares(agent) == ["new"]
    inventory = agent.unix().GetInventory(INV, timeout=30)
    assert inventory.gpus[GPU_MIG].mig_enabled and not inventory.gpus[GPU_MIG].mig_devices
    # the same term and a newer one go through
    stub.PrepareShare(fastpod("same", gpu_b), timeout=60, metadata=_term(4))
    stub.ReleaseShare(agent_pb2.ReleaseShareRequest(share_id="same"), timeout=60, metadata=_term(5))
    assert _refused(stub.PrepareShare, fastpod("four", gpu_b), 4).details().endswith(
        "this agent has seen term 5: a newer controller leads")


def test_the_highest_term_seen_survives_a_restart(agent):
    agent.start()
    gpu = _uuids(agent)[GPU_A]
    agent.mtls().PrepareShare(fastpod("a", gpu), timeout=60, metadata=_term(7))
    agent.kill9()
    agent.start()
    err = _refused(agent.mtls().PrepareShare, fastpod("b", gpu), 6)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "has seen term 7" in err.details()
    agent.stop()
    agent.start()
    assert _refused(agent.mtls().ReleaseShare, agent_pb2.ReleaseShareRequest(share_id="a"), 6).code() \
        == grpc.StatusCode.FAILED_PRECONDITION
    assert _shares(agent) == ["a"]


def test_calls_without_a_term_are_accepted_after_one_was_seen(agent):
    agent.start()
    gpu = _uuids(agent)[GPU_A]
    agent.mtls().PrepareShare(fastpod("fenced", gpu), timeout=60, metadata=_term(4))
    agent.mtls().PrepareShare(fastpod("plain", gpu), timeout=60)             # a standalone controller
    agent.unix().ReleaseShare(agent_pb2.ReleaseShareRequest(share_id="fenced"), timeout=60)   # the CLI
    assert _shares(agent) == ["plain"]


@pytest.mark.parametrize("value", ["three", "-1", "2147483648", "", "1" * 5000])
def test_a_malformed_term_is_refused_with_the_allowed_range(agent, value):
    agent.start()
    gpu = _uuids(agent)[GPU_A]
    with pytest.raises(grpc.RpcError) as caught:
        agent.mtls().PrepareShare(fastpod("a", gpu), timeout=60, metadata=(("fastshare-term", value),))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == ("fastshare-term (call metadata): must be a whole number in "
                                      f"0..2147483647 (the controller's leader term), got {value!r}")
    assert _shares(agent) == []


def test_a_newer_term_waits_for_the_older_terms_calls_under_way(tmp_path):
    """A call of term 3 admitted before term 4 was seen finishes before any call of term 4 acts:
    otherwise it could still change a GPU after the new leader's call, as if never fenced."""
    journal = Journal(tmp_path / "journal.db")
    terms = LeaderTerms(journal)
    order = []
    with terms.hold(3, Deadline(5)):
        newer = threading.Thread(target=lambda: _act(terms, 4, order))
        newer.start()
        time.sleep(0.3)
        order.append(3)
    newer.join(10)
    assert order == [3, 4]
    with pytest.raises(StaleTerm), terms.hold(3, Deadline(5)):
        pass
    journal.close()
    assert LeaderTerms(Journal(tmp_path / "journal.db")).highest == 4   # from the journal


def test_a_newer_term_gives_up_at_its_deadline_if_an_older_call_never_ends(tmp_path):
    terms = LeaderTerms(Journal(tmp_path / "journal.db"))
    with terms.hold(3, Deadline(5)), pytest.raises(AgentError) as caught, terms.hold(4, Deadline(0.2)):
        pass
    assert caught.value.code == "DEADLINE_EXCEEDED" and "term 3" in str(caught.value)


def _act(terms, term, order):
    with terms.hold(term, Deadline(5)):
        order.append(term)


def test_a_term_too_long_for_a_number_is_refused_with_the_allowed_range():
    """Thousands of digits: Python's int() gives up (ValueError), which answered INTERNAL ("failed
    inside the agent") instead of naming the metadata and its range."""
    with pytest.raises(AgentError) as caught:
        terms.parse(["1" * 5000])
    assert caught.value.code == "INVALID_ARGUMENT"
    assert str(caught.value).startswith("fastshare-term (call metadata): must be a whole number in "
                                        "0..2147483647 (the controller's leader term), got '111")


# The fencing rules on their own (no agent process): parse, LeaderTerms -----------------------

_RANGE = ("fastshare-term (call metadata): must be a whole number in 0..2147483647 (the controller's "
          "leader term)")


def test_the_metadata_keys_are_the_ones_the_controller_sends_and_reads():
    assert (terms.METADATA_KEY, terms.SEEN_KEY) == (agent_client.TERM_KEY, agent_client.SEEN_KEY)


@pytest.mark.parametrize("values, term", [([], None), (["0"], 0), (["7"], 7), (["0007"], 7),
                                          (["0" * 12 + "7"], 7), (["2147483647"], 2147483647)])
def test_a_term_is_a_whole_number_up_to_int32(values, term):
    assert terms.parse(values) == term


@pytest.mark.parametrize("values", [["2147483648"], ["3", "4"], ["\u0663"], [" 3"], ["3 "], ["+3"], ["1e3"]])
def test_anything_else_is_refused_naming_the_metadata_and_its_range(values):
    with pytest.raises(AgentError) as caught:
        terms.parse(values)
    assert caught.value.code == "INVALID_ARGUMENT"
    assert str(caught.value) == f"{_RANGE}, got {','.join(values)!r}"


def test_a_stale_term_names_both_terms_and_carries_the_one_seen():
    stale = StaleTerm(3, 4)
    assert (stale.code, stale.seen) == ("FAILED_PRECONDITION", 4)
    assert str(stale) == "request from leader term 3; this agent has seen term 4: a newer controller leads"


def test_calls_without_a_term_are_not_fenced_and_record_nothing(tmp_path):
    journal = Journal(tmp_path / "journal.db")
    fencing = LeaderTerms(journal)
    with fencing.hold(None, Deadline(5)):
        pass
    assert fencing.highest is None and journal.leader_term() is None
    with fencing.hold(2, Deadline(5)), fencing.hold(None, Deadline(0)):   # not behind the call of term 2
        pass
    assert journal.leader_term() == 2


def test_each_new_term_is_recorded_before_its_call_acts_and_refused_below_after_a_restart(tmp_path):
    journal = Journal(tmp_path / "journal.db")
    fencing = LeaderTerms(journal)
    with fencing.hold(0, Deadline(5)):
        assert journal.leader_term() == 0
    with fencing.hold(2, Deadline(5)):
        assert journal.leader_term() == 2 and fencing.highest == 2
    with fencing.hold(2, Deadline(5)), fencing.hold(2, Deadline(5)):   # the same term again, concurrently
        assert journal.leader_term() == 2
    journal.close()
    again = LeaderTerms(Journal(tmp_path / "journal.db"))
    with pytest.raises(StaleTerm) as caught, again.hold(1, Deadline(5)):
        pass
    assert caught.value.seen == 2
    with again.hold(2, Deadline(0)):
        pass


def test_a_newer_term_waits_for_every_older_call_under_way(tmp_path):
    journal = Journal(tmp_path / "journal.db")
    fencing = LeaderTerms(journal)
    order: list[int] = []
    first, second = fencing.hold(3, Deadline(5)), fencing.hold(3, Deadline(5))
    first.__enter__()
    second.__enter__()
    newer = threading.Thread(target=lambda: _act(fencing, 4, order))
    newer.start()
    time.sleep(0.2)
    first.__exit__(None, None, None)
    time.sleep(0.2)
    assert order == [] and journal.leader_term() == 3   # one call of term 3 still acts
    started = time.monotonic()
    second.__exit__(None, None, None)
    newer.join(10)
    assert order == [4] and time.monotonic() - started < 2 and journal.leader_term() == 4
    with fencing.hold(5, Deadline(0)):   # nothing older under way: no wait at all
        pass


def test_a_call_that_waited_is_refused_if_a_newer_term_came_meanwhile(tmp_path):
    journal = Journal(tmp_path / "journal.db")
    fencing = LeaderTerms(journal)
    outcome: dict[int, str] = {}

    def call(term):
        try:
            with fencing.hold(term, Deadline(5)):
                outcome[term] = "acted"
        except StaleTerm as exc:
            outcome[term] = f"stale, seen {exc.seen}"

    with fencing.hold(3, Deadline(5)):
        waiting = [threading.Thread(target=call, args=(4,))]
        waiting[0].start()
        time.sleep(0.2)
        waiting.append(threading.Thread(target=call, args=(5,)))
        waiting[1].start()
        time.sleep(0.2)
    for thread in waiting:
        thread.join(10)
    assert outcome == {4: "stale, seen 5", 5: "acted"} and journal.leader_term() == 5


def test_a_newer_term_that_gave_up_waiting_still_fences_the_older_one(tmp_path):
    journal = Journal(tmp_path / "journal.db")
    fencing = LeaderTerms(journal)
    with fencing.hold(3, Deadline(5)):
        with pytest.raises(AgentError) as caught, fencing.hold(4, Deadline(0.1)):
            pass
        assert caught.value.code == "DEADLINE_EXCEEDED"
        assert str(caught.value) == ("calls of leader term 3 still under way; the call of term 4 waited "
                                     "for them until its deadline")
        # term 4 was seen: the old leader's next call is refused
        with pytest.raises(StaleTerm), fencing.hold(3, Deadline(5)):
            pass
    assert journal.leader_term() == 3   # recorded only by a call of term 4 that acts


def test_calls_of_the_new_term_that_waited_together_then_act_together(tmp_path):
    """Once the old term's calls are done, the new leader's calls run side by side: none waits
    for another of its own term (a MIG creation would otherwise hold up every other call)."""
    fencing = LeaderTerms(Journal(tmp_path / "journal.db"))
    together = threading.Barrier(2, timeout=5)
    outcome: list[str] = []

    def call():
        try:
            with fencing.hold(4, Deadline(3)):
                together.wait()
                outcome.append("acted")
        except (AgentError, threading.BrokenBarrierError) as exc:
            outcome.append(repr(exc))

    with fencing.hold(3, Deadline(5)):
        calls = [threading.Thread(target=call) for _ in range(2)]
        for thread in calls:
            thread.start()
        time.sleep(0.2)
    for thread in calls:
        thread.join(10)
    assert outcome == ["acted", "acted"]
