"""`make demo` (scripts/demo.sh) end to end, as a user runs it: every kind placed, the misfit
rejected with its reason, the invalid request naming its field, everything released, and
nothing left behind (no process, no directory)."""

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _processes_under(directory: Path) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    return [line for line in ps.splitlines() if str(directory) in line]


def test_the_demo_places_every_kind_rejects_with_reasons_and_leaves_nothing_behind():
    tmp = Path(tempfile.mkdtemp(prefix="fsd-", dir="/tmp"))   # short: MPS pipe paths are sockets
    try:
        env = {**os.environ, "TMPDIR": str(tmp),
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        done = subprocess.run(["bash", "scripts/demo.sh"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=180)
        leftovers = _processes_under(tmp), list(tmp.iterdir())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)
    assert done.returncode == 0, out[-3000:]
    for kind in ("whole", "fastpod", "mps", "exclusive"):
        assert re.search(rf" {kind} +active ", out), f"no active {kind} allocation shown:\n{out}"
    assert "rejected: no node has 2 idle GPU(s); none of the 2 node(s) looked at has an idle GPU" in out
    assert "spec.quota_limit (--quota): must be >= quota_request (0.9), got 0.3" in out
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30" in out
    assert not re.search(r" (whole|fastpod|mps|exclusive) +active ", out.split("release everything")[1]), \
        "something stayed active"
    assert "nothing left running" in out
    assert leftovers == ([], [])
