"""Keep the garbage collector's full passes short in the long-running servers."""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Call once a server has started: every object alive now (modules, the gRPC and protobuf
    machinery, the state rebuilt at start) lives as long as the process, yet each full
    collection walked all of them again while holding the GIL, stalling every request in
    flight (measured in the controller and agent under load: 24-30 ms; ~1 ms once frozen)."""
    gc.collect()
    gc.freeze()
