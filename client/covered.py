"""Covered rounds: the rounds a rank passes without waiting for their answer.

A round whose layer the built plan already covers (a *covered round*) of a
node-local group in sidecar mode does not wait: every rank of a round must
state the same layer, so its decision can only be REUSE. The rank sends its
proposal on its session (so the sidecar still keeps the history, sees the
rank alive and checks that the ranks agree) and returns; the answers are
read in the order sent, later (``WorkspaceManager._settle``):

* before a round that waits (one that needs more than was built, or round 1
  of a lifetime), before ``get_communication()``, ``moe_alltoall``,
  ``combine_into()``, the checkpoints and ``cleanup()``, every earlier answer
  is read; and at most ``max_unanswered`` are ever outstanding (a covered
  round past it reads the oldest first), so the answers never outgrow the
  stream's flow-control window;
* a refusal (another layer name or shape on another rank) is raised there,
  on every rank, with the sidecar's message naming the round, layers and ranks;
* an answer that is not REUSE (the sidecar's plan is above what was built:
  merged from another node, or another rank of that round needed more)
  is executed there: every rank of that round got the same decision, the
  ranks that waited in it build at once, the ranks that passed it as
  covered join that build when they read the answer, so the build's
  collectives and the barrier meet and no rank builds alone. Such a rank
  then reads every answer still outstanding and commits what it holds
  against the latest round answered (the sidecar's latest closed round, so
  still retained, and decided at the plan just built).

So a covered round costs a rank one message put on its stream, no wait and
no collective.

Embedded mode passes covered rounds too, as far as its agreement allows: a
covered round asks the rank's own core (which keeps its history) and, when
that answers REUSE, skips the all-gather. The ranks' next agreement (the
next round that waits, or ``get_communication()`` / ``moe_alltoall`` /
``combine_into()`` / the checkpoints, which agree once on what is held)
carries each rank's round: ranks that passed different rounds as covered
are out of step (they stated different layers or sizes in a round), and
every rank raises, naming each rank's round and layer. ``cleanup()`` stays
local in embedded mode and agrees on nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from moe_sidecar.client.errors import InternalError
from moe_sidecar.client.transport import Transport
from moe_sidecar.core.group import Decision
from moe_sidecar.core.plan import Action, Capacities, Plan

__all__ = ["check_reuse", "passes_as_covered", "read_answers"]


def passes_as_covered(capacities: Capacities, built: Plan | None, mode_allows: bool) -> bool:
    """Whether a round of a layer at ``capacities`` may go on without its
    answer or the ranks' agreement: the plan ``built`` covers the layer and
    ``mode_allows`` it, which holds in two cases. In sidecar mode, when one
    decider sees the whole group: its decision can then only be REUSE, or a
    build every rank of the round joins later. In embedded mode, always: the
    rank's own core decides, and the ranks' next agreement finds any rank
    that passed another round as covered."""
    return mode_allows and built is not None and built.covers(capacities)


def check_reuse(group: str, round_number: int, layer: str, plan: Plan, held: Plan | None) -> None:
    """Refuses a REUSE of ``plan`` (decided in round ``round_number`` for
    ``layer``) when this rank does not hold it.

    Raises:
        InternalError: ``held`` does not cover ``plan``.
    """
    if held is None or not held.covers(plan.capacities):
        raise InternalError(
            f"group {group!r} round {round_number} (layer {layer!r}): the sidecar "
            f"answered REUSE of {plan} but this rank holds {held}; was the "
            "sidecar's state replaced while this process ran? Restart the ranks"
        )


def read_answers(
    transport: Transport,
    keep: int,
    check: Callable[[int, str, Plan], None],
    build: Callable[[Decision], float],
) -> tuple[int, float | None]:
    """Reads the answers still outstanding on ``transport``, oldest first,
    until at most ``keep`` remain, and does what they ask; returns the latest
    round answered and the seconds of the last build (None: no build).

    A REUSE needs nothing but ``check(round, layer, plan)``, that this rank
    holds its plan. A refusal is raised. A BUILD/REBUILD (the sidecar's plan
    rose above what was built while this rank passed the round as covered)
    is built here by ``build(decision)``: every rank of that round got the
    same decision and builds it, at once or when it reads it, so the build's
    collectives meet. Then every answer still outstanding is read (more
    builds if they ask for them), so the caller commits the plan held against
    the latest round answered: every message sent before the commit has been
    answered, so that round is the sidecar's latest closed one (still
    retained), decided at the plan held.

    Raises:
        CoordinatorError: an answer is a refusal (naming the round's layers
            and ranks), or the sidecar could not be reached.
        InternalError: ``check`` refused a REUSE.
        BackendError: a build an answer asked for failed.
    """
    build_seconds: float | None = None
    answered = 0
    while transport.unanswered > (0 if build_seconds is not None else keep):
        decision = transport.next_answer()
        answered = decision.round
        if decision.action is Action.REUSE:
            check(decision.round, decision.layer, decision.plan)
            continue
        build_seconds = build(decision)
    return answered, build_seconds
