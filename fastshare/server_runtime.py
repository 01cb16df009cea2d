"""Interpreter settings for the long-running servers: short garbage-collector pauses, and a
thread that needs the GIL back (a request after its disk write) gets it soon.

Measured with ``bench/controller_pauses.py`` (a controller of 10,000 nodes, a reconcile pass
every 5 s, a status every 10 s, Allocate and Release between them): with the interpreter's
defaults the collector's full collections took 13.6 s a minute, each stalling every request for
up to 380 ms, and an Allocate's p99 was 340 ms; with these settings 0.4 s, 170 ms and 36 ms (see
RELIABILITY.md "Pauses at 10,000 nodes")."""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

# How long a thread holds the GIL while another waits for it (Python's default: 5 ms). A
# request waits for it after each disk write and each SQLite step; behind a reconcile pass
# (seconds of Python) that was up to 5 ms each time, some 100 ms an Allocate at 10,000 nodes.
SWITCH_INTERVAL_S = 0.001
# The collector's own full passes, only a backstop once reconcile passes collect and freeze:
# the third threshold is how many middle-generation collections come between two of them
# (default 10). Without it a pass's short-lived objects were walked by some 100 full passes a
# minute at 10,000 nodes, even with the rest frozen.
FULL_PASS_THRESHOLD = 100
# Objects frozen and dropped later are freed by reference counting; only a reference cycle among
# them waits for this full collection.
UNFREEZE_EVERY_S = 3600.0

_last_unfreeze: float | None = None   # set once this process is a server (not a test or the CLI)


def settle_startup() -> None:
    """Call once a process is to be a server (before its state is loaded, or once it has
    started). Nearly every object alive then (modules, the gRPC and protobuf machinery, state
    loaded at start) lives as long as the process, yet each full collection walked all of them
    again while holding the GIL (24-30 ms in the controller and agent under load; ~1 ms once
    frozen)."""
    global _last_unfreeze
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    _last_unfreeze = time.monotonic()


def settle_after_pass(now: float | None = None) -> None:
    """After each reconcile pass of a server, by :func:`collection_paused` (a no-op before
    :func:`settle_startup`).

    What a cluster adds after the start (nodes, allocations, the placement engine's view of
    them) lives long too, and a full collection walked it all again each time a pass's
    short-lived objects had been promoted: at 10,000 nodes, once a second. Collecting what is
    new (a few milliseconds: the pass's own objects are gone by now) and freezing what survives
    keeps each full collection to the objects made since the last pass."""
    global _last_unfreeze
    if _last_unfreeze is None:
        return
    now = time.monotonic() if now is None else now
    gen0, gen1, _ = gc.get_threshold()
    gc.set_threshold(gen0, gen1, FULL_PASS_THRESHOLD)   # full collections now come with each pass
    if now - _last_unfreeze >= UNFREEZE_EVERY_S:
        gc.unfreeze()   # this once, the collection walks everything (0.4 s at 10,000 nodes)
        _last_unfreeze = now
    gc.collect()
    gc.freeze()


@contextmanager
def collection_paused() -> Iterator[None]:
    """Around a controller's start and each of its reconcile passes, which build objects for
    every node and allocation at once. The collector ran its full collections as that heap grew,
    each walking all of it again: 3.7 s of a 10 s start at 10,000 nodes, and inside a pass a
    stall of every request up to 140 ms (``bench/controller_pauses.py``). Reference counting
    frees the garbage meanwhile; in a server, what is left (cycles) is collected once after it
    and what survives frozen, before the collector is on again (else its first young collection
    walked all of it: 0.6 s more)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        settle_after_pass()
        if was_enabled:
            gc.enable()
