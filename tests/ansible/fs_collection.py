"""Helpers for the fastshare.gpu collection tests: where things are, how to run the tools.

(tests/ansible has no __init__.py on purpose: a package named `ansible` would shadow the real
one in the pytest process.)
"""

from __future__ import annotations

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


