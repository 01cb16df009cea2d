"""The controller's bookkeeping a share carries (idempotency key, lease ttl), so that a controller
whose state went back in time can adopt the share with them: validated like the other fields,
kept in the journal and the inventory, and not part of what makes two prepares "the same share"
(a journal written by an older agent, without them, is re-prepared by an upgraded controller)."""

import json
import sqlite3

import grpc

from fastshare.node.model import ShareSpec
from fastshare.v1 import agent_pb2

from .harness import GPU_A, rpc_error, share

GiB = 1 << 30
INV = agent_pb2.GetInventoryRequest()


def _gpu(agent) -> str:
    return agent.unix().GetInventory(INV, timeout=30).gpus[GPU_A].uuid


def test_key_and_ttl_are_validated_and_kept(agent):
    agent.start()
    gpu, stub = _gpu(agent), agent.unix()
    for fields, name in ((dict(idempotency_key="bad key"), "share.idempotency_key"),
                         (dict(idempotency_key="k" * 257), "share.idempotency_key"),
                         (dict(lease_ttl_seconds=4), "share.lease_ttl_seconds"),
                         (dict(lease_ttl_seconds=7 * 24 * 3600 + 1), "share.lease_ttl_seconds")):
        err = rpc_error(stub.PrepareShare, share("s-1", "mps", [gpu], memory_bytes=GiB, **fields))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (fields, err.details())
        assert name in err.details(), err.details()
    assert stub.GetInventory(INV, timeout=30).shares == []

    made = stub.PrepareShare(share("s-1", "mps", [gpu], memory_bytes=GiB, idempotency_key="job/1:a",
                                   lease_ttl_seconds=30), timeout=60)
    assert made.created and made.share.idempotency_key == "job/1:a" and made.share.lease_ttl_seconds == 30
    agent.stop()
    agent.start()
    (held,) = agent.unix().GetInventory(INV, timeout=30).shares
    assert (held.idempotency_key, held.lease_ttl_seconds) == ("job/1:a", 30)


def test_a_share_journaled_by_an_older_agent_is_prepared_again_with_key_and_ttl(agent):
    agent.start()
    gpu = _gpu(agent)
    first = agent.unix().PrepareShare(share("old-1", "mps", [gpu], memory_bytes=GiB, owner="ns/pod"),
                                      timeout=60)
    agent.stop()
    journal = agent.workdir / "state" / "journal.db"
    db = sqlite3.connect(journal)   # what an agent before these fields wrote
    (text,) = db.execute("SELECT spec FROM shares WHERE id='old-1'").fetchone()
    old = {k: v for k, v in json.loads(text).items() if k not in ("idempotency_key", "lease_ttl_seconds")}
    with db:
        db.execute("UPDATE shares SET spec=? WHERE id='old-1'", (json.dumps(old, sort_keys=True),))
    db.close()
    assert ShareSpec.from_json(json.dumps(old)).idempotency_key == ""

    agent.start()
    stub = agent.unix()
    assert [s.id for s in stub.GetInventory(INV, timeout=30).shares] == ["old-1"]
    again = stub.PrepareShare(share("old-1", "mps", [gpu], memory_bytes=GiB, owner="ns/pod",
                                    idempotency_key="k1", lease_ttl_seconds=60), timeout=60)
    assert not again.created and dict(again.env) == dict(first.env)
    # What the share is still decides: another size under the same id is refused.
    other = share("old-1", "mps", [gpu], memory_bytes=2 * GiB, owner="ns/pod", idempotency_key="k1")
    assert rpc_error(stub.PrepareShare, other).code() == grpc.StatusCode.ALREADY_EXISTS
