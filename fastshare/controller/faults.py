"""Deterministic crash points for the crash tests.

``FASTSHARE_FAULT=controller.after_commit`` makes the controller kill itself with SIGKILL the
first time it reaches that point, exactly like a power cut or kill -9 there. Without the
variable this is one dictionary lookup; nothing else reads it.
"""

from __future__ import annotations

import os
import signal

ENV = "FASTSHARE_FAULT"

# Every crash point of the controller, in the order an allocation and a release pass them.
POINTS = (
    "controller.after_commit",         # allocation stored as pending, agent not asked yet
    "controller.after_prepare",        # agent prepared the share, store still says pending
    "controller.after_activate",       # store says active, the caller not answered yet
    "controller.after_release_commit",  # store says releasing, agent not asked yet
    "controller.after_agent_release",  # agent released the share, store still says releasing
)
# Reached only when an agent refuses a new share for its GPU's state (core.GPU_REFUSALS): the
# allocation, still pending, recorded on another GPU, whose agent is not asked yet.
AFTER_PLACE_AGAIN = "controller.after_place_again"


def point(name: str) -> None:
    """Die here (SIGKILL, no cleanup) if the environment asks for this crash point."""
    if os.environ.get(ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
