"""Deterministic crash points for the kill -9 tests.

``FASTSHARE_FAULT=agent.after_mig_create`` makes the agent SIGKILL itself the first time it
reaches that point, exactly like a power cut there. Without the variable this is one
dictionary lookup; nothing else reads the variable.
"""

from __future__ import annotations

import os
import signal

ENV = "FASTSHARE_FAULT"

POINTS = (
    "agent.after_share_journaled",  # share row 'preparing', nothing created yet
    "agent.after_mig_create",       # MIG instance exists, journal still says 'creating'
    "agent.after_compute_mode",     # GPU switched to EXCLUSIVE_PROCESS, MPS daemon not started
    "agent.after_mps_start",        # MPS daemon answers, journal still says 'starting'
    "agent.after_share_files",      # share files rewritten, share still 'preparing'
    "agent.after_share_committed",  # fast path: share stored/forgotten in one commit, files not yet
    "agent.after_release_journaled",  # share row 'releasing', nothing freed yet
    "agent.after_mig_destroy",      # MIG instance gone, journal still says 'destroying'
    "agent.after_mig_mode",         # MIG mode changed (forced: the shares that lose the GPU not dropped yet)
    "agent.after_layout_destroy",   # a layout step destroyed an instance (forced: its shares not dropped yet)
)


def point(name: str) -> None:
    """Die here (SIGKILL, no cleanup) if the environment asks for this crash point."""
    if os.environ.get(ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
