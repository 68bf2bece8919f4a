"""A group's lifetimes across restarts of its ranks, against a real sidecar
(a server on real sockets).

A first start fails when round 1 of the group's first lifetime is refused:
a rank missing or late past ``--round-timeout``, or a stranger's proposal
holding a slot until then. Nothing ran, so there is no running lifetime for
a restart to wait for: when every local rank starts again with a new
lifetime, round 1 of the new lifetime is decided, whichever rank comes
first (the rank that was missing included).

A rank of a lifetime that ended (the group restarted without it) is told
so: ``ABORTED``, "belongs to lifetime ..., which ended".
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from moe_sidecar.server import running_server
from moe_workspace.v1 import coordinator_pb2 as pb
from tests.integration.helpers import (
    NVFP4,
    coordinator_stub,
    details,
    make_config,
    propose_request,
    rpc_error,
)

pytestmark = pytest.mark.timeout(60)

GROUP = "failed-start/ep4"
RANKS = 4
TIMEOUT = 1.0
"""The round timeout: short, so the first start fails quickly."""


def _proposal(rank: int, lifetime: str, proof: str = "ranks-proof-of-the-start-1") -> Any:
    request = propose_request(
        rank, 1, NVFP4, group=GROUP, ep_size=RANKS, local_ranks=RANKS, lifetime=lifetime
    )
    request.group_proof = proof
    return request


async def _held(stub: Any, proposals: int) -> None:
    """Returns once the sidecar holds ``proposals`` waiting proposals of the
    group (its open round's and its pending restart's, of any proof).

    Concurrent calls are separate streams, each served by its own task: the
    order they are sent in is not the order the sidecar takes them in, so a
    test that needs an order waits for each call to be held."""
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        try:
            group = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
            if group.waiting_ranks + group.restarting_ranks >= proposals:
                return
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:
                raise
        assert asyncio.get_running_loop().time() < deadline, f"{proposals} proposal(s) never held"
        await asyncio.sleep(0.005)


async def _start(
    stub: Any, ranks: list[int], lifetime: str, proof: str, *, held: int = 0
) -> list[Any]:
    """``ranks`` propose round 1 one after another (a rank's call starts
    once the sidecar holds the one before), each with its own lifetime;
    ``held``: the group's proposals the sidecar already holds."""
    calls = []
    for n, rank in enumerate(ranks):
        if n:
            await _held(stub, held + n)
        calls.append(
            asyncio.ensure_future(
                stub.Propose(_proposal(rank, f"{lifetime}-{rank}", proof), timeout=20)
            )
        )
    return list(await asyncio.gather(*calls, return_exceptions=True))


@pytest.mark.parametrize("first", [0, 3], ids=["arrived-rank-first", "missing-rank-first"])
async def test_a_group_whose_first_start_timed_out_starts_again(tmp_path: Path, first: int) -> None:
    """Rank 3 is missing from the first start (round 1 times out for ranks
    0-2); then all four start again with new lifetimes, rank ``first``
    first: round 1 of the new lifetime is decided (BUILD) for all four."""
    async with (
        running_server(make_config(tmp_path, round_timeout=TIMEOUT)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        failed = await _start(stub, [0, 1, 2], "first", "ranks-proof-of-the-start-1")
        for outcome in failed:
            assert isinstance(outcome, grpc.aio.AioRpcError), outcome
            assert outcome.code() == grpc.StatusCode.DEADLINE_EXCEEDED, details(outcome)

        order = [first, *(r for r in range(RANKS) if r != first)]
        answers = await _start(stub, order, "second", "ranks-proof-of-the-start-2")
        for answer in answers:
            assert isinstance(answer, pb.ProposeResponse), details(answer)
        assert {a.action for a in answers} == {pb.ACTION_BUILD}
        group = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
        assert len(group.ranks) == RANKS and all(r.current for r in group.ranks)


async def test_a_start_held_by_a_stranger_until_it_timed_out_starts_again(
    tmp_path: Path,
) -> None:
    """A stranger proposes round 1 for rank 3 before it starts, and rank 3
    does not start in time: round 1 times out. Then the real ranks all start
    again: their round 1 is decided from their own proposals."""
    async with (
        running_server(make_config(tmp_path, round_timeout=TIMEOUT)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        stranger = asyncio.ensure_future(
            stub.Propose(_proposal(3, "stranger", "a-stranger-s-own-proof-3"), timeout=20)
        )
        # Held before the ranks come (a stranger's proposal arriving after
        # three of the four is refused at once: rule 3 of policy/proof.py).
        await _held(stub, 1)
        failed = await _start(stub, [0, 1, 2], "first", "ranks-proof-of-the-start-1", held=1)
        assert all(isinstance(f, grpc.aio.AioRpcError) for f in failed), failed
        assert (await rpc_error(stranger)).code() == grpc.StatusCode.DEADLINE_EXCEEDED

        answers = await _start(stub, list(range(RANKS)), "second", "ranks-proof-of-the-start-2")
        for answer in answers:
            assert isinstance(answer, pb.ProposeResponse), details(answer)
        assert {a.action for a in answers} == {pb.ACTION_BUILD}


async def test_a_rank_of_an_ended_lifetime_is_told_it_ended(tmp_path: Path) -> None:
    """The group runs, then restarts (every rank, new lifetimes): a rank of
    the ended lifetime proposing its next round, or retrying round 1, gets
    ABORTED naming its lifetime and that it ended, not "does not know"."""
    async with (
        running_server(make_config(tmp_path)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        await _start(stub, list(range(RANKS)), "first", "ranks-proof-of-the-start-1")
        await _start(stub, list(range(RANKS)), "second", "ranks-proof-of-the-start-2")
        for rnd in (2, 1):
            late = _proposal(2, "first-2", "ranks-proof-of-the-start-1")
            late.round = rnd
            error = await rpc_error(stub.Propose(late, timeout=10))
            assert error.code() == grpc.StatusCode.ABORTED, details(error)
            assert "belongs to lifetime " in details(error), details(error)
            assert "which ended when other ranks of the group restarted" in details(error), details(
                error
            )


async def test_a_new_start_missing_a_rank_times_out_saying_the_last_start_failed(
    tmp_path: Path,
) -> None:
    """After a failed first start, a new start that again misses rank 3
    times out saying that nothing runs and every local rank must propose
    (not that the running lifetime's ranks did not restart)."""
    async with (
        running_server(make_config(tmp_path, round_timeout=TIMEOUT)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        await _start(stub, [0, 1, 2], "first", "ranks-proof-of-the-start-1")
        again = await _start(stub, [0, 1, 2], "second", "ranks-proof-of-the-start-2")
        for outcome in again:
            assert isinstance(outcome, grpc.aio.AioRpcError), outcome
            assert outcome.code() == grpc.StatusCode.DEADLINE_EXCEEDED, details(outcome)
            text = details(outcome)
            assert "3 of 4 local ranks began a new lifetime" in text, text
            assert "the group's last start failed" in text, text
            assert "running lifetime" not in text, text
