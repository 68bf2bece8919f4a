"""The events and the words of the decision core: the one event builder and the
texts refusals and events are made of. Pure."""

from __future__ import annotations

from moe_sidecar.core.effects import EventKind, GroupEvent, Publish
from moe_sidecar.core.errors import quote_name
from moe_sidecar.core.group import GroupState, OpenRound, Proposal, RankRecord, Requirement
from moe_sidecar.core.identity import short_id
from moe_sidecar.core.plan import Action, Capacities, Plan

__all__ = [
    "gone_text",
    "group_event",
    "layer_text",
    "lifetime_started",
    "missing_text",
    "requirement_text",
    "shape_origin",
    "shape_text",
    "who",
]


def group_event(
    state: GroupState,
    kind: EventKind,
    now: float,
    *,
    closes: OpenRound | None = None,
    round: int = 0,
    action: Action | None = None,
    plan: Plan | None = None,
    ep_rank: int = -1,
    layer: str = "",
    message: str = "",
    missing_ranks: tuple[int, ...] = (),
    ranks: tuple[int, ...] | None = None,
    grew: bool = False,
    node: str = "",
) -> GroupEvent:
    """The event of ``kind`` a step of group ``state`` publishes at ``now``.

    An event that closes the round (or restart) ``closes`` carries its number
    (unless ``round`` is given), its ranks (its proposers unless ``ranks`` is
    given) and its latency: the seconds from its first proposal to ``now``.
    """
    latency = None
    if closes is not None:
        round = round or closes.number
        ranks = tuple(q.ep_rank for q in closes.proposals) if ranks is None else ranks
        latency = max(0.0, now - closes.opened_at)
    return GroupEvent(
        state.name,
        kind,
        now,
        round=round,
        action=action,
        plan=plan,
        ep_rank=ep_rank,
        layer=layer,
        message=message,
        missing_ranks=missing_ranks,
        ranks=ranks or (),
        grew=grew,
        latency=latency,
        node=node,
    )


def lifetime_started(state: GroupState, p: Proposal, now: float) -> Publish:
    """The event of a lifetime's first proposal."""
    return Publish(
        group_event(
            state,
            EventKind.LIFETIME_STARTED,
            now,
            round=1,
            plan=state.plan,
            ep_rank=p.ep_rank,
            message=f"lifetime {state.lifetime_index} started by rank {p.ep_rank} "
            f"({short_id(p.lifetime)})",
        )
    )


def layer_text(layer: str) -> str:
    """A layer label as refusals quote it."""
    return quote_name(layer) if layer else "(unnamed layer)"


def requirement_text(r: Requirement) -> str:
    """A requirement as refusals quote it: its capacities and its layer (cut
    like every name)."""
    return f"Requirement(capacities={r.capacities!r}, layer={quote_name(r.layer)})"


def who(p: Proposal) -> str:
    """``rank R layer L``: who made a proposal."""
    return f"rank {p.ep_rank} layer {layer_text(p.requirement.layer)}"


def shape_text(c: Capacities) -> str:
    """The shape of capacities: ``top_k=..., num_experts=...``."""
    return f"top_k={c.top_k}, num_experts={c.num_experts}"


def shape_origin(state: GroupState) -> str:
    """Who fixed the group's shape, from the growth history of its epoch."""
    first = next((g for g in state.history if g.plan.epoch == state.epoch), None)
    if first is None:
        return "the group's plan"
    return f"rank {first.ep_rank} layer {layer_text(first.layer)}"


def gone_text(record: RankRecord) -> str:
    """Why a rank that left is missing, with where it was last."""
    layer = quote_name(record.last_layer) if record.last_layer else "(unnamed)"
    return (
        f"rank {record.ep_rank} (last reported round {record.last_round}, layer {layer}) is "
        f"gone: {record.left}"
    )


def missing_text(missing: list[RankRecord]) -> list[str]:
    """Each missing rank with the round and layer it last reported."""
    return [
        f"rank {r.ep_rank} (last reported round {r.last_round}, layer "
        + (quote_name(r.last_layer) if r.last_layer else "(unnamed)")
        + ")"
        for r in missing
    ]
