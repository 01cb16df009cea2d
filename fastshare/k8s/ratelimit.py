"""Rate limits for the unauthenticated node-certificate port (:mod:`fastshare.k8s.bootstrap`).

Anyone in the cluster can call ``NodeBootstrap``; each call that passes the cheap checks costs
the controller a TokenReview, a Pod read and a Node read against the API server. Two token
buckets stand before those: one per caller address (so one caller cannot use up the rest's
share) and one for all callers (so many addresses together cannot hammer the API server). A
call finding either empty is refused with RESOURCE_EXHAUSTED and told when to retry.

The defaults never bother a real cluster. An agent asks once at start and then once per 16 h
(2/3 of its 24 h certificate): the per-address bucket (:data:`PEER_BURST` calls, then one per
:data:`PEER_PERIOD_S` seconds) leaves room for a few restarts and retries in a row. When every
agent of a 1,000-node cluster starts at once (a DaemonSet rollout: new Pods, empty emptyDirs),
the global bucket admits :data:`GLOBAL_BURST` calls at once and :data:`GLOBAL_RATE` a second
after that: 1,000 certificates take (1,000 - 50) / 10 = 95 s of admissions; the refused agents
back off (at most 60 s, jittered, never sooner than told), so all have theirs within about
two and a half minutes (``tests/k8s/test_bootstrap_ratelimit.py`` simulates it: 145 s, about
six calls an agent). 10 admissions a second are 30 API requests a second (a TokenReview, a
Pod read, a Node read each): little for an API server, and the most any caller can cause.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

GLOBAL_RATE = 10.0        # admissions per second, all callers together
GLOBAL_BURST = 50
PEER_PERIOD_S = 10.0      # one admission per this many seconds per caller address, after the burst
PEER_BURST = 5
MAX_PEERS = 10_000        # addresses remembered; the least recently seen are forgotten first
RETRY_AFTER_KEY = "fastshare-retry-after-s"   # trailing metadata of a RESOURCE_EXHAUSTED refusal


@dataclass(frozen=True)
class Limits:
    global_rate: float = GLOBAL_RATE
    global_burst: int = GLOBAL_BURST
    peer_rate: float = 1 / PEER_PERIOD_S
    peer_burst: int = PEER_BURST
    max_peers: int = MAX_PEERS

    def __post_init__(self) -> None:
        for field in ("global_rate", "peer_rate"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{field} must be more than 0 per second, got {getattr(self, field)}")
        for field in ("global_burst", "peer_burst", "max_peers"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be at least 1, got {getattr(self, field)}")


class TokenBucket:
    """``burst`` tokens, refilled at ``rate`` a second. Not thread-safe (the limiter locks)."""

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.stamp = now

    def _refill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait(self, now: float) -> float:
        """Seconds until a token is there (0: one is there now)."""
        self._refill(now)
        return 0.0 if self.tokens >= 1 else (1 - self.tokens) / self.rate

    def take(self) -> None:
        self.tokens -= 1


class Refusal(Exception):
    """Over a limit: ``retry_after`` seconds until the call would be admitted; ``message`` says so."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


def peer_address(peer: str) -> str:
    """The address part of a gRPC peer string (``ipv4:10.0.0.5:41234``, ``ipv6:[fd00::5]:41234``):
    the port changes with every connection, the address does not."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6" and rest.startswith("["):
        return rest[1:].split("]", 1)[0]
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    return peer


class RequestLimiter:
    """A bucket per caller address and one for all (see the module docstring)."""

    def __init__(self, limits: Limits | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits or Limits()
        self._clock = clock
        self._lock = threading.Lock()
        self._global = TokenBucket(self.limits.global_rate, self.limits.global_burst, clock())
        self._peers: OrderedDict[str, TokenBucket] = OrderedDict()

    def admit(self, address: str) -> None:
        """Take a token from ``address``'s bucket and the global one, or raise :class:`Refusal`
        (taking none: a refused call costs nothing)."""
        lim = self.limits
        with self._lock:
            now = self._clock()
            bucket = self._peers.get(address)
            if bucket is None:
                self._forget()
                bucket = self._peers[address] = TokenBucket(lim.peer_rate, lim.peer_burst, now)
            self._peers.move_to_end(address)
            wait = bucket.wait(now)
            if wait > 0:
                raise Refusal(f"too many node-certificate requests from {address} (at most {lim.peer_burst} "
                              f"at once, then one every {1 / lim.peer_rate:.0f} s); retry in {wait:.1f} s",
                              wait)
            wait = self._global.wait(now)
            if wait > 0:
                raise Refusal(f"the controller is answering too many node-certificate requests (at most "
                              f"{lim.global_rate:g} a second, all callers together); retry in {wait:.1f} s",
                              wait)
            bucket.take()
            self._global.take()

    def _forget(self) -> None:
        """Room for one more address at ``max_peers``: the least recently seen is forgotten, in
        O(1) (a scan for buckets full again cost 10,000 steps under the lock per new address
        while many addresses called). A forgotten address starts again with a full bucket; the
        global bucket still counts every call."""
        while len(self._peers) >= self.limits.max_peers:
            self._peers.popitem(last=False)
