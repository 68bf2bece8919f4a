"""Membership views of an EP group: who the all-to-all runs among. Pure.

Per group lifetime the sidecar decides a sequence of **views**. A view has a
number that only grows, a member set (EP ranks), the workspace generation
its members hold, a state, a deadline and a cause:

* the lifetime's first view holds every rank of its first round, COMMITTED;
* a member **leaves** only because its session closed or an admin excluded it
  (a drain): never because a survivor suspects it; there is no input here
  for a suspicion. The next view, PROPOSED, holds the rest at the same
  generation: within a generation members only leave;
* a rank is **added** only with a new generation (a replacement joining: one
  rebuild at the stored plan, for everyone), never into a running workspace;
* a PROPOSED view **commits** when every member has acknowledged it at a
  quiesced point (its last combine done) with the same count of all-to-all
  rounds (dispatch + combine pairs): then every member masks the same ranks
  from the same step on. Members that quiesced at different counts, or a
  deadline passed first, **fail** the view: FAILED is final for the
  lifetime (the group fails stop; its ranks restart).

Nothing here is stored or sent; :func:`mask` is FlashInfer's form of a
view's members (bit i = rank i alive).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from moe_sidecar.core.errors import PreconditionFailed

__all__ = [
    "Acknowledgement",
    "View",
    "ViewState",
    "acknowledge",
    "expire",
    "first_view",
    "join",
    "leave",
    "mask",
    "without",
]


class ViewState(enum.Enum):
    """Where a view stands."""

    PROPOSED = "proposed"
    """Decided by the sidecar, waiting for every member's acknowledgement."""
    COMMITTED = "committed"
    """Every member acknowledged it at the same all-to-all round count."""
    FAILED = "failed"
    """Acknowledged at different counts, or not in time: the group fails stop."""


@dataclass(frozen=True)
class Acknowledgement:
    """A member reached a quiesced point under a PROPOSED view."""

    ep_rank: int
    rounds: int
    """All-to-all rounds (dispatch + combine pairs) the member had completed."""


@dataclass(frozen=True)
class View:
    """One membership view of a group lifetime."""

    number: int
    """1 for a lifetime's first view; every later view's is one more."""
    members: tuple[int, ...]
    """The EP ranks the all-to-all runs among, ascending."""
    generation: int
    """The workspace generation the members hold (or rebuild to, on a join)."""
    state: ViewState
    cause: str
    """Why this view exists, in words an operator reads."""
    deadline: float | None = None
    """When a PROPOSED view fails unacknowledged (None otherwise)."""
    acks: tuple[Acknowledgement, ...] = ()
    """Members' acknowledgements of a PROPOSED view, in arrival order."""
    joined: tuple[int, ...] = ()
    """Members a join added (replacements holding no workspace yet): their
    acknowledgements count, their round counts are not compared (they ran
    no all-to-all round of the running workspace)."""

    def members_text(self) -> str:
        """The members as an operator reads them: ``members 0, 1, 2, 3 (3 joined)``."""
        joined = f" ({', '.join(str(r) for r in self.joined)} joined)" if self.joined else ""
        return f"members {', '.join(str(r) for r in self.members)}{joined}"

    def missing(self) -> tuple[int, ...]:
        """Members that have not acknowledged the view."""
        acked = {a.ep_rank for a in self.acks}
        return tuple(r for r in self.members if r not in acked)


def first_view(members: tuple[int, ...], generation: int, cause: str) -> View:
    """A lifetime's first view: ``members``, COMMITTED (its first round agreed on them)."""
    return View(1, tuple(sorted(set(members))), generation, ViewState.COMMITTED, cause)


def _proposed(
    view: View, members: tuple[int, ...], generation: int, cause: str, deadline: float
) -> View:
    return View(view.number + 1, members, generation, ViewState.PROPOSED, cause, deadline)


def leave(view: View, ep_rank: int, cause: str, now: float, ack_timeout: float) -> View | None:
    """:func:`without` one member (its session closed)."""
    return without(view, (ep_rank,), cause, now, ack_timeout)


def without(
    view: View, ranks: tuple[int, ...], cause: str, now: float, ack_timeout: float
) -> View | None:
    """The view after members ``ranks`` left (a session closed, or an admin
    excluded them): the rest, PROPOSED at the same generation, due by ``now +
    ack_timeout``. A proposal still open is superseded (its acknowledgements
    were for other members). None when nothing moves: none of ``ranks`` is a
    member, or the view FAILED (a failed group only stops). The last member
    leaving fails the view.
    """
    if view.state is ViewState.FAILED or not set(ranks) & set(view.members):
        return None
    rest = tuple(r for r in view.members if r not in ranks)
    if not rest:
        return replace(
            view,
            number=view.number + 1,
            members=(),
            state=ViewState.FAILED,
            cause=f"{cause}; no member is left",
            deadline=None,
            acks=(),
        )
    following = _proposed(view, rest, view.generation, cause, now + ack_timeout)
    if view.state is ViewState.PROPOSED:
        # A join still open stays a join for the members it added that remain.
        following = replace(following, joined=tuple(r for r in view.joined if r in rest))
    return following


def join(
    view: View, ep_rank: int, generation: int, cause: str, now: float, ack_timeout: float
) -> View:
    """The view after a replacement for rank ``ep_rank`` joined: every member
    and it, PROPOSED at ``generation`` (the rebuild they all make).

    Raises:
        PreconditionFailed: ``ep_rank`` is a member already, the view FAILED,
            or ``generation`` is not above the view's (a rank is added only
            with a new generation).
    """
    if view.state is ViewState.FAILED:
        raise PreconditionFailed(
            f"view {view.number} failed ({view.cause}): the group must restart"
        )
    if ep_rank in view.members:
        raise PreconditionFailed(f"rank {ep_rank} is a member of view {view.number} already")
    if generation <= view.generation:
        raise PreconditionFailed(
            f"rank {ep_rank} may join only with a new generation: view {view.number} holds "
            f"generation {view.generation}, the join names {generation}"
        )
    members = tuple(sorted((*view.members, ep_rank)))
    following = _proposed(view, members, generation, cause, now + ack_timeout)
    return replace(following, joined=(ep_rank,))


def acknowledge(view: View, ep_rank: int, number: int, rounds: int, now: float) -> View:
    """The view after member ``ep_rank`` acknowledged view ``number`` at a
    quiesced point, ``rounds`` all-to-all rounds done: COMMITTED once every
    member has, at one count; FAILED when the counts differ or the deadline
    passed. A retried acknowledgement (same count) changes nothing. The
    counts of the members a join added (:attr:`View.joined`) are not
    compared: they ran no round of the workspace the others quiesced.

    Raises:
        PreconditionFailed: ``number`` is not the view's, the view FAILED,
            ``ep_rank`` is no member, or it acknowledged before at another count.
    """
    if number != view.number:
        raise PreconditionFailed(
            f"rank {ep_rank} acknowledges view {number}; the group is at view {view.number}"
        )
    if view.state is ViewState.FAILED:
        raise PreconditionFailed(
            f"view {view.number} failed ({view.cause}): the group must restart"
        )
    if ep_rank not in view.members:
        raise PreconditionFailed(f"rank {ep_rank} is no member of view {view.number}")
    earlier = next((a for a in view.acks if a.ep_rank == ep_rank), None)
    if earlier is not None or view.state is ViewState.COMMITTED:
        if earlier is not None and earlier.rounds != rounds:
            raise PreconditionFailed(
                f"rank {ep_rank} acknowledged view {view.number} at {earlier.rounds} all-to-all "
                f"rounds; now at {rounds}"
            )
        return view
    expired = expire(view, now)
    if expired is not None:
        return expired
    acked = replace(view, acks=(*view.acks, Acknowledgement(ep_rank, rounds)))
    if acked.missing():
        return acked
    compared = sorted((a for a in acked.acks if a.ep_rank not in view.joined), key=_rank)
    if len({a.rounds for a in compared}) <= 1:
        return replace(acked, state=ViewState.COMMITTED, deadline=None)
    at = ", ".join(f"rank {a.ep_rank} at {a.rounds}" for a in compared)
    return replace(
        acked,
        state=ViewState.FAILED,
        deadline=None,
        cause=f"{view.cause}; the members quiesced at different all-to-all rounds ({at})",
    )


def _rank(a: Acknowledgement) -> int:
    return a.ep_rank


def expire(view: View, now: float) -> View | None:
    """The FAILED view of a PROPOSED one past its deadline, naming who did not
    acknowledge; None when the view is not due."""
    if view.state is not ViewState.PROPOSED or view.deadline is None or now < view.deadline:
        return None
    missing = ", ".join(str(r) for r in view.missing())
    return replace(
        view,
        state=ViewState.FAILED,
        deadline=None,
        cause=f"{view.cause}; ranks {missing} did not acknowledge it in time",
    )


def mask(view: View) -> int:
    """FlashInfer's active-rank mask of ``view``: bit i set = rank i alive."""
    bits = 0
    for rank in view.members:
        bits |= 1 << rank
    return bits
