"""Every collective a manager issues on its EP group's CPU group, counted, with
a peer's death in one turned into :class:`~moe_sidecar.client.errors.RankLost`.

The backend's own build collectives are not here (nor counted).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from moe_sidecar.client.agreement import (
    GroupSecrets,
    LocalOutcome,
    SecretShare,
    agree_round,
    share_group_secret,
)
from moe_sidecar.client.backends import AlltoAll, AlltoAllBackend
from moe_sidecar.client.construction import stated_local_ranks
from moe_sidecar.client.errors import BackendError, InternalError, RankLost
from moe_sidecar.client.lost_rank import rank_lost
from moe_sidecar.client.transport import Transport
from moe_sidecar.core.plan import Action, Plan
from moe_sidecar.core.policy.arrivals import UNCOUNTED

__all__ = ["GroupCollectives"]


class GroupCollectives:
    """The manager's collectives on ``cpu_group``; ``count`` says how many it issued.

    Args:
        cpu_group: the EP group's CPU (gloo) process group.
        group: the EP group's name (in the agreement's errors).
        transport: the manager's transport, asked who left when a collective
            failed because a peer died.
    """

    def __init__(self, cpu_group: dist.ProcessGroup, group: str, transport: Transport) -> None:
        self._cpu_group = cpu_group
        self._group = group
        self._transport = transport
        self._ep_size = dist.get_world_size(cpu_group)
        self._ep_rank = dist.get_rank(cpu_group)
        self.count = 0

    def _lost(self, where: str, error: RuntimeError) -> RankLost:
        """The typed error of the collective ``where`` that failed with ``error``
        (:func:`~moe_sidecar.client.lost_rank.rank_lost`)."""
        return rank_lost(self._transport, self._group, self._ep_rank, where, error)

    def local_ranks(self, explicit: int | None) -> int:
        """How many ranks of the EP group run on this node, as stated
        (:func:`~moe_sidecar.client.construction.stated_local_ranks`); a group
        of one rank has one; :data:`~moe_sidecar.core.policy.arrivals.UNCOUNTED` when the ranks count it at
        their lifetime's first exchange (:meth:`share_secret`). No collective.

        Raises:
            InvalidArgument: a bad ``MOE_SIDECAR_LOCAL_RANKS`` or count.
        """
        stated = stated_local_ranks(explicit, self._ep_size)
        if stated is not None:
            return stated
        return 1 if self._ep_size == 1 else UNCOUNTED

    def share_secret(
        self,
        wait_for: Callable[[SecretShare], None] | None = None,
        owner_key: bytes | None = None,
        *,
        count_hosts: bool = False,
    ) -> GroupSecrets:
        """The group's proof for a lifetime, drawn by rank 0 and shared with
        rank 0's ``owner_key``, and with ``count_hosts`` this node's ranks
        counted (:func:`~moe_sidecar.client.agreement.share_group_secret`).

        Raises:
            RankLost: a peer died in the exchange.
            CoordinatorError: raised by ``wait_for``.
        """
        self.count += 2 if count_hosts else 1
        try:
            return share_group_secret(self._cpu_group, wait_for, owner_key, count_hosts=count_hosts)
        except RuntimeError as error:
            raise self._lost("sharing the group's proof", error) from error

    def agree(self, outcome: LocalOutcome) -> tuple[Action, Plan]:
        """The round's agreed action and plan
        (:func:`~moe_sidecar.client.agreement.agree_round`).

        Raises:
            RankLost: a peer died in the all-gather.
            AgreementError: the ranks are out of step or one failed.
            BackendError: raised as it came.
        """
        self.count += 1
        try:
            return agree_round(self._cpu_group, outcome, group_name=self._group)
        except RuntimeError as error:
            if isinstance(error, BackendError):
                raise
            raise self._lost("the agreement", error) from error
        except BaseException:
            self.count += 1  # the all_gather_object naming who failed
            raise

    def agree_on_held(self, ep_rank: int, layer: str, held: Plan | None, round_number: int) -> None:
        """Embedded: one agreement on what is held (``held``, after round
        ``round_number`` of ``layer``), after rounds passed as covered; it
        finds ranks out of step (see :mod:`moe_sidecar.client.agreement`).

        Raises:
            AgreementError: the ranks passed different rounds as covered.
            RankLost: a peer died in the all-gather.
            InternalError: the ranks hold different plans.
        """
        _, agreed = self.agree(
            LocalOutcome(ep_rank=ep_rank, layer=layer, plan=held, round=round_number, settling=True)
        )
        if held is None or not held.covers(agreed.capacities):
            raise InternalError(
                f"EP group {self._group!r} after round {round_number}: this rank holds {held} "
                f"but the ranks' plans join to {agreed}; restart the ranks"
            )

    def barrier_after_build(self, backend: AlltoAllBackend, handle: AlltoAll) -> None:
        """Waits until every rank holds its new workspace ``handle`` (built by
        ``backend``); a rank frees the old one only after, as peers may still
        read it. The EP group only; never the world.

        Raises:
            RankLost: a peer died in the barrier (``handle`` is released first).
        """
        self.count += 1
        try:
            dist.barrier(group=self._cpu_group)
        except RuntimeError as error:
            backend.release(handle)
            raise self._lost("the post-build barrier", error) from error
