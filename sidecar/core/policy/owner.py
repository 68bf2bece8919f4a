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
proposals carry that owner (:func:`inherits_stored_plan`). Otherwise it
begins a new epoch from its own proposals, as a takeover does, and its owner
becomes the stored one: a stranger's plan is never built by the real ranks,
and ranks without their key (lost, or a client older than owner keys) lose
one rebuild, nothing else. Within a lifetime the owner is not compared.

The owner travels with the plan through a cluster store
(:class:`~moe_sidecar.core.cluster.ClusterPlan`), so a node that holds a
group's plan only from another node holds its owner too. The first lifetime
of a group on such a node inherits the plan on the same terms as a restart
(:func:`disowns_stored_plan`): a stranger that squats the group on another
node does not build the plan, and cannot plant one that the real ranks
there build.
"""

from __future__ import annotations

from collections.abc import Iterable

from moe_sidecar.core.group import GroupState, OpenRound, Proposal

__all__ = ["disowns_stored_plan", "inherits_stored_plan", "restart_owner"]


def inherits_stored_plan(state: GroupState, proposals: Iterable[Proposal]) -> bool:
    """Whether a new lifetime whose round 1 holds ``proposals`` inherits
    ``state``'s stored plan: the stored owner is set and every proposal
    carries it (an empty owner on either side never matches)."""
    owners = {q.owner for q in proposals}
    return bool(state.owner) and owners == {state.owner}


def restart_owner(proposals: tuple[Proposal, ...]) -> str:
    """The owner a new lifetime stores: its proposals' one owner, or empty
    when they carry none or several (then no later lifetime inherits its plan)."""
    owners = {q.owner for q in proposals}
    return next(iter(owners)) if len(owners) == 1 else ""


def disowns_stored_plan(state: GroupState, rnd: OpenRound) -> bool:
    """Whether deciding ``rnd`` begins a new epoch without ``state``'s stored
    plan: it is the first round of a lifetime that did not come as a restart
    (the group's first lifetime on this node; a restart checks its owner when
    it completes), a plan is stored (here, or merged from another node), and
    the round's proposals do not carry its owner."""
    return (
        rnd.number == 1
        and state.proof is None
        and state.plan is not None
        and not inherits_stored_plan(state, rnd.proposals)
    )
