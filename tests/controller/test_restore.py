"""Restoring the controller's state.db from an older backup (real controller, real agent on a
simulated machine): the shares allocated after the backup are still running on the agent, so
the controller must neither free them as orphans nor hand their capacity out again. It adopts
them (a record rebuilt from the agent's share, with the idempotency key and lease it carries;
`fastshare release` ends it as usual) and says so; a true orphan (a share whose record this
database did have, or never committed) is still freed. And `fastshare controller backup` takes
a consistent copy of the live state."""

from __future__ import annotations

import os
import sqlite3
import subprocess

import grpc
import pytest

from fastshare.controller.core import sequence_of
from fastshare.controller.model import Node
from fastshare.controller.sqlite_store import SqliteStore
from fastshare.v1 import agent_pb2, common_pb2
from fastshare.v1 import controller_pb2 as pb

from .conftest import GiB, allocate, fastshare_bin, wait_for

L4_HALF = dict(sm_percent=50, memory_bytes=4 * GiB, models=["L4"])


def backup(state: str, out: str) -> subprocess.CompletedProcess:
    return subprocess.run([fastshare_bin(), "controller", "backup", "--state", state, "--out", out],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def node(cluster):
    cluster.add_machine("node-a", ["A100-SXM4-40GB", "L4"], mig_enabled=True)
    cluster.start_controller()
    cluster.start_agent("node-a")
    return cluster


def test_restoring_an_older_backup_adopts_the_newer_shares_instead_of_freeing_them(node):
    cluster = node
    client = cluster.client()
    old = allocate(client, "fastpod", owner="team/old", **L4_HALF)
    state = cluster.state_dir / "state.db"
    copy = cluster.root / "backup.db"
    done = backup(str(state), str(copy))   # the controller is running
    assert done.returncode == 0, done.stderr
    assert "integrity check ok" in done.stderr
    newer = allocate(client, "fastpod", owner="team/newer", **L4_HALF)          # the L4 is full now
    sliced = allocate(client, "exclusive", owner="team/sliced", mig_profile="3g.20gb")
    agent = cluster.agents["node-a"]
    assert {old.id, newer.id, sliced.id} <= agent.share_ids(cluster.pki)

    cluster.controller.stop()   # the operator restores the backup
    for leftover in ("state.db", "state.db-wal", "state.db-shm"):
        (cluster.state_dir / leftover).unlink(missing_ok=True)
    copy.rename(state)
    cluster.start_controller()
    cluster.wait_node("node-a", available=True)

    # The newer shares are still on the agent (the controller started without them on record).
    held = agent.share_ids(cluster.pki)
    assert {old.id, newer.id, sliced.id} <= held, cluster.controller.output()
    records = {a.id: a for a in cluster.status().allocations}
    for before in (newer, sliced):
        adopted = records[before.id]
        assert adopted.state == pb.ALLOCATION_STATE_ACTIVE, adopted
        assert adopted.reason.startswith("adopted: "), adopted.reason
        assert (adopted.node, adopted.owner) == (before.node, before.owner)
        assert adopted.spec.kind == before.spec.kind
        assert [d.gpu_uuid for d in adopted.devices] == [d.gpu_uuid for d in before.devices]
        assert dict(adopted.env) == dict(before.env)
    assert records[sliced.id].devices[0].mig_uuid == sliced.devices[0].mig_uuid
    log = cluster.controller.output()
    assert f"ERROR fastshare.controller: node node-a holds share {newer.id}" in log, log
    assert log.count(f"holds share {newer.id}") == 1
    # Reported by `fastshare status`, and its capacity is not handed out again.
    shown = subprocess.run([fastshare_bin(), "status", "--controller", cluster.address, "--tls-dir",
                            str(cluster.pki.dir)], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "COLUMNS": "250"})
    assert shown.returncode == 0, shown.stderr
    assert "Adopted" in shown.stdout and newer.id in shown.stdout, shown.stdout
    with pytest.raises(grpc.RpcError) as refused:
        allocate(client, "fastpod", sm_percent=10, memory_bytes=GiB, models=["L4"])
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()

    # A true orphan is still freed: a share with a sequence this database has issued (the
    # backup holds `old`), or one in the old id format, that no record holds.
    stub = agent.stub(cluster.pki)
    seq = sequence_of(old.id)
    assert seq is not None
    orphans = [f"fs-{seq:x}-00000000", "fs-0123456789abcdef"]
    a100 = next(g.uuid for g in stub.GetInventory(agent_pb2.GetInventoryRequest(), timeout=30).gpus
                if g.mig_enabled)
    for orphan in orphans:   # made on the agent behind the controller's back
        stub.PrepareShare(agent_pb2.PrepareShareRequest(share=agent_pb2.Share(
            id=orphan, kind=common_pb2.SHARE_KIND_EXCLUSIVE, device_uuids=[a100], mig_profile="1g.5gb",
            owner="nobody")), timeout=60)
    wait_for(lambda: not set(orphans) & agent.share_ids(cluster.pki), 60, "the true orphans freed")
    assert {old.id, newer.id, sliced.id} <= agent.share_ids(cluster.pki)

    # Recovery: the adopted allocations end like any other, and survive another restart first.
    cluster.controller.stop()
    cluster.start_controller()
    cluster.wait_node("node-a", available=True)
    for before in (newer, sliced):
        ended = subprocess.run([fastshare_bin(), "release", before.id, "--controller", cluster.address,
                                "--tls-dir", str(cluster.pki.dir)],
                               capture_output=True, text=True, timeout=60)
        assert ended.returncode == 0, ended.stderr
        assert f"allocation {before.id} on node node-a: released" in ended.stdout, ended.stdout
    assert not {newer.id, sliced.id} & agent.share_ids(cluster.pki)
    again = allocate(client, "fastpod", sm_percent=10, memory_bytes=GiB, models=["L4"])
    assert again.state == pb.ALLOCATION_STATE_ACTIVE


def test_backup_refuses_to_overwrite_and_checks_the_copy(tmp_path):
    state = tmp_path / "state.db"
    store = SqliteStore(state)   # open, as the controller keeps it
    store.put_node(Node(name="n1", address="127.0.0.1:1"))
    out = tmp_path / "copy.db"
    out.write_text("keep me")
    refused = backup(str(state), str(out))
    assert refused.returncode != 0, refused.stderr
    assert "--out" in refused.stderr and "exists" in refused.stderr, refused.stderr
    assert out.read_text() == "keep me"

    missing = backup(str(tmp_path / "nope.db"), str(tmp_path / "new.db"))
    assert missing.returncode != 0 and "--state" in missing.stderr, missing.stderr
    assert not (tmp_path / "new.db").exists() and not (tmp_path / "nope.db").exists()

    not_state = tmp_path / "other.db"
    sqlite3.connect(not_state).close()
    wrong = backup(str(not_state), str(tmp_path / "new.db"))
    assert wrong.returncode != 0 and "not a fastshare controller state" in wrong.stderr, wrong.stderr
    assert not (tmp_path / "new.db").exists()

    done = backup(str(state), str(tmp_path / "new.db"))
    assert done.returncode == 0, done.stderr
    assert "1 node(s); integrity check ok" in done.stderr, done.stderr
    assert (tmp_path / "new.db").stat().st_mode & 0o777 == 0o600
    assert not (tmp_path / "new.db-wal").exists()
    store.close()
    restored = SqliteStore(tmp_path / "new.db")
    assert [n.name for n in restored.list_nodes()] == ["n1"]
    restored.close()


def test_a_run_under_a_lease_survives_a_restore_and_its_lease_comes_back(node):
    """The adopted record gets its lease back (from the share) and the run keeps renewing it."""
    cluster = node
    state, copy = cluster.state_dir / "state.db", cluster.root / "backup.db"
    assert backup(str(state), str(copy)).returncode == 0
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FASTSHARE_")},
           "FASTSHARE_CONTROLLER": cluster.address, "FASTSHARE_TLS_DIR": str(cluster.pki.dir)}
    run = subprocess.Popen([fastshare_bin(), "run", "--kind", "mps", "--mem", "1GiB", "--lease-ttl", "6",
                            "--", "sleep", "300"], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: any(a.state == pb.ALLOCATION_STATE_ACTIVE for a in cluster.status().allocations),
                 60, "the run's allocation")
        (made,) = [a for a in cluster.status().allocations if a.state == pb.ALLOCATION_STATE_ACTIVE]
        cluster.controller.stop()
        for leftover in ("state.db", "state.db-wal", "state.db-shm"):
            (cluster.state_dir / leftover).unlink(missing_ok=True)
        copy.rename(state)
        cluster.start_controller()
        cluster.wait_node("node-a", available=True)

        def leased():
            record = {a.id: a for a in cluster.status().allocations}.get(made.id)
            return record is not None and record.lease_expires_at > 0 and record
        adopted = wait_for(leased, 60, "the adopted allocation's lease renewed by the run")
        assert adopted.reason.startswith("adopted: ") and adopted.state == pb.ALLOCATION_STATE_ACTIVE
        assert run.poll() is None, "the run must go on"
    finally:
        run.terminate()
        _, stderr = run.communicate(timeout=60)
    assert "INVALID_ARGUMENT" not in stderr, stderr   # "the allocation has no lease", every renewal
    assert "released" in stderr, stderr                # and the run ended the adopted allocation itself
    assert made.id not in cluster.agents["node-a"].share_ids(cluster.pki)


def _restore(cluster, copy) -> None:
    """The operator (or a power loss) takes the state.db back to ``copy``; the controller restarts."""
    cluster.controller.stop()
    state = cluster.state_dir / "state.db"
    for leftover in ("state.db", "state.db-wal", "state.db-shm"):
        (cluster.state_dir / leftover).unlink(missing_ok=True)
    copy.rename(state)
    cluster.start_controller()
    cluster.wait_node("node-a", available=True)


def test_a_retry_with_the_same_key_gets_the_adopted_allocation_back(node):
    """Power-loss shape: the record of an answered-or-not Allocate is lost, its share is adopted
    (the share carries the key), and the client's retry with the same key gets that allocation,
    not a second share next to it."""
    cluster = node
    client = cluster.client()
    state, copy = cluster.state_dir / "state.db", cluster.root / "backup.db"
    assert backup(str(state), str(copy)).returncode == 0
    first = allocate(client, "fastpod", key="job-7/attempt-1", owner="team/job", ttl=600, **L4_HALF)
    _restore(cluster, copy)

    adopted = {a.id: a for a in cluster.status().allocations}[first.id]
    assert adopted.reason.startswith("adopted: ") and adopted.state == pb.ALLOCATION_STATE_ACTIVE
    assert adopted.lease_expires_at > 0, adopted   # its lease came back with it
    again = allocate(cluster.client(), "fastpod", key="job-7/attempt-1", owner="team/job", ttl=600,
                     **L4_HALF)
    assert again.id == first.id, (again, cluster.controller.output())
    assert dict(again.env) == dict(first.env)
    assert cluster.agents["node-a"].share_ids(cluster.pki) == {first.id}
    assert [a.id for a in cluster.status().allocations] == [first.id]
    # The key still guards the request: a different one under it is refused, as for any record.
    with pytest.raises(grpc.RpcError) as refused:
        allocate(cluster.client(), "fastpod", key="job-7/attempt-1", owner="team/job", ttl=600,
                 sm_percent=25, memory_bytes=GiB, models=["L4"])
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS, refused.value.details()


def test_an_adopted_allocation_whose_client_is_gone_is_released_when_its_lease_expires(node):
    cluster = node
    state, copy = cluster.state_dir / "state.db", cluster.root / "backup.db"
    assert backup(str(state), str(copy)).returncode == 0
    made = allocate(cluster.client(), "mps", key="gone-client", ttl=6, memory_bytes=GiB)
    _restore(cluster, copy)   # nobody renews it from here on

    def ended():
        record = {a.id: a for a in cluster.status().allocations}.get(made.id)
        return record is not None and record.state == pb.ALLOCATION_STATE_RELEASED and record
    released = wait_for(ended, 60, f"the adopted allocation released\n{cluster.controller.output()}")
    assert released.reason == "lease expired", released.reason
    assert made.id not in cluster.agents["node-a"].share_ids(cluster.pki)


def test_a_retry_answered_before_the_adoption_keeps_the_key_and_the_share_is_still_adopted(cluster):
    """The share's node is down when the client retries: the retry makes a new allocation on
    another node and holds the key; the share, adopted when its node is back, is recorded without
    the key (saying which allocation holds it) instead of failing adoption every pass."""
    for name in ("node-a", "node-b"):
        cluster.add_machine(name, ["L4"])
    cluster.start_controller()
    for name in ("node-a", "node-b"):
        cluster.start_agent(name)
    state, copy = cluster.state_dir / "state.db", cluster.root / "backup.db"
    assert backup(str(state), str(copy)).returncode == 0
    first = allocate(cluster.client(), "mps", key="early-retry", ttl=600, memory_bytes=GiB)
    down, other = first.node, ({"node-a", "node-b"} - {first.node}).pop()
    cluster.agents[down].stop()
    cluster.controller.stop()
    for leftover in ("state.db", "state.db-wal", "state.db-shm"):
        (cluster.state_dir / leftover).unlink(missing_ok=True)
    copy.rename(state)
    cluster.start_controller()
    cluster.wait_node(down, available=False)
    retry = allocate(cluster.client(), "mps", key="early-retry", ttl=600, memory_bytes=GiB)
    assert retry.node == other and retry.id != first.id

    cluster.start_agent(down)
    # The node is available once it registers; its shares are adopted at the reconciler's next pass.
    adopted = wait_for(lambda: {a.id: a for a in cluster.status().allocations}.get(first.id), 60,
                       f"the share on {down} adopted\n{cluster.controller.output()}")
    assert adopted.state == pb.ALLOCATION_STATE_ACTIVE and adopted.reason.startswith("adopted: ")
    assert f"its idempotency key is held by allocation {retry.id}" in adopted.reason, adopted.reason
    assert adopted.lease_expires_at > 0
    again = allocate(cluster.client(), "mps", key="early-retry", ttl=600, memory_bytes=GiB)
    assert again.id == retry.id


@pytest.mark.parametrize("directory", ["state#1", "state?1", "state%201"])
def test_backup_of_a_state_whose_path_has_uri_characters(tmp_path, directory):
    """The state's path goes into an SQLite URI: '#', '?' and '%' in it must not open another file
    (a stray empty database at the cut path, and a backup refused as 'not a fastshare state')."""
    (tmp_path / directory).mkdir()
    state = tmp_path / directory / "state.db"
    store = SqliteStore(state)
    store.put_node(Node(name="n1", address="127.0.0.1:1"))
    store.close()
    before = sorted(p.name for p in tmp_path.iterdir())
    done = backup(str(state), str(tmp_path / "new.db"))
    assert done.returncode == 0, done.stderr
    assert "1 node(s); integrity check ok" in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "new.db"])


def test_a_backup_interrupted_midway_leaves_nothing_that_looks_like_a_backup(tmp_path, monkeypatch):
    """A backup killed midway (a cron job's timeout, Ctrl-C) left a partial, unchecked file at
    --out that looked like a backup. It is now written beside it and linked there once checked."""
    from click.testing import CliRunner

    from fastshare.cli import main as cli

    state = tmp_path / "state.db"
    SqliteStore(state).close()
    real_connect = sqlite3.connect

    class Interrupted(sqlite3.Connection):
        def backup(self, *args, **kwargs):
            raise KeyboardInterrupt

    monkeypatch.setattr(sqlite3, "connect", lambda *a, **k: real_connect(*a, factory=Interrupted, **k))
    out = tmp_path / "copy.db"
    result = CliRunner().invoke(cli, ["controller", "backup", "--state", str(state), "--out", str(out)])
    assert result.exit_code != 0
    assert not out.exists() and not (tmp_path / "copy.db.partial").exists()
    monkeypatch.undo()

    (tmp_path / "copy.db.partial").write_text("left by a killed run")
    left = backup(str(state), str(out))
    assert left.returncode != 0 and "interrupted backup left it" in left.stderr, left.stderr
    assert not out.exists()


def test_a_share_numbered_ahead_of_the_clock_on_a_node_away_at_start_is_adopted_not_freed(cluster):
    """The controller's clock is behind the number of a share its database lost (clock stepped
    back, or state.db restored onto a host whose clock is behind; here the share, made behind the
    controller's back, is numbered ahead of the clock). Its node is away at start and the clock
    passes its number meanwhile: the controller issues numbers around it, and its mark passes it.
    When the node is back, the share was freed as an orphan under its workload; now it is judged
    as at the controller's start: adopted."""
    import time

    for name in ("node-a", "node-b"):
        cluster.add_machine(name, ["L4"])
    cluster.start_controller()
    for name in ("node-a", "node-b"):
        cluster.start_agent(name)
    cluster.controller.stop()
    stub = cluster.agents["node-a"].stub(cluster.pki)
    gpu = stub.GetInventory(agent_pb2.GetInventoryRequest(), timeout=30).gpus[0].uuid
    sequence = time.time_ns() // 1000 + 30_000_000   # room for a slow start on a loaded machine
    lost = f"fs-{sequence:x}-0000abcd"
    stub.PrepareShare(agent_pb2.PrepareShareRequest(share=agent_pb2.Share(
        id=lost, kind=common_pb2.SHARE_KIND_FASTPOD, device_uuids=[gpu], sm_percent=50, memory_bytes=4 * GiB,
        quota_request=0.5, quota_limit=1.0, owner="team/lost")), timeout=60)
    cluster.agents["node-a"].stop()
    cluster.start_controller()
    cluster.wait_node("node-b", available=True)
    first = allocate(cluster.client(), "mps", memory_bytes=GiB)
    assert first.node == "node-b" and sequence_of(first.id) < sequence, "the start took too long for the test"
    wait_for(lambda: time.time_ns() // 1000 > sequence, 45, "the clock past the lost share's number")
    second = allocate(cluster.client(), "mps", memory_bytes=GiB)
    assert sequence_of(second.id) > sequence

    cluster.start_agent("node-a")

    def judged():
        return ({a.id: a for a in cluster.status().allocations}.get(lost)
                or lost not in cluster.agents["node-a"].share_ids(cluster.pki))
    wait_for(judged, 60, f"the share on node-a judged\n{cluster.controller.output()}")
    assert f"freed orphan share {lost}" not in cluster.controller.output()
    assert lost in cluster.agents["node-a"].share_ids(cluster.pki)
    adopted = {a.id: a for a in cluster.status().allocations}[lost]
    assert adopted.state == pb.ALLOCATION_STATE_ACTIVE and adopted.reason.startswith("adopted: "), adopted
