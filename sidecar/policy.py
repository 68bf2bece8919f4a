"""The decision core: rounds, the monotonic union, validation. Pure.

Frozen dataclasses in, frozen dataclasses and an :class:`Action` out. No
grpc, no asyncio, no torch, no clock: the time is an argument (``now``, in
seconds on whatever clock the caller uses consistently). The sidecar's state
holder and the client's embedded mode both drive their groups through these
functions, so the two modes decide identically.

The protocol (DESIGN section 4):

* The n-th ``initialize()`` of a rank in one process lifetime is round n.
  A round closes when every local rank of the group has proposed it, and
  every one of them gets the same outcome.
* ``plan_n = (max(workspace_{n-1}, needs), max(tokens_{n-1}, tokens), top_k,
  num_experts)``; the generation moves only when the plan grows. The stored
  plan outlives process lifetimes, so round 1 of a restart starts from the
  historical union.
* ``BUILD`` for the first decision of a lifetime, ``REBUILD`` when the plan
  exceeds what the lifetime built, ``REUSE`` otherwise.
* Another ``top_k``/``num_experts`` than the plan, or ranks disagreeing in a
  round, closes the round as refused for everyone.
* A retried proposal for a closed round gets the same outcome back.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TypeAlias

from moe_sidecar.errors import (
    CoordinatorError,
    ErrorCode,
    InvalidArgument,
    PreconditionFailed,
    RoundAborted,
    error_for_code,
)
from moe_sidecar.sizing import workspace_for_payload

__all__ = [
    "MAX_BYTES",
    "MAX_EP_SIZE",
    "MAX_NAME_LENGTH",
    "MAX_NUM_EXPERTS",
    "MAX_TOKENS",
    "MAX_TOP_K",
    "RETAINED_ROUNDS",
    "Action",
    "Answered",
    "Closed",
    "CommitRecord",
    "Decision",
    "GroupState",
    "Growth",
    "OpenRound",
    "Outcome",
    "Plan",
    "Proposal",
    "ProposeResult",
    "RankRecord",
    "Refusal",
    "Requirement",
    "Waiting",
    "commit",
    "expire",
    "new_group",
    "propose",
    "reset",
    "validate_group_name",
    "validate_proposal",
]

MAX_EP_SIZE = 64
"""FlashInfer's kMaxRanks."""
MAX_TOP_K = 22
"""FlashInfer's kMaxTopK."""
MAX_BYTES = 1 << 40
"""Sizes above this are refused as absurd (1 TiB per rank)."""
MAX_TOKENS = (1 << 31) - 1
"""FlashInfer holds max_num_tokens in an int32."""
MAX_NUM_EXPERTS = 1 << 16
MAX_NAME_LENGTH = 256
"""Longest group name, layer label or lifetime id."""
RETAINED_ROUNDS = 8
"""Closed rounds kept per group to answer retries."""
MAX_HISTORY = 256
"""Growth events kept per group (oldest dropped first)."""


class Action(enum.Enum):
    """What every rank of a round does with the decided plan."""

    BUILD = "build"
    """First decision of this lifetime: build at the plan's size."""
    REUSE = "reuse"
    """The plan is what the lifetime already built: keep it."""
    REBUILD = "rebuild"
    """The plan exceeds what the lifetime built: build anew, free the old."""


@dataclass(frozen=True)
class Requirement:
    """What one MoE layer needs on one rank."""

    workspace_bytes: int
    max_num_tokens: int
    top_k: int
    num_experts: int
    layer: str = ""
    payload_bytes: int = 0
    """The part of ``workspace_bytes`` that is the layer's dispatch and
    combine payload (:func:`moe_sidecar.sizing.payload_bytes`); 0 when unknown."""


@dataclass(frozen=True)
class Proposal:
    """One rank's proposal for one round."""

    group: str
    ep_size: int
    ep_rank: int
    local_ranks: int
    lifetime: str
    round: int
    requirement: Requirement


@dataclass(frozen=True)
class Plan:
    """A workspace plan: what every rank of the group builds."""

    workspace_bytes: int
    max_num_tokens: int
    top_k: int
    num_experts: int
    generation: int
    shape_layer: str = ""
    """The layer that fixed ``top_k``/``num_experts`` (for error messages)."""
    shape_rank: int = 0
    payload_bytes: int = 0
    """The largest layer payload the plan serves."""

    def covers(self, workspace_bytes: int, max_num_tokens: int) -> bool:
        """Whether a workspace of this plan serves the given sizes."""
        return workspace_bytes <= self.workspace_bytes and max_num_tokens <= self.max_num_tokens


@dataclass(frozen=True)
class Growth:
    """One growth of a group's plan and what caused it."""

    generation: int
    workspace_bytes: int
    max_num_tokens: int
    layer: str
    ep_rank: int
    round: int
    at: float


@dataclass(frozen=True)
class Decision:
    """The outcome of a round every rank acts on."""

    round: int
    action: Action
    plan: Plan
    grew: bool
    layer: str


@dataclass(frozen=True)
class Refusal:
    """A round that closed with an error; every rank of it gets the error."""

    round: int
    code: ErrorCode
    message: str
    missing_ranks: tuple[int, ...] = ()

    def error(self) -> CoordinatorError:
        """A fresh exception for this refusal."""
        return error_for_code(self.code, self.message)


Outcome: TypeAlias = Decision | Refusal


@dataclass(frozen=True)
class RankRecord:
    """What the group knows of one local rank."""

    ep_rank: int
    lifetime: str
    lifetime_index: int
    """Which lifetime of the group this rank's lifetime belongs to."""
    last_round: int = 0
    last_layer: str = ""
    last_seen: float = 0.0
    committed_generation: int = 0
    build_seconds: float = 0.0


@dataclass(frozen=True)
class OpenRound:
    """A round collecting proposals."""

    number: int
    opened_at: float
    deadline: float
    proposals: tuple[Proposal, ...] = ()

    def proposal_of(self, ep_rank: int) -> Proposal | None:
        return next((p for p in self.proposals if p.ep_rank == ep_rank), None)


@dataclass(frozen=True)
class GroupState:
    """Everything one sidecar knows of one EP group."""

    name: str
    ep_size: int
    local_ranks: int
    plan: Plan | None = None
    """The stored union over every lifetime since the last reset."""
    generation: int = 0
    """Last generation issued; never reused, not even after a reset."""
    lifetime_index: int = 0
    """How many lifetimes of the group have started."""
    built: Plan | None = None
    """Latest plan decided in the current lifetime (None: nothing yet)."""
    last_closed_round: int = 0
    closed: tuple[Outcome, ...] = ()
    """Outcomes of the most recent closed rounds of the current lifetime."""
    open_round: OpenRound | None = None
    ranks: tuple[RankRecord, ...] = ()
    history: tuple[Growth, ...] = ()

    def rank(self, ep_rank: int) -> RankRecord | None:
        return next((r for r in self.ranks if r.ep_rank == ep_rank), None)

    def current_ranks(self) -> tuple[RankRecord, ...]:
        """Ranks that belong to the current lifetime."""
        return tuple(r for r in self.ranks if r.lifetime_index == self.lifetime_index)

    def outcome_of(self, round_number: int) -> Outcome | None:
        return next((o for o in self.closed if o.round == round_number), None)


@dataclass(frozen=True)
class Waiting:
    """The proposal joined an open round that still misses ranks."""

    round: int
    deadline: float
    aborted: Refusal | None = None
    """A round of an earlier lifetime this proposal abandoned, if any."""
    new_lifetime: bool = False
    """This proposal started a new lifetime of the group."""


@dataclass(frozen=True)
class Closed:
    """The proposal closed its round (or the round was refused at once)."""

    outcome: Outcome
    aborted: Refusal | None = None
    """A round of an earlier lifetime this proposal abandoned, if any."""
    new_lifetime: bool = False


@dataclass(frozen=True)
class Answered:
    """The proposal retried a closed round: here is that round's outcome."""

    outcome: Outcome


@dataclass(frozen=True)
class CommitRecord:
    """A rank reports the plan it holds after building and the barrier."""

    ep_rank: int
    lifetime: str
    round: int
    plan: Plan
    build_seconds: float


ProposeResult: TypeAlias = Waiting | Closed | Answered


# --- validation -----------------------------------------------------------


def _check_name(field: str, value: str, *, allow_empty: bool) -> None:
    if not value and not allow_empty:
        raise InvalidArgument.of(field, value, "must not be empty")
    if len(value) > MAX_NAME_LENGTH:
        raise InvalidArgument.of(
            field, value[:40] + "...", f"is {len(value)} characters; at most {MAX_NAME_LENGTH}"
        )
    if any(not ch.isprintable() for ch in value):
        raise InvalidArgument.of(field, value, "must hold printable characters only")


def validate_group_name(group: str) -> None:
    """Checks a group name.

    Raises:
        InvalidArgument: empty, over-long or non-printable.
    """
    _check_name("group", group, allow_empty=False)


def _check_range(field: str, value: int, low: int, high: int, why: str = "") -> None:
    if not low <= value <= high:
        suffix = f" ({why})" if why else ""
        raise InvalidArgument.of(field, value, f"must be in [{low}, {high}]{suffix}")


def validate_proposal(p: Proposal) -> None:
    """Checks every field of a proposal before it touches any state.

    Raises:
        InvalidArgument: naming the first bad field and its value.
    """
    validate_group_name(p.group)
    _check_range("ep_size", p.ep_size, 1, MAX_EP_SIZE, "FlashInfer's rank limit")
    _check_range("ep_rank", p.ep_rank, 0, p.ep_size - 1, f"ep_size is {p.ep_size}")
    _check_range("local_ranks", p.local_ranks, 1, p.ep_size, f"ep_size is {p.ep_size}")
    _check_name("lifetime", p.lifetime, allow_empty=False)
    if p.round < 1:
        raise InvalidArgument.of("round", p.round, "rounds count from 1")
    r = p.requirement
    _check_range("requirement.workspace_bytes", r.workspace_bytes, 1, MAX_BYTES)
    _check_range("requirement.max_num_tokens", r.max_num_tokens, 1, MAX_TOKENS)
    _check_range("requirement.top_k", r.top_k, 1, MAX_TOP_K, "FlashInfer's kMaxTopK")
    _check_range(
        "requirement.num_experts",
        r.num_experts,
        p.ep_size,
        MAX_NUM_EXPERTS,
        f"FlashInfer needs num_experts >= ep_size={p.ep_size}",
    )
    _check_name("requirement.layer", r.layer, allow_empty=True)
    _check_range(
        "requirement.payload_bytes",
        r.payload_bytes,
        0,
        r.workspace_bytes,
        f"part of requirement.workspace_bytes={r.workspace_bytes}",
    )


# --- the round machine ----------------------------------------------------


def new_group(name: str, ep_size: int, local_ranks: int) -> GroupState:
    """An empty group: no plan, no lifetime yet."""
    return GroupState(name=name, ep_size=ep_size, local_ranks=local_ranks)


def _layer_of(p: Proposal) -> str:
    return repr(p.requirement.layer) if p.requirement.layer else "(unnamed layer)"


def _who(p: Proposal) -> str:
    return f"rank {p.ep_rank} layer {_layer_of(p)}"


def _shape_conflict(state: GroupState, p: Proposal, others: Iterable[Proposal]) -> str | None:
    """Why ``p`` cannot join its round, or None."""
    r = p.requirement
    for q in others:
        if q.ep_rank == p.ep_rank:
            continue
        s = q.requirement
        if (s.top_k, s.num_experts) != (r.top_k, r.num_experts):
            return (
                f"ranks disagree in round {p.round} of group {p.group!r}: "
                f"{_who(q)} has top_k={s.top_k}, num_experts={s.num_experts} but "
                f"{_who(p)} has top_k={r.top_k}, num_experts={r.num_experts}"
            )
        if s.layer and r.layer and s.layer != r.layer:
            return (
                f"ranks disagree in round {p.round} of group {p.group!r}: "
                f"rank {q.ep_rank} is at layer {s.layer!r} but rank {p.ep_rank} is at "
                f"layer {r.layer!r}; every rank must run the same layers in the same order"
            )
    base = state.plan or state.built
    if base is not None and (base.top_k, base.num_experts) != (r.top_k, r.num_experts):
        where = "" if state.built is not None else " (stored from an earlier lifetime)"
        return (
            f"heterogeneous MoE layers in group {p.group!r}: {_who(p)} has "
            f"top_k={r.top_k}, num_experts={r.num_experts} but the plan{where} was fixed "
            f"by rank {base.shape_rank} layer "
            f"{base.shape_layer!r} with top_k={base.top_k}, num_experts={base.num_experts}; "
            "FlashInfer's MoeAlltoAll needs one top_k and num_experts for every layer"
            + ("; ResetGroup forgets the stored plan" if state.built is None else "")
        )
    return None


def _decide(state: GroupState, rnd: OpenRound, now: float) -> tuple[GroupState, Decision]:
    proposals = rnd.proposals
    by_ws = max(proposals, key=lambda q: (q.requirement.workspace_bytes, -q.ep_rank))
    by_tokens = max(proposals, key=lambda q: (q.requirement.max_num_tokens, -q.ep_rank))
    by_payload = max(proposals, key=lambda q: (q.requirement.payload_bytes, -q.ep_rank))
    first = proposals[0]
    layer = first.requirement.layer

    base = state.plan or state.built
    tokens = max(by_tokens.requirement.max_num_tokens, base.max_num_tokens if base else 0)
    payload = max(by_payload.requirement.payload_bytes, base.payload_bytes if base else 0)
    # The maximum of sizes and of token counts, taken apart, is not enough:
    # FlashInfer's auxiliary data grows with the token count the workspace is
    # built for, so every payload seen must fit beside the aux of `tokens`.
    # (Payloads are 0 from clients that do not state them: sizes alone then.)
    ws = max(
        by_ws.requirement.workspace_bytes,
        base.workspace_bytes if base else 0,
        workspace_for_payload(state.ep_size, tokens, payload) if payload else 0,
    )
    if base is None:
        grew = True
        cause = by_ws
        generation = state.generation + 1
        shape_layer, shape_rank = layer, first.ep_rank
    else:
        grew = not base.covers(ws, tokens)
        if by_ws.requirement.workspace_bytes > base.workspace_bytes:
            cause = by_ws
        elif tokens > base.max_num_tokens:
            cause = by_tokens
        else:
            cause = by_payload
        generation = state.generation + 1 if grew else base.generation
        shape_layer, shape_rank = base.shape_layer, base.shape_rank
    plan = Plan(
        workspace_bytes=ws,
        max_num_tokens=tokens,
        top_k=first.requirement.top_k,
        num_experts=first.requirement.num_experts,
        generation=generation,
        shape_layer=shape_layer,
        shape_rank=shape_rank,
        payload_bytes=payload,
    )

    if state.built is None:
        action = Action.BUILD
    elif state.built.covers(plan.workspace_bytes, plan.max_num_tokens):
        action = Action.REUSE
    else:
        action = Action.REBUILD

    decision = Decision(round=rnd.number, action=action, plan=plan, grew=grew, layer=layer)
    history = state.history
    if grew:
        history = (
            *history,
            Growth(
                generation=generation,
                workspace_bytes=plan.workspace_bytes,
                max_num_tokens=plan.max_num_tokens,
                layer=cause.requirement.layer,
                ep_rank=cause.ep_rank,
                round=rnd.number,
                at=now,
            ),
        )[-MAX_HISTORY:]
    state = replace(
        _close(state, decision),
        plan=plan,
        generation=generation if grew else state.generation,
        built=plan,
        history=history,
    )
    return state, decision


def _close(state: GroupState, outcome: Outcome) -> GroupState:
    return replace(
        state,
        open_round=None,
        last_closed_round=outcome.round,
        closed=(*state.closed, outcome)[-RETAINED_ROUNDS:],
    )


def _with_rank(state: GroupState, record: RankRecord) -> GroupState:
    others = tuple(r for r in state.ranks if r.ep_rank != record.ep_rank)
    return replace(state, ranks=tuple(sorted((*others, record), key=lambda r: r.ep_rank)))


def _start_lifetime(state: GroupState, p: Proposal) -> tuple[GroupState, Refusal | None]:
    """Begins a new lifetime of the group; abandons the open round, if any."""
    aborted = None
    if state.open_round is not None:
        aborted = Refusal(
            round=state.open_round.number,
            code=ErrorCode.ABORTED,
            message=(
                f"round {state.open_round.number} of group {p.group!r} abandoned: rank "
                f"{p.ep_rank} restarted (new lifetime {p.lifetime!r}); restart every rank"
            ),
        )
    state = replace(
        state,
        lifetime_index=state.lifetime_index + 1,
        built=None,
        last_closed_round=0,
        closed=(),
        open_round=None,
        local_ranks=p.local_ranks,
    )
    return state, aborted


def _accepts_newcomers(state: GroupState) -> bool:
    """Whether a rank arriving with a new lifetime joins the current one.

    It does while the lifetime is still at round 1: round 1 open, or closed
    by a refusal before every local rank arrived (a round 1 that decided had
    every local rank, so a newcomer after it is a restart).
    """
    if state.lifetime_index == 0:
        return False
    if state.open_round is not None:
        return state.open_round.number == 1
    if state.last_closed_round == 0:
        return True
    return state.last_closed_round == 1 and isinstance(state.outcome_of(1), Refusal)


def _check_layout(state: GroupState, p: Proposal) -> None:
    if p.ep_size != state.ep_size:
        raise PreconditionFailed(
            f"group {p.group!r} has ep_size={state.ep_size} but rank {p.ep_rank} proposes "
            f"ep_size={p.ep_size}; the group name must change with the parallel layout"
        )


def propose(
    state: GroupState | None, p: Proposal, now: float, round_timeout: float
) -> tuple[GroupState, ProposeResult]:
    """Applies one proposal to a group.

    ``state`` is None for a group this sidecar has never seen. Returns the
    new state and what to tell the proposer: wait (:class:`Waiting`), the
    outcome of the round it closed (:class:`Closed`), or the outcome of the
    closed round it retried (:class:`Answered`). A refusal that ends a round
    for everyone is a :class:`Closed` holding a :class:`Refusal`.

    Raises:
        InvalidArgument: a field is malformed (state unchanged).
        PreconditionFailed: the proposal contradicts the group alone (wrong
            layout, out-of-sequence round, a retry that changed content);
            state unchanged.
        RoundAborted: the rank belongs to a lifetime the group has left.
    """
    validate_proposal(p)
    if state is None:
        state = new_group(p.group, p.ep_size, p.local_ranks)
    _check_layout(state, p)

    record = state.rank(p.ep_rank)
    aborted: Refusal | None = None
    new_lifetime = False
    if record is None or record.lifetime != p.lifetime:
        if p.round != 1:
            raise PreconditionFailed(
                f"rank {p.ep_rank} of group {p.group!r} proposes round {p.round} from lifetime "
                f"{p.lifetime!r}, which this sidecar has never seen; a lifetime starts at "
                "round 1 (was the sidecar's state dir lost?)"
            )
        in_current = record is not None and record.lifetime_index == state.lifetime_index
        if in_current or not _accepts_newcomers(state):
            state, aborted = _start_lifetime(state, p)
            new_lifetime = True
        elif p.local_ranks != state.local_ranks:
            raise PreconditionFailed(
                f"group {p.group!r} has local_ranks={state.local_ranks} on this node but rank "
                f"{p.ep_rank} proposes local_ranks={p.local_ranks}"
            )
        elif state.last_closed_round == 1:
            # Round 1 of this lifetime was refused before this rank arrived:
            # it is part of the same restart and shares the refusal.
            outcome = state.outcome_of(1)
            assert outcome is not None
            return state, Answered(outcome)
        record = RankRecord(
            ep_rank=p.ep_rank, lifetime=p.lifetime, lifetime_index=state.lifetime_index
        )
    else:
        if record.lifetime_index != state.lifetime_index:
            raise RoundAborted(
                f"rank {p.ep_rank} of group {p.group!r} belongs to lifetime {p.lifetime!r}, "
                "which ended when other ranks of the group restarted; restart this rank"
            )
        if p.local_ranks != state.local_ranks:
            raise PreconditionFailed(
                f"group {p.group!r} has local_ranks={state.local_ranks} on this node but rank "
                f"{p.ep_rank} proposes local_ranks={p.local_ranks}"
            )
        if p.round <= state.last_closed_round:
            outcome = state.outcome_of(p.round)
            if outcome is None:
                raise PreconditionFailed(
                    f"rank {p.ep_rank} of group {p.group!r} retries round {p.round}, which "
                    f"closed long ago (latest closed round: {state.last_closed_round})"
                )
            return state, Answered(outcome)
        if p.round > state.last_closed_round + 1:
            raise PreconditionFailed(
                f"rank {p.ep_rank} of group {p.group!r} proposes round {p.round} but the "
                f"group's next round is {state.last_closed_round + 1}"
            )

    rnd = state.open_round or OpenRound(number=p.round, opened_at=now, deadline=now + round_timeout)
    earlier = rnd.proposal_of(p.ep_rank)
    if earlier is not None:
        if earlier.requirement != p.requirement:
            raise PreconditionFailed(
                f"rank {p.ep_rank} of group {p.group!r} re-proposed round {p.round} with "
                f"{p.requirement} after proposing {earlier.requirement}"
            )
        return state, Waiting(round=rnd.number, deadline=rnd.deadline)

    record = replace(record, last_round=p.round, last_layer=p.requirement.layer, last_seen=now)
    state = _with_rank(state, record)
    conflict = _shape_conflict(state, p, rnd.proposals)
    if conflict is not None:
        refusal = Refusal(round=rnd.number, code=ErrorCode.FAILED_PRECONDITION, message=conflict)
        return _close(state, refusal), Closed(refusal, aborted, new_lifetime)

    rnd = replace(rnd, proposals=tuple(sorted((*rnd.proposals, p), key=lambda q: q.ep_rank)))
    if len(rnd.proposals) < state.local_ranks:
        state = replace(state, open_round=rnd)
        return state, Waiting(rnd.number, rnd.deadline, aborted, new_lifetime)
    state, decision = _decide(state, rnd, now)
    return state, Closed(decision, aborted, new_lifetime)


def expire(state: GroupState, now: float) -> tuple[GroupState, Refusal | None]:
    """Fails the open round if its deadline has passed.

    The refusal names every missing rank and the last layer each reported.
    Returns the state unchanged and None when nothing expired.
    """
    rnd = state.open_round
    if rnd is None or now < rnd.deadline:
        return state, None
    present = {p.ep_rank for p in rnd.proposals}
    missing = [r for r in state.current_ranks() if r.ep_rank not in present]
    unseen = state.local_ranks - len(present) - len(missing)
    parts = [
        f"rank {r.ep_rank} (last reported round {r.last_round}, layer "
        + (repr(r.last_layer) if r.last_layer else "(unnamed)")
        + ")"
        for r in missing
    ]
    if unseen > 0:
        parts.append(f"{unseen} rank(s) never seen in this lifetime")
    layer = rnd.proposals[0].requirement.layer if rnd.proposals else ""
    message = (
        f"round {rnd.number} of group {state.name!r} (layer {layer!r}) timed out after "
        f"{rnd.deadline - rnd.opened_at:.1f}s: {state.local_ranks - len(present)} of "
        f"{state.local_ranks} local ranks missing: {'; '.join(parts)}; "
        f"ranks present: {sorted(present)}"
    )
    refusal = Refusal(
        round=rnd.number,
        code=ErrorCode.DEADLINE_EXCEEDED,
        message=message,
        missing_ranks=tuple(r.ep_rank for r in missing),
    )
    return _close(state, refusal), refusal


def commit(state: GroupState, c: CommitRecord, now: float) -> GroupState:
    """Records what a rank holds after building and passing the barrier.

    A committed plan larger than the group's (agreed across nodes) is
    absorbed into the stored union, so a warm restart starts from it.

    Raises:
        InvalidArgument: a malformed field.
        PreconditionFailed: the rank or lifetime is unknown to the group, or
            the round has not closed.
    """
    _check_range("ep_rank", c.ep_rank, 0, state.ep_size - 1, f"ep_size is {state.ep_size}")
    _check_name("lifetime", c.lifetime, allow_empty=False)
    _check_range("plan.workspace_bytes", c.plan.workspace_bytes, 1, MAX_BYTES)
    _check_range("plan.max_num_tokens", c.plan.max_num_tokens, 1, MAX_TOKENS)
    _check_range("plan.top_k", c.plan.top_k, 1, MAX_TOP_K)
    _check_range(
        "plan.payload_bytes",
        c.plan.payload_bytes,
        0,
        c.plan.workspace_bytes,
        "part of the workspace",
    )
    if c.plan.generation < 1:
        raise InvalidArgument.of("plan.generation", c.plan.generation, "generations count from 1")
    if not 0.0 <= c.build_seconds < 86400.0:
        raise InvalidArgument.of("build_seconds", c.build_seconds, "must be in [0, 86400)")
    record = state.rank(c.ep_rank)
    if record is None or record.lifetime != c.lifetime:
        raise PreconditionFailed(
            f"rank {c.ep_rank} of group {state.name!r} commits from lifetime {c.lifetime!r}, "
            "which never proposed to this sidecar"
        )
    if c.round > state.last_closed_round or record.lifetime_index != state.lifetime_index:
        raise PreconditionFailed(
            f"rank {c.ep_rank} of group {state.name!r} commits round {c.round}, which has not "
            f"closed in its lifetime (latest closed round: {state.last_closed_round})"
        )
    shape = state.plan or state.built
    if shape is not None and (c.plan.top_k, c.plan.num_experts) != (shape.top_k, shape.num_experts):
        raise PreconditionFailed(
            f"rank {c.ep_rank} of group {state.name!r} commits top_k={c.plan.top_k}, "
            f"num_experts={c.plan.num_experts}, which the group's plan does not have"
        )
    state = _with_rank(
        state,
        replace(
            record,
            committed_generation=c.plan.generation,
            build_seconds=c.build_seconds,
            last_seen=now,
        ),
    )
    base = state.plan or state.built
    if base is not None and not base.covers(c.plan.workspace_bytes, c.plan.max_num_tokens):
        generation = max(state.generation + 1, c.plan.generation)
        plan = replace(
            base,
            workspace_bytes=max(base.workspace_bytes, c.plan.workspace_bytes),
            max_num_tokens=max(base.max_num_tokens, c.plan.max_num_tokens),
            payload_bytes=max(base.payload_bytes, c.plan.payload_bytes),
            generation=generation,
        )
        growth = Growth(
            generation=generation,
            workspace_bytes=plan.workspace_bytes,
            max_num_tokens=plan.max_num_tokens,
            layer="(agreed across nodes)",
            ep_rank=c.ep_rank,
            round=c.round,
            at=now,
        )
        state = replace(
            state,
            plan=plan,
            built=plan,
            generation=generation,
            history=(*state.history, growth)[-MAX_HISTORY:],
        )
    return state


def reset(state: GroupState) -> GroupState:
    """Forgets the stored plan and its history; the next lifetime starts afresh.

    The generation counter is kept, so generations are never reused. A
    lifetime that is running keeps growing from what it has built.
    """
    return replace(state, plan=None, history=())
