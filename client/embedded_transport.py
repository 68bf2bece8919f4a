"""The decision core in this process: the transport of a rank without a sidecar.

:class:`EmbeddedTransport` drives :mod:`moe_sidecar.core.policy` in-process
with one local rank per group; the manager then agrees across the EP group
itself. :mod:`moe_sidecar.client.transport` re-exports it and picks it when no
sidecar is named.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from moe_sidecar import flashinfer
from moe_sidecar.client.errors import InternalError, PreconditionFailed
from moe_sidecar.core import limits, policy
from moe_sidecar.core.defaults import ENV_TARGET
from moe_sidecar.core.effects import Wait
from moe_sidecar.core.group import (
    CommitRecord,
    Decision,
    GroupState,
    Proposal,
    RankSummary,
    Refusal,
)
from moe_sidecar.core.identity import lifetime_id, owner_id, proof_id
from moe_sidecar.core.membership import View
from moe_sidecar.core.policy.arrivals import Arrival

__all__ = ["EmbeddedTransport"]

_DECIDES_IN_THE_AGREEMENT = (
    "{method}() on the embedded transport: embedded mode decides every round at once "
    "and checks covered rounds in the ranks' agreement, so nothing is left unanswered"
)

_CEILING = limits.WorkspaceCeiling(limits.DEFAULT_MAX_WORKSPACE_BYTES, flashinfer.workspace_size)
"""Embedded mode's ceiling: the sidecar's default, in each group's release."""


class EmbeddedTransport:
    """The decision core in this process, one group state per group name.

    Each rank decides alone (its proposals say ``local_ranks=1``), exactly as
    a sidecar would for a group with one rank on the node; the manager's
    agreement step then makes the EP group's ranks agree.

    Args:
        round_timeout: passed to the core; a round with one local rank closes
            at once, so it never expires.
        clock: seconds on a monotonic clock (the core takes time as an argument).
    """

    def __init__(
        self, *, round_timeout: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.round_timeout = round_timeout
        self._clock = clock
        self._groups: dict[str, GroupState] = {}

    @property
    def rpc_count(self) -> int:
        return 0

    @property
    def unanswered(self) -> int:
        """Always 0: embedded mode leaves no proposal unanswered."""
        return 0

    def propose_later(self, proposal: Proposal) -> None:
        """Never called: embedded mode proposes with :meth:`propose` and
        checks covered rounds in the ranks' agreement, not through answers
        read later.

        Raises:
            InternalError: always.
        """
        raise InternalError(_DECIDES_IN_THE_AGREEMENT.format(method="propose_later"))

    def next_answer(self) -> Decision:
        """Never called: nothing is ever unanswered (see :meth:`propose_later`).

        Raises:
            InternalError: always.
        """
        raise InternalError(_DECIDES_IN_THE_AGREEMENT.format(method="next_answer"))

    @property
    def embedded(self) -> bool:
        return True

    def group_state(self, group: str) -> GroupState | None:
        """What the in-process core knows of ``group`` (for inspection)."""
        return self._groups.get(group)

    def propose(self, proposal: Proposal) -> Decision:
        """See :meth:`Transport.propose`.

        Raises:
            InvalidArgument: a malformed proposal.
            PreconditionFailed: another top_k/num_experts than the plan, a
                round out of sequence.
            InternalError: the core left the round open although this rank is
                its only local rank (``local_ranks`` must be 1 here).
        """
        proposal = _past_boundary(proposal)
        step = policy.propose(
            self._groups.get(proposal.group),
            proposal,
            self._clock(),
            self.round_timeout,
            ceiling=_CEILING,
        )
        # In-process there is nobody to answer, persist to or notify: the
        # step's state and reply are all that matter.
        self._groups[proposal.group] = step.state
        reply = step.reply
        if isinstance(reply, Wait) or reply is None:
            raise InternalError(
                f"embedded round {proposal.round} of group {proposal.group!r} waits for other "
                f"local ranks (local_ranks={proposal.local_ranks}); embedded mode decides "
                "each rank alone and needs local_ranks=1"
            )
        if isinstance(reply, Refusal):
            raise reply.error()
        return reply

    def commit(self, group: str, record: CommitRecord) -> None:
        """See :meth:`Transport.commit`.

        Raises:
            PreconditionFailed: the rank or round is unknown to the core.
            PermissionDenied: the commit's group proof is not the lifetime's.
            InvalidArgument: a malformed field.
            InternalError: ``group`` never proposed here.
        """
        state = self._groups.get(group)
        if state is None:
            raise InternalError(f"embedded commit for group {group!r}, which never proposed")
        record = replace(
            record, lifetime=lifetime_id(record.lifetime), proof=proof_id(record.proof)
        )
        step = policy.commit(state, record, self._clock(), ceiling=_CEILING)
        self._groups[group] = step.state
        if isinstance(step.reply, Refusal):
            raise step.reply.error()

    def arrive(self, arrival: Arrival) -> None:
        """Nothing to tell: embedded, no proof is shared before a proposal."""
        return None

    def gone_ranks(self, group: str) -> list[RankSummary]:
        """Always empty: in-process, no rank's departure is seen."""
        return []

    def latest_view(self, group: str) -> View | None:
        """Refused: see :meth:`acknowledge_view`.

        Raises:
            PreconditionFailed: always.
        """
        raise _masks_need_a_sidecar(group)

    def acknowledge_view(self, group: str, view: int, rounds: int) -> View:
        """Refused: embedded mode has no sidecar to decide membership views
        (no rank sees another's death), so no view is adopted and no rank is
        masked here.

        Raises:
            PreconditionFailed: always, saying that masks need sidecar mode.
        """
        raise _masks_need_a_sidecar(group)

    def await_view(self, group: str, view: int, timeout: float) -> View:
        """Refused: see :meth:`acknowledge_view`.

        Raises:
            PreconditionFailed: always.
        """
        raise _masks_need_a_sidecar(group)

    def close(self) -> None:
        """Nothing to release: the core's group states are kept, as a sidecar
        keeps them across a rank's sessions."""


def _masks_need_a_sidecar(group: str) -> PreconditionFailed:
    return PreconditionFailed(
        f"EP group {group!r}: membership views and rank masks need sidecar mode "
        f"({ENV_TARGET} set): embedded mode has no sidecar to decide a view"
    )


def _past_boundary(proposal: Proposal) -> Proposal:
    """The in-process boundary: the core sees the lifetime's and the group
    proof's ids, never their tokens (and the owner digest's id)."""
    return replace(
        proposal,
        lifetime=lifetime_id(proposal.lifetime),
        proof=proof_id(proposal.proof),
        owner=owner_id(proposal.owner),
    )
