"""Fixtures for the node agent tests (the machinery lives in harness.py)."""

from .harness import agent, devices, pki_dir, sim_machine  # noqa: F401
