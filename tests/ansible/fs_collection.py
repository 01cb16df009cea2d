"""Helpers for the fastshare.gpu collection tests: where things are, how to run the tools.

(tests/ansible has no __init__.py on purpose: a package named `ansible` would shadow the real
one in the pytest process.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
GALAXY = yaml.safe_load((REPO / "galaxy.yml").read_text())
COLLECTION = f"{GALAXY['namespace']}.{GALAXY['name']}"


def tool(name: str) -> str:
    """An Ansible tool from this virtualenv (never one that happens to be on PATH)."""
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{name} is not installed in {BIN}; run `make venv` (the [dev] extra has it)")
    return str(path)


def run(args: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None,
        timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a tool; on failure show its whole output so the test report says what went wrong."""
    full_env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0", **(env or {})}
    proc = subprocess.run(args, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n"
                    f"--- stderr\n{proc.stderr}")
    return proc




def run_module(collections_path: Path, module: str, args: dict, *, check: bool = False,
               diff: bool = False, python: str | None = None, env: dict[str, str] | None = None) -> dict:
    """Run a module the way Ansible does (ad hoc against localhost) and return its result."""
    cmd = [tool("ansible"), "localhost", "-c", "local", "-i", "localhost,", "-m", module,
           "-e", f"ansible_python_interpreter={python or sys.executable}"]
    if args:
        cmd += ["-a", json.dumps(args)]
    if check:
        cmd.append("--check")
    if diff:
        cmd.append("--diff")
    proc = run(cmd, check=False, env={"ANSIBLE_COLLECTIONS_PATH": str(collections_path),
                                      "ANSIBLE_LOAD_CALLBACK_PLUGINS": "1",
                                      "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.json",
                                      "ANSIBLE_LOCALHOST_WARNING": "0",
                                      "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0", **(env or {})})
    try:
        doc = json.loads(proc.stdout)
        result = doc["plays"][0]["tasks"][0]["hosts"]["localhost"]
    except (ValueError, KeyError, IndexError):
        pytest.fail(f"no JSON result from {' '.join(cmd)} (rc {proc.returncode})\n"
                    f"{proc.stdout}\n{proc.stderr}")
    assert bool(result.get("failed")) == (proc.returncode != 0), (proc.returncode, result)
    return result


def run_tasks(collections_path: Path, tasks: list[dict], tmp_path: Path, *, python: str | None = None,
              extra_args: list[str] | None = None, gather_facts: bool = False,
              env: dict[str, str] | None = None) -> list[dict]:
    """Run tasks in one localhost play (one Ansible start-up for many calls); one result each.

    Every task gets ignore_errors so that later tasks still run; callers assert on `failed`.
    ``env`` is added to the environment of ansible-playbook (and so of the tasks: PATH, say).
    """
    play = [{"name": "fastshare.gpu module test", "hosts": "localhost", "connection": "local",
             "gather_facts": gather_facts, "gather_subset": ["!all", "min"],
             "vars": {"ansible_python_interpreter": python or sys.executable},
             "tasks": [{"ignore_errors": True, **task} for task in tasks]}]
    playbook = tmp_path / "play.yml"
    playbook.write_text(json.dumps(play))
    proc = run([tool("ansible-playbook"), "-i", "localhost,", str(playbook), *(extra_args or [])],
               check=False,
               env={"ANSIBLE_COLLECTIONS_PATH": str(collections_path),
                    "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.json",
                    "ANSIBLE_LOCALHOST_WARNING": "0", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0",
                    **(env or {})})
    try:
        doc = json.loads(proc.stdout)
        tasks = doc["plays"][0]["tasks"]
        # (a meta task such as flush_handlers has no result)
        return [task["hosts"]["localhost"] for task in tasks if "localhost" in task["hosts"]]
    except (ValueError, KeyError, IndexError):
        pytest.fail(f"no JSON result from the playbook (rc {proc.returncode})\n"
                    f"{proc.stdout}\n{proc.stderr}")
