#!/usr/bin/env python3
"""How long this host's disk and CPU scheduler stall, measured beside a benchmark.

A latency target of tens of milliseconds is only as good as the host under it: one fdatasync
that takes half a second holds every durable answer for that long, whatever the program does.
So a benchmark that reports a tail latency should say what the host did meanwhile. This probe
runs as its own process (it shares no GIL with the load generator), with two threads:
  - disk: a 4 KiB write and an fdatasync every 50 ms, in the directory under test (so on the
    filesystem the measured program makes durable);
  - cpu: sleeps 5 ms at a time and notes how late it woke (run-queue delay, steal time).
On SIGTERM it prints one JSON object and exits: per probe, how many samples it took, the
slowest, and every stall over --threshold-ms as [start, seconds] on CLOCK_MONOTONIC (what
``time.monotonic()`` reads in any process on the host).

    python bench/host_stalls.py DIR [--threshold-ms 20]

bench/controller.py runs it around its open-loop phase (:class:`HostStalls`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

DISK_PERIOD_S = 0.05
CPU_SLEEP_S = 0.005


@dataclass
class Probe:
    """Samples and stalls of one probe thread; ``busy_since`` marks a sample in progress."""

    samples: int = 0
    slowest: float = 0.0
    stalls: list[tuple[float, float]] = field(default_factory=list)
    busy_since: float | None = None

    def record(self, started: float, took: float, threshold: float) -> None:
        self.samples += 1
        self.slowest = max(self.slowest, took)
        if took > threshold:
            self.stalls.append((started, took))

    def report(self, threshold: float) -> dict:
        """Including a sample still stuck now: the stall that is happening counts too."""
        stalls = list(self.stalls)
        if self.busy_since is not None and (stuck := time.monotonic() - self.busy_since) > threshold:
            stalls.append((self.busy_since, stuck))
        return {"samples": self.samples, "slowest_s": max([self.slowest, *(s for _, s in stalls)]),
                "stalls": stalls}


def probe_disk(directory: Path, probe: Probe, threshold: float, stop: threading.Event) -> None:
    path = directory / f".host-stalls-{os.getpid()}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        block = b"\0" * 4096
        i = 0
        while not stop.wait(DISK_PERIOD_S):
            probe.busy_since = started = time.monotonic()
            os.pwrite(fd, block, (i % 16) * 4096)   # in place after the first 16: no size change
            os.fdatasync(fd)
            probe.busy_since = None
            probe.record(started, time.monotonic() - started, threshold)
            i += 1
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def probe_cpu(probe: Probe, threshold: float, stop: threading.Event) -> None:
    while not stop.is_set():
        started = time.monotonic()
        time.sleep(CPU_SLEEP_S)
        late = time.monotonic() - started - CPU_SLEEP_S
        probe.record(started + CPU_SLEEP_S, max(0.0, late), threshold)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path, help="where to write (the filesystem under test)")
    parser.add_argument("--threshold-ms", type=float, default=20.0, help="report stalls longer than this")
    args = parser.parse_args()
    threshold = args.threshold_ms / 1000
    stop = threading.Event()
    disk, cpu = Probe(), Probe()
    threads = [threading.Thread(target=probe_disk, args=(args.directory, disk, threshold, stop), daemon=True),
               threading.Thread(target=probe_cpu, args=(cpu, threshold, stop), daemon=True)]
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    for t in threads:
        t.start()
    print("ready", flush=True)
    while not stop.wait(1.0):
        pass
    for t in threads:
        t.join(timeout=1.0)   # a disk probe stuck in fdatasync is reported as stuck, not awaited
    json.dump({"threshold_s": threshold, "disk": disk.report(threshold), "cpu": cpu.report(threshold)},
              sys.stdout)
    sys.stdout.flush()
    os._exit(0)   # do not wait for a daemon thread stuck in the kernel


class HostStalls:
    """Runs the probe in its own process for the duration of a ``with`` block; ``result`` holds
    its report afterwards."""

    def __init__(self, directory: Path, threshold_ms: float = 20.0) -> None:
        self.args = [sys.executable, str(Path(__file__)), str(directory), "--threshold-ms", str(threshold_ms)]
        self.result: dict = {}

    def __enter__(self) -> HostStalls:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("host stall probe failed to start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=30)
        self.result = json.loads(out)

    def stalls(self) -> list[tuple[float, float]]:
        """Every stall either probe saw, as (start, end) on CLOCK_MONOTONIC."""
        return [(start, start + took)
                for kind in ("disk", "cpu") for start, took in self.result[kind]["stalls"]]

    def summary(self) -> str:
        parts = []
        for kind, what in (("disk", "fdatasync"), ("cpu", "wake-up delay")):
            r = self.result[kind]
            parts.append(f"{what}: {len(r['stalls'])} over {1000 * self.result['threshold_s']:.0f} ms "
                         f"in {r['samples']} samples, slowest {1000 * r['slowest_s']:.0f} ms")
        return "; ".join(parts)


def overlaps(span: tuple[float, float], stalls: list[tuple[float, float]]) -> bool:
    """Whether a request in flight from span[0] to span[1] lived through any stall."""
    return any(start < span[1] and span[0] < end for start, end in stalls)


if __name__ == "__main__":
    main()
