"""The allocation sequence against a real SQLite store: which share numbers a state database
never issued (a share with one is newer than the database: adopted, not freed), also after a
restore from a backup once new allocations have moved the high-water mark past the lost ones;
and a node the restored database does not know takes no new work until its newer shares are
adopted. The agent is a recording stand-in: the decisions are the controller's."""

from __future__ import annotations

import shutil
import sqlite3
import time

import grpc

from fastshare.controller.agent_client import AgentError
from fastshare.controller.core import ControllerCore, new_id
from fastshare.controller.model import Allocation, Kind, Spec, State, sequence_of
from fastshare.controller.reconciler import Reconciler
from fastshare.controller.sqlite_store import SqliteStore
from fastshare.v1 import agent_pb2, common_pb2

from .recording_agent import RecordingAgent

GiB = 1024**3


def _record(store: SqliteStore) -> str:
    allocation_id = new_id(store.next_sequence())
    store.create_allocation(Allocation(id=allocation_id, spec=Spec(Kind.MPS, memory_bytes=GiB), owner="me",
                                       state=State.RELEASED, node="n1", created_at=time.time()))
    return allocation_id


def _copy(store_path, to) -> None:
    source, copy = sqlite3.connect(store_path), sqlite3.connect(to)
    source.backup(copy)
    source.close()
    copy.close()


def test_ids_carry_a_growing_sequence_and_old_ids_none():
    assert sequence_of(new_id(0x1234)) == 0x1234 and new_id(0x1234).startswith("fs-1234-")
    assert sequence_of("fs-0123456789abcdef") is None      # made before the sequence
    assert sequence_of("fs-1234-0000000g") is None and sequence_of("other-1234-00000000") is None
    assert sequence_of(new_id(None)) is None


def test_a_restored_database_still_knows_what_it_never_issued(tmp_path):
    path = tmp_path / "state.db"
    store = SqliteStore(path)
    kept = sequence_of(_record(store))
    _copy(path, tmp_path / "backup.db")                       # the backup
    lost = [sequence_of(_record(store)) for _ in range(2)]    # allocated after it
    assert not store.never_issued(kept) and not any(store.never_issued(s) for s in lost)
    store.close()

    shutil.copy(tmp_path / "backup.db", path)                 # restored
    (tmp_path / "state.db-wal").unlink(missing_ok=True)
    (tmp_path / "state.db-shm").unlink(missing_ok=True)
    restored = SqliteStore(path)
    assert all(restored.never_issued(s) for s in lost) and not restored.never_issued(kept)
    fresh = sequence_of(_record(restored))                    # new work moves the mark past them
    assert fresh > max(lost)
    assert all(restored.never_issued(s) for s in lost), "the gap of the restored start is remembered"
    assert not restored.never_issued(fresh) and not restored.never_issued(kept)
    restored.close()
    again = SqliteStore(path)                                 # and survives another restart
    assert all(again.never_issued(s) for s in lost) and not again.never_issued(fresh)
    assert not again.never_issued(kept)
    again.close()




def test_a_node_the_restored_database_does_not_know_takes_no_work_until_its_shares_are_adopted(tmp_path):
    path = tmp_path / "state.db"
    store = SqliteStore(path)
    _record(store)
    store.close()
    _copy(path, tmp_path / "backup.db")
    store = SqliteStore(path)                                 # a later run registered n1 and allocated
    lost = new_id(store.next_sequence())
    store.close()
    shutil.copy(tmp_path / "backup.db", path)                 # restored: n1 and `lost` unknown

    agent = RecordingAgent()
    agent.prepare(agent_pb2.Share(id=lost, kind=common_pb2.SHARE_KIND_FASTPOD, device_uuids=["GPU-0"],
                                  sm_percent=100, memory_bytes=20 * GiB, quota_request=1.0, quota_limit=1.0,
                                  owner="team/lost"))
    store = SqliteStore(path)
    try:
        core = ControllerCore(store, agent)
        reconciler = Reconciler(core)
        reconciler.start()
        _record(store)                                        # the restored controller works on
        core.register_node("n1", "127.0.0.1:1", {})
        placed = core.ledger.place(core.ledger.to_request("fs-x", Spec(Kind.MPS, memory_bytes=GiB)))
        assert not placed and "no record of" in placed.reason, placed   # held out until adopted

        report = reconciler.run_once(["n1"])
        assert report.adopted == [lost] and not report.orphans_freed, report
        adopted = core.get(lost)
        assert adopted.state is State.ACTIVE and adopted.owner == "team/lost"
        assert adopted.spec == Spec(Kind.FASTPOD, sm_percent=100, memory_bytes=20 * GiB, quota_request=1.0,
                                    quota_limit=1.0)
        assert adopted.env["FASTSHARE_ALLOCATION_ID"] == lost and adopted.env["X"] == "1"
        placed = core.ledger.place(core.ledger.to_request("fs-x", Spec(Kind.FASTPOD, sm_percent=10,
                                                                       memory_bytes=GiB)))
        assert not placed and "no record of" not in placed.reason, placed   # the GPU is full, as it is
        assert lost in agent.shares
        core.release(lost)
        assert lost not in agent.shares and core.get(lost).state is State.RELEASED
    finally:
        store.close()


def test_an_adopted_allocation_on_an_over_committed_gpu_is_still_found_by_its_key(tmp_path):
    """The over-commit note the reconciler writes over an adopted record's reason must not make
    the client's retry with the same key a conflict (nor drop it from status's Adopted list)."""
    from fastshare.controller.core import ADOPTED, KeyConflict
    from fastshare.controller.validation import Request

    store = SqliteStore(tmp_path / "state.db")
    agent = RecordingAgent()
    try:
        core = ControllerCore(store, agent)
        reconciler = Reconciler(core)
        reconciler.start()
        core.register_node("n1", "127.0.0.1:1", {})
        reconciler.run_once()
        kept = core.allocate(Request(Spec(Kind.FASTPOD, sm_percent=100, memory_bytes=20 * GiB), owner="old"))
        lost = new_id(store.next_sequence())   # its pending record lost (power loss, or a restored backup)
        agent.prepare(agent_pb2.Share(id=lost, kind=common_pb2.SHARE_KIND_FASTPOD, device_uuids=["GPU-0"],
                                      sm_percent=50, memory_bytes=GiB, quota_request=0.5, quota_limit=1.0,
                                      owner="team/lost", idempotency_key="k-lost"))
        assert reconciler.run_once().adopted == [lost]
        reconciler.run_once()   # the GPU holds 150 % of its SMs: the adopted record is noted over-committed
        adopted = core.get(lost)
        assert core.ledger.over(lost) and adopted.state is State.ACTIVE, adopted
        assert adopted.reason.startswith(ADOPTED), adopted.reason   # status lists it under Adopted
        try:
            again = core.allocate(Request(Spec(Kind.FASTPOD, sm_percent=50, memory_bytes=GiB, models=("L4",)),
                                          owner="team/lost", idempotency_key="k-lost"))
        except KeyConflict as exc:
            raise AssertionError(f"the retry of the adopted allocation was refused: {exc}") from None
        assert again.id == lost and kept.id != lost
        assert "over-committed: " in adopted.reason
        core.release(kept.id)
        reconciler.run_once()   # the GPU takes it again: the note goes, the adoption's reason stays
        assert not core.ledger.over(lost) and core.get(lost).reason.startswith(ADOPTED)
        assert "over-committed" not in core.get(lost).reason
    finally:
        store.close()


# -- a clock behind the numbers of the shares the database lost ----------------------------------
# The lost shares are numbered ahead of the real clock: what a controller whose clock is behind
# theirs (stepped back, or state.db restored onto a host with a skewed clock) finds on its agents.

class _Down:
    def inventory(self) -> agent_pb2.Inventory:
        raise AgentError("n2", "GetInventory", grpc.StatusCode.UNAVAILABLE, "connection refused")


class _Agents:
    """One recording agent per node; a node in ``down`` cannot be reached."""

    deadline = 10.0   # seconds, as AgentPool.deadline

    def __init__(self) -> None:
        self.nodes = {"n1": RecordingAgent(), "n2": RecordingAgent()}
        self.down: set[str] = set()

    def get(self, node: str, address: str) -> RecordingAgent | _Down:
        return _Down() if node in self.down else self.nodes[node]


def _ahead(seconds: float) -> int:
    """A sequence number the clock reaches in ``seconds``."""
    return time.time_ns() // 1000 + int(seconds * 1e6)


def _clock_past(share_id: str) -> None:
    """Wait until the clock, the numbering's source, has passed the share's number."""
    while time.time_ns() // 1000 <= sequence_of(share_id):
        time.sleep(0.05)


def _hold(agent: RecordingAgent, sequence: int, owner: str, device: str = "GPU-0") -> str:
    share_id = f"fs-{sequence:x}-0000abcd"
    agent.prepare(agent_pb2.Share(id=share_id, kind=common_pb2.SHARE_KIND_MPS, device_uuids=[device],
                                  memory_bytes=GiB, owner=owner))
    return share_id


def _known_nodes(path, agents: _Agents) -> None:
    """A state database that knows n1 and n2 (registered by an earlier run)."""
    store = SqliteStore(path)
    core = ControllerCore(store, agents)
    core.register_node("n1", "127.0.0.1:1", {})
    core.register_node("n2", "127.0.0.1:2", {})
    store.close()


def _mps(core: ControllerCore) -> Allocation:
    from fastshare.controller.validation import Request
    return core.allocate(Request(Spec(Kind.MPS, memory_bytes=GiB), owner="new"))


def test_numbers_issued_stay_above_every_share_an_agent_holds(tmp_path):
    """A lost share on a reachable node numbered ahead of the clock is adopted; new numbers go on
    above it (from the clock they fell below it), so one numbered between, on a node unreachable
    at start, is still never issued when that node is back, also after a restart meanwhile."""
    agents = _Agents()
    _known_nodes(tmp_path / "state.db", agents)
    high = _hold(agents.nodes["n1"], _ahead(3600), "team/high")
    low = _hold(agents.nodes["n2"], _ahead(1800), "team/low")
    agents.down.add("n2")
    store = SqliteStore(tmp_path / "state.db")
    try:
        core = ControllerCore(store, agents)
        assert Reconciler(core).start().adopted == [high]
        made = _mps(core)
        assert made.node == "n1" and sequence_of(made.id) > sequence_of(high), (made.id, high)
        assert store.never_issued(sequence_of(low))
    finally:
        store.close()

    store = SqliteStore(tmp_path / "state.db")   # restarted while n2 is still away
    try:
        core = ControllerCore(store, agents)
        reconciler = Reconciler(core)
        reconciler.start()
        assert sequence_of(_mps(core).id) > sequence_of(high)
        agents.down.clear()
        core.register_node("n2", "127.0.0.1:2", {})
        report = reconciler.run_once()
        assert report.adopted == [low] and not report.orphans_freed, report
        assert low in agents.nodes["n2"].shares and core.get(low).state is State.ACTIVE
    finally:
        store.close()


def test_a_share_on_a_node_unreachable_at_start_is_judged_as_at_start(tmp_path):
    """The clock passes a lost share's number while its node is away: this process issues numbers
    around it. The node's first inventory is judged against the ranges as they were at start: the
    share is adopted, not freed; one that cannot be adopted is kept, also across a restart."""
    agents = _Agents()
    _known_nodes(tmp_path / "state.db", agents)
    lost = _hold(agents.nodes["n2"], _ahead(5), "team/lost")
    stuck = _hold(agents.nodes["n2"], sequence_of(lost) + 1, "team/stuck", device="GPU-9")   # no such GPU
    agents.down.add("n2")
    store = SqliteStore(tmp_path / "state.db")
    try:
        core = ControllerCore(store, agents)
        reconciler = Reconciler(core)
        reconciler.start()
        before = _mps(core)
        assert sequence_of(before.id) < sequence_of(lost), "the start took too long for this test"
        _clock_past(stuck)
        after = _mps(core)
        assert sequence_of(after.id) > sequence_of(stuck)

        agents.down.clear()
        core.register_node("n2", "127.0.0.1:2", {})
        report = reconciler.run_once()
        assert report.adopted == [lost] and not report.orphans_freed, report
        assert core.get(lost).state is State.ACTIVE
        assert not reconciler.run_once().orphans_freed
        assert stuck in agents.nodes["n2"].shares and core.held_out("n2")
    finally:
        store.close()
    store = SqliteStore(tmp_path / "state.db")
    try:
        assert store.never_issued(sequence_of(stuck)) and not store.never_issued(sequence_of(after.id))
        core = ControllerCore(store, agents)
        assert not Reconciler(core).start().orphans_freed
        assert stuck in agents.nodes["n2"].shares
    finally:
        store.close()


def test_a_clock_behind_the_stored_mark_is_warned_about(tmp_path, caplog):
    path = tmp_path / "state.db"
    store = SqliteStore(path)
    ahead = _ahead(86400)
    store.create_allocation(Allocation(id=new_id(ahead), spec=Spec(Kind.MPS, memory_bytes=GiB), owner="me",
                                       state=State.RELEASED, node="n1", created_at=time.time()))
    store.close()
    with caplog.at_level("WARNING"):
        store = SqliteStore(path)
    try:
        assert store.next_sequence() == ahead + 1
        warnings = [r for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1, caplog.text
        text = warnings[0].getMessage()
        assert "clock" in text and "behind" in text and "orphan" in text, text
    finally:
        store.close()
    caplog.clear()
    SqliteStore(tmp_path / "other.db").close()   # a clock ahead of the mark: nothing to say
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text


def test_a_share_numbered_beyond_any_clock_is_an_orphan_not_a_crash(tmp_path):
    """An id of the sequenced shape whose number no clock makes (16 hex digits: beyond SQLite's
    integers) broke every reconciler pass with an OverflowError when its adoption was recorded.
    No controller numbered it: it is freed as an orphan, and the node's other shares are judged."""
    agents = _Agents()
    _known_nodes(tmp_path / "state.db", agents)
    bogus = _hold(agents.nodes["n1"], 2**64 - 1, "team/bogus")
    lost = _hold(agents.nodes["n1"], _ahead(60), "team/lost")
    store = SqliteStore(tmp_path / "state.db")
    try:
        core = ControllerCore(store, agents)
        report = Reconciler(core).start()
        assert sequence_of(bogus) is None
        assert report.adopted == [lost] and bogus in report.orphans_freed, report
        assert bogus not in agents.nodes["n1"].shares
        assert sequence_of(_mps(core).id) > sequence_of(lost)
    finally:
        store.close()


def test_a_number_passed_by_a_refused_allocation_is_still_judged_as_at_start(tmp_path):
    """A refused allocation (no capacity) is numbered but stores no record: the clock had passed
    the lost share's number, the mark had not. When its node was back, the share was judged
    never issued for the moment only: the next allocation's record moved the mark past it, and
    the share was freed as an orphan under its workload. Now it is remembered as never issued."""
    import pytest

    from fastshare.controller.core import Rejected

    agents = _Agents()
    _known_nodes(tmp_path / "state.db", agents)
    lost = _hold(agents.nodes["n2"], _ahead(5), "team/lost")
    agents.down.add("n2")
    store = SqliteStore(tmp_path / "state.db")
    try:
        assert time.time_ns() // 1000 < sequence_of(lost), "the start took too long for this test"
        core = ControllerCore(store, agents)
        reconciler = Reconciler(core)
        reconciler.start()
        core.set_schedulable("n1", False, "full")
        _clock_past(lost)
        with pytest.raises(Rejected):
            _mps(core)                                  # numbered past the lost share, no record

        agents.down.clear()
        core.register_node("n2", "127.0.0.1:2", {})     # its first inventory: the lost share
        core.set_schedulable("n1", True)
        made = _mps(core)
        assert made.node == "n1" and sequence_of(made.id) > sequence_of(lost)
        report = reconciler.run_once()
        assert report.adopted == [lost] and not report.orphans_freed, report
        assert lost in agents.nodes["n2"].shares and core.get(lost).state is State.ACTIVE
    finally:
        store.close()


def test_a_node_still_away_across_restarts_is_judged_as_at_the_start_it_was_first_away(tmp_path):
    """The clock passes a lost share's number while its node is away, and the controller restarts
    (twice) before the node is back: the restarted one judged the node against its own start,
    took the share for an orphan and freed it under its workload. The ranges the node must be
    judged against are kept in state.db until it is reached: the share is adopted."""
    agents = _Agents()
    _known_nodes(tmp_path / "state.db", agents)
    lost = _hold(agents.nodes["n2"], _ahead(5), "team/lost")
    agents.down.add("n2")
    store = SqliteStore(tmp_path / "state.db")
    try:
        assert time.time_ns() // 1000 < sequence_of(lost), "the start took too long for this test"
        core = ControllerCore(store, agents)
        Reconciler(core).start()
        _clock_past(lost)
        after = _mps(core)                           # the mark passes the lost share's number
        assert sequence_of(after.id) > sequence_of(lost)
    finally:
        store.close()
    for _ in range(2):                               # restarted, n2 still away
        store = SqliteStore(tmp_path / "state.db")
        try:
            core = ControllerCore(store, agents)
            assert not Reconciler(core).start().orphans_freed
            _mps(core)
        finally:
            store.close()

    store = SqliteStore(tmp_path / "state.db")
    try:
        core = ControllerCore(store, agents)
        reconciler = Reconciler(core)
        reconciler.start()
        agents.down.clear()
        core.register_node("n2", "127.0.0.1:2", {})
        report = reconciler.run_once()
        assert report.adopted == [lost] and not report.orphans_freed, report
        assert lost in agents.nodes["n2"].shares and core.get(lost).state is State.ACTIVE
    finally:
        store.close()
    store = SqliteStore(tmp_path / "state.db")       # judged once: the next start judges n2 as usual
    try:
        assert not store.never_issued(sequence_of(after.id)) and store.never_issued(sequence_of(lost))
        core = ControllerCore(store, agents)
        report = Reconciler(core).start()
        assert not report.orphans_freed and not report.adopted, report
    finally:
        store.close()


def test_an_away_node_is_judged_against_its_earliest_start_until_reached_or_forgotten(tmp_path):
    """The store keeps, for each known node not reached since a start, that start's mark: its
    first inventory is judged against it across restarts, once; a forgotten node loses it (back
    one day, it is a new node, judged as at the start of the process that sees it)."""
    from fastshare.controller.model import Node

    def passed(store: SqliteStore, sequence: int) -> None:   # numbering went past it (clock behind)
        store.create_allocation(Allocation(id=new_id(sequence), spec=Spec(Kind.MPS, memory_bytes=GiB),
                                           owner="me", state=State.RELEASED, node="n3",
                                           created_at=time.time()))

    path = tmp_path / "state.db"
    store = SqliteStore(path)
    for name in ("n1", "n2"):
        store.put_node(Node(name=name, address=f"h:{name}"))
    store.close()
    on_n1, on_n2, later = _ahead(3600), _ahead(3601), _ahead(3602)
    store = SqliteStore(path)                     # n1 and n2 away from this start on
    passed(store, later + 10)
    store.close()
    store = SqliteStore(path)                     # restarted, both still away
    try:
        assert not store.never_issued(on_n1) and not store.never_issued(on_n2)
        store.delete_node("n1")                   # forgotten
        store.saw([on_n1], first_of="n1")
        assert not store.never_issued(on_n1), "a forgotten node is judged as a new one"
        store.saw([on_n2], first_of="n2")
        assert store.never_issued(on_n2)
    finally:
        store.close()
    store = SqliteStore(path)
    try:
        assert store.never_issued(on_n2) and not store.never_issued(on_n1)
        store.saw([later], first_of="n2")         # judged once: now as at this start
        assert not store.never_issued(later)
    finally:
        store.close()
