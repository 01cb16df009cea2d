"""Fencing tokens: refuse calls from a controller that no longer leads.

In Kubernetes mode the controller sends its leader term (the Lease's ``leaseTransitions``
while it holds it) as call metadata ``fastshare-term`` with every call that changes the node.
The controller checks that it still leads before each call, but a call can take seconds
(the RPC deadline); one that left just before its Lease lapsed can arrive after a standby has
taken over and made calls of its own. The agent remembers the highest term it has seen (in
its journal: it survives restarts) and refuses a call of a lower term with FAILED_PRECONDITION
(trailing metadata ``fastshare-term-seen`` holds the term seen), before it acts.

A call of a new term also waits for the calls of older terms that were admitted before it and
are still under way (bounded by its deadline): once the new leader's call acts, no call of the
old one is still acting.

Calls without a term are accepted: the standalone controller has no election, and the node's
own tools (``fastshare node``/``mig`` on the unix socket) are the operator's. Fencing therefore
protects against a deposed Kubernetes-mode controller, not against a client that leaves the
term out.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from fastshare.node.agent import AgentError, Deadline
from fastshare.node.journal import Journal

METADATA_KEY = "fastshare-term"
SEEN_KEY = "fastshare-term-seen"   # trailing metadata of a refusal: the highest term seen
MAX_TERM = 2**31 - 1               # leaseTransitions is an int32


class StaleTerm(AgentError):
    def __init__(self, term: int, seen: int) -> None:
        super().__init__("FAILED_PRECONDITION", f"request from leader term {term}; this agent has seen "
                                                f"term {seen}: a newer controller leads")
        self.seen = seen


def parse(values: list[str]) -> int | None:
    """The term from the call's ``fastshare-term`` metadata values (None: no term)."""
    if not values:
        return None
    value = ",".join(values)   # sent more than once: not a number either
    # the length first: int() refuses thousands of digits (ValueError, not this message)
    if value.isascii() and value.isdigit() and len(value.lstrip("0")) <= len(str(MAX_TERM)) \
            and int(value) <= MAX_TERM:
        return int(value)
    raise AgentError("INVALID_ARGUMENT", f"{METADATA_KEY} (call metadata): must be a whole number in "
                                         f"0..{MAX_TERM} (the controller's leader term), got {value!r}")


class LeaderTerms:
    """The highest term seen, and the calls of each term under way."""

    def __init__(self, journal: Journal) -> None:
        self._journal = journal
        self._cond = threading.Condition()
        self._recorded = journal.leader_term()   # durable (in the journal)
        self.highest = self._recorded             # seen, maybe still waiting to be recorded
        self._running: dict[int, int] = {}        # term -> calls of it under way

    @contextlib.contextmanager
    def hold(self, term: int | None, deadline: Deadline) -> Iterator[None]:
        """Around one call: refused (StaleTerm) if older than a term seen; a newer term is
        recorded, once no call of an older one is still under way, before the call acts."""
        if term is None:
            yield
            return
        with self._cond:
            self._admit(term, deadline)
            self._running[term] = self._running.get(term, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._running[term] -= 1
                if not self._running[term]:
                    del self._running[term]
                self._cond.notify_all()

    def _admit(self, term: int, deadline: Deadline) -> None:
        """With the condition's lock held."""
        if self.highest is not None and term < self.highest:
            raise StaleTerm(term, self.highest)
        self.highest = term
        if self._recorded is not None and term <= self._recorded:
            return
        if not self._cond.wait_for(lambda: not any(t < term for t in self._running), deadline.remaining()):
            older = ", ".join(str(t) for t in sorted(self._running) if t < term)
            raise AgentError("DEADLINE_EXCEEDED", f"calls of leader term {older} still under way; the call "
                                                  f"of term {term} waited for them until its deadline")
        if term < self.highest:   # a newer term came while this call waited
            raise StaleTerm(term, self.highest)
        if self._recorded is None or term > self._recorded:
            self._journal.raise_leader_term(term)
            self._recorded = term
