"""Node agent calls from the in-cluster controller, fenced by its leader election.

A call that changes a GPU passes the fence first and carries the leader term, so that a deposed
leader's late call is refused by any agent that has seen its successor (see fastshare.node.terms).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastshare.controller.agent_client import AgentClient, AgentError, AgentPool
from fastshare.k8s.leader import Deposed, Fence
from fastshare.v1 import agent_pb2, common_pb2


class FencedAgent:
    """One node agent whose calls that change a GPU pass the fence first and carry its term (the
    fencing token); reads go straight. A call the agent refuses because it has seen a newer
    term raises :class:`Deposed`, never AgentError: the core must not take it for the agent's
    answer about the share and compensate (mark failed, release) what the new leader owns."""

    def __init__(self, agent: AgentClient, fence: Fence) -> None:
        self._agent, self._fence = agent, fence

    def ping(self) -> None:
        self._agent.ping()

    def ping_unwaited(self, done: Callable[[AgentError | None], None]) -> bool:
        return self._agent.ping_unwaited(done)

    def inventory(self) -> agent_pb2.Inventory:
        return self._agent.inventory()

    def _changing(self, call: Callable[[int | None], Any]) -> Any:
        for _ in range(2):
            self._fence.check()
            try:
                return call(self._fence.term)
            except AgentError as exc:
                if exc.seen_term is None:
                    raise
                self._fence.refused(exc.seen_term)   # Deposed, unless our term moved past it
        raise Deposed("agents refuse this controller's leader term")

    def prepare(self, share: agent_pb2.Share) -> agent_pb2.PrepareShareReply:
        return self._changing(lambda term: self._agent.prepare(share, term))

    def release(self, share_id: str,
                kind: int = common_pb2.SHARE_KIND_UNSPECIFIED) -> agent_pb2.ReleaseShareReply:
        return self._changing(lambda term: self._agent.release(share_id, kind, term))

    def set_mig_mode(self, gpu_uuid: str, enabled: bool) -> agent_pb2.SetMigModeReply:
        return self._changing(lambda term: self._agent.set_mig_mode(gpu_uuid, enabled, term))


class FencedAgents:
    """The agent pool as the core sees it in-cluster: every client fenced (see FencedAgent)."""

    def __init__(self, pool: AgentPool, fence: Fence) -> None:
        self._pool, self._fence = pool, fence

    @property
    def deadline(self) -> float:
        return self._pool.deadline

    def get(self, node: str, address: str) -> FencedAgent:
        return FencedAgent(self._pool.get(node, address), self._fence)

    def drop(self, node: str) -> None:
        self._pool.drop(node)

    def close(self) -> None:
        self._pool.close()
