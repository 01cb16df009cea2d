"""The state-of-record interface the controller core needs, and its errors.

Kept small on purpose: the standalone controller implements it with SQLite
(:mod:`fastshare.controller.sqlite_store`); the Kubernetes front end implements it over the
Kubernetes API and reuses the core, the agent client and the reconciler unchanged.
Every method is one atomic step: a crash between two calls leaves a state the reconciler
knows how to finish.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable

from fastshare.controller.model import Allocation, Node, State


class StoreError(Exception):
    """The store could not do what was asked."""


class DuplicateKey(StoreError):
    """An allocation with this idempotency key exists already (``existing``)."""

    def __init__(self, existing: Allocation) -> None:
        super().__init__(f"idempotency key {existing.idempotency_key!r} is used by {existing.id}")
        self.existing = existing


class Conflict(StoreError):
    """A state transition lost a race: the allocation is not in an expected state."""

    def __init__(self, allocation_id: str, current: State | None, expected: Iterable[State]) -> None:
        wanted = ", ".join(sorted(s.value for s in expected))
        now = current.value if current else "missing"
        super().__init__(f"allocation {allocation_id} is {now}, expected one of: {wanted}")
        self.current = current


class StateStore(abc.ABC):
    """Nodes and allocations, durably."""

    # -- nodes -------------------------------------------------------------------------------
    @abc.abstractmethod
    def put_node(self, node: Node) -> None:
        """Create or replace a node (and its GPUs)."""

    @abc.abstractmethod
    def get_node(self, name: str) -> Node | None: ...

    @abc.abstractmethod
    def list_nodes(self) -> list[Node]: ...

    def delete_node(self, name: str) -> None:
        """Forget a node (taken out for good); its allocations must be finished first."""
        raise StoreError("this store cannot forget nodes")

    @abc.abstractmethod
    def mark_node(self, name: str, *, available: bool, last_heartbeat: float | None = None) -> None:
        """Record liveness without touching the node's inventory."""

    # -- allocations ---------------------------------------------------------------------------
    @abc.abstractmethod
    def create_allocation(self, allocation: Allocation) -> None:
        """Insert a new allocation; raises :class:`DuplicateKey` if its idempotency key is taken."""

    @abc.abstractmethod
    def transition(self, allocation_id: str, expected: Iterable[State], new_state: State,
                   **changes: object) -> Allocation:
        """Compare-and-set the state (plus other fields); raises :class:`Conflict`."""

    @abc.abstractmethod
    def update(self, allocation_id: str, **changes: object) -> Allocation:
        """Change fields other than the state (e.g. the lease expiry)."""

    @abc.abstractmethod
    def get_allocation(self, allocation_id: str) -> Allocation | None: ...

    @abc.abstractmethod
    def find_by_key(self, idempotency_key: str) -> Allocation | None: ...

    @abc.abstractmethod
    def list_allocations(self, states: Iterable[State] | None = None,
                         node: str | None = None) -> list[Allocation]: ...

    def next_sequence(self) -> int | None:
        """The sequence number for a new allocation id (see ``model.sequence_of``); None: this
        store keeps no high-water mark, ids carry no number and every unrecorded share is an orphan."""
        return None

    def never_issued(self, sequence: int) -> bool:
        """True when no allocation recorded in this store's history (or ever issued by it) had
        ``sequence``: a share with it is newer than the store, which went back in time (restored
        from a backup, or its last commits lost), not an orphan. Atomic with ``create_allocation``."""
        return False

    def saw(self, sequences: Iterable[int], first_of: str = "") -> None:  # noqa: B027 - no sequence here
        """The sequence numbers of the shares an agent holds (its inventory was read). Numbers
        issued from then on are above every one: a clock behind them (stepped back, or the store
        restored onto a host whose clock is behind) must not issue numbers among them, whose mark
        would then pass a share the store lost, taken for an orphan from then on. ``first_of``:
        the node whose first inventory this process read (none of its shares is this process's,
        which places nothing on a node before it read its inventory): a number the store had not
        issued when this process started (or, for a node the store knew and no process reached
        since, when the first of those processes started) stays never issued, also one numbering
        has passed since (the node was away meanwhile)."""

    def prune_finished(self, before: float) -> int:
        """Forget released and failed allocations last changed before ``before`` (unix seconds);
        returns how many. Stores whose finished records go away by themselves keep the default."""
        return 0

    def sync(self, ticket: object | None = None) -> None:  # noqa: B027 - durable stores: nothing to do
        """Durability barrier: every change made before the call (or before ``ticket`` was
        taken) survives a power loss once it returns. The API calls it before it answers, so
        nothing it acknowledged can be lost."""

    def flush_soon(self) -> object | None:
        """Start making every change so far durable in the background; ``sync(ticket)`` waits
        for it. Lets a caller overlap that with an agent RPC."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook, most stores hold nothing
        """Release resources (connections, files)."""
