"""Runs the molecule scenarios: three real systemd hosts (systemd-nspawn) provisioned over ssh.

`hosts` proves the host machinery (create/destroy, ssh, systemd, network, offline pip);
`default` converges the collection's playbooks/site.yml and verifies a working cluster. The
`default` scenario needs the roles, playbooks and services; until they have all landed its test
names exactly which of them are missing instead of pretending to pass, and a failure caused by a
known defect outside molecule/ is reported as xfail naming that defect.

Each test prints the scenario's wall time; the full log goes to the pytest temp dir.
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

# What molecule/default needs from the rest of the project (path -> who provides it).
DEFAULT_NEEDS = {
    "galaxy.yml": "the fastshare.gpu collection (issue 7)",
    "playbooks/site.yml": "site playbook (issue 7)",
    "playbooks/mig_reconfigure.yml": "MIG reconfiguration playbook (issue 7)",
    "roles/gpu_node/tasks/main.yml": "gpu_node role (issue 7)",
    "roles/controller/tasks/main.yml": "controller role (issue 7)",
    "fastshare/node": "node agent (issue 4)",
    "fastshare/node/registration.py": "agent -> controller registration client the agent loads (issues 4/5)",
    "fastshare/controller": "standalone controller and `fastshare run` (issue 5)",
}

# Defects outside molecule/ that make the default scenario fail although the hosts, the scenario
# and verify are right: (task name in the log, error in the log, the defect and its issue). A run
# that fails with both texts in its log is reported as xfail naming the defect; any other failure
# fails the test, and once the defect is fixed the scenario has to pass for real.
KNOWN_BLOCKERS = [
    ("Write the controller configuration",
     "not enough arguments for format string",
     "roles/controller/tasks/systemd.yml: the `validate` command of 'Write the controller "
     "configuration' contains Python %-formatting, which Ansible's own %s substitution breaks "
     "(issue 7)"),
]

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


def test_hosts_scenario_temporary_converge_proves_hosts_only(
    hosts_supported: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Create/destroy + a stand-in converge (pip install from the wheelhouse) + host checks."""
    rc, seconds, log = run_scenario("hosts", tmp_path)
    report(capsys, "hosts", seconds, log)
    assert rc == 0, f"molecule test -s hosts failed (rc={rc}):\n{tail(log)}"


def test_default_scenario_site_converge_and_verify(
    hosts_supported: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real thing: site.yml on three hosts, idempotence, and the end-to-end verify."""
    missing = [f"{path} ({who})" for path, who in DEFAULT_NEEDS.items() if not (REPO / path).exists()]
    if missing:
        pytest.skip("molecule/default waits for what has not landed yet: " + "; ".join(missing))
    rc, seconds, log = run_scenario("default", tmp_path)
    report(capsys, "default", seconds, log)
    if rc != 0:
        text = log.read_text(errors="replace")
        for task, error, defect in KNOWN_BLOCKERS:
            if task in text and error in text:
                pytest.xfail(f"molecule/default blocked by a known defect: {defect} (log: {log})")
    assert rc == 0, f"molecule test -s default failed (rc={rc}):\n{tail(log)}"
