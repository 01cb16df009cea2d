"""Runs molecule/default: three real systemd hosts (systemd-nspawn) provisioned over ssh by the
collection's playbooks/site.yml, then verified end to end.

The test prints the scenario's wall time; the full log goes to the pytest temp dir.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCENARIO_TIMEOUT = 25 * 60  # the target is < 15 min; the margin is for a busy 2-core machine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(SCENARIO_TIMEOUT + 120)]


def host_support_problem() -> str | None:
    """Why this machine cannot run nspawn hosts, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, bridge, systemd-nspawn)"
    for tool in ("systemd-nspawn", "debootstrap", "ip", "ssh", "ssh-keygen", "molecule"):
        if shutil.which(tool) is None:
            return f"{tool} not found (make pytest installs scripts/system-packages.txt when root)"
    if not Path("/sys/fs/cgroup").is_dir():
        return "no cgroup filesystem: systemd cannot run as PID 1 in a container here"
    return None


def run_scenario(name: str, log_dir: Path) -> tuple[int, float, Path]:
    log = log_dir / f"molecule-{name}.log"
    env = dict(os.environ, ANSIBLE_FORCE_COLOR="0", PY_COLORS="0", NO_COLOR="1")
    started = time.monotonic()
    with log.open("w") as out:
        res = subprocess.run(
            ["molecule", "test", "--scenario-name", name],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=SCENARIO_TIMEOUT,
        )
    return res.returncode, time.monotonic() - started, log


def report(capsys: pytest.CaptureFixture[str], name: str, seconds: float, log: Path) -> None:
    # Shown even for passing tests: the wall time is one of the figures this suite reports.
    with capsys.disabled():
        print(f"\nmolecule scenario {name!r}: {seconds:.0f}s wall time (log: {log})")


def tail(log: Path, lines: int = 80) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture
def hosts_supported() -> None:
    problem = host_support_problem()
    if problem:
        pytest.skip(problem)


def test_default_scenario_site_converge_and_verify(
    hosts_supported: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real thing: site.yml on three hosts, idempotence, and the end-to-end verify."""
    rc, seconds, log = run_scenario("default", tmp_path)
    report(capsys, "default", seconds, log)
    assert rc == 0, f"molecule test -s default failed (rc={rc}):\n{tail(log)}"
