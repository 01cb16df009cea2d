"""Fixtures for the whole suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.standins import stop_mps_standins


@pytest.fixture(scope="session", autouse=True)
def _no_mps_standin_left_running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A test run leaves nothing running: the stand-in daemons its node agents started stop when
    the suite ends (pytest keeps the last runs' directories, where they would wait)."""
    yield
    stop_mps_standins(tmp_path_factory.getbasetemp())
