"""The node-certificate port's rate limits on their own (a virtual clock, no servers): what a
caller may do, when it is told to retry, and that the defaults serve a whole cluster at once.
With a real gRPC server and API server: tests/k8s/test_node_bootstrap.py."""

from __future__ import annotations

import heapq
import random

import pytest

from fastshare.k8s.ratelimit import Limits, Refusal, RequestLimiter, peer_address
from fastshare.security.rotation import FIRST_BACKOFF_S, MAX_BACKOFF_S, backoff


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_one_caller_gets_its_burst_then_one_call_per_period_and_is_told_when():
    clock = Clock()
    limiter = RequestLimiter(Limits(peer_burst=3, peer_rate=0.1), clock=clock)
    for _ in range(3):
        limiter.admit("10.0.0.1")
    with pytest.raises(Refusal) as info:
        limiter.admit("10.0.0.1")
    assert info.value.retry_after == pytest.approx(10.0)
    assert "too many node-certificate requests from 10.0.0.1" in info.value.message
    assert "retry in 10.0 s" in info.value.message
    limiter.admit("10.0.0.2")            # another caller is not held up
    clock.now = 9.0
    with pytest.raises(Refusal) as info:
        limiter.admit("10.0.0.1")
    assert info.value.retry_after == pytest.approx(1.0)
    clock.now = 10.0
    limiter.admit("10.0.0.1")


def test_all_callers_together_are_held_to_the_global_rate_and_a_refusal_costs_nothing():
    clock = Clock()
    limiter = RequestLimiter(Limits(global_burst=4, global_rate=2.0), clock=clock)
    for i in range(4):
        limiter.admit(f"10.0.1.{i}")
    with pytest.raises(Refusal) as info:
        limiter.admit("10.0.1.9")
    assert "at most 2 a second, all callers together" in info.value.message
    assert info.value.retry_after == pytest.approx(0.5)
    clock.now = 0.5
    limiter.admit("10.0.1.9")           # the refused call took no token from its own bucket either
    for _ in range(3):
        clock.now += 10
        limiter.admit("10.0.1.9")


def test_many_addresses_are_forgotten_without_losing_the_limit():
    clock = Clock()
    limiter = RequestLimiter(Limits(max_peers=100, peer_burst=1, peer_rate=0.001, global_burst=10_000,
                                    global_rate=1000), clock=clock)
    for i in range(1000):
        limiter.admit(f"10.1.{i // 256}.{i % 256}")
    assert len(limiter._peers) == 100
    with pytest.raises(Refusal):          # the most recent callers are still remembered
        limiter.admit("10.1.3.231")


@pytest.mark.parametrize(("peer", "address"), [
    ("ipv4:10.0.0.5:41234", "10.0.0.5"), ("ipv6:[fd00::5]:41234", "fd00::5"),
    ("ipv6:[::1]:1", "::1"), ("unix:/tmp/x", "unix:/tmp/x")])
def test_the_callers_address_leaves_out_the_port(peer, address):
    assert peer_address(peer) == address


def test_every_agent_of_a_1000_node_cluster_starting_at_once_is_served_within_three_minutes():
    """The default limits and the agent's backoff (FIRST_BACKOFF_S doubling to MAX_BACKOFF_S,
    never sooner than the controller's hint): 1,000 agents starting within 10 s all get their
    certificate within 180 s, and the controller never admits more than its rate."""
    rng = random.Random(7)
    random.seed(7)   # backoff()'s jitter
    clock = Clock()
    limiter = RequestLimiter(clock=clock)
    queue = [(rng.uniform(0, 10), f"10.2.{i // 250}.{i % 250}", FIRST_BACKOFF_S) for i in range(1000)]
    heapq.heapify(queue)
    served: list[float] = []
    attempts = 0
    while queue:
        clock.now, address, delay = heapq.heappop(queue)
        attempts += 1
        try:
            limiter.admit(address)
        except Refusal as exc:
            heapq.heappush(queue, (clock.now + backoff(delay, exc.retry_after), address,
                                   min(delay * 2, MAX_BACKOFF_S)))
        else:
            served.append(clock.now)
    assert len(served) == 1000
    assert max(served) < 180, max(served)
    lim = limiter.limits
    for start in range(0, 180, 10):   # admissions in any 10 s: at most the burst plus the rate
        assert sum(start <= t < start + 10 for t in served) <= lim.global_burst + 10 * lim.global_rate
    assert attempts < 12_000          # refusals are cheap, but not a storm either
