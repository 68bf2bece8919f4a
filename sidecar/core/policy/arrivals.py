"""Arrivals: the ranks of a lifetime's first round, seen before they can propose. Pure.

At a lifetime's first ``initialize()`` the ranks of an EP group share their
group's proof over their CPU group (:mod:`moe_sidecar.core.policy.proof`)
before any of them can propose, so a rank that is late there keeps its
peers waiting where the sidecar cannot see them. So each rank first tells
the sidecar it has *arrived* (group, layout, rank, lifetime; no proof, which
it does not hold yet) and waits on that call while the proof is shared:

- the sidecar shows the arrived ranks (``moe-sidecar groups``,
  ``moe_sidecar_waiting_ranks``) until each proposes;
- an arrival still waiting ``round_timeout`` seconds after it came is
  answered DEADLINE_EXCEEDED naming the ranks that have not arrived (with
  the last layer each reported in an earlier lifetime, if any) and those
  whose arrival ended before they proposed (they died or gave up);
- the rank's first proposal answers its arrival: it has nothing to wait for.

An arrival carries no proof, so anyone can send one, and it is worth no
more than that: it never enters a round (:class:`~moe_sidecar.core.group.OpenRound`),
never creates or changes a group, and never answers anybody but itself.
Each arrival has its own deadline, counted from when it came, so a
stranger's arrival cannot make a real rank's wait end sooner or later; at
most it makes the missing ranks named in a timeout read as arrived.

An arrival's ``local_ranks`` may be :data:`UNCOUNTED`: where nobody stated
how many ranks of the group run on each node, the ranks count them in the
same exchange that shares the proof (no collective runs before it), so
they do not know it yet when they arrive.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moe_sidecar.core import limits
from moe_sidecar.core.errors import ErrorCode, quote_name
from moe_sidecar.core.group import GroupState, Refusal
from moe_sidecar.core.policy.validation import validate_group_name

__all__ = [
    "UNCOUNTED",
    "Arrival",
    "Arrivals",
    "arrive",
    "arrived_ranks",
    "expire_arrivals",
    "has_proposed",
    "proposed",
    "validate_arrival",
    "withdraw",
]

UNCOUNTED = 0
"""An arrival's ``local_ranks`` when its rank has not counted its node's
ranks yet (it counts them in the exchange its arrival waits on)."""
_LEFT_KEPT = 64
"""Most departed arrivals a group remembers (to name them in a timeout)."""


@dataclass(frozen=True)
class Arrival:
    """One rank that has arrived at its lifetime's first round and cannot propose yet."""

    group: str
    ep_size: int
    ep_rank: int
    local_ranks: int
    """Ranks of the group on the arriving rank's node (:data:`UNCOUNTED`: not
    counted yet)."""
    lifetime: str
    """The id of the rank's lifetime (never its token) past the sidecar's boundary."""
    at: float = 0.0
    deadline: float = 0.0


@dataclass(frozen=True)
class Arrivals:
    """The arrivals of one group still waiting, and the ranks whose arrival
    ended before they proposed."""

    waiting: tuple[Arrival, ...] = ()
    left: tuple[int, ...] = ()
    """Ranks whose arrival call ended before their first proposal, oldest first."""
    layout: tuple[int, int] = (0, 0)
    """``(ep_size, local_ranks)`` of the latest arrival (``local_ranks`` the
    latest counted, :data:`UNCOUNTED` until one is)."""

    def __bool__(self) -> bool:
        return bool(self.waiting or self.left)

    def next_deadline(self) -> float | None:
        """The earliest deadline of a waiting arrival (None: none waits)."""
        return min((a.deadline for a in self.waiting), default=None)


def validate_arrival(a: Arrival) -> None:
    """Checks every field of an arrival before it touches any state.

    Raises:
        InvalidArgument: naming the first bad field and its value.
    """
    validate_group_name(a.group)
    limits.check_count("ep_size", a.ep_size, 1, limits.MAX_EP_SIZE, limits.EP_SIZE_REASON)
    limits.check_count("ep_rank", a.ep_rank, 0, a.ep_size - 1, f"ep_size is {a.ep_size}")
    limits.check_count(
        "local_ranks",
        a.local_ranks,
        UNCOUNTED,
        a.ep_size,
        f"ep_size is {a.ep_size}; {UNCOUNTED}: not counted yet",
    )
    limits.check_name("lifetime", a.lifetime, allow_empty=False)


def arrive(held: Arrivals, a: Arrival, now: float, round_timeout: float) -> Arrivals:
    """``held`` with ``a`` waiting from ``now`` for ``round_timeout`` seconds
    (an arrival of the same lifetime is replaced: a retry).

    Raises:
        InvalidArgument: a bad field (nothing changes).
    """
    validate_arrival(a)
    a = replace(a, at=now, deadline=now + round_timeout)
    others = tuple(w for w in held.waiting if w.lifetime != a.lifetime)
    local = a.local_ranks or (held.layout[1] if held.layout[0] == a.ep_size else UNCOUNTED)
    return replace(held, waiting=(*others, a), layout=(a.ep_size, local))


def proposed(held: Arrivals, lifetime: str, ep_rank: int) -> Arrivals:
    """``held`` once rank ``ep_rank`` of ``lifetime`` proposed: without its
    arrival (answered) and without ``ep_rank`` among the ranks gone."""
    return replace(
        held,
        waiting=tuple(w for w in held.waiting if w.lifetime != lifetime),
        left=tuple(r for r in held.left if r != ep_rank),
    )


def has_proposed(group: GroupState | None, a: Arrival) -> bool:
    """Whether ``a``'s lifetime already proposed for its rank: its arrival
    then has nothing to wait for (the arrival call and the proposal travel
    on different calls, so the proposal can reach the sidecar first)."""
    if group is None:
        return False
    record = group.rank(a.ep_rank)
    if record is not None and record.lifetime == a.lifetime:
        return True
    for rnd in (group.open_round, group.pending):
        if rnd is not None:
            proposal = rnd.proposal_of(a.ep_rank)
            if proposal is not None and proposal.lifetime == a.lifetime:
                return True
    return False


def withdraw(held: Arrivals, lifetime: str) -> Arrivals:
    """``held`` after the arrival call of ``lifetime`` ended without its
    rank proposing (the process died, or gave up): remembered as left."""
    gone = [w.ep_rank for w in held.waiting if w.lifetime == lifetime]
    if not gone:
        return held
    left = tuple(r for r in held.left if r not in gone) + tuple(gone)
    return replace(
        held,
        waiting=tuple(w for w in held.waiting if w.lifetime != lifetime),
        left=left[-_LEFT_KEPT:],
    )


def arrived_ranks(held: Arrivals, group: GroupState | None = None) -> tuple[int, ...]:
    """The ranks that arrived and have not proposed yet, in rank order
    (ranks already in the group's open round or restart are not counted twice)."""
    proposing = set()
    if group is not None:
        for rnd in (group.open_round, group.pending):
            if rnd is not None:
                proposing |= {p.ep_rank for p in rnd.proposals}
    return tuple(sorted({w.ep_rank for w in held.waiting} - proposing))


def _missing_text(a: Arrival, held: Arrivals, group: GroupState | None) -> tuple[str, list[int]]:
    present = set(arrived_ranks(held, group))
    if group is not None:
        for rnd in (group.open_round, group.pending):
            if rnd is not None:
                present |= {p.ep_rank for p in rnd.proposals}
    missing = [r for r in range(a.ep_size) if r not in present]
    parts = []
    for rank in missing:
        record = group.rank(rank) if group is not None else None
        layer = (
            f", last layer {quote_name(record.last_layer)}" if record and record.last_layer else ""
        )
        why = "arrived, then its call ended (it died or gave up)" if rank in held.left else ""
        parts.append(f"rank {rank} ({why or 'never arrived'}{layer})")
    if a.local_ranks == UNCOUNTED:
        parts.append("ranks of other nodes, if any, arrive at their own sidecars")
    elif a.local_ranks < a.ep_size:
        parts.append(
            f"{a.ep_size - a.local_ranks} of the {a.ep_size} ranks run on other nodes and arrive "
            "at their own sidecars, so some ranks named here may be there"
        )
    return "; ".join(parts), missing


def expire_arrivals(
    held: Arrivals, now: float, group: GroupState | None
) -> tuple[Arrivals, tuple[tuple[Arrival, Refusal], ...]]:
    """Every waiting arrival past its deadline with its DEADLINE_EXCEEDED
    refusal, naming the ranks not there; ``held`` without them."""
    due = tuple(w for w in held.waiting if w.deadline <= now)
    if not due:
        return held, ()
    answers = []
    for a in due:
        text, missing = _missing_text(a, held, group)
        # Every rank came (some already propose): the proof did not reach this one.
        text = text or "every rank arrived, but the group's proof did not reach this rank"
        message = (
            f"the first round of group {quote_name(a.group)} timed out for rank {a.ep_rank} after "
            f"{a.deadline - a.at:.1f}s: the EP group's ranks share their group proof over "
            f"their CPU group before they propose, and not all of them came: {text}; ranks "
            f"arrived: {list(arrived_ranks(held, group))}"
        )
        refusal = Refusal(
            round=1,
            code=ErrorCode.DEADLINE_EXCEEDED,
            message=message,
            missing_ranks=tuple(missing),
        )
        answers.append((a, refusal))
    waiting = tuple(w for w in held.waiting if w.deadline > now)
    return replace(held, waiting=waiting), tuple(answers)
