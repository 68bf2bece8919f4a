"""A lifetime's first round, where the sidecar sees it: the group's proof
shared while the rank's arrival waits at its sidecar.

Before its first proposal a rank holds no proof: its EP group's ranks share
one over their CPU group first (:class:`~moe_sidecar.client.agreement.SecretShare`),
and a rank late there keeps its peers waiting. So each rank first sends an
arrival to its sidecar (``Arrive``: group, layout, rank, lifetime, no proof),
then starts the broadcast, and waits for whichever ends first:

- the broadcast: the proof is shared; the rank proposes, which answers its
  arrival at the sidecar;
- the arrival, refused: the sidecar's ``--round-timeout`` passed, and the
  rank raises its :class:`~moe_sidecar.client.errors.RoundTimedOut`, which
  names the ranks that did not arrive (and their last layers, if any). The
  broadcast is left in flight: the rank is ending, as after any round that
  timed out;
- the arrival, failed otherwise (a sidecar older than ``Arrive``, the
  client's own deadline): the broadcast alone ends the wait, as before.

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

import grpc

from moe_sidecar.client.agreement import SecretShare
from moe_sidecar.client.errors import RoundTimedOut, error_from_rpc
from moe_sidecar.client.group_collectives import GroupCollectives
from moe_sidecar.client.owner_key import owner_digest, owner_key_or_none
from moe_sidecar.client.session import LOCAL_DEADLINE_DETAILS
from moe_sidecar.client.transport import Transport
from moe_sidecar.core.policy.arrivals import Arrival
from moe_workspace.v1.coordinator_pb2 import ArriveResponse

__all__ = ["share_proof_in_view"]

_log = logging.getLogger(__name__)


def _wait_for_either(share: SecretShare, call: grpc.Future[ArriveResponse]) -> None:
    """Returns once the broadcast or the arrival call ended."""
    ended = threading.Event()
    share.on_done(ended.set)
    call.add_done_callback(lambda _: ended.set())
    # Both end on their own: the broadcast within gloo's timeout, the call
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


def share_proof_in_view(
    collectives: GroupCollectives, transport: Transport, arrival: Arrival, target: str = ""
) -> tuple[str, str]:
    """The group's proof for this lifetime and its owner digest (of rank
    0's owner key; empty without one), shared while ``arrival`` (its
    lifetime the rank's token) waits at the sidecar.

    Raises:
        RoundTimedOut: the sidecar's round timeout passed before every rank
            of the group came, naming the ranks that did not.
        RankLost: a peer died in the broadcast (the arrival is cancelled, so
            the sidecar shows this rank gone to the peers still waiting).
    """
    key = owner_key_or_none(arrival.group, os.environ) if arrival.ep_rank == 0 else None
    call = transport.arrive(arrival)
    if call is None:
        shared = collectives.share_secret(owner_key=key)
        return shared.proof, owner_digest(shared.owner_key, arrival.group)

    def wait(share: SecretShare) -> None:
        _wait_for_either(share, call)
        if share.done() or not call.done():
            return  # the proof is shared: the broadcast's result says how
        refused = _refusal(call, target)
        if refused is not None:
            raise refused from call.exception()

    try:
        shared = collectives.share_secret(wait, key)
    except BaseException:
        call.cancel()
        raise
    return shared.proof, owner_digest(shared.owner_key, arrival.group)
