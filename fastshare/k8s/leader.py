"""Leader election over a coordination.k8s.io Lease: one active controller at a time.

Same rules as client-go's leaderelection: the holder renews the Lease every ``retry_period``;
a candidate takes over only when it has seen the same Lease record unchanged for a whole
``lease_duration`` measured on its own monotonic clock (no trust in other hosts' clocks);
every write is a compare-and-set on resourceVersion, so two candidates never both win. A
leader that cannot renew within ``renew_deadline`` considers itself deposed and stops acting.
Needs only get/create/update on the one Lease (see templates/rbac.yaml.j2).

Fencing token: the Lease's ``leaseTransitions`` while we hold it (:attr:`LeaderElector.term`),
one more at every takeover. The controller sends it with every agent call that changes a GPU,
and an agent that has seen a newer term refuses the call (see :mod:`fastshare.node.terms`).
"""

from __future__ import annotations

import datetime
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import urllib3
from kubernetes import client

log = logging.getLogger(__name__)


def _now_micro() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclass
class _Observed:
    key: tuple  # (holder, renewTime, resourceVersion) of the record last seen
    at: float   # monotonic time it was first seen


class Deposed(Exception):
    """This process does not lead (any more): the step that asked was not taken."""


class Fence:
    """Every step that changes the cluster or a GPU (an API write, an agent's prepare, release
    or MIG mode change) passes :meth:`check` first. A controller whose Lease lapsed in the
    middle of a pass (``leading()`` false: not renewed within renew_deadline, or released)
    takes no further step of it: a standby may be leading by then, and a deposed leader's
    agent call would race it. What the pass did so far is recorded, so the next leader's
    rebuild finishes or undoes it. ``elector`` None: always leading (no election).

    :attr:`term`, the elector's term, goes with every agent call that changes a GPU: an agent
    that has seen a newer term refuses a call that left before the lapse and arrives after a
    takeover."""

    def __init__(self, elector: LeaderElector | None = None) -> None:
        self._elector = elector
        self._told = False   # the lapse was logged (once per lapse, not once per refused step)

    @property
    def term(self) -> int | None:
        """The fencing token to send (None: no election, none sent)."""
        return self._elector.term if self._elector is not None else None

    def refused(self, seen: int) -> None:
        """An agent refused our term: it has seen term ``seen`` (newer). Returns if we still hold
        the Lease and moved its term past ``seen`` (the Lease was made anew - deleted, or another
        --lease-name - and counted from 0 again; the call may be made again with :attr:`term`);
        else raises :class:`Deposed`: a newer controller leads."""
        term = self.term
        if self._elector is None or self._elector.advance_term(seen) is None:
            log.warning("an agent has seen leader term %s, newer than ours (%s): passes stop", seen, term)
            raise Deposed(f"an agent has seen leader term {seen}; this controller's is {term}")

    def check(self) -> None:
        if self._elector is None or self._elector.is_leader:
            self._told = False
            return
        if not self._told:
            self._told = True
            log.warning("not the leader any more: passes stop before their next change")
        raise Deposed("not the leader any more")


class LeaderElector:
    """Call :meth:`step` periodically (or :meth:`run` in a thread); :attr:`is_leader` says who acts."""

    def __init__(self, api: client.ApiClient, namespace: str, name: str, identity: str, *,
                 lease_duration: float = 15.0, renew_deadline: float = 10.0, retry_period: float = 2.0,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if not lease_duration > renew_deadline > retry_period > 0:
            raise ValueError("need lease_duration > renew_deadline > retry_period > 0")
        self.leases = client.CoordinationV1Api(api)
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self.monotonic = monotonic
        self._observed: _Observed | None = None
        # leaseTransitions of the Lease while we hold it: the fencing token (None: never led)
        self.term: int | None = None
        self._writing = threading.Lock()   # step() and advance_term(): one Lease update at a time
        # monotonic time our last successful attempt as holder started: its write landed after it,
        # so a candidate's wait (from when it saw that write) ends after ours (renew_deadline)
        self._renewed_at: float | None = None
        # each Lease request gives up after this: a hung one must not keep step() (and a deposed
        # leader's controller) waiting past renew_deadline; an attempt makes two requests
        self._timeout = renew_deadline / 2

    @property
    def is_leader(self) -> bool:
        # read once: workers ask (see Fence) while step() may set it to None
        renewed_at = self._renewed_at
        return renewed_at is not None and self.monotonic() - renewed_at < self.renew_deadline

    def step(self) -> bool:
        """One attempt to acquire or renew; returns whether we lead afterwards."""
        started = self.monotonic()
        try:
            with self._writing:
                if self._try():
                    self._renewed_at = started
        except client.ApiException as exc:
            if exc.status not in (404, 409):
                log.warning("lease %s/%s: %s %s", self.namespace, self.name, exc.status, exc.reason)
        # API server unreachable: keep trying until renew_deadline passes. The client reports a
        # refused or broken connection as urllib3's HTTPError (MaxRetryError), not as an OSError.
        except (OSError, urllib3.exceptions.HTTPError) as exc:
            log.warning("lease %s/%s: %s", self.namespace, self.name, exc)
        if self._renewed_at is not None and not self.is_leader:
            log.warning("lost leadership of %s/%s", self.namespace, self.name)
            self._renewed_at = None
        return self.is_leader

    def _spec(self, transitions: int, acquired: datetime.datetime | None) -> client.V1LeaseSpec:
        now = _now_micro()
        return client.V1LeaseSpec(
            holder_identity=self.identity, lease_duration_seconds=math.ceil(self.lease_duration),
            acquire_time=acquired or now, renew_time=now, lease_transitions=transitions)

    def _try(self) -> bool:
        try:
            lease = self.leases.read_namespaced_lease(self.name, self.namespace,
                                                      _request_timeout=self._timeout)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            body = client.V1Lease(metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                                  spec=self._spec(0, None))
            # 409 if another won the race
            self.leases.create_namespaced_lease(self.namespace, body, _request_timeout=self._timeout)
            log.info("%s acquired lease %s/%s", self.identity, self.namespace, self.name)
            self.term = 0
            return True
        spec = lease.spec or client.V1LeaseSpec()
        key = (spec.holder_identity, spec.renew_time, lease.metadata.resource_version)
        now = self.monotonic()
        if self._observed is None or self._observed.key != key:
            self._observed = _Observed(key, now)
        held_by_me = spec.holder_identity == self.identity
        duration = spec.lease_duration_seconds or self.lease_duration
        free = not spec.holder_identity or now - self._observed.at >= duration
        if not held_by_me and not free:
            return False
        transitions = (spec.lease_transitions or 0) + (0 if held_by_me else 1)
        lease.spec = self._spec(transitions, spec.acquire_time if held_by_me else None)
        # CAS on resourceVersion
        self.leases.replace_namespaced_lease(self.name, self.namespace, lease, _request_timeout=self._timeout)
        self.term = transitions
        if not held_by_me:
            log.info("%s took over lease %s/%s (term %d) from %r", self.identity, self.namespace, self.name,
                     transitions, spec.holder_identity)
        return True

    def advance_term(self, seen: int) -> int | None:
        """An agent has seen leader term ``seen``, not older than ours, while we lead: the Lease
        was made anew (deleted, or renamed) and counts from 0 again. Set its leaseTransitions past
        ``seen`` - a compare-and-set, so only while we still hold it - and return the new term;
        None if we do not lead (then the agent's term is a newer leader's)."""
        with self._writing:
            started = self.monotonic()
            if not self.is_leader:
                return None
            try:
                lease = self.leases.read_namespaced_lease(self.name, self.namespace,
                                                          _request_timeout=self._timeout)
                spec = lease.spec or client.V1LeaseSpec()
                if spec.holder_identity != self.identity:
                    return None
                term = spec.lease_transitions or 0
                if term <= seen:   # still behind the agents: move on (also a renewal)
                    term = seen + 1
                    lease.spec = self._spec(term, spec.acquire_time)
                    self.leases.replace_namespaced_lease(self.name, self.namespace, lease,
                                                         _request_timeout=self._timeout)
                    self._renewed_at = started
                    log.warning("lease %s/%s: agents have seen leader term %d, more than the Lease counts "
                                "(made anew?); this leader's term is now %d", self.namespace, self.name,
                                seen, term)
            except client.ApiException as exc:
                log.warning("lease %s/%s: term not advanced: %s %s", self.namespace, self.name, exc.status,
                            exc.reason)
                return None
            except (OSError, urllib3.exceptions.HTTPError) as exc:
                log.warning("lease %s/%s: term not advanced: %s", self.namespace, self.name, exc)
                return None
            self.term = term
            return term

    def release(self) -> None:
        """Give up leadership at once (on clean shutdown) so a standby takes over without waiting."""
        if self._renewed_at is None:
            return
        self._renewed_at = None
        try:
            lease = self.leases.read_namespaced_lease(self.name, self.namespace,
                                                      _request_timeout=self._timeout)
            if lease.spec and lease.spec.holder_identity == self.identity:
                lease.spec.holder_identity = None
                lease.spec.lease_duration_seconds = 1
                self.leases.replace_namespaced_lease(self.name, self.namespace, lease,
                                                     _request_timeout=self._timeout)
        except client.ApiException as exc:
            log.warning("could not release lease %s/%s: %s", self.namespace, self.name, exc.reason)
        except (OSError, urllib3.exceptions.HTTPError) as exc:  # the standby waits the lease out
            log.warning("could not release lease %s/%s: %s", self.namespace, self.name, exc)

    def run(self, stop: threading.Event, on_change: Callable[[bool], None] | None = None) -> None:
        """Acquire/renew every ``retry_period`` until ``stop`` is set; report leadership changes."""
        leading = False
        while not stop.is_set():
            now_leading = self.step()
            if now_leading != leading and on_change is not None:
                on_change(now_leading)
            leading = now_leading
            stop.wait(self.retry_period)
        self.release()
        if leading and on_change is not None:
            on_change(False)
