"""A lifetime's first round, where the sidecar sees it: the group's proof
shared while the rank's arrival waits at its sidecar.

Before its first proposal a rank holds no proof: its EP group's ranks share
one over their CPU group first (:class:`~moe_sidecar.client.agreement.SecretShare`),
and a rank late there keeps its peers waiting. Where nobody stated how many
ranks of the group run on each node (``local_ranks``,
``MOE_SIDECAR_LOCAL_RANKS``), the ranks count them in the same exchange: no
collective runs before it, so nothing before a rank's first proposal waits
on gloo alone. Each rank first sends an arrival to its sidecar (``Arrive``:
group, layout, rank, lifetime, no proof; ``local_ranks``
:data:`~moe_sidecar.core.policy.arrivals.UNCOUNTED` when it is still to be
counted), then starts the exchange, and waits for whichever ends first:

- the exchange: the proof is shared; the rank proposes, which answers its
  arrival at the sidecar;
- the arrival, refused: the sidecar's ``--round-timeout`` passed, and the
  rank raises its :class:`~moe_sidecar.client.errors.RoundTimedOut`, which
  names the ranks that did not arrive (and their last layers, if any). The
  exchange is left in flight: the rank is ending, as after any round that
  timed out;
- the arrival, failed otherwise (a sidecar older than ``Arrive``, the
  client's own deadline): the exchange alone ends the wait, as before.

The exchange fails when a peer's process is gone. A peer that arrived and
then died is named at once (its arrival's call ended: the sidecar shows it
gone). A peer that exited before it arrived is known to nobody but the
arrivals that came: the rank waits for its own arrival's answer, at most
the round timeout from when it arrived, and raises
:class:`~moe_sidecar.client.errors.RankLost` with the sidecar's words,
which name the ranks that never arrived.

Meanwhile ``moe-sidecar groups`` and ``moe_sidecar_waiting_ranks`` show the
arrived ranks. An arrival carries no proof and the sidecar lets it change
nothing but what it shows and its own caller's wait
(:mod:`moe_sidecar.core.policy.arrivals`), so the proof is as strong as it
was. Embedded, no proof is shared (nothing to wait for); a group of one
rank draws its proof alone.

The same broadcast carries rank 0's owner key
(:mod:`moe_sidecar.client.owner_key`), so every rank sends the group's
owner digest: no collective more.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import grpc

from moe_sidecar.client.agreement import GroupSecrets, SecretShare
from moe_sidecar.client.errors import RankLost, RoundTimedOut, error_from_rpc
from moe_sidecar.client.group_collectives import GroupCollectives
from moe_sidecar.client.owner_key import owner_digest, owner_key_or_none
from moe_sidecar.client.session import LOCAL_DEADLINE_DETAILS
from moe_sidecar.client.transport import Transport
from moe_sidecar.core.errors import quote_name
from moe_sidecar.core.policy.arrivals import UNCOUNTED, Arrival
from moe_workspace.v1.coordinator_pb2 import ArriveResponse

__all__ = ["FirstRound", "share_proof_in_view"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FirstRound:
    """What a rank holds after its lifetime's first exchange."""

    proof: str
    """The lifetime's group proof, as hex digits."""
    owner_digest: str
    """The group's owner digest (of rank 0's owner key; empty without one)."""
    local_ranks: int
    """Ranks of the group on this node: as the arrival stated it, or counted
    in the exchange."""


def _wait_for_either(share: SecretShare, call: grpc.Future[ArriveResponse]) -> None:
    """Returns once the exchange or the arrival call ended."""
    ended = threading.Event()
    share.on_done(ended.set)
    call.add_done_callback(lambda _: ended.set())
    # Both end on their own: the exchange within gloo's timeout, the call
    # within its deadline.
    ended.wait()


def _refusal(call: grpc.Future[ArriveResponse], target: str) -> RoundTimedOut | None:
    """The sidecar's timeout of the arrival (None: the call ended otherwise)."""
    failure = call.exception()
    if failure is None or not isinstance(failure, grpc.RpcError):
        return None
    error = error_from_rpc(failure, method="Arrive", target=target)
    local_deadline = getattr(failure, "details", lambda: "")() == LOCAL_DEADLINE_DETAILS
    if isinstance(error, RoundTimedOut) and not local_deadline:
        return error
    _log.debug("the arrival at the sidecar ended without a timeout: %s", error)
    return None


def _exited_before_arriving(lost: RankLost, refused: RoundTimedOut, arrival: Arrival) -> RankLost:
    """The exchange failed (``lost``), the sidecar saw no rank leave, and
    this rank's arrival was refused at the round timeout (``refused``, which
    names the ranks that never arrived): a peer exited before it arrived, or
    after its own arrival timed out."""
    return RankLost(
        f"EP group {quote_name(arrival.group)}: sharing the group's proof failed on rank "
        f"{arrival.ep_rank}, a peer's connection closed (gloo: {lost.__cause__ or lost}), and "
        "the sidecar saw no rank leave: a rank named below exited before its first "
        "initialize() reached the sidecar (or after its own first round timed out); the "
        f"sidecar, at its round timeout: {refused}; restart every rank"
    )


def share_proof_in_view(
    collectives: GroupCollectives, transport: Transport, arrival: Arrival, target: str = ""
) -> FirstRound:
    """The group's proof for this lifetime, its owner digest (of rank 0's
    owner key; empty without one) and this node's ranks, shared (and, where
    ``arrival.local_ranks`` is :data:`~moe_sidecar.core.policy.arrivals.UNCOUNTED`,
    counted) while ``arrival`` (its lifetime the rank's token) waits at the
    sidecar.

    Raises:
        RoundTimedOut: the sidecar's round timeout passed before every rank
            of the group came, naming the ranks that did not.
        RankLost: a peer died in the exchange (the arrival is cancelled, so
            the sidecar shows this rank gone to the peers still waiting),
            named as the sidecar saw it leave, or as never arrived.
    """
    key = owner_key_or_none(arrival.group, os.environ) if arrival.ep_rank == 0 else None
    count = arrival.local_ranks == UNCOUNTED
    call = transport.arrive(arrival)
    if call is None:
        return _first_round(collectives.share_secret(owner_key=key, count_hosts=count), arrival)

    def wait(share: SecretShare) -> None:
        _wait_for_either(share, call)
        if share.done() or not call.done():
            return  # the exchange ended: its result says how
        refused = _refusal(call, target)
        if refused is not None:
            raise refused from call.exception()

    try:
        shared = collectives.share_secret(wait, key, count_hosts=count)
    except RankLost as lost:
        refused = None
        if not lost.ranks:
            # Nobody seen leaving: a peer that never arrived is named by this
            # rank's own arrival, answered within the round timeout.
            call.exception()
            refused = _refusal(call, target)
        call.cancel()
        if refused is None:
            raise
        raise _exited_before_arriving(lost, refused, arrival) from refused
    except BaseException:
        call.cancel()
        raise
    return _first_round(shared, arrival)


def _first_round(shared: GroupSecrets, arrival: Arrival) -> FirstRound:
    return FirstRound(
        proof=shared.proof,
        owner_digest=owner_digest(shared.owner_key, arrival.group),
        local_ranks=shared.local_ranks or arrival.local_ranks,
    )
