"""A replacement for a departed rank joins the running lifetime. Pure.

Under the ``mask`` peer-loss policy the survivors of a death go on under a
view without the dead rank (:mod:`.views`). A replacement process for that
rank begins a lifetime of its own and proposes round 1 like any new
lifetime; what tells it from a restart of the group is the group's proof:
the survivors shared the running lifetime's proof with it over the CPU
group they re-formed with it, so only a process the survivors let in holds
it (a restart draws a new proof; a stranger holds none). Such a proposal:

* takes the departed rank's place in the running lifetime (its record now
  names the new lifetime, the old one ended);
* is answered with a REBUILD at the stored plan under a new generation
  (never reused), which every member of the next view builds once (a
  retry of that proposal gets the same answer, :func:`rejoin_retry`);
* proposes that view: every member and the newcomer, at the new
  generation (:func:`moe_sidecar.core.membership.join`), due within
  ``ack_timeout``; it commits once every member acknowledged it, the
  survivors at one all-to-all round count.

Refused (PRECONDITION_FAILED, nothing changes): the rank's earlier lifetime
is still here (two processes claim one rank), the lifetime has no view to
join (nothing built, a round open, the current view still PROPOSED or
FAILED), the rank is a member of the view already, it states another
FlashInfer release, or the stored plan does not serve the replacement's
layer.
"""

from __future__ import annotations

from dataclasses import replace

from moe_sidecar.core import limits
from moe_sidecar.core.effects import Deadline, EventKind, Persist, Publish, Step
from moe_sidecar.core.errors import PreconditionFailed, quote_name
from moe_sidecar.core.group import Decision, GroupState, Proposal, RankRecord
from moe_sidecar.core.identity import short_id
from moe_sidecar.core.membership import ViewState, join
from moe_sidecar.core.plan import Action, Plan
from moe_sidecar.core.policy.events import group_event, requirement_text
from moe_sidecar.core.policy.views import view_text

__all__ = ["claims_running_lifetime", "rejoin", "rejoin_retry"]


def claims_running_lifetime(state: GroupState, p: Proposal, record: RankRecord | None) -> bool:
    """Whether ``p``, of a lifetime the group has not seen for its rank,
    claims the rank's place in the running lifetime: the rank is of that
    lifetime, which has built, and ``p`` carries its (non-empty) proof."""
    return (
        record is not None
        and record.lifetime != p.lifetime
        and record.lifetime_index == state.lifetime_index
        and state.built is not None
        and bool(state.proof)
        and p.proof == state.proof
    )


def rejoin(
    state: GroupState, p: Proposal, record: RankRecord, now: float, ack_timeout: float
) -> Step:
    """The replacement ``p`` (see :func:`claims_running_lifetime`) takes the
    departed rank's place: its reply is the REBUILD at the stored plan under
    the next generation, and the next view (every member and it, PROPOSED
    at that generation) is stored and published with its deadline.

    Raises:
        PreconditionFailed: the rank's earlier lifetime is still here, the
            lifetime has no committed view to join (or a round is open), the
            rank is a member already, it states another FlashInfer release,
            or the stored plan does not serve ``p``'s layer.
        InvalidArgument: the generation counter is spent.
    """
    group = quote_name(state.name)
    if not record.left:
        raise PreconditionFailed(
            f"rank {p.ep_rank} of group {group} is still here as lifetime "
            f"{short_id(record.lifetime)} (its session is open): lifetime {short_id(p.lifetime)} "
            "may replace it only once it has left (two processes claim one rank)"
        )
    view = state.current_view()
    stored = state.plan
    assert state.built is not None and stored is not None, "claims_running_lifetime checked it"
    if view is None or state.open_round is not None or view.state is ViewState.PROPOSED:
        what = (
            f"round {state.open_round.number} is open"
            if state.open_round is not None
            else f"view {view.number} is still proposed"
            if view is not None
            else "it has no view"
        )
        raise PreconditionFailed(
            f"rank {p.ep_rank} of group {group} cannot rejoin now: {what}; a replacement joins "
            "a committed view between rounds (retry once the view commits)"
        )
    if state.release and p.release != state.release:
        raise PreconditionFailed(
            f"rank {p.ep_rank} of group {group} rejoins building with FlashInfer {p.release!r}, "
            f"but the group builds with FlashInfer {state.release!r}; every rank of a group "
            "must run one FlashInfer release"
        )
    if not stored.covers(p.requirement.capacities):
        raise PreconditionFailed(
            f"rank {p.ep_rank} of group {group} rejoins with {requirement_text(p.requirement)}, "
            f"which the stored plan {stored} does not serve: a replacement rebuilds at the "
            "stored plan"
        )
    generation = state.generation + 1
    limits.check_count("generation", generation, 1, limits.MAX_GENERATION)
    cause = (
        f"rank {p.ep_rank} rejoined as lifetime {short_id(p.lifetime)} (replacing "
        f"{short_id(record.lifetime)}): every member rebuilds at generation {generation}"
    )
    # join raises for a member already present or a failed view.
    following = join(view, p.ep_rank, generation, cause, now, ack_timeout)
    newcomer = RankRecord(
        ep_rank=p.ep_rank,
        lifetime=p.lifetime,
        lifetime_index=state.lifetime_index,
        last_round=p.round,
        last_layer=p.requirement.layer,
        last_seen=now,
        ended_lifetime=record.lifetime,
    )
    state = replace(
        state, generation=generation, view=following, view_lifetime=state.lifetime_index
    ).with_rank(newcomer)
    event = group_event(
        state, EventKind.VIEW_CHANGED, now, ep_rank=p.ep_rank, message=view_text(following)
    )
    reply = _rebuild(stored, generation, p)
    effects = (Persist(), Publish(replace(event, view=following)), Deadline(state.next_deadline()))
    return Step(state, reply=reply, effects=effects)


def rejoin_retry(state: GroupState, p: Proposal) -> Step | None:
    """The answer to a replacement's retried round 1 (its answer was lost):
    the same REBUILD, no effect; None when ``p`` is not that (its rank joined
    the current view and has proposed nothing since)."""
    view = state.current_view()
    record = state.rank(p.ep_rank)
    if (
        view is None
        or p.ep_rank not in view.joined
        or p.round != 1
        or record is None
        or record.last_round != 1
        or state.plan is None
    ):
        return None
    return Step(state, reply=_rebuild(state.plan, view.generation, p))


def _rebuild(stored: Plan, generation: int, p: Proposal) -> Decision:
    """A replacement's answer: REBUILD at the stored plan under ``generation``."""
    plan = Plan(stored.capacities, stored.epoch, generation)
    return Decision(p.round, Action.REBUILD, plan, grew=False, layer=p.requirement.layer)
