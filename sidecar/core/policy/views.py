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

from moe_sidecar.core.effects import EventKind, Publish
from moe_sidecar.core.group import GroupState
from moe_sidecar.core.membership import View, leave
from moe_sidecar.core.policy.events import group_event

__all__ = ["DEFAULT_ACK_TIMEOUT_S", "member_left", "view_text"]

DEFAULT_ACK_TIMEOUT_S: Final = 60.0
"""How long a proposed view waits for its members' acknowledgements when the
caller names no limit (the sidecar passes its ``--round-timeout``)."""


def view_text(view: View) -> str:
    """One line an operator reads of ``view``."""
    members = ", ".join(str(r) for r in view.members) or "none"
    return (
        f"view {view.number} {view.state.value}: members {members} at generation "
        f"{view.generation} ({view.cause})"
    )


def member_left(
    state: GroupState, ep_rank: int, cause: str, now: float, ack_timeout: float
) -> tuple[GroupState, tuple[Publish, ...]]:
    """The state after member ``ep_rank`` of the current view left, and the
    VIEW_CHANGED event of the next view; unchanged, with no event, when no
    view moves (no view yet, not a member, or a failed view)."""
    view = state.current_view()
    following = leave(view, ep_rank, cause, now, ack_timeout) if view is not None else None
    if following is None:
        return state, ()
    state = replace(state, view=following, view_lifetime=state.lifetime_index)
    event = group_event(
        state, EventKind.VIEW_CHANGED, now, ep_rank=ep_rank, message=view_text(following)
    )
    return state, (Publish(replace(event, view=following)),)
