"""What a rank's rounds decide it executes, from the decisions it receives.

The manager (:mod:`moe_sidecar.client.manager`) runs a round: it proposes,
receives a decision (or a failure) and executes an action and plan. What it
executes is worked out here, from the decision and the plan this rank holds:

- whether a round may pass as covered, without waiting for its answer or
  the ranks' agreement (:mod:`moe_sidecar.client.covered`);
- the action and plan of a round that waits: the decision as it came where
  one decider sees the whole group, else the one the EP group agrees on
  (:mod:`moe_sidecar.client.agreement`); a REUSE of a plan this rank does
  not hold is refused;
- settling the rounds passed as covered, before a round that waits and
  before anything reads what is built: in sidecar mode their answers, read
  oldest first, built (through the manager's build) where they ask for more
  and the plan held then committed; embedded, one agreement on what is held.
  Every settling first hears of a peer's death
  (:class:`~moe_sidecar.client.peer_loss.PeerLossWatch`).

The manager owns the round's position (the lifetime, its round, the last
layer), the build and the commit; this holds no workspace.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from moe_sidecar.client.agreement import LocalOutcome
from moe_sidecar.client.covered import check_reuse, passes_as_covered, read_answers
from moe_sidecar.client.group_collectives import GroupCollectives
from moe_sidecar.client.peer_loss import PeerLossWatch
from moe_sidecar.client.transport import Transport
from moe_sidecar.core.group import Decision
from moe_sidecar.core.plan import Action, Capacities, Plan

__all__ = ["Build", "Commit", "RoundDecisions"]

Build = Callable[[Plan, Action, str, int], float]
"""Builds a plan: ``build(plan, action, layer, round)`` returns the build's seconds."""

Commit = Callable[[int, Plan, float], None]
"""Commits the plan held: ``commit(round, plan, build_seconds)``."""

_log = logging.getLogger("moe_sidecar.client.manager")
"""The manager's logger: a late build is logged where the rounds' builds are."""


class RoundDecisions:
    """What one rank's rounds execute, and what its covered rounds leave to settle.

    Args:
        group: the EP group's name on the sidecar.
        ep_rank: this rank in the EP group.
        transport: where the decisions come from; the covered rounds' answers
            wait there (sidecar mode).
        peer_loss: hears of a peer's death while this rank is blocked.
        on_group: the EP group's collectives (the agreements).
        held_plan: the plan this rank holds (None: nothing built).
        ep_size: the group's EP size (a group of one rank has no peer to lose).
        agrees_across_ranks: every round adds the cross-rank agreement (more
            ranks than one decider sees, or embedded).
        build: builds what an answer read late asks for.
        commit: commits the plan held after such a build.
    """

    def __init__(
        self,
        group: str,
        ep_rank: int,
        transport: Transport,
        peer_loss: PeerLossWatch,
        on_group: GroupCollectives,
        held_plan: Callable[[], Plan | None],
        *,
        ep_size: int,
        agrees_across_ranks: bool,
        build: Build,
        commit: Commit,
    ) -> None:
        self._group = group
        self._ep_rank = ep_rank
        self._ep_size = ep_size
        self._transport = transport
        self._peer_loss = peer_loss
        self._on_group = on_group
        self._held_plan = held_plan
        self._agrees_across_ranks = agrees_across_ranks
        self._build = build
        self._commit = commit
        self.unagreed = 0
        """Embedded: rounds passed as covered since the last agreement."""

    def passes_as_covered(self, capacities: Capacities) -> bool:
        """Whether a round of a layer at ``capacities`` may go on without its
        answer or the ranks' agreement (:func:`~moe_sidecar.client.covered.passes_as_covered`)."""
        # Embedded mode always agrees across ranks, yet passes covered rounds:
        # its next agreement checks them (see moe_sidecar.client.covered).
        mode_allows = self._transport.embedded or not self._agrees_across_ranks
        return passes_as_covered(capacities, self._held_plan(), mode_allows)

    def decide(
        self,
        layer: str,
        decision: Decision | None,
        failure: BaseException | None,
        round_number: int,
    ) -> tuple[Action, Plan]:
        """The action and plan of this round, from the decision received.

        A group one decider sees whole executes the decision as it came. A
        group agreed across deciders (nodes, or embedded ranks) executes the
        agreed one: the join of every rank's plan, with the action that asks
        most among those the deciders gave.

        Raises:
            AgreementError: the ranks are out of step, or one failed (its
                ``failure``).
            RankLost: a peer died in the all-gather.
            BackendError: a rank's failure, raised as it came.
            InternalError: a REUSE of a plan this rank does not hold.
        """
        if self._agrees_across_ranks:
            self.unagreed = 0
            action, plan = self._on_group.agree(
                LocalOutcome(
                    ep_rank=self._ep_rank,
                    layer=layer,
                    plan=decision.plan if decision is not None else None,
                    failure=failure,
                    round=round_number,
                    action=decision.action if decision is not None else Action.REUSE,
                )
            )
        else:
            assert decision is not None  # a failure is raised unless agreed across ranks
            action, plan = decision.action, decision.plan
        if action is Action.REUSE:
            self._check_reuse(round_number, layer, plan)
        return action, plan

    def settle(self, lifetime: str, last_layer: str, round_number: int, keep: int = 0) -> None:
        """Reads the answers still outstanding until at most ``keep`` remain,
        builds what they ask, and commits the plan held after a build
        (:meth:`_read_answers`). Embedded: agrees once on what is held after
        rounds passed as covered (the latest ``round_number``, of ``last_layer``).

        Raises:
            CoordinatorError: an answer is a refusal (naming the round's
                layers and ranks), the commit was refused, or the sidecar
                could not be reached.
            InternalError: a REUSE of a plan this rank does not hold.
            BackendError: a build an answer asked for failed.
            AgreementError: embedded, the ranks passed different rounds as covered.
            RankLost: (``MOE_SIDECAR_ON_PEER_LOSS=raise``) a peer of this
                lifetime (``lifetime``) died since the last call.
        """
        # Every call into the manager comes here: the watcher is armed for this
        # lifetime, and a peer's death is raised (under MOE_SIDECAR_ON_PEER_LOSS=raise).
        self._peer_loss.check(self._group, self._ep_rank, lifetime, ep_size=self._ep_size)
        # Every forward step reads moe_alltoall and every covered round comes
        # here: most of the time there is nothing to settle.
        if not self.unagreed and self._transport.unanswered <= keep:
            return
        if self._transport.embedded:
            self._agree_on_held(last_layer, round_number)
            return
        self._read_answers(keep)

    def _check_reuse(self, round_number: int, layer: str, plan: Plan) -> None:
        check_reuse(self._group, round_number, layer, plan, self._held_plan())

    def _read_answers(self, keep: int) -> None:
        """Reads the answers still outstanding until at most ``keep`` remain
        and does what they ask (:func:`~moe_sidecar.client.covered.read_answers`);
        after a build, commits the plan held against the latest round answered.

        Raises:
            CoordinatorError: an answer is a refusal (naming the round's layers
                and ranks), the commit was refused, or the sidecar could not
                be reached.
            InternalError: a REUSE of a plan this rank does not hold.
            BackendError: a build an answer asked for failed.
        """
        answered, build_seconds = read_answers(
            self._transport, keep, self._check_reuse, self._build_answered
        )
        held = self._held_plan()
        if build_seconds is not None and held is not None:
            self._commit(answered, held, build_seconds)

    def _build_answered(self, decision: Decision) -> float:
        """Builds what an answer read late asks for; returns the build's seconds."""
        _log.info(
            "group %s round %d (%s): %s asked for after this rank passed the round as "
            "covered (the sidecar's plan is above what was built)",
            self._group,
            decision.round,
            decision.layer,
            decision.action.value,
        )
        return self._build(decision.plan, decision.action, decision.layer, decision.round)

    def _agree_on_held(self, last_layer: str, round_number: int) -> None:
        """Embedded: one agreement on what is held, after rounds passed as
        covered (:meth:`GroupCollectives.agree_on_held`).

        Raises:
            AgreementError: the ranks passed different rounds as covered.
            RankLost: a peer died in the all-gather.
            InternalError: the ranks hold different plans.
        """
        self.unagreed = 0
        self._on_group.agree_on_held(self._ep_rank, last_layer, self._held_plan(), round_number)
