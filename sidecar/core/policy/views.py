"""Membership moves of a group: the state's side of :mod:`moe_sidecar.core.membership`. Pure.

Membership moves only on a closed session (:func:`member_left`, from
:func:`~moe_sidecar.core.policy.depart.depart`), an admin exclusion or a
replacement joining; a survivor's suspicion is no input here. Each move
stores the new view in the group's state (with the lifetime it belongs to)
and publishes a VIEW_CHANGED event carrying it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Final

from moe_sidecar.core import limits
from moe_sidecar.core.effects import Deadline, Effect, EventKind, Persist, Publish, Step
from moe_sidecar.core.errors import InvalidArgument, PreconditionFailed, quote_name
from moe_sidecar.core.group import GroupState
from moe_sidecar.core.membership import View, ViewState, acknowledge, expire, leave, without
from moe_sidecar.core.policy.events import group_event

__all__ = [
    "DEFAULT_ACK_TIMEOUT_S",
    "acknowledge_view",
    "exclude",
    "expire_view",
    "member_left",
    "resume_view",
    "view_text",
]

DEFAULT_ACK_TIMEOUT_S: Final = 60.0
"""How long a proposed view waits for its members' acknowledgements when the
caller names no limit (the sidecar passes its ``--round-timeout``)."""


def view_text(view: View) -> str:
    """One line an operator reads of ``view``.

    A view every member left (state FAILED: nothing follows it in the
    lifetime) reads ``ended``: the ranks' normal exit ends it too, and the
    cause says how each went.
    """
    if not view.members:
        return f"view {view.number} ended at generation {view.generation} ({view.cause})"
    return (
        f"view {view.number} {view.state.value}: {view.members_text()} at generation "
        f"{view.generation} ({view.cause})"
    )


def member_left(
    state: GroupState, ep_rank: int, cause: str, now: float, ack_timeout: float
) -> tuple[GroupState, tuple[Effect, ...]]:
    """The state after member ``ep_rank`` of the current view left, with the
    VIEW_CHANGED event of the next view and its deadline's timer; unchanged,
    with no effect, when no view moves (no view yet, not a member, or a
    failed view)."""
    view = state.current_view()
    following = leave(view, ep_rank, cause, now, ack_timeout) if view is not None else None
    if view is None or following is None:
        return state, ()
    following = _unjoined(state, view, following)
    state = replace(state, view=following, view_lifetime=state.lifetime_index)
    event = group_event(
        state, EventKind.VIEW_CHANGED, now, ep_rank=ep_rank, message=view_text(following)
    )
    return state, (Publish(replace(event, view=following)), Deadline(state.next_deadline()))


def exclude(
    state: GroupState, ranks: tuple[int, ...], reason: str, now: float, ack_timeout: float
) -> Step:
    """An admin takes ``ranks`` out of the group's membership (a drain): the
    next view, without them, is PROPOSED at the same generation. The ranks
    keep their sessions; nobody is told of a death.

    Raises:
        InvalidArgument: no rank named, a rank outside ``[0, ep_size)``, or
            a reason longer than a name may be.
        PreconditionFailed: nothing is built yet (no view), the view failed,
            or a rank named is no member of the current view (naming it and
            the members).
    """
    if not ranks:
        raise InvalidArgument.of("ranks", [], "name at least one rank to exclude")
    if len(reason) > limits.MAX_NAME_LENGTH:
        raise InvalidArgument.of(
            "reason", f"{len(reason)} characters", f"at most {limits.MAX_NAME_LENGTH}"
        )
    for rank in ranks:
        if not 0 <= rank < state.ep_size:
            raise InvalidArgument.of("ranks", rank, f"must be a rank below ep_size={state.ep_size}")
    view = state.current_view()
    if view is None:
        raise PreconditionFailed(
            f"group {quote_name(state.name)} has no view yet: nothing is built"
        )
    strangers = [r for r in ranks if r not in view.members]
    if strangers:
        raise PreconditionFailed(
            f"ranks {strangers} are no members of view {view.number} of group "
            f"{quote_name(state.name)} (members: {list(view.members)})"
        )
    cause = f"ranks {sorted(set(ranks))} excluded by an admin (drain)" + (
        f": {reason}" if reason else ""
    )
    following = without(view, ranks, cause, now, ack_timeout)
    if following is None:
        raise PreconditionFailed(
            f"view {view.number} failed ({view.cause}): the group must restart"
        )
    return _adopt(state, _unjoined(state, view, following), now)


def acknowledge_view(
    state: GroupState, ep_rank: int, lifetime: str, number: int, rounds: int, now: float
) -> Step:
    """Rank ``ep_rank`` (of lifetime ``lifetime``) acknowledged view ``number``
    at a quiesced point with ``rounds`` all-to-all rounds done. The view
    commits (or fails) once every member has; a VIEW_CHANGED event says so.

    Raises:
        InvalidArgument: ``number`` or ``rounds`` out of range.
        PreconditionFailed: the rank is not of the group's running lifetime
            (or is gone), there is no view, or the view refuses the
            acknowledgement (see :func:`moe_sidecar.core.membership.acknowledge`).
    """
    limits.check_count("view", number, 1, limits.MAX_GENERATION)
    limits.check_count("rounds", rounds, 0, limits.MAX_GENERATION)
    record = state.rank(ep_rank)
    if (
        record is None
        or record.lifetime != lifetime
        or record.lifetime_index != state.lifetime_index
        or record.left
    ):
        raise PreconditionFailed(
            f"rank {ep_rank} of group {quote_name(state.name)} is not of the running lifetime: "
            "its acknowledgement counts for nothing"
        )
    view = state.current_view()
    if view is None:
        raise PreconditionFailed(
            f"group {quote_name(state.name)} has no view yet: nothing is built"
        )
    following = acknowledge(view, ep_rank, number, rounds, now)
    if following == view:
        return Step(state)
    if following.state is ViewState.PROPOSED:
        state = replace(state, view=following, view_lifetime=state.lifetime_index)
        return Step(state, effects=(Persist(),))
    return _adopt(state, following, now)


def expire_view(state: GroupState, now: float) -> Step | None:
    """Fails the proposed view past its deadline (naming who did not
    acknowledge it): the group fails stop. None when no view is due."""
    view = state.current_view()
    failed = expire(view, now) if view is not None else None
    if failed is None:
        return None
    return _adopt(state, failed, now)


def resume_view(state: GroupState, now: float, ack_timeout: float) -> GroupState:
    """A restarted sidecar's group: a proposed view gets a full ``ack_timeout``
    from ``now`` (the time the sidecar was down does not count)."""
    view = state.current_view()
    if view is None or view.deadline is None:
        return state
    return replace(state, view=replace(view, deadline=now + ack_timeout))


def _unjoined(state: GroupState, view: View, following: View) -> View:
    """``following`` at the generation the members built when every rank a
    still proposed join added has left it: nobody rebuilt for that join (the
    members rebuild only once it commits), so its generation is not theirs."""
    if (
        view.state is ViewState.PROPOSED
        and view.joined
        and not following.joined
        and following.members
        and state.built is not None
    ):
        return replace(following, generation=state.built.generation)
    return following


def _adopt(state: GroupState, view: View, now: float) -> Step:
    """The lifetime's view becomes ``view``: stored, published, its deadline set."""
    state = replace(state, view=view, view_lifetime=state.lifetime_index)
    event = group_event(state, EventKind.VIEW_CHANGED, now, message=view_text(view))
    return Step(
        state,
        effects=(Persist(), Publish(replace(event, view=view)), Deadline(state.next_deadline())),
    )
