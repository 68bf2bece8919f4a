"""Admin calls on a group: reset its stored plan, check it may be removed. Pure."""

from __future__ import annotations

from dataclasses import replace

from moe_sidecar.core import limits
from moe_sidecar.core.effects import EventKind, Persist, Publish, Replicate, Step
from moe_sidecar.core.errors import PreconditionFailed, quote_name
from moe_sidecar.core.group import GroupState
from moe_sidecar.core.policy.events import group_event

__all__ = ["check_removable", "reset"]


def check_removable(state: GroupState) -> None:
    """Whether an admin may remove the group now.

    Raises:
        PreconditionFailed: a round or a restart of the group is collecting
            proposals (its ranks are waiting for an answer).
    """
    if state.busy():
        waiting = len(state.open_round.proposals) if state.open_round else 0
        restarting = len(state.pending.proposals) if state.pending else 0
        raise PreconditionFailed(
            f"group {quote_name(state.name)} is in use: {waiting} rank(s) wait in an open round "
            f"and {restarting} in a restart; remove it once its ranks are gone"
        )


def reset(state: GroupState, now: float) -> Step:
    """Forgets the stored plan and its history: a new epoch begins.

    The generation counter is kept, so generations are never reused. A
    lifetime that is running keeps growing from what it has built.

    Raises:
        InvalidArgument: the epoch would leave its range.
    """
    limits.check_count("epoch", state.epoch + 1, 0, limits.MAX_GENERATION)
    state = replace(state, epoch=state.epoch + 1, plan=None, history=())
    return Step(
        state,
        effects=(
            Persist(),
            Replicate(),
            Publish(
                group_event(
                    state,
                    EventKind.RESET,
                    now,
                    message=f"stored plan forgotten: epoch {state.epoch} begins (generation "
                    f"stays {state.generation})",
                )
            ),
        ),
    )
