"""What the decision core knows of an EP group: frozen values, with the
methods that read them and make changed copies of them.

A round is an :class:`OpenRound` (its proposals in rank order, their need,
the slots each proof holds, the owner they carry) and the group a
:class:`GroupState` (its ranks, its closed rounds, its stored plan and whose
it is, the plan a round decides); each step of
:mod:`moe_sidecar.core.policy` asks these values and builds its
:class:`~moe_sidecar.core.effects.Step` from their answers. The one codec per
boundary converts them (:mod:`moe_sidecar.wire.codec` to and from the wire,
:mod:`moe_sidecar.store.row_codec` to and from stored rows).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TypeAlias

from moe_sidecar.core.errors import CoordinatorError, ErrorCode, error_for_code
from moe_sidecar.core.identity import short_id
from moe_sidecar.core.limits import WorkspaceSize
from moe_sidecar.core.membership import View, first_view
from moe_sidecar.core.plan import Action, Capacities, EpochPlan, Plan, grow, join_capacities

__all__ = [
    "RETAINED_ROUNDS",
    "CommitRecord",
    "Decision",
    "GroupState",
    "GroupSummary",
    "Growth",
    "OpenRound",
    "Outcome",
    "Proposal",
    "RankRecord",
    "RankSummary",
    "Refusal",
    "Requirement",
    "summarize",
]

RETAINED_ROUNDS = 64
"""Closed rounds kept per group to answer retries, stored with the group.

It is also the most proposals a rank's client may leave unanswered
(:class:`moe_sidecar.client.WorkspaceManager`'s ``max_unanswered`` refuses
more): a client re-sends what is unanswered on a new stream after a
sidecar restart, and every such round is then at most this many rounds old,
so it is still answered, with the answer it had."""


@dataclass(frozen=True)
class Requirement:
    """What one MoE layer needs on one rank."""

    capacities: Capacities
    layer: str = ""
    """A label of the layer (e.g. ``"model.layers.61.mlp"``) for history and errors."""


@dataclass(frozen=True)
class Proposal:
    """One rank's proposal for one round."""

    group: str
    ep_size: int
    ep_rank: int
    local_ranks: int
    lifetime: str
    """The rank's lifetime: its secret token on the client's side, its id
    (:func:`moe_sidecar.core.identity.lifetime_id`) once past the sidecar's boundary."""
    round: int
    requirement: Requirement
    proof: str = ""
    """The group's proof: the token the group's ranks share on the client's
    side, its id (:func:`moe_sidecar.core.identity.proof_id`) past the
    sidecar's boundary; empty: none (a client older than proofs)."""
    release: str = ""
    """The FlashInfer release the rank builds with (a name of
    ``moe_sidecar.flashinfer.RELEASES``; empty: a client older than the
    field, which drove the default release). Every rank of a lifetime must
    state the same; the group's workspace bytes are that release's."""
    owner: str = ""
    """The id (:func:`moe_sidecar.core.identity.owner_id`) of the group's
    owner digest, SHA-256 of the owner key rank 0 keeps on disk and the
    group name; empty: none (a client older than owner keys, or embedded).
    A restart inherits the stored plan only with the stored owner
    (:mod:`moe_sidecar.core.policy.owner`)."""


@dataclass(frozen=True)
class Decision:
    """The outcome of a round every rank acts on."""

    round: int
    action: Action
    plan: Plan
    grew: bool
    """True when this round grew the group's plan (a new generation)."""
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
class Growth:
    """One growth of a group's plan and what caused it."""

    plan: Plan
    """The plan after the growth."""
    layer: str
    ep_rank: int
    round: int
    at: float
    node: str = ""
    """The node whose sidecar made this growth (``--node-name``); empty in
    rows written before nodes were recorded."""


@dataclass(frozen=True)
class RankRecord:
    """What the group knows of one local rank."""

    ep_rank: int
    lifetime: str
    """The id of the rank's lifetime (:mod:`moe_sidecar.core.identity`), never its token."""
    lifetime_index: int
    """Which lifetime of the group this rank's lifetime belongs to."""
    last_round: int = 0
    last_layer: str = ""
    last_seen: float = 0.0
    committed_generation: int = 0
    build_seconds: float = 0.0
    left: str = ""
    ended_lifetime: str = ""
    """The id of the rank's lifetime that ended when this one began with a
    restart ("" when none): its ranks are told it ended, not that it is unknown."""
    """Why the rank is gone (its session stream closed), or empty while it is here."""


@dataclass(frozen=True)
class OpenRound:
    """A round collecting proposals."""

    number: int
    opened_at: float
    deadline: float
    proposals: tuple[Proposal, ...] = ()
    need: Capacities | None = None
    """The join of the proposals' capacities so far (of the proposals that
    share the first one's shape; :meth:`GroupState.decided_plan` joins the
    proposals a decision is made of)."""
    first_proof: str = ""
    """The proof of the proposal that opened the round: it wins a tie for a
    slot (:mod:`moe_sidecar.core.policy.proof`)."""

    def proposal_of(self, ep_rank: int) -> Proposal | None:
        """The proposal of ``ep_rank`` in this round, if it proposed."""
        return next((p for p in self.proposals if p.ep_rank == ep_rank), None)

    def with_proposal(self, p: Proposal) -> OpenRound:
        """This round with ``p`` among its proposals (in rank order) and in its
        need; the round's first proposal sets the proof that opened it.

        A proposal of another shape than the need's (another proof's: a
        proposal of the round's own proof and another shape is refused
        first) stays out of the need: it never joins this round's decision."""
        capacities = p.requirement.capacities
        if self.need is None:
            need = capacities
        elif self.need.shape == capacities.shape:
            need = join_capacities(self.need, capacities)
        else:
            need = self.need
        proposals = self.proposals
        at = next((i for i, q in enumerate(proposals) if q.ep_rank > p.ep_rank), len(proposals))
        return replace(
            self,
            proposals=(*proposals[:at], p, *proposals[at:]),
            need=need,
            first_proof=self.first_proof if proposals else p.proof,
        )

    def without(self, ep_rank: int) -> OpenRound:
        """This round without the proposal of ``ep_rank`` (its need rebuilt; the
        proof that opened it kept)."""
        rest = replace(self, proposals=(), need=None)
        for q in self.proposals:
            if q.ep_rank != ep_rank:
                rest = rest.with_proposal(q)
        return replace(rest, first_proof=self.first_proof)

    def slots_by_proof(self) -> Counter[str]:
        """How many slots of this round each proof holds."""
        return Counter(q.proof for q in self.proposals)

    def single_proof(self) -> bool:
        """Whether every proposal of this round carries one proof (an empty round does)."""
        return len(self.slots_by_proof()) <= 1

    def closing_proof(self, local_ranks: int) -> str | None:
        """The proof this round closes with (the proof's rule 1,
        :mod:`moe_sidecar.core.policy.proof`): every one of ``local_ranks``
        slots held, all with one proof; None while it may not close."""
        slots = self.slots_by_proof()
        if len(self.proposals) < local_ranks or len(slots) != 1:
            return None
        return next(iter(slots))

    def owner(self) -> str:
        """The owner a new lifetime whose round 1 this is stores: its
        proposals' one owner, or empty when they carry none or several (then
        no later lifetime inherits its plan; :mod:`moe_sidecar.core.policy.owner`)."""
        owners = {q.owner for q in self.proposals}
        return next(iter(owners)) if len(owners) == 1 else ""


@dataclass(frozen=True)
class GroupState:
    """Everything one sidecar knows of one EP group."""

    name: str
    ep_size: int
    local_ranks: int
    epoch: int = 0
    """Moved by every reset; plans of a lower epoch are replaced whole."""
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
    pending: OpenRound | None = None
    """Round 1 of the next lifetime, collecting ranks that began new lifetimes
    while the current one runs. It becomes the current lifetime only once
    every local rank has joined it (a whole restart), so a single stranger
    can never end the running lifetime."""
    ranks: tuple[RankRecord, ...] = ()
    history: tuple[Growth, ...] = ()
    proof: str | None = None
    """The id of the current lifetime's group proof, fixed when the
    lifetime's first round is decided (None before; "" for ranks without
    proofs). Every later proposal and commit of the lifetime must carry it."""
    refused_proposals: int = 0
    """Proposals and commits refused because their proof did not match."""
    release: str = ""
    """The FlashInfer release the group's ranks build with: fixed by the
    first decided round of each lifetime (empty: none decided yet, or a row
    stored before releases were recorded; both mean the default release)."""
    view: View | None = None
    """The latest membership view decided after the lifetime's first one
    (None: none since; see :meth:`current_view`)."""
    view_lifetime: int = 0
    """The lifetime ``view`` belongs to (a view of an earlier one is not current)."""
    owner: str = ""
    """The owner id (:attr:`Proposal.owner`) of the lifetime that stored the
    plan: fixed by each lifetime's first decided round (empty: none, or a
    row stored before owners were recorded)."""

    def current_view(self) -> View | None:
        """The current lifetime's membership view: the one decided last, else
        its first (every rank of the lifetime still there, committed, at the
        generation built); None before anything is built."""
        if self.view is not None and self.view_lifetime == self.lifetime_index:
            return self.view
        members = tuple(r.ep_rank for r in self.current_ranks() if not r.left)
        if self.built is None or not members:
            return None
        return first_view(members, self.built.generation, f"lifetime {self.lifetime_index} began")

    def last_activity(self) -> float:
        """When a rank last proposed or committed, or the plan last grew (0: never)."""
        return max([r.last_seen for r in self.ranks] + [g.at for g in self.history], default=0.0)

    @property
    def held(self) -> EpochPlan:
        """Where the group stands in the plans' lattice: epoch, plan, generation counter."""
        return EpochPlan(self.epoch, self.plan, self.generation)

    def busy(self) -> bool:
        """Whether a round or a restart is collecting proposals."""
        return self.open_round is not None or self.pending is not None

    def next_deadline(self) -> float | None:
        """The earliest deadline of the open and the pending round and of a
        proposed membership view (None: none)."""
        deadlines = [r.deadline for r in (self.open_round, self.pending) if r is not None]
        # Only a decided view can be a proposed one with a deadline: the first
        # view current_view() would otherwise build is committed, without one,
        # so it is not built here (this runs at every round's open and close).
        view = self.view if self.view_lifetime == self.lifetime_index else None
        if view is not None and view.deadline is not None:
            deadlines.append(view.deadline)
        return min(deadlines) if deadlines else None

    def rank(self, ep_rank: int) -> RankRecord | None:
        """What the group knows of ``ep_rank``, if it ever proposed."""
        return next((r for r in self.ranks if r.ep_rank == ep_rank), None)

    def current_ranks(self) -> tuple[RankRecord, ...]:
        """Ranks that belong to the current lifetime."""
        return tuple(r for r in self.ranks if r.lifetime_index == self.lifetime_index)

    def outcome_of(self, round_number: int) -> Outcome | None:
        """The retained outcome of a closed round of the current lifetime."""
        return next((o for o in self.closed if o.round == round_number), None)

    def never_ran(self) -> bool:
        """Whether the running lifetime never ran: its round 1 closed refused
        (a rank missing past the deadline, a stranger's proof holding a slot,
        a plan refused), so no rank of it built anything, and it has no ranks
        for a restart to wait for."""
        return (
            self.open_round is None
            and self.last_closed_round == 1
            and isinstance(self.outcome_of(1), Refusal)
        )

    def restart_layout(self) -> int:
        """The local ranks the pending restart collects (its first proposal's),
        or the running lifetime's when none is pending."""
        if self.pending is not None and self.pending.proposals:
            return self.pending.proposals[0].local_ranks
        return self.local_ranks

    def ranks_with(self, record: RankRecord) -> tuple[RankRecord, ...]:
        """The group's ranks (in rank order) with ``record`` in place of its
        rank's earlier record: the rank's slot is replaced where it is, not
        the tuple re-sorted."""
        ranks = self.ranks
        for index, r in enumerate(ranks):
            if r.ep_rank == record.ep_rank:
                return (*ranks[:index], record, *ranks[index + 1 :])
            if r.ep_rank > record.ep_rank:
                return (*ranks[:index], record, *ranks[index:])
        return (*ranks, record)

    def with_rank(self, record: RankRecord) -> GroupState:
        """This group with ``record`` in place of the rank's earlier record."""
        return replace(self, ranks=self.ranks_with(record))

    def closed_by(self, outcome: Outcome) -> GroupState:
        """This group with its open round closed by ``outcome`` (kept for retries)."""
        return replace(
            self,
            open_round=None,
            last_closed_round=outcome.round,
            closed=(*self.closed, outcome)[-RETAINED_ROUNDS:],
        )

    def inherits_stored_plan(self, proposals: Iterable[Proposal]) -> bool:
        """Whether a new lifetime whose round 1 holds ``proposals`` inherits the
        stored plan: the stored owner is set and every proposal carries it
        (an empty owner on either side never matches;
        :mod:`moe_sidecar.core.policy.owner`)."""
        owners = {q.owner for q in proposals}
        return bool(self.owner) and owners == {self.owner}

    def disowns_stored_plan(self, rnd: OpenRound) -> bool:
        """Whether deciding ``rnd`` begins a new epoch without the stored plan:
        it is the first round of a lifetime that did not come as a restart
        (the group's first lifetime on this node; a restart checks its owner
        when it completes), a plan is stored (here, or merged from another
        node), and the round's proposals do not carry its owner."""
        return (
            rnd.number == 1
            and self.proof is None
            and self.plan is not None
            and not self.inherits_stored_plan(rnd.proposals)
        )

    def decided_plan(self, rnd: OpenRound) -> Plan:
        """The stored plan grown by the join of ``rnd``'s proposals (one proof,
        one shape: a round closes only so) and of what the lifetime built.

        Raises:
            ShapeMismatch: the need, the plan and the built workspace have no one shape.
        """
        need = rnd.proposals[0].requirement.capacities
        for q in rnd.proposals[1:]:
            need = join_capacities(need, q.requirement.capacities)
        if self.built is not None:
            # The lifetime's earlier layers still run on what it built: the plan
            # must keep serving them, whatever a reset or another node did since.
            need = join_capacities(need, self.built.capacities)
        return grow(self.plan, need, epoch=self.epoch, last_generation=self.generation)


@dataclass(frozen=True)
class CommitRecord:
    """A rank reports the plan it holds after building and the barrier."""

    ep_rank: int
    lifetime: str
    round: int
    plan: Plan
    build_seconds: float
    proof: str = ""
    """The group's proof, as in :attr:`Proposal.proof`."""


@dataclass(frozen=True)
class RankSummary:
    """One rank of a group, as operators see it."""

    ep_rank: int
    lifetime: str
    """A short id of the rank's lifetime (:func:`moe_sidecar.core.identity.short_id`)."""
    last_round: int
    last_layer: str
    committed_generation: int
    build_seconds: float
    last_seen: float
    current: bool
    """False when the rank belongs to an earlier lifetime of the group."""
    left: str = ""
    """Why the rank is gone, or empty."""


@dataclass(frozen=True)
class GroupSummary:
    """A group as operators see it (``GetGroup``, ``ListGroups``, ``moe-sidecar groups``)."""

    name: str
    ep_size: int
    local_ranks: int
    epoch: int
    plan: Plan | None
    lifetimes: int
    last_closed_round: int
    open_round: int
    """The round collecting proposals now (0: none)."""
    waiting_ranks: int
    restarting_ranks: int
    """Ranks that began new lifetimes and wait for the rest of the restart."""
    last_activity: float
    """When a rank last proposed or committed, or the plan last grew (0: never)."""
    ranks: tuple[RankSummary, ...]
    history: tuple[Growth, ...]
    refused_proposals: int = 0
    """Proposals and commits refused because their group proof did not match."""
    release: str = ""
    """The FlashInfer release the group's ranks build with (empty: the default)."""
    view: View | None = None
    """The current lifetime's membership view (None: nothing built yet)."""
    arrived_ranks: tuple[int, ...] = ()
    """Ranks that arrived at their lifetime's first round and have not proposed
    yet (:mod:`moe_sidecar.core.policy.arrivals`)."""
    awaited_ranks: tuple[int, ...] = ()
    """Ranks of the running lifetime no session has spoken for since the
    sidecar started on its state (a restart): declared lost once its
    reconnect window passes."""

    def workspace_bytes(self, plan: Plan, size: WorkspaceSize) -> int:
        """Per-rank workspace bytes of ``plan`` in this group, by ``size`` (the
        size function of the group's release)."""
        return size(self.release, plan.capacities, self.ep_size)


def summarize(state: GroupState) -> GroupSummary:
    """What operators are shown of ``state``."""
    rnd = state.open_round
    return GroupSummary(
        name=state.name,
        ep_size=state.ep_size,
        local_ranks=state.local_ranks,
        epoch=state.epoch,
        plan=state.plan,
        lifetimes=state.lifetime_index,
        last_closed_round=state.last_closed_round,
        open_round=rnd.number if rnd is not None else 0,
        waiting_ranks=len(rnd.proposals) if rnd is not None else 0,
        restarting_ranks=len(state.pending.proposals) if state.pending is not None else 0,
        last_activity=state.last_activity(),
        ranks=tuple(
            RankSummary(
                ep_rank=r.ep_rank,
                lifetime=short_id(r.lifetime),
                last_round=r.last_round,
                last_layer=r.last_layer,
                committed_generation=r.committed_generation,
                build_seconds=r.build_seconds,
                last_seen=r.last_seen,
                current=r.lifetime_index == state.lifetime_index,
                left=r.left,
            )
            for r in state.ranks
        ),
        history=state.history,
        refused_proposals=state.refused_proposals,
        release=state.release,
        view=state.current_view(),
    )
