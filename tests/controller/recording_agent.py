"""A node agent stand-in for controller-core tests that need no agent process: one L4, and it
holds what it is given (prepare is idempotent by id, as the real agent's)."""

from __future__ import annotations

from fastshare.v1 import agent_pb2

GiB = 1024**3


class RecordingAgent:
    """Also its own pool (``get`` returns it), as AgentPool is asked for clients."""

    deadline = 10.0   # seconds, as AgentPool.deadline

    def __init__(self) -> None:
        self.shares: dict[str, agent_pb2.Share] = {}

    def get(self, node: str, address: str) -> RecordingAgent:
        return self

    def inventory(self) -> agent_pb2.Inventory:
        return agent_pb2.Inventory(
            gpus=[agent_pb2.Gpu(index=0, uuid="GPU-0", name="NVIDIA L4", memory_bytes=22 * GiB, sm_count=58)],
            shares=list(self.shares.values()))

    def prepare(self, share: agent_pb2.Share) -> agent_pb2.PrepareShareReply:
        self.shares[share.id] = share
        return agent_pb2.PrepareShareReply(share=share, env={"X": "1"}, device_uuids=list(share.device_uuids))

    def release(self, share_id: str, kind: int = 0) -> agent_pb2.ReleaseShareReply:
        self.shares.pop(share_id, None)
        return agent_pb2.ReleaseShareReply(released=True)
