"""The MPS stand-in daemons a test run leaves behind (see ``tests/conftest.py``)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

MPS_PID_FILE = "nvidia-cuda-mps-control.pid"   # as fastshare/mps/standin.py writes it


def stop_mps_standins(root: Path) -> list[int]:
    """SIGTERM the MPS stand-in daemons whose pipe directories lie under ``root`` (a daemon
    outlives the node agent that started it, as the real control daemon does, and stays until
    its directory is deleted); returns their pids. A pid file whose process is gone, or is no
    stand-in any more, is left alone."""
    stopped = []
    for pid_file in root.rglob(MPS_PID_FILE):
        try:
            pid = int(pid_file.read_text().split()[0])
            if b"mps-standin" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError, IndexError):
            continue
        stopped.append(pid)
    return stopped
