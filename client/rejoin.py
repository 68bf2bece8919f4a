"""A replacement rank rejoins the running lifetime: both sides of it in the client.

Under ``MOE_SIDECAR_ON_PEER_LOSS=mask`` the survivors of a death run under a
committed view without the dead rank. When the engine has started a
replacement process for that rank and re-formed the EP group's CPU (gloo)
group with it (every EP rank at its own rank in it), the survivors call
:meth:`AlltoAllManager.rejoin <moe_sidecar.client.manager.AlltoAllManager.rejoin>`
(:func:`rejoin_survivor`) and the replacement :func:`join_as_replacement`,
at one time, each with the new group; over it:

1. the lowest rank other than the replacement broadcasts the running
   lifetime's group proof, its owner digest, the survivors' last round and
   their all-to-all step count (:class:`Handover`);
2. the replacement proposes round 1 of its own lifetime with that proof;
   the sidecar takes it as the departed rank's replacement
   (:mod:`moe_sidecar.core.policy.rejoin`), answers REBUILD at the stored
   plan under the next generation and proposes the join view (every rank,
   at that generation); the replacement broadcasts that answer (or its
   refusal, so the survivors raise too instead of waiting);
3. every rank builds the all-to-all at that plan over the new group once
   (a survivor frees its old one first: FlashInfer would hand back its cached
   workspace of the same layout), acknowledges the
   join view (the replacement at 0 steps: the sidecar compares only the
   survivors' counts) and waits until it is COMMITTED; the mask then names
   every rank.

Nobody commits the rebuild as a round's plan: the join is no round. The
replacement then numbers its rounds after the survivors' (its next round is
theirs), and counts their steps as its own, so the next layer's proposals of
every rank meet in one round and a later view compares one step count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist

from moe_sidecar.client.backends import BACKENDS, AlltoAllBackend, backend_for
from moe_sidecar.client.errors import (
    CoordinatorError,
    InternalError,
    InvalidArgument,
    PreconditionFailed,
)
from moe_sidecar.client.group_collectives import GroupCollectives
from moe_sidecar.client.held_workspace import HeldWorkspace
from moe_sidecar.client.layer_need import LayerNeed
from moe_sidecar.client.lost_rank import rank_lost
from moe_sidecar.client.membership_view import AdoptedView, ViewFollower
from moe_sidecar.client.peer_loss import PeerLossPolicy, PeerLossWatch
from moe_sidecar.client.round_decisions import RoundDecisions
from moe_sidecar.client.transport import Transport
from moe_sidecar.core.defaults import ENV_ON_PEER_LOSS
from moe_sidecar.core.errors import quote_name
from moe_sidecar.core.group import Decision, Requirement
from moe_sidecar.core.membership import View, ViewState
from moe_sidecar.core.plan import Action, Plan


class AlltoAllManager(Protocol):
    """What the join reads and sets of a
    :class:`moe_sidecar.client.manager.AlltoAllManager` (its internals, named
    here as a protocol rather than imported: the manager imports this
    module), so that the type checker checks every use against the manager."""

    cpu_group: dist.ProcessGroup
    ep_size: int
    ep_rank: int
    group: str
    backend: AlltoAllBackend
    _transport: Transport
    _peer_loss: PeerLossWatch
    _on_group: GroupCollectives
    _held: HeldWorkspace
    _views: ViewFollower
    _decisions: RoundDecisions
    _group_proof: str | None
    _owner_digest: str
    _round: int
    _initializes: int
    _last_layer: str

    @property
    def embedded(self) -> bool: ...

    def _round_decisions(self) -> RoundDecisions: ...

    def _settle(self, keep: int = 0) -> None: ...

    def _propose(self, requirement: Requirement) -> Decision: ...

    def _build(self, plan: Plan, action: Action, layer: str, round_number: int) -> float: ...


__all__ = ["Handover", "JoinAnswer", "join_as_replacement", "rejoin_survivor"]


@dataclass(frozen=True)
class Handover:
    """What the survivors hand the replacement over the new CPU group."""

    proof: str
    """The running lifetime's group proof."""
    owner_digest: str
    round: int
    """The survivors' last round: the replacement's next round is the one after."""
    steps: int
    """The all-to-all steps (dispatch + combine pairs) the survivors completed."""


@dataclass(frozen=True)
class JoinAnswer:
    """What the replacement's round 1 was answered: the plan, or why not."""

    plan: Plan | None
    refusal: str = ""


def _handing_rank(ep_size: int, newcomer: int) -> int:
    """The rank that hands the proof over: the lowest one not the replacement."""
    return next(r for r in range(ep_size) if r != newcomer)


def _broadcast(manager: AlltoAllManager, value: object, src: int, where: str) -> Any:
    """``value`` of rank ``src`` on every rank of the manager's (new) group.

    Raises:
        RankLost: a peer died in the broadcast.
    """
    manager._on_group.count += 1
    carried: list[object] = [value]
    try:
        dist.broadcast_object_list(carried, group=manager.cpu_group, group_src=src)
    except RuntimeError as error:
        raise rank_lost(manager._transport, manager.group, manager.ep_rank, where, error) from error
    return carried[0]


def _check_mask_policy(manager: AlltoAllManager, what: str) -> None:
    """Raises:
    PreconditionFailed: not the ``mask`` policy, or embedded mode."""
    if manager._peer_loss.policy is not PeerLossPolicy.MASK or manager.embedded:
        raise PreconditionFailed(
            f"{what} needs {ENV_ON_PEER_LOSS}=mask and a sidecar (the views are the "
            f"sidecar's); the policy is {manager._peer_loss.policy.value!r}"
            + (", embedded mode" if manager.embedded else "")
        )


def _check_group(manager: AlltoAllManager, cpu_group: dist.ProcessGroup) -> None:
    """Raises:
    InvalidArgument: ``cpu_group`` is not of the EP group's size, or this
    rank is at another rank in it."""
    size, rank = dist.get_world_size(cpu_group), dist.get_rank(cpu_group)
    if (size, rank) != (manager.ep_size, manager.ep_rank):
        raise InvalidArgument.of(
            "cpu_group",
            f"rank {rank} of {size}",
            f"must hold every rank of EP group {quote_name(manager.group)} at its own rank "
            f"(this is rank {manager.ep_rank} of {manager.ep_size})",
        )


def _rebind(manager: AlltoAllManager, cpu_group: dist.ProcessGroup) -> None:
    """The manager's collectives, and a backend made by name, on ``cpu_group``."""
    count = manager._on_group.count
    manager.cpu_group = cpu_group
    manager._on_group = GroupCollectives(cpu_group, manager.group, manager._transport)
    manager._on_group.count = count
    # A built-in backend (its name one backend_for() makes: 0.7.2.post1's
    # is called "flashinfer") is made again on the new group; its build
    # exchanges handles on the group it was made with.
    if manager.backend.name in BACKENDS:
        manager.backend = backend_for(manager.backend.name, cpu_group)
        manager._held.backend = manager.backend
    manager._decisions = manager._round_decisions()


def rejoin_survivor(
    manager: AlltoAllManager, cpu_group: dist.ProcessGroup, timeout_s: float | None = None
) -> AdoptedView:
    """A survivor's side of a replacement's join (see the module): hands the
    proof over on ``cpu_group`` (the EP group re-formed with the replacement),
    rebinds the manager's collectives to it (a backend passed as an object
    must work over the new group by itself), rebuilds the all-to-all once at
    the join's plan, acknowledges the join view and waits (at most
    ``timeout_s`` s; default the propose timeout) until it is COMMITTED.

    Raises:
        InvalidArgument: ``cpu_group`` does not hold every EP rank at its own rank.
        PreconditionFailed: not the ``mask`` policy or embedded mode, nothing
            built, no view adopted or not exactly one rank outside it, the
            replacement's round 1 was refused (its message), or the sidecar's
            latest view is not its join.
        ViewFailed: the join view failed: every rank restarts.
        RoundTimedOut: the join view was not decided in time.
        RankLost: a peer died in a collective.
        BackendError: the rebuild failed (the old workspace is freed by
            then: nothing is built, and the group restarts).
        CoordinatorError: the sidecar could not be asked.
    """
    _check_mask_policy(manager, "rejoin()")
    adopted, held = manager._views.adopted, manager._held.plan
    outside = (
        [] if adopted is None else [r for r in range(manager.ep_size) if r not in adopted.members]
    )
    if held is None or adopted is None or len(outside) != 1:
        raise PreconditionFailed(
            f"rejoin() on rank {manager.ep_rank} of EP group {quote_name(manager.group)}: a "
            "replacement joins a built all-to-all whose adopted view lacks exactly one rank "
            f"(adopted: {list(adopted.members) if adopted else None}, built: {held})"
        )
    _check_group(manager, cpu_group)
    manager._settle()  # nothing unanswered: the handed round is the group's last
    _rebind(manager, cpu_group)
    newcomer, src = outside[0], _handing_rank(manager.ep_size, outside[0])
    handover = Handover(
        manager._group_proof or "", manager._owner_digest, manager._round, manager._views.rounds
    )
    _broadcast(manager, handover if manager.ep_rank == src else None, src, "the proof's handover")
    answer: JoinAnswer = _broadcast(manager, None, newcomer, "the replacement's answer")
    if answer.plan is None:
        raise PreconditionFailed(
            f"EP group {quote_name(manager.group)}: the replacement for rank {newcomer} was "
            f"refused: {answer.refusal}"
        )
    _check_join_view(manager, manager._transport.latest_view(manager.group), answer.plan, newcomer)
    plan = Plan(held.capacities, held.epoch, answer.plan.generation)
    # The old workspace goes first, not after the build as in a growth: the
    # join's plan has its layout, and FlashInfer hands back a cached
    # workspace of the same layout (mapped with the dead rank's memory, with
    # no collective) instead of mapping the replacement's. Every survivor
    # has passed the answer's broadcast, so no peer steps on it any more.
    manager._held.release()
    manager._build(plan, Action.REBUILD, manager._last_layer, manager._round)
    follower: ViewFollower = manager._views
    return follower.adopt(timeout_s, held_generation=plan.generation)


def _check_join_view(
    manager: AlltoAllManager, view: View | None, plan: Plan, newcomer: int
) -> None:
    """Raises:
    PreconditionFailed: ``view`` is not the PROPOSED join of ``newcomer`` at
    ``plan``'s generation, or ``plan`` is not the plan this rank holds."""
    held = manager._held.plan
    if (
        view is not None
        and view.state is ViewState.PROPOSED
        and view.generation == plan.generation
        and newcomer in view.members
        and held is not None
        and held.capacities == plan.capacities
    ):
        return
    raise PreconditionFailed(
        f"EP group {quote_name(manager.group)}: the replacement for rank {newcomer} was answered "
        f"{plan}, but the sidecar's latest view is {view} and rank {manager.ep_rank} holds {held}"
        ": no join to rebuild for (restart the group)"
    )


def join_as_replacement(
    manager: AlltoAllManager, need: LayerNeed, timeout_s: float | None = None
) -> AdoptedView:
    """The replacement's side of its join (see the module), its manager
    made on the re-formed CPU group (with ``local_ranks`` given, or
    ``MOE_SIDECAR_LOCAL_RANKS``: the survivors join no count of it) and
    nothing initialized yet: receives the proof, proposes round 1 with
    ``need`` (which the stored plan must serve), builds the REBUILD it is
    answered, acknowledges the join view and waits until it is COMMITTED.
    From then on the manager's rounds follow the survivors'.

    Raises:
        PreconditionFailed: not the ``mask`` policy or embedded mode, the
            manager has begun its lifetime already, the sidecar refused the
            join (e.g. the stored plan does not serve ``need``), or its
            answer was not a REBUILD.
        ViewFailed: the join view failed: every rank restarts.
        RoundTimedOut: the join view was not decided in time.
        RankLost: a peer died in a collective.
        BackendError: the build failed.
        CoordinatorError: the sidecar could not be reached.
    """
    _check_mask_policy(manager, "join_as_replacement()")
    if manager._group_proof is not None or manager._round or manager._held.plan is not None:
        raise PreconditionFailed(
            f"join_as_replacement() on rank {manager.ep_rank} of EP group "
            f"{quote_name(manager.group)}: the manager began its lifetime already (round "
            f"{manager._round}); a replacement joins with a new manager"
        )
    src = _handing_rank(manager.ep_size, manager.ep_rank)
    handover: Handover = _broadcast(manager, None, src, "the proof's handover")
    manager._group_proof, manager._owner_digest = handover.proof, handover.owner_digest
    manager._initializes += 1
    manager._last_layer = need.layer
    manager._round = 1  # a new lifetime's first round, which the sidecar answers apart
    failure: CoordinatorError | None = None
    try:
        decision = manager._propose(Requirement(capacities=need.capacities, layer=need.layer))
        if decision.action is not Action.REBUILD:
            raise InternalError(
                f"EP group {quote_name(manager.group)}: the replacement for rank "
                f"{manager.ep_rank} was answered {decision.action.value} of {decision.plan}, "
                "not the REBUILD of a join (did the group restart meanwhile?)"
            )
        answer = JoinAnswer(decision.plan)
    except CoordinatorError as error:
        failure, answer = error, JoinAnswer(None, f"{type(error).__name__}: {error}")
    _broadcast(manager, answer, manager.ep_rank, "the replacement's answer")
    if failure is not None or answer.plan is None:
        raise failure or InternalError("no answer")
    manager._held.layouts.remember(need.layout)
    manager._build(answer.plan, Action.REBUILD, need.layer, 1)
    follower: ViewFollower = manager._views
    adopted = follower.adopt(timeout_s, held_generation=answer.plan.generation)
    manager._round, manager._views.rounds = handover.round, handover.steps
    return adopted
