"""A group's membership view in its stored row (the ``"view"`` key).

Rows written before views have no such key and load without a stored view
(:meth:`~moe_sidecar.core.group.GroupState.current_view` then derives the
lifetime's first one). Every field is checked as the rest of a row is.
"""

from __future__ import annotations

from typing import Any

from moe_sidecar.core import limits
from moe_sidecar.core.membership import Acknowledgement, View, ViewState
from moe_sidecar.store.row_fields import (
    RowError,
    int_field,
    list_field,
    rank_numbers_field,
    str_field,
    time_field,
)

__all__ = ["decode_view", "encode_view"]

_STATES = {s.value: s for s in ViewState}


def encode_view(view: View, lifetime_index: int) -> dict[str, Any]:
    """The stored form of ``view``, of lifetime ``lifetime_index``."""
    return {
        "number": view.number,
        "lifetime_index": lifetime_index,
        "members": list(view.members),
        "generation": view.generation,
        "state": view.state.value,
        "cause": view.cause,
        "deadline": view.deadline,
        "acks": [[a.ep_rank, a.rounds] for a in view.acks],
        "joined": list(view.joined),
    }


def decode_view(d: Any, ep_size: int) -> tuple[View, int]:
    """A stored view and the lifetime it belongs to.

    Raises:
        RowError: a field is missing, of the wrong type or out of range (naming it).
    """
    if not isinstance(d, dict):
        raise RowError(f"field 'view' holds {type(d).__name__}, not an object")
    state = _STATES.get(str_field(d, "state"))
    if state is None:
        raise RowError(f"field 'state' holds {d['state']!r}; one of {sorted(_STATES)}")
    acks = []
    for ack in list_field(d, "acks"):
        pair = (
            {"ep_rank": ack[0], "rounds": ack[1]} if isinstance(ack, list) and len(ack) == 2 else {}
        )
        acks.append(
            Acknowledgement(
                int_field(pair, "ep_rank", 0, ep_size - 1),
                int_field(pair, "rounds", 0, limits.MAX_ROUND),
            )
        )
    view = View(
        number=int_field(d, "number", 1, limits.MAX_GENERATION),
        members=tuple(rank_numbers_field(d, "members", ep_size)),
        generation=int_field(d, "generation"),
        state=state,
        cause=str_field(d, "cause"),
        deadline=time_field(d, "deadline") if d.get("deadline") is not None else None,
        acks=tuple(acks),
        # Rows written before joins have no "joined": no member was added.
        joined=tuple(rank_numbers_field(d, "joined", ep_size)) if "joined" in d else (),
    )
    return view, int_field(d, "lifetime_index")
