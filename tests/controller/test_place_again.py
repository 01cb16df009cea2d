"""A new allocation its agent refuses for the GPU's state is placed again (see the real-agent tests
in test_mig_pending); here the limits, with a stand-in agent that refuses as told: an older agent
(no refusal field), an agent whose inventory contradicts its refusal, and one that refuses every GPU.
Real SQLite store and ledger."""

from __future__ import annotations

import grpc
import pytest

from fastshare.controller.agent_client import AgentError
from fastshare.controller.core import PLACE_AGAIN, AgentFailed, ControllerCore
from fastshare.controller.model import Kind, Spec, State
from fastshare.controller.sqlite_store import SqliteStore
from fastshare.controller.validation import Request
from fastshare.v1 import agent_pb2

from .recording_agent import GiB, RecordingAgent


class RefusingAgent(RecordingAgent):
    """Four L4s; a prepare on a GPU in ``refuse`` is refused with ``refusal``; the inventory shows the
    GPUs refused so far lost (unless ``contradict``: it shows every GPU working; ``gone``: it leaves
    them out, the others numbered anew as NVML does)."""

    def __init__(self, refuse: set[str], refusal: int, contradict: bool = False, gone: bool = False) -> None:
        super().__init__()
        self.refuse, self.refusal, self.contradict, self.gone = refuse, refusal, contradict, gone
        self.refused: list[str] = []

    def inventory(self) -> agent_pb2.Inventory:
        closed = set() if self.contradict else set(self.refused)
        uuids = [f"GPU-{i}" for i in range(4) if not (self.gone and f"GPU-{i}" in closed)]
        return agent_pb2.Inventory(gpus=[
            agent_pb2.Gpu(index=i, uuid=u, name="NVIDIA L4", memory_bytes=22 * GiB, sm_count=58,
                          lost="GPU_IS_LOST" if u in closed else "")
            for i, u in enumerate(uuids)], shares=list(self.shares.values()))

    def prepare(self, share: agent_pb2.Share) -> agent_pb2.PrepareShareReply:
        gpu = share.device_uuids[0]
        if gpu in self.refuse:
            self.refused.append(gpu)
            raise AgentError("n1", "PrepareShare", grpc.StatusCode.FAILED_PRECONDITION,
                             f"GPU {gpu} is lost (fell off the bus?)", refusal=self.refusal)
        return super().prepare(share)


def _core(tmp_path, agent: RefusingAgent) -> ControllerCore:
    core = ControllerCore(SqliteStore(tmp_path / "state.db"), agent)
    core.register_node("n1", "127.0.0.1:1", {})
    return core


def _whole(core: ControllerCore):
    return core.allocate(Request(spec=Spec(Kind.WHOLE, gpu_count=1), owner="me"))


def test_placed_again_on_another_gpu_its_first_reservation_given_back(tmp_path):
    """The store's record and the ledger name the second GPU only; the agent holds the share once."""
    agent = RefusingAgent(set(), agent_pb2.REFUSAL_GPU_LOST)
    core = _core(tmp_path, agent)
    first = _whole(core)   # where the engine puts it: there again while its view is the same
    core.release(first.id)
    agent.refuse = {first.devices[0].gpu_uuid}
    placed = _whole(core)
    assert placed.state is State.ACTIVE and placed.devices[0].gpu_uuid != first.devices[0].gpu_uuid
    assert agent.refused == [first.devices[0].gpu_uuid]
    assert core.store.get_allocation(placed.id).devices == placed.devices
    assert set(agent.shares) == {placed.id}
    assert [u["gpu"] for u in core.ledger.usage() if u["whole"]] == [placed.devices[0].gpu_index]


@pytest.mark.parametrize("refusal, contradict", [(agent_pb2.REFUSAL_UNSPECIFIED, False),
                                                 (max(agent_pb2.Refusal.values()) + 1, False),
                                                 (agent_pb2.REFUSAL_GPU_LOST, True)])
def test_an_older_agent_or_one_whose_inventory_contradicts_its_refusal_fails_it_as_before(
        tmp_path, refusal, contradict):
    """An agent without the refusal field (older), or with a kind this controller does not know (a
    newer agent's, in a batch's CallStatus): the allocation ends failed, as before, after one prepare.
    One whose inventory still shows the GPU working: not placed on it again, failed."""
    agent = RefusingAgent({f"GPU-{i}" for i in range(4)}, refusal, contradict)
    core = _core(tmp_path, agent)
    with pytest.raises(AgentFailed) as failed:
        _whole(core)
    assert len(agent.refused) == 1, agent.refused
    record = core.get(failed.value.allocation.id)
    assert record.state is State.FAILED and "is lost" in record.reason, record
    assert not core.ledger.holds(record.id)


def test_refused_on_every_gpu_it_is_placed_again_a_bounded_number_of_times(tmp_path):
    """Never a loop: PLACE_AGAIN more tries, each on another GPU, then failed as before."""
    agent = RefusingAgent({f"GPU-{i}" for i in range(4)}, agent_pb2.REFUSAL_GPU_LOST)
    core = _core(tmp_path, agent)
    with pytest.raises(AgentFailed) as failed:
        _whole(core)
    assert len(agent.refused) == PLACE_AGAIN + 1 == len(set(agent.refused)), agent.refused
    record = core.get(failed.value.allocation.id)
    assert record.state is State.FAILED and record.node == "n1", record
    assert record.devices[0].gpu_uuid == agent.refused[-1], (record.devices, agent.refused)
    assert not core.ledger.holds(record.id)


def test_the_answer_waits_for_the_new_placement_on_disk(tmp_path):
    """allocate answers once what it answers survives a power loss. The barrier covered the first
    (pending) record only: a power loss after the answer could take the commit that moved it, the
    reconciler then prepared the old placement (refused again) and failed an allocation the caller
    was told is active elsewhere. The barrier covers the commit that placed it again."""
    agent = RefusingAgent(set(), agent_pb2.REFUSAL_GPU_LOST)
    core = _core(tmp_path, agent)
    first = _whole(core)
    core.release(first.id)
    agent.refuse = {first.devices[0].gpu_uuid}
    group = core.store._group
    moved_at, tickets = [], []
    transition, sync = core.store.transition, core.store.sync

    def recording_transition(allocation_id, from_states, to, **changes):
        done = transition(allocation_id, from_states, to, **changes)
        if to is State.PENDING:
            moved_at.append(group._committed)
        return done

    def recording_sync(ticket=None):
        tickets.append(group._committed if ticket is None else ticket)
        sync(ticket)

    core.store.transition, core.store.sync = recording_transition, recording_sync
    placed = _whole(core)
    assert placed.devices[0].gpu_uuid != first.devices[0].gpu_uuid
    assert len(moved_at) == 1 and tickets and tickets[-1] >= moved_at[0], (moved_at, tickets)


def test_a_share_whose_gpu_left_the_node_where_no_other_gpu_takes_it_fails_saying_both(tmp_path):
    """Its GPU gone from the node (REFUSAL_GPU_GONE) and every other GPU held: the allocation ends
    failed, its reason the agent's refusal and why no other GPU takes it; it is counted nowhere (its
    GPU is not in the view any more) and what the others hold stays counted."""
    agent = RefusingAgent(set(), agent_pb2.REFUSAL_GPU_GONE, gone=True)
    core = _core(tmp_path, agent)
    held = [_whole(core) for _ in range(4)]
    freed = held.pop()
    core.release(freed.id)
    agent.refuse = {freed.devices[0].gpu_uuid}
    with pytest.raises(AgentFailed) as failed:
        _whole(core)
    record = core.get(failed.value.allocation.id)
    assert record.state is State.FAILED, record
    assert "no other GPU takes it" in record.reason, record.reason
    assert agent.refused == [freed.devices[0].gpu_uuid] and not core.ledger.holds(record.id)
    assert all(core.ledger.holds(a.id) for a in held)
    assert [u["gpu"] for u in core.ledger.usage() if u["whole"]] == [0, 1, 2]
