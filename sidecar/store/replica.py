"""Where plans go beyond the node: the replica interface, its host, its metrics.

``--store`` picks one of two stores (:class:`moe_sidecar.config.StoreTarget`):

* ``sqlite:///DIR`` (the default, ``--state-dir``): the node's SQLite
  database alone (:class:`moe_sidecar.store.sqlite.StateStore`); no replica runs;
* ``etcd://...``: the same SQLite database stays the node's write-ahead
  record, and a :class:`Replica` (:class:`moe_sidecar.etcd.replica.EtcdReplica`)
  keeps every group's :class:`~moe_sidecar.core.cluster.ClusterPlan` in etcd as
  the join of what every node decided, and merges what other nodes decide.

The state holder (:class:`moe_sidecar.state.Coordinator`) calls
:meth:`Replica.replicate` for every step that carries
:class:`~moe_sidecar.core.effects.Replicate`, after the step's SQLite transaction
recorded the group as pending; the replica calls back through
:class:`ReplicaHost` (which the Coordinator is) to read what to push, to
merge what arrived and to clear what the cluster has. Round state (waiters,
lifetimes, timers) never leaves the node.
"""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from moe_sidecar.core.cluster import ClusterPlan

__all__ = ["Replica", "ReplicaHost", "StoreMetrics"]


class ReplicaHost(Protocol):
    """What a replica needs of the node's state holder (the Coordinator)."""

    node: str
    """This node's name (``--node-name``)."""

    def now(self) -> float:
        """The clock's seconds."""
        ...

    def cluster_plan(self, name: str) -> ClusterPlan | None:
        """The replicated part of a group, as the node holds it now."""
        ...

    def group_names(self) -> list[str]:
        """Every group the node holds."""
        ...

    def merge(self, remote: ClusterPlan) -> bool:
        """Merges a document read from the cluster; True if the group changed.

        Raises:
            InvalidArgument: a field is out of range.
            PreconditionFailed: it cannot join the node's group.
            CoordinatorUnavailable: the node cannot persist the merge.
        """
        ...

    def pending_replication(self) -> list[tuple[str, int]]:
        """Groups still to push, each with its outbox ``seq``."""
        ...

    def replicated(self, name: str, seq: int) -> bool:
        """The cluster has ``name`` as of ``seq``; True if it was forgotten."""
        ...

    def mark_pending(self, names: list[str]) -> None:
        """Push these groups (again)."""
        ...


class Replica(Protocol):
    """A cluster store beside the node's SQLite database."""

    async def start(self, host: ReplicaHost) -> None:
        """Reads the cluster once (bounded by the store's timeout; an
        unreachable store is logged, not raised), then keeps pushing and
        watching in the background."""
        ...

    def replicate(self, name: str) -> None:
        """Group ``name`` changed here and is recorded as pending: push it soon.
        Never blocks and never raises."""
        ...

    async def close(self, flush_seconds: float) -> None:
        """Pushes what is pending for at most ``flush_seconds``, then stops.
        What is left stays pending in SQLite for the next start."""
        ...


class StoreMetrics:
    """The cluster store's series, in the sidecar's registry (only with a cluster store)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.up = Gauge(
            "moe_sidecar_store_up",
            "1 while the cluster store answers, 0 while it is unreachable.",
            registry=registry,
        )
        self.pending = Gauge(
            "moe_sidecar_store_pending_groups",
            "Groups changed on this node that the cluster store has not got yet.",
            registry=registry,
        )
        self.writes = Counter(
            "moe_sidecar_store_writes",
            "Compare-and-swap writes to the cluster store by result (written, conflict, error).",
            ["result"],
            registry=registry,
        )
        self.merges = Counter(
            "moe_sidecar_store_merges",
            "Documents from the cluster store that changed a group on this node.",
            registry=registry,
        )
        self.rejected = Counter(
            "moe_sidecar_store_rejected_documents",
            "Documents from the cluster store that were set aside: too big, without a valid "
            "HMAC, unreadable, out of range, implausible, or not joinable with this node's group.",
            registry=registry,
        )
        self.resyncs = Counter(
            "moe_sidecar_store_resyncs",
            "Full re-reads of the prefix (start, compacted history, a cluster re-created).",
            registry=registry,
        )
