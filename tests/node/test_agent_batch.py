"""PrepareShares / ReleaseShares: each call in a batch gets the answer it would have had alone,
and the batch is acknowledged only once the journal holds all of it."""

import grpc

from fastshare.device import simnvml
from fastshare.node import sharefiles
from fastshare.v1 import agent_pb2

from .harness import GPU_A, GPU_B, GPU_MIG, fastpod, rpc_error, share

INV = agent_pb2.GetInventoryRequest()


def _status(result) -> tuple[grpc.StatusCode, str]:
    code = next(c for c in grpc.StatusCode if c.value[0] == result.status.code)
    return code, result.status.message


def test_a_batch_answers_each_call_as_if_alone(agent):
    agent.start()
    gpus = [g.uuid for g in agent.unix().GetInventory(INV, timeout=30).gpus]
    stub = agent.mtls()
    alone = stub.PrepareShare(fastpod("alone", gpus[GPU_B], sm=10), timeout=60)
    calls = [fastpod("a", gpus[GPU_A], sm=30), fastpod("too-big", gpus[GPU_A], sm=80),
             share("no-kind", "whole", [gpus[GPU_A]]), fastpod("b", gpus[GPU_A], sm=40),
             fastpod("a", gpus[GPU_A], sm=30), fastpod("a", gpus[GPU_A], sm=31)]
    calls[2].share.ClearField("kind")
    reply = stub.PrepareShares(agent_pb2.PrepareSharesRequest(calls=calls), timeout=60)

    assert len(reply.results) == len(calls)
    ok = [r.status.code == 0 for r in reply.results]
    assert ok == [True, False, False, True, True, False]
    a, too_big, no_kind, b, again, changed = reply.results
    assert a.reply.created and not again.reply.created and again.reply.env == a.reply.env
    assert b.reply.created and b.reply.port and b.reply.port != a.reply.port
    assert set(a.reply.env) == set(alone.env)   # the same kind of answer as PrepareShare's
    code, message = _status(too_big)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "share.sm_percent 80" in message
    code, message = _status(no_kind)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "share.kind" in message
    code, message = _status(changed)
    assert code == grpc.StatusCode.ALREADY_EXISTS

    held = {s.id for s in agent.unix().GetInventory(INV, timeout=30).shares}
    assert held == {"alone", "a", "b"}
    entries = sharefiles.read(agent.rundir / "shares", gpus[GPU_A])
    assert {e.key for e in entries} == {"a", "b"}

    released = stub.ReleaseShares(agent_pb2.ReleaseSharesRequest(calls=[
        agent_pb2.ReleaseShareRequest(share_id=i) for i in ("a", "never-was", "b", "a")]), timeout=60)
    assert [(r.status.code, r.reply.released) for r in released.results] == [
        (0, True), (0, False), (0, True), (0, False)]
    assert {s.id for s in agent.unix().GetInventory(INV, timeout=30).shares} == {"alone"}


def test_a_batch_is_bounded_and_an_empty_one_does_nothing(agent):
    agent.start()
    gpu = agent.unix().GetInventory(INV, timeout=30).gpus[GPU_A].uuid
    stub = agent.unix()
    err = rpc_error(stub.PrepareShares, agent_pb2.PrepareSharesRequest(
        calls=[fastpod(f"s{i}", gpu, sm=1) for i in range(257)]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "calls: at most 256" in err.details()
    assert stub.PrepareShares(agent_pb2.PrepareSharesRequest(), timeout=60).results == []
    assert agent.unix().GetInventory(INV, timeout=30).shares == []


def test_a_refusal_for_the_gpus_state_says_so_in_a_field_alone_and_in_a_batch(agent, sim_machine):
    """The controller told a refusal for the GPU's state (MIG mode, a lost GPU, a pending MIG change:
    another GPU may take the share) from one for the request only by the message's words. Now the
    agent says it in a field: trailing metadata 'fastshare-refusal' alone, CallStatus.refusal in a
    batch; any other refusal carries none."""
    agent.start()
    gpus = [g.uuid for g in agent.unix().GetInventory(INV, timeout=30).gpus]
    stub = agent.mtls()
    err = rpc_error(stub.PrepareShare, share("w", "whole", [gpus[GPU_MIG]]))   # MIG is on there
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
    said = tuple(err.trailing_metadata())
    assert ("fastshare-refusal", "REFUSAL_MIG_MODE") in said, said
    err = rpc_error(stub.PrepareShare, fastpod("big", gpus[GPU_A], sm=101))
    assert not [k for k, _ in err.trailing_metadata() or () if k == "fastshare-refusal"], err

    simnvml.lose_gpu(sim_machine, GPU_B)
    agent.unix().GetInventory(INV, timeout=30)   # the agent reads its GPUs again
    reply = stub.PrepareShares(agent_pb2.PrepareSharesRequest(calls=[
        fastpod("on-mig", gpus[GPU_MIG]), fastpod("on-lost", gpus[GPU_B]),
        fastpod("fits", gpus[GPU_A], sm=80), fastpod("too-big", gpus[GPU_A], sm=70)]), timeout=60)
    assert [(r.status.code, r.status.refusal) for r in reply.results] == [
        (grpc.StatusCode.FAILED_PRECONDITION.value[0], agent_pb2.REFUSAL_MIG_MODE),
        (grpc.StatusCode.FAILED_PRECONDITION.value[0], agent_pb2.REFUSAL_GPU_LOST),
        (0, agent_pb2.REFUSAL_UNSPECIFIED),
        (grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], agent_pb2.REFUSAL_UNSPECIFIED)], reply


def test_a_share_on_a_gpu_no_longer_on_the_node_is_refused_as_such_alone_and_in_a_batch(agent, sim_machine):
    """A GPU taken out of the node (or renumbered under a new UUID at a reboot) was refused as NOT_FOUND
    with no refusal field, so the controller failed the allocation although another GPU could take
    it. Now that refusal says REFUSAL_GPU_GONE (code still NOT_FOUND); a MIG profile or MIG device
    that does not exist is about the request and carries none."""
    agent.start()
    gpus = [g.uuid for g in agent.unix().GetInventory(INV, timeout=30).gpus]
    stub = agent.mtls()
    gone = simnvml.remove_gpu(sim_machine, GPU_B)
    assert gone == gpus[GPU_B]
    agent.unix().GetInventory(INV, timeout=30)   # the agent reads its GPUs again
    err = rpc_error(stub.PrepareShare, share("w", "whole", [gone]))
    assert err.code() == grpc.StatusCode.NOT_FOUND and f"GPU {gone} is not on node" in err.details(), err
    assert ("fastshare-refusal", "REFUSAL_GPU_GONE") in tuple(err.trailing_metadata()), err
    for about_the_request in (share("x", "exclusive", [gpus[GPU_MIG]], mig_profile="9g.99gb"),
                              share("m", "mps", ["MIG-00000000-0000-0000-0000-000000000000"])):
        err = rpc_error(stub.PrepareShare, about_the_request)
        assert err.code() == grpc.StatusCode.NOT_FOUND, err
        assert not [k for k, _ in err.trailing_metadata() or () if k == "fastshare-refusal"], err

    reply = stub.PrepareShares(agent_pb2.PrepareSharesRequest(calls=[
        fastpod("on-gone", gone), share("x", "exclusive", [gpus[GPU_MIG]], mig_profile="9g.99gb"),
        fastpod("fits", gpus[GPU_A])]), timeout=60)
    not_found = grpc.StatusCode.NOT_FOUND.value[0]
    assert [(r.status.code, r.status.refusal) for r in reply.results] == [
        (not_found, agent_pb2.REFUSAL_GPU_GONE), (not_found, agent_pb2.REFUSAL_UNSPECIFIED),
        (0, agent_pb2.REFUSAL_UNSPECIFIED)], reply
    assert {s.id for s in agent.unix().GetInventory(INV, timeout=30).shares} == {"fits"}
