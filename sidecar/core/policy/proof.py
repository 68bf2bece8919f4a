"""Whose proposals a round takes: the group's proof. Pure.

Every proposal carries its group's proof: the id of a secret that rank 0 of
the EP group draws and shares over the group's CPU group before the
group's first proposal, so every rank of one lifetime of the group holds
the same one and nobody else does. Within a round (the open round of the
running lifetime, or a restart collecting round 1 of the next one) the
proposals are grouped by proof, and:

1. A round closes only when every local slot holds a proposal and all of
   them carry one proof; the decision is made from those proposals alone
   (:meth:`~moe_sidecar.core.group.OpenRound.closing_proof`; the slots each
   proof holds are :meth:`~moe_sidecar.core.group.OpenRound.slots_by_proof`).
2. The first decided round of a lifetime fixes the lifetime's proof
   (:attr:`~moe_sidecar.core.group.GroupState.proof`); from then on any
   other proof is refused at once, for proposals and commits alike.
3. Before that (round 1 of a group's first lifetime, a restart's round 1,
   and the rounds after a refused round 1), a proposal for a free slot is
   admitted beside proposals of other proofs, unless another proof already
   holds more than half of the local slots: its proof could then never
   fill the round (rule 4 takes a slot only from a proof holding fewer), so
   it is refused at once.
4. A proposal for a slot held by a proposal of another proof takes the slot
   when its proof holds more slots than the holder's proof (the contested
   slot counted as the holder's), or as many and its proof opened the
   round (:attr:`~moe_sidecar.core.group.OpenRound.first_proof`); the
   displaced proposal is answered PERMISSION_DENIED. Otherwise it is
   refused and the holder keeps the slot.

So a stranger who proposes for a slot the real ranks have not reached yet
(a rank that has not arrived in a first lifetime, the last rank of a
restart) holds it only until the real rank arrives: the real ranks then hold
more slots, and the stranger is refused. A stranger can take a slot only
from a proof holding fewer slots than its own, so a round the real ranks
opened, or hold most of, never closes with it; a round holding two proofs
never closes at all, so the worst a stranger can do to it is make it time
out. Layers and shapes are compared among the proposals of one proof: a
stranger's proposal cannot make the real ranks' round refused.

What no proof can settle: a party that proposes for every local slot of a
group before any real rank does (a group squatted first) is, to the
sidecar, the group's ranks. :mod:`moe_sidecar.core.policy.propose` lets the
real ranks take such a group back with a layout of more local ranks, and
the group's owner (:mod:`moe_sidecar.core.policy.owner`) keeps what the
squatter's lifetime grew from being inherited by theirs, whatever its layout.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from moe_sidecar.core.errors import quote_name
from moe_sidecar.core.group import OpenRound, Proposal
from moe_sidecar.core.identity import short_id

__all__ = [
    "Contest",
    "Verdict",
    "contest",
    "held_by_proofs_text",
    "mismatch_text",
    "proof_text",
]


class Verdict(enum.Enum):
    """What rule 3 or 4 decides for a proposal of a round."""

    ADMIT = "admit"
    """The slot is free: the proposal joins the round beside any other proofs."""
    TAKE_BACK = "take_back"
    """The slot's holder has another proof and fewer slots: the proposal takes it."""
    REFUSE = "refuse"
    """Another proof wins: the proposal is refused, the round is untouched."""


@dataclass(frozen=True)
class Contest:
    """The verdict for one proposal and, when refused or taking a slot, why."""

    verdict: Verdict
    displaced: Proposal | None = None
    """The holder a TAKE_BACK displaces."""
    reason: str = ""


def proof_text(proof: str) -> str:
    """A proof as messages show it: a short prefix of its id, or ``(none)``."""
    return short_id(proof) if proof else "(none)"


def contest(rnd: OpenRound, p: Proposal, local_ranks: int) -> Contest:
    """Rules 3 and 4: whether ``p`` joins ``rnd``, takes its slot back, or is refused.

    ``p``'s slot is free or held by another proof (a holder of ``p``'s own
    proof is the caller's to handle: a retry, or two processes claiming one
    rank).
    """
    slots = rnd.slots_by_proof()
    mine = slots.get(p.proof, 0)
    holder = rnd.proposal_of(p.ep_rank)
    if holder is None:
        leader, held = max(
            ((proof, n) for proof, n in slots.items() if proof != p.proof),
            key=lambda item: item[1],
            default=("", 0),
        )
        if 2 * held > local_ranks:
            return Contest(
                Verdict.REFUSE,
                reason=f"proof {proof_text(leader)} already holds {held} of the {local_ranks} "
                "local ranks of this round",
            )
        return Contest(Verdict.ADMIT)
    theirs = slots[holder.proof]
    if mine > theirs or (mine == theirs and p.proof == rnd.first_proof):
        return Contest(Verdict.TAKE_BACK, displaced=holder)
    return Contest(
        Verdict.REFUSE,
        reason=f"rank {p.ep_rank} is held by a proposal with proof {proof_text(holder.proof)}, "
        f"which holds {theirs} slot(s) of this round to this proof's {mine}",
    )


def mismatch_text(group: str, ep_rank: int, proof: str, why: str) -> str:
    """The message of a refusal for a proof that does not match."""
    return (
        f"group {quote_name(group)} rank {ep_rank}: the group proof does not match "
        f"({proof_text(proof)}): {why}; a process that is not one of the group's ranks cannot "
        "propose for it (the ranks share their proof over the EP group's CPU group at their "
        "first initialize())"
    )


def held_by_proofs_text(rnd: OpenRound) -> str:
    """Why a round (or restart) holding proposals of more than one proof
    cannot close (rule 1), naming each proof, its ranks and who opened the
    round; "" when it holds one proof's proposals or none."""
    slots = rnd.slots_by_proof()
    if len(slots) <= 1:
        return ""
    held = "; ".join(
        f"proof {proof_text(proof)}"
        + (" (opened the round)" if proof == rnd.first_proof else "")
        + f" holds ranks {sorted(q.ep_rank for q in rnd.proposals if q.proof == proof)}"
        for proof, _ in slots.most_common()
    )
    return (
        f"it held proposals of {len(slots)} group proofs ({held}), and a round closes only "
        "when one proof holds every local slot: a process that is not one of the group's "
        "ranks (another proof) held a slot"
    )
