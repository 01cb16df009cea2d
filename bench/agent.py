"""Node agent latency: PrepareShare/ReleaseShare of a `fastpod` share on an existing MPS
daemon, against a no-op Ping on the same server and channel (the baseline, same run).

Starts a real agent process (simulated NVML machine, MPS stand-in, mTLS on loopback), warms
it up with one share so the MPS daemon exists, then times N prepare+release pairs.

    .venv/bin/python bench/agent.py [--rounds 300] [--transport mtls|unix]

Target: PrepareShare p99 < 20 ms on this machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from fastshare.device import simnvml
from fastshare.node.client import channel, stub
from fastshare.security import certs as pki
from fastshare.security.tls import TlsPaths
from fastshare.v1 import agent_pb2, common_pb2

BIN = Path(sys.executable).parent


def _start_agent(work: Path) -> tuple[subprocess.Popen, dict[str, int], Path]:
    pki.init_ca(work / "ca")
    pki.issue(work / "ca", "node", work / "server", sans=["127.0.0.1"], role="node", days=1)
    # Over mTLS the agent takes PrepareShare only from the controller: the benchmark is one.
    pki.issue(work / "ca", "bench", work / "client", role="controller", days=1)
    machine = work / "machine.json"
    simnvml.create_machine(machine, ["A100-SXM4-40GB"])
    # Like production: run_dir on tmpfs (/run), the journal on disk (fsync is real there).
    run = Path(tempfile.mkdtemp(prefix="fsb-", dir="/dev/shm" if Path("/dev/shm").is_dir() else "/tmp"))
    config = work / "node.yaml"
    config.write_text(yaml.safe_dump({
        "node_name": "bench", "listen": "127.0.0.1:0", "unix_socket": str(run / "node.sock"),
        "state_dir": str(work / "state"), "run_dir": str(run), "device_backend": "sim",
        "sim_state": str(machine), "mps_control_binary": str(BIN / "fastshare-mps-standin"),
        "metrics_listen": "", "tls": {"cert": str(work / "server/node.crt"),
                                      "key": str(work / "server/node.key"), "ca": str(work / "ca/ca.crt")}}))
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(run / "notify"))
    notify.settimeout(120)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTSHARE_")}
    env["NOTIFY_SOCKET"] = str(run / "notify")
    proc = subprocess.Popen([str(BIN / "fastshare"), "node", "serve", "--config", str(config),
                             "--log-level", "WARNING"], env=env)
    message = notify.recv(4096).decode()
    notify.close()
    status = dict(line.split("=", 1) for line in message.splitlines())["STATUS"].removeprefix("serving ")
    ports = {k: int(v) for k, v in (item.split("=") for item in status.split(", "))}
    return proc, ports, run


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _row(name: str, samples: list[float], baseline: list[float] | None) -> str:
    p50, p99 = _pct(samples, 0.5) * 1e3, _pct(samples, 0.99) * 1e3
    rate = len(samples) / sum(samples)
    ratio = ""
    if baseline:
        ratio = f"{p50 / (_pct(baseline, 0.5) * 1e3):7.1f}x {p99 / (_pct(baseline, 0.99) * 1e3):7.1f}x"
    return f"{name:<28} {rate:9.0f} {p50:9.2f} {p99:9.2f} {statistics.mean(samples) * 1e3:9.2f}  {ratio}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--transport", choices=("mtls", "unix"), default="mtls")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fastshare-bench-"))
    proc, ports, run = _start_agent(work)
    try:
        if args.transport == "mtls":
            ch = channel(f"127.0.0.1:{ports['listen']}", tls=TlsPaths.in_dir(work / "client", "bench"))
        else:
            ch = channel(unix_socket=run / "node.sock")
        agent = stub(ch)
        gpu = agent.GetInventory(agent_pb2.GetInventoryRequest(), timeout=60).gpus[0].uuid

        def fastpod(share_id: str) -> agent_pb2.PrepareShareRequest:
            return agent_pb2.PrepareShareRequest(share=agent_pb2.Share(
                id=share_id, kind=common_pb2.SHARE_KIND_FASTPOD, device_uuids=[gpu], sm_percent=10,
                memory_bytes=1 << 30, quota_request=0.1, quota_limit=0.5))

        agent.PrepareShare(fastpod("resident"), timeout=60)  # the MPS daemon now exists
        for i in range(20):  # warm-up: connections, caches, code paths
            agent.Ping(common_pb2.Empty(), timeout=10)
            agent.PrepareShare(fastpod(f"warm-{i}"), timeout=10)
            agent.ReleaseShare(agent_pb2.ReleaseShareRequest(share_id=f"warm-{i}"), timeout=10)

        ping, prepare, release, pair = [], [], [], []
        for i in range(args.rounds):
            t0 = time.perf_counter()
            agent.Ping(common_pb2.Empty(), timeout=10)
            t1 = time.perf_counter()
            reply = agent.PrepareShare(fastpod(f"s-{i}"), timeout=10)
            t2 = time.perf_counter()
            agent.ReleaseShare(agent_pb2.ReleaseShareRequest(share_id=f"s-{i}"), timeout=10)
            t3 = time.perf_counter()
            assert reply.created and reply.env["CUDA_MPS_PIPE_DIRECTORY"]
            ping.append(t1 - t0)
            prepare.append(t2 - t1)
            release.append(t3 - t2)
            pair.append(t3 - t1)
        print(f"node agent, fastpod share on an existing MPS daemon, {args.rounds} rounds over "
              f"{args.transport} (simulated NVML, MPS stand-in; journal {work / 'state'}, run dir {run})")
        print(f"{'call':<28} {'calls/s':>9} {'p50 ms':>9} {'p99 ms':>9} {'mean ms':>9}  vs Ping p50 / p99")
        print(_row("Ping (baseline, no-op)", ping, None))
        print(_row("PrepareShare", prepare, ping))
        print(_row("ReleaseShare", release, ping))
        print(_row("Prepare+Release round trip", pair, ping))
        p99 = _pct(prepare, 0.99) * 1e3
        print(f"PrepareShare p99 {p99:.2f} ms: {'meets' if p99 < 20 else 'MISSES'} the 20 ms target")
        return 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        from fastshare.mps.control import MpsControl

        control = MpsControl(BIN / "fastshare-mps-standin", run / "mps")
        for uuid in control.running_devices():
            control.stop(uuid)
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
