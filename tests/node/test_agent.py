"""The node agent as a real process: prepare/release of every kind, idempotent retries,
status codes, concurrent requests on one GPU."""

import threading

import grpc

from fastshare.device import simnvml
from fastshare.mps.control import MpsControl
from fastshare.node import sharefiles
from fastshare.v1 import agent_pb2, common_pb2

from .harness import GPU_A, GPU_B, GPU_MIG, STANDIN, fastpod, rpc_error, share

INV = agent_pb2.GetInventoryRequest()


def _uuids(agent):
    return [g.uuid for g in agent.unix().GetInventory(INV, timeout=30).gpus]


def _release(stub, share_id):
    return stub.ReleaseShare(agent_pb2.ReleaseShareRequest(share_id=share_id), timeout=60)


def test_inventory_over_unix_socket_and_mtls(agent):
    agent.start()
    for stub in (agent.unix(), agent.mtls()):
        inv = stub.GetInventory(INV, timeout=30)
        assert inv.node_name == "node-1" and inv.agent_version and inv.driver_version
        assert [g.name for g in inv.gpus] == ["NVIDIA H100 80GB HBM3", "Tesla V100-SXM2-32GB",
                                              "Tesla V100-SXM2-32GB"]
        assert inv.gpus[GPU_MIG].mig_enabled and not inv.gpus[GPU_A].mig_capable
        assert "3g.40gb" in {p.name for p in inv.gpus[GPU_MIG].mig_profiles}
    agent.unix().Ping(common_pb2.Empty(), timeout=30)


def test_exclusive_creates_a_mig_slice_idempotently_and_release_destroys_it(agent, devices):
    agent.start()
    gpu = _uuids(agent)[GPU_MIG]
    stub = agent.mtls()
    request = share("train-1", "exclusive", [gpu], mig_profile="3g.40gb", owner="ns/pod")
    first = stub.PrepareShare(request, timeout=60)
    (mig_uuid,) = first.device_uuids
    assert first.created and mig_uuid.startswith("MIG-")
    assert first.env["CUDA_VISIBLE_DEVICES"] == mig_uuid == first.env["NVIDIA_VISIBLE_DEVICES"]
    (instance,) = devices.mig_instances(GPU_MIG)
    assert instance.uuid == mig_uuid and instance.profile_name == "3g.40gb"
    assert first.share.HasField("mig_start") and first.share.mig_start == instance.start

    again = stub.PrepareShare(request, timeout=60)  # a retry (lost reply): same answer, nothing new
    assert not again.created and list(again.device_uuids) == [mig_uuid]
    assert len(devices.mig_instances(GPU_MIG)) == 1

    other = share("train-1", "exclusive", [gpu], mig_profile="1g.10gb")
    assert rpc_error(stub.PrepareShare, other).code() == grpc.StatusCode.ALREADY_EXISTS

    inv = agent.unix().GetInventory(INV, timeout=30)
    (dev,) = inv.gpus[GPU_MIG].mig_devices
    assert dev.created_by_agent and dev.share_id == "train-1"
    assert [s.id for s in inv.shares] == ["train-1"]

    reply = _release(stub, "train-1")
    assert reply.released and list(reply.destroyed_mig_devices) == [mig_uuid]
    assert devices.mig_instances(GPU_MIG) == []
    assert not _release(stub, "train-1").released  # idempotent


def test_exclusive_explicit_placement_exhaustion_and_bad_placement(agent, devices):
    agent.start()
    gpu = _uuids(agent)[GPU_MIG]
    stub = agent.unix()
    stub.PrepareShare(share("a", "exclusive", [gpu], mig_profile="4g.40gb", mig_start=0), timeout=60)
    err = rpc_error(stub.PrepareShare, share("b", "exclusive", [gpu], mig_profile="4g.40gb"))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "free placements: " in err.details() and "3g.40gb@4" in err.details()
    err = rpc_error(stub.PrepareShare, share("c", "exclusive", [gpu], mig_profile="3g.40gb", mig_start=2))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "share.mig_start" in err.details()
    err = rpc_error(stub.PrepareShare, share("d", "exclusive", [gpu], mig_profile="9g.1tb"))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "3g.40gb" in err.details()
    assert [(m.profile_name, m.start) for m in devices.mig_instances(GPU_MIG)] == [("4g.40gb", 0)]
    err = rpc_error(stub.PrepareShare, share("e", "exclusive", [_uuids(agent)[GPU_A]], mig_profile="1g.10gb"))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "does not support MIG" in err.details()


def test_fastpod_and_mps_shares_use_one_verified_daemon_and_the_share_files(agent):
    agent.start()
    gpu = _uuids(agent)[GPU_A]
    stub = agent.mtls()
    a = stub.PrepareShare(fastpod("fp-a", gpu, sm=30, mem_gib=4, req=0.25, lim=0.5), timeout=60)
    b = stub.PrepareShare(fastpod("fp-b", gpu, sm=50, mem_gib=8, req=0.5, lim=1.0), timeout=60)
    c = stub.PrepareShare(share("mem-c", "mps", [gpu], memory_bytes=2 << 30), timeout=60)
    pipe = a.host_paths["mps_pipe_dir"]
    assert pipe == b.host_paths["mps_pipe_dir"] == c.env["CUDA_MPS_PIPE_DIRECTORY"]
    assert a.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert a.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in c.env
    assert a.port != b.port and a.env["FASTSHARE_POD_MANAGER_PORT"] == str(a.port)

    mps = MpsControl(STANDIN, agent.rundir / "mps")
    assert mps.answers(gpu)  # the daemon really runs and answers on that pipe
    assert mps.command(gpu, "get_default_active_thread_percentage").strip() == "100"  # mps share: no SM cap
    inv = agent.unix().GetInventory(INV, timeout=30)
    (daemon,) = inv.mps_daemons
    assert daemon.device_uuid == gpu and daemon.healthy and set(daemon.share_ids) == {"fp-a", "fp-b", "mem-c"}

    root = agent.rundir / "shares"
    assert sharefiles.read(root, gpu) == [sharefiles.ShareEntry("fp-a", 0.25, 0.5, 4 << 30, a.port),
                                          sharefiles.ShareEntry("fp-b", 0.5, 1.0, 8 << 30, b.port)]
    assert a.host_paths["share_config"] == str(sharefiles.config_path(root, gpu))

    assert _release(stub, "fp-a").stopped_mps_daemons == []
    assert [e.key for e in sharefiles.read(root, gpu)] == ["fp-b"]
    _release(stub, "fp-b")
    assert sharefiles.read(root, gpu) == [] and mps.answers(gpu)  # mem-c still uses the daemon
    assert list(_release(stub, "mem-c").stopped_mps_daemons) == [gpu]
    assert not mps.answers(gpu) and not (agent.rundir / "mps" / gpu).exists()
    assert agent.unix().GetInventory(INV, timeout=30).mps_daemons == []


def test_fastpod_capacity_is_checked_and_reported(agent):
    agent.start()
    gpu = _uuids(agent)[GPU_A]
    stub = agent.unix()
    stub.PrepareShare(fastpod("big", gpu, sm=70, mem_gib=20, req=0.6, lim=1.0), timeout=60)
    err = rpc_error(stub.PrepareShare, fastpod("too-many-sm", gpu, sm=40))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "share.sm_percent 40" in err.details() and "30% SM" in err.details()
    err = rpc_error(stub.PrepareShare, fastpod("too-much-quota", gpu, sm=10, req=0.5, lim=0.5))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "quota_request" in err.details()
    err = rpc_error(stub.PrepareShare, fastpod("too-much-mem", gpu, sm=10, mem_gib=16, req=0.1))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "12288 MiB" in err.details()
    stub.PrepareShare(fastpod("fits", gpu, sm=30, mem_gib=12, req=0.4, lim=0.4), timeout=60)


def test_whole_gpus_and_conflicts(agent):
    agent.start()
    uuids = _uuids(agent)
    stub = agent.unix()
    reply = stub.PrepareShare(share("w", "whole", [uuids[GPU_A], uuids[GPU_B]]), timeout=60)
    assert reply.env["CUDA_VISIBLE_DEVICES"] == f"{uuids[GPU_A]},{uuids[GPU_B]}"
    assert list(reply.device_uuids) == [uuids[GPU_A], uuids[GPU_B]]
    err = rpc_error(stub.PrepareShare, fastpod("fp", uuids[GPU_B]))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "whole" in err.details()
    err = rpc_error(stub.PrepareShare, share("w2", "whole", [uuids[GPU_MIG]]))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "MIG mode" in err.details()
    _release(stub, "w")
    stub.PrepareShare(fastpod("fp", uuids[GPU_B]), timeout=60)
    err = rpc_error(stub.PrepareShare, share("w3", "whole", [uuids[GPU_B]]))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_invalid_requests_name_the_field(agent):
    agent.start()
    uuids = _uuids(agent)
    stub = agent.unix()
    cases = [
        (share("bad id!", "whole", [uuids[GPU_A]]), "share.id"),
        (fastpod("x", uuids[GPU_A], sm=0), "share.sm_percent"),
        (fastpod("x", uuids[GPU_A], req=0.8, lim=0.5), "share.quota_request"),
        (share("x", "fastpod", [uuids[GPU_A], uuids[GPU_B]], sm_percent=10), "share.device_uuids"),
        (share("x", "exclusive", [uuids[GPU_MIG]]), "share.mig_profile"),
        (agent_pb2.PrepareShareRequest(share=agent_pb2.Share(id="x", device_uuids=[uuids[0]])), "share.kind"),
        (agent_pb2.PrepareShareRequest(), "share is required"),
    ]
    for request, field in cases:
        err = rpc_error(stub.PrepareShare, request)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.details())
        assert field in err.details()
    err = rpc_error(stub.PrepareShare, fastpod("x", "GPU-00000000-0000-0000-0000-000000000000"))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert agent.unix().GetInventory(INV, timeout=30).shares == []


def test_mig_mode_change_is_refused_while_shares_hold_the_gpu(agent):
    agent.start()
    gpu = _uuids(agent)[GPU_MIG]
    stub = agent.unix()
    stub.PrepareShare(share("x", "exclusive", [gpu], mig_profile="1g.10gb"), timeout=60)
    err = rpc_error(stub.SetMigMode, agent_pb2.SetMigModeRequest(gpu_uuid=gpu, enabled=False))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    _release(stub, "x")
    reply = stub.SetMigMode(agent_pb2.SetMigModeRequest(gpu_uuid=gpu, enabled=False), timeout=60)
    assert reply.changed and not reply.pending  # Hopper applies it at once
    err = rpc_error(stub.PrepareShare, share("y", "exclusive", [gpu], mig_profile="1g.10gb"))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "MIG is disabled" in err.details()


def _parallel(n, fn):
    results, errors = [None] * n, [None] * n

    def run(i):
        try:
            results[i] = fn(i)
        except grpc.RpcError as exc:
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results, errors


def test_concurrent_requests_on_one_gpu_never_overcommit(agent, devices):
    agent.start()
    uuids = _uuids(agent)
    stub = agent.unix()
    # 8 fastpods of 20 % SM race for one GPU: exactly 5 fit.
    results, errors = _parallel(8, lambda i: stub.PrepareShare(
        fastpod(f"p{i}", uuids[GPU_A], sm=20, mem_gib=1, req=0.1, lim=0.2), timeout=120))
    assert sum(r is not None for r in results) == 5
    assert {e.code() for e in errors if e is not None} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert len(sharefiles.read(agent.rundir / "shares", uuids[GPU_A])) == 5
    assert len(agent.unix().GetInventory(INV, timeout=30).mps_daemons) == 1
    # The same share id retried concurrently: one creation, one answer.
    results, errors = _parallel(4, lambda i: stub.PrepareShare(fastpod("same", uuids[GPU_B]), timeout=120))
    assert errors == [None] * 4
    assert sum(r.created for r in results) == 1 and len({r.port for r in results}) == 1
    # 8 one-slice MIG instances race for the 7 slices of the H100.
    results, errors = _parallel(8, lambda i: stub.PrepareShare(
        share(f"m{i}", "exclusive", [uuids[GPU_MIG]], mig_profile="1g.10gb"), timeout=120))
    assert sum(r is not None for r in results) == 7
    assert {e.code() for e in errors if e is not None} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert len({r.device_uuids[0] for r in results if r}) == 7 == len(devices.mig_instances(GPU_MIG))


def test_concurrent_fast_path_changes_leave_exact_share_files(agent):
    """Concurrent prepares and releases on a running daemon coalesce their share-file writes;
    whatever the interleaving, the files end up listing exactly the shares that remain."""
    agent.start()
    gpu = _uuids(agent)[GPU_A]
    stub = agent.unix()
    stub.PrepareShare(fastpod("first", gpu, sm=4, mem_gib=1, req=0.04, lim=0.1), timeout=120)  # daemon up
    _, errors = _parallel(16, lambda i: stub.PrepareShare(
        fastpod(f"c{i}", gpu, sm=4, mem_gib=1, req=0.04, lim=0.1), timeout=120))
    assert errors == [None] * 16
    listed = {e.key for e in sharefiles.read(agent.rundir / "shares", gpu)}
    assert listed == {"first"} | {f"c{i}" for i in range(16)}
    _, errors = _parallel(8, lambda i: _release(stub, f"c{2 * i}"))
    assert errors == [None] * 8
    remaining = {"first"} | {f"c{2 * i + 1}" for i in range(8)}
    assert {e.key for e in sharefiles.read(agent.rundir / "shares", gpu)} == remaining
    assert len({e.port for e in sharefiles.read(agent.rundir / "shares", gpu)}) == len(remaining)


def test_fastpod_on_a_mig_device_gets_its_own_daemon(agent, devices):
    agent.start()
    gpu = _uuids(agent)[GPU_MIG]
    stub = agent.unix()
    err = rpc_error(stub.PrepareShare, fastpod("on-gpu", gpu))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "MIG-" in err.details()
    layout = stub.ApplyMigLayout(agent_pb2.MigLayoutRequest(gpu_uuid=gpu, profiles={"3g.40gb": 2}),
                                 timeout=60)
    mig = layout.mig_devices[0].uuid
    reply = stub.PrepareShare(fastpod("on-mig", mig, sm=50, mem_gib=8), timeout=60)
    assert reply.env["CUDA_VISIBLE_DEVICES"] == mig and mig in reply.host_paths["mps_pipe_dir"]
    assert MpsControl(STANDIN, agent.rundir / "mps").answers(mig)
    err = rpc_error(stub.PrepareShare, fastpod("too-big", mig, sm=10, mem_gib=60))  # a 3g has ~40 GB
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    start = next(m.start for m in layout.mig_devices if m.uuid == mig)
    err = rpc_error(stub.PrepareShare, share("ex", "exclusive", [gpu], mig_profile="3g.40gb",
                                             mig_start=start))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "in use" in err.details()
    assert list(_release(stub, "on-mig").stopped_mps_daemons) == [mig]
    assert len(devices.mig_instances(GPU_MIG)) == 2  # layout instances stay


def test_agent_still_starts_when_journaled_gpus_disappeared(agent, sim_machine):
    agent.start()
    uuids = _uuids(agent)
    agent.unix().PrepareShare(fastpod("fp", uuids[GPU_A]), timeout=60)
    agent.unix().PrepareShare(share("ex", "exclusive", [uuids[GPU_MIG]], mig_profile="1g.10gb"), timeout=60)
    agent.kill9()
    simnvml.create_machine(sim_machine, ["H100-SXM5-80GB", "V100-SXM2-32GB"], mig_enabled=True,
                           overwrite=True)  # new GPUs (new UUIDs), the journal knows the old ones
    agent.start()
    inv = agent.unix().GetInventory(INV, timeout=30)
    assert len(inv.gpus) == 2 and not {g.uuid for g in inv.gpus} & set(uuids)
    # the shares on the GPUs that went are dropped (nothing can use them), each named in the log
    assert not inv.shares
    log = agent.log.read_text()
    assert all(f"share {sid}: GPU {uuid} is no longer on this node" in log
               for sid, uuid in (("fp", uuids[GPU_A]), ("ex", uuids[GPU_MIG]))), log
    assert agent.unix().PrepareShare(fastpod("new", inv.gpus[GPU_A].uuid), timeout=60).created


def test_an_mps_share_without_a_memory_limit_lifts_the_daemon_memory_cap(agent):
    """memory_bytes 0 on an MPS share means no limit (agent.proto), and the share's env sets none,
    so its clients get the daemon's default: joining a daemon capped for smaller shares, it was
    left capped at their largest limit (a workload promised the whole GPU's memory got 2 GiB)."""
    agent.start()
    inv = agent.unix().GetInventory(INV, timeout=30)
    gpu, memory_mib = inv.gpus[GPU_A].uuid, inv.gpus[GPU_A].memory_bytes >> 20
    stub = agent.unix()
    stub.PrepareShare(share("capped", "mps", [gpu], memory_bytes=2 << 30), timeout=60)
    mps = MpsControl(STANDIN, agent.rundir / "mps")
    assert mps.command(gpu, "get_default_device_pinned_mem_limit 0").strip() == "2048M"
    free = stub.PrepareShare(share("unlimited", "mps", [gpu]), timeout=60)
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in free.env
    assert mps.command(gpu, "get_default_device_pinned_mem_limit 0").strip() == f"{memory_mib}M"
    stub.PrepareShare(share("capped-2", "mps", [gpu], memory_bytes=4 << 30), timeout=60)  # stays lifted
    assert mps.command(gpu, "get_default_device_pinned_mem_limit 0").strip() == f"{memory_mib}M"
