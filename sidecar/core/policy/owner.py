"""Whose stored plan a restart builds: the group's owner. Pure.

The stored plan outlives process lifetimes, so a restart's round 1 starts
from it. The group proof (:mod:`.proof`) tells one lifetime's ranks from
strangers, but a stranger that proposes for every local slot of a group
before the real ranks (or while they are down) completes a round with its
own proof and stores its plan: to the sidecar it was the group's lifetime.

So every proposal also carries the group's owner: the id of a digest of a
key that the group's rank 0 keeps on disk, which outlives lifetimes and
which only the group's ranks are given (over the EP group's CPU group, with
the proof). Each lifetime's first decided round stores its owner with the
plan; a new lifetime's round 1 inherits the stored plan only when its
proposals carry that owner
(:meth:`~moe_sidecar.core.group.GroupState.inherits_stored_plan`).
Otherwise it begins a new epoch from its own proposals, as a takeover does, and its owner
becomes the stored one: a stranger's plan is never built by the real ranks,
and ranks without their key (lost, or a client older than owner keys) lose
one rebuild, nothing else. Within a lifetime the owner is not compared.

The owner travels with the plan through a cluster store
(:class:`~moe_sidecar.core.cluster.ClusterPlan`), so a node that holds a
group's plan only from another node holds its owner too. The first lifetime
of a group on such a node inherits the plan on the same terms as a restart
(:meth:`~moe_sidecar.core.group.GroupState.disowns_stored_plan`): a stranger
that squats the group on another node does not build the plan, and cannot plant one that the real ranks
there build.

The rule reads the group and the round, so it is theirs: a new lifetime
stores :meth:`~moe_sidecar.core.group.OpenRound.owner`, the one owner its
round 1's proposals carry; :mod:`.restart` and :mod:`.propose` ask the
group whether a round inherits or disowns its stored plan.
"""

from __future__ import annotations

__all__: list[str] = []
