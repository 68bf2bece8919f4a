"""What a step of the decision core asks its executor to do, as data.

Every function of :mod:`moe_sidecar.core.policy` returns a :class:`Step`: the
group's new state, the reply for the caller, and the effects to carry out in
order. The sidecar's state holder (:class:`moe_sidecar.state.Coordinator`)
executes them and never compares states to find out what happened:

* :class:`Persist`: write the new state before anything else of the step
  happens; if the write fails, nothing of the step happens.
* :class:`RecordReuse`: the same promise for a round decided REUSE, whose
  whole change a restart re-derives from the stored row and one short
  record (the round and its layer): that record is written first instead.
* :class:`Answer`: wake every call waiting for a round with its outcome.
* :class:`Dismiss`: answer the one call of a proposal another took the slot of.
* :class:`Publish`: a :class:`GroupEvent` for Watch streams, logs and metrics.
* :class:`Deadline`: arm (or, with ``None``, cancel) the group's round timer.
* :class:`Replicate`: the group's replicated part (epoch, plan, generation,
  history) changed here; hand it to the cluster store (a no-op with SQLite
  alone). The executor records it as pending with the step's :class:`Persist`,
  so what a store missed is pushed when it returns.

A step without :class:`Persist` or :class:`RecordReuse` answers nobody
(a proposal joining its round: the rank's retry re-sends it); its state
rides along with the group's next write. So every answer a rank has
received is one a restarted sidecar gives again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TypeAlias

from moe_sidecar.core.group import Decision, GroupState, Outcome, Refusal
from moe_sidecar.core.membership import View
from moe_sidecar.core.plan import Action, Plan

__all__ = [
    "Answer",
    "Deadline",
    "Dismiss",
    "Effect",
    "EventKind",
    "GroupEvent",
    "Persist",
    "Publish",
    "RecordReuse",
    "Replicate",
    "Reply",
    "Step",
    "Wait",
]


class EventKind(enum.Enum):
    """What happened to a group (the wire's ``EventKind``)."""

    ROUND_DECIDED = "round_decided"
    ROUND_REFUSED = "round_refused"
    RANK_TIMEOUT = "rank_timeout"
    COMMIT = "commit"
    RESET = "reset"
    LIFETIME_STARTED = "lifetime_started"
    ROUND_ABORTED = "round_aborted"
    GROUP_REMOVED = "group_removed"
    RANK_LEFT = "rank_left"
    PLAN_MERGED = "plan_merged"
    """A plan decided on another node (through the cluster store) was merged in."""
    PROOF_REFUSED = "proof_refused"
    """A proposal or commit was refused: its group proof does not match."""
    VIEW_CHANGED = "view_changed"
    """A new membership view was decided (or the current one committed or failed)."""


@dataclass(frozen=True)
class GroupEvent:
    """One event of a group: what Watch streams deliver, logs print and metrics count."""

    group: str
    kind: EventKind
    at: float
    round: int = 0
    action: Action | None = None
    plan: Plan | None = None
    ep_rank: int = -1
    """The rank concerned, or -1 when the event concerns the group."""
    layer: str = ""
    message: str = ""
    missing_ranks: tuple[int, ...] = ()
    ranks: tuple[int, ...] = ()
    """The ranks of a closed round."""
    grew: bool = False
    """A decided round grew the plan."""
    latency: float | None = None
    """Seconds from a round's first proposal to its close (closed rounds only)."""
    node: str = ""
    """The node the event's plan came from (merged plans only)."""
    lost: bool = False
    """RANK_LEFT: the rank's session broke (a death), not closed cleanly."""
    survivors: tuple[str, ...] = ()
    """RANK_LEFT: short lifetime ids of the running lifetime's ranks still present."""
    view: View | None = None
    """VIEW_CHANGED: the view decided."""


@dataclass(frozen=True)
class Persist:
    """Write the step's state before carrying out anything else of it."""


@dataclass(frozen=True)
class RecordReuse:
    """Before anything else of the step: record that round ``round`` of
    lifetime ``lifetime_index`` closed REUSE at ``layer`` (the stored plan,
    nothing else changed; :func:`moe_sidecar.core.policy.recovery.replay_reuse`
    applies the record to the stored row)."""

    lifetime_index: int
    round: int
    layer: str


@dataclass(frozen=True)
class Answer:
    """Wake every call waiting for round ``round`` of lifetime ``lifetime_index``."""

    lifetime_index: int
    round: int
    outcome: Outcome


@dataclass(frozen=True)
class Dismiss:
    """Answer only the call of lifetime ``lifetime`` waiting for round ``round``
    of lifetime ``lifetime_index`` (its proposal lost its slot) with ``outcome``."""

    lifetime_index: int
    round: int
    lifetime: str
    outcome: Refusal


@dataclass(frozen=True)
class Publish:
    """Deliver ``event`` to Watch streams, logs and metrics."""

    event: GroupEvent


@dataclass(frozen=True)
class Deadline:
    """Arm the group's round timer for ``at`` (the clock's seconds), or cancel it."""

    at: float | None


@dataclass(frozen=True)
class Replicate:
    """Hand the group's epoch, plan, generation and history to the cluster store."""


Effect: TypeAlias = Persist | RecordReuse | Answer | Dismiss | Publish | Deadline | Replicate


@dataclass(frozen=True)
class Wait:
    """The caller joined an open round: wait for its :class:`Answer`."""

    lifetime_index: int
    round: int
    deadline: float


Reply: TypeAlias = Wait | Decision | Refusal | None
"""What the caller of a step gets: wait, an outcome, or nothing (commit, reset)."""


@dataclass(frozen=True)
class Step:
    """One step of the core: the new state, the caller's reply, the effects in order."""

    state: GroupState
    reply: Reply = None
    effects: tuple[Effect, ...] = ()

    @property
    def persists(self) -> bool:
        """Whether the state must be written before the effects are carried out."""
        return any(isinstance(e, Persist) for e in self.effects)

    @property
    def reuse_record(self) -> RecordReuse | None:
        """The REUSE round to record before the effects are carried out, if any."""
        return next((e for e in self.effects if isinstance(e, RecordReuse)), None)

    @property
    def replicates(self) -> bool:
        """Whether the group's replicated part must reach the cluster store."""
        return any(isinstance(e, Replicate) for e in self.effects)
