"""Controller registration for the node agent (the agent's ``_controller_hook`` calls ``run``).

A thin adapter owned by the controller side: the client itself is
:mod:`fastshare.controller.registration`; this module only maps the agent's configuration.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from fastshare.controller.registration import Registrar, advertised_address
from fastshare.security.tls import TlsPaths

log = logging.getLogger("fastshare.node.registration")


def run(config, agent, stop: threading.Event) -> None:
    """Register ``config.node_name`` at ``config.controller_address`` and heartbeat until ``stop``."""
    del agent  # part of the hook's signature; the controller pulls the inventory itself
    if not config.listen or config.listen.endswith(":0"):
        log.error("controller_address is set but listen is %r: the controller needs a fixed mTLS "
                  "address to dial back; not registering", config.listen)
        return
    tls = TlsPaths(Path(config.tls.cert), Path(config.tls.key), Path(config.tls.ca))
    address = advertised_address(config.listen, config.node_name)
    Registrar(config.controller_address, config.node_name, address, tls).run(stop)
