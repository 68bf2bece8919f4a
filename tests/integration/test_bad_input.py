"""Every bad input gets the right status, a message naming field and value, and
changes nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from moe_sidecar.core.errors import QUOTED_NAME_CHARACTERS, quote_name
from moe_sidecar.core.limits import MAX_NAME_LENGTH
from moe_sidecar.server import RunningServer, running_server
from moe_workspace.v1 import coordinator_pb2 as pb
from tests.integration.helpers import (
    NVFP4,
    capacities,
    coordinator_stub,
    details,
    make_config,
    propose_request,
    rpc_error,
    token,
)

pytestmark = pytest.mark.timeout(60)

GROUP = "model/ep2"
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _proposal(**changes: Any) -> pb.ProposeRequest:
    request = propose_request(0, 2, group=GROUP, ep_size=2, local_ranks=2)
    for key, value in changes.items():
        if key.startswith("req_"):
            setattr(request.requirement.capacities, key[4:], value)
        elif key == "no_capacities":
            request.requirement.ClearField("capacities")
        elif key == "no_requirement":
            request.ClearField("requirement")
        else:
            setattr(request, key, value)
    return request


BAD_PROPOSALS = [
    ("empty group", _proposal(group=""), INVALID, "group=''"),
    (
        "long group",
        _proposal(group="g" * 257),
        INVALID,
        f"group={quote_name('g' * 257)}: at most 256 characters",
    ),
    ("non-printable group", _proposal(group="a\tb"), INVALID, "group='a\\tb'"),
    ("ep_rank = ep_size", _proposal(ep_rank=2), INVALID, "ep_rank=2"),
    ("local_ranks 0", _proposal(local_ranks=0), INVALID, "local_ranks=0"),
    ("local_ranks > ep_size", _proposal(local_ranks=3), INVALID, "local_ranks=3"),
    ("ep_size 0", _proposal(ep_size=0, ep_rank=0), INVALID, "ep_size=0"),
    ("ep_size 65", _proposal(ep_size=65, local_ranks=1), INVALID, "ep_size=65"),
    ("top_k 0", _proposal(req_top_k=0), INVALID, "requirement.capacities.top_k=0"),
    ("top_k 23", _proposal(req_top_k=23), INVALID, "requirement.capacities.top_k=23"),
    (
        "zero dispatch bytes",
        _proposal(req_dispatch_bytes_per_token=0),
        INVALID,
        "requirement.capacities.dispatch_bytes_per_token=0",
    ),
    (
        "absurd combine bytes",
        _proposal(req_combine_bytes_per_token=1 << 40),
        INVALID,
        "requirement.capacities.combine_bytes_per_token=1099511627776",
    ),
    ("zero tokens", _proposal(req_max_tokens=0), INVALID, "requirement.capacities.max_tokens=0"),
    (
        "absurd tokens",
        _proposal(req_max_tokens=1 << 40),
        INVALID,
        "requirement.capacities.max_tokens=1099511627776",
    ),
    (
        "absurd derived workspace",
        _proposal(req_max_tokens=1 << 30, req_dispatch_bytes_per_token=1 << 20),
        INVALID,
        "at most 1099511627776",
    ),
    ("zero experts", _proposal(req_num_experts=0), INVALID, "requirement.capacities.num_experts=0"),
    ("missing requirement", _proposal(no_requirement=True), INVALID, "requirement=None"),
    (
        "missing capacities",
        _proposal(no_capacities=True),
        INVALID,
        "requirement.capacities=None",
    ),
    ("round 0", _proposal(round=0), INVALID, "round=0"),
    ("empty lifetime", _proposal(lifetime=""), INVALID, "a lifetime token of 0 characters"),
    ("short lifetime", _proposal(lifetime="guessable"), INVALID, "a lifetime token of 9"),
    (
        "an owner digest that is no SHA-256",
        _proposal(owner_digest="ABC"),
        INVALID,
        "owner_digest: 3 characters that are not an owner digest",
    ),
    (
        "other ep_size than the group",
        _proposal(ep_size=4),
        grpc.StatusCode.FAILED_PRECONDITION,
        "ep_size=4",
    ),
    (
        "round out of sequence",
        _proposal(round=7),
        grpc.StatusCode.FAILED_PRECONDITION,
        "round 7",
    ),
    (
        "unknown lifetime past round 1",
        _proposal(lifetime=token("stranger"), round=3),
        grpc.StatusCode.FAILED_PRECONDITION,
        "does not know",
    ),
]


def _plan(**changes: Any) -> pb.Plan:
    """The plan round 1 of the fixture's group decided, changed."""
    plan = pb.Plan(generation=1)
    plan.capacities.CopyFrom(NVFP4.capacities)
    for key, value in changes.items():
        if key == "generation":
            plan.generation = value
        else:
            setattr(plan.capacities, key, value)
    return plan


def _commit(**changes: Any) -> pb.CommitRequest:
    request = pb.CommitRequest(
        group=GROUP, ep_rank=0, lifetime=token("life-0"), round=1, plan=_plan()
    )
    for key, value in changes.items():
        if key == "no_plan":
            request.ClearField("plan")
        elif key == "plan":
            request.plan.CopyFrom(value)
        else:
            setattr(request, key, value)
    return request


BAD_COMMITS = [
    ("unknown group", _commit(group="nope"), grpc.StatusCode.NOT_FOUND, "group='nope'"),
    ("empty group", _commit(group=""), INVALID, "group=''"),
    ("missing plan", _commit(no_plan=True), INVALID, "plan=None"),
    ("ep_rank out of range", _commit(ep_rank=9), INVALID, "ep_rank=9"),
    ("zero tokens", _commit(plan=_plan(max_tokens=0)), INVALID, "plan.capacities.max_tokens=0"),
    ("top_k 23", _commit(plan=_plan(top_k=23)), INVALID, "plan.capacities.top_k=23"),
    ("generation 0", _commit(plan=_plan(generation=0)), INVALID, "plan.generation=0"),
    (
        "another plan than decided",
        _commit(plan=_plan(dispatch_bytes_per_token=1 << 20)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "the round decided",
    ),
    (
        "another generation than decided",
        _commit(plan=_plan(generation=999)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "the round decided",
    ),
    ("negative build time", _commit(build_seconds=-1.0), INVALID, "build_seconds=-1.0"),
    (
        "unknown lifetime",
        _commit(lifetime=token("stranger")),
        grpc.StatusCode.FAILED_PRECONDITION,
        "never proposed",
    ),
    (
        "round not closed",
        _commit(round=5),
        grpc.StatusCode.FAILED_PRECONDITION,
        "round 5",
    ),
    (
        "round 0",
        _commit(round=0),
        INVALID,
        "round=0",
    ),
]


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[RunningServer]:
    """A server with one group that closed round 1."""
    async with running_server(make_config(tmp_path, enable_admin=False)) as running:
        async with coordinator_stub(running.addresses.listen[0]) as stub:
            await asyncio.gather(
                *(
                    stub.Propose(
                        propose_request(r, 1, NVFP4, group=GROUP, ep_size=2, local_ranks=2),
                        timeout=5,
                    )
                    for r in range(2)
                )
            )
        yield running


async def _snapshot(stub: Any) -> pb.ListGroupsResponse:
    response: pb.ListGroupsResponse = await stub.ListGroups(pb.ListGroupsRequest(), timeout=5)
    return response


BAD_CALLS = [("Propose", *p) for p in BAD_PROPOSALS] + [("Commit", *c) for c in BAD_COMMITS]


@pytest.mark.parametrize(
    ("method", "request_", "code", "needle"),
    [(c[0], *c[2:]) for c in BAD_CALLS],
    ids=[f"{c[0]}: {c[1]}" for c in BAD_CALLS],
)
async def test_bad_request(
    server: RunningServer, method: str, request_: Any, code: grpc.StatusCode, needle: str
) -> None:
    async with coordinator_stub(server.addresses.listen[1]) as stub:
        before = await _snapshot(stub)
        error = await rpc_error(getattr(stub, method)(request_, timeout=5))
        assert error.code() == code, details(error)
        assert needle in details(error)
        assert await _snapshot(stub) == before


async def test_names_as_long_as_allowed_are_quoted_cut_in_a_refusal(server: RunningServer) -> None:
    # A group and layers with names of the full 256 characters: the refusal of
    # a layer of another shape quotes each to 64 characters and its length.
    group = "m" * (MAX_NAME_LENGTH - 4) + "/ep2"
    first = pb.Requirement(capacities=capacities(), layer="a" * MAX_NAME_LENGTH)
    other = pb.Requirement(capacities=capacities(top_k=4), layer="b" * MAX_NAME_LENGTH)

    def ask(rank: int, rnd: int, requirement: pb.Requirement) -> pb.ProposeRequest:
        return propose_request(rank, rnd, requirement, group=group, ep_size=2, local_ranks=2)

    async with coordinator_stub(server.addresses.listen[0]) as stub:
        await asyncio.gather(*(stub.Propose(ask(r, 1, first), timeout=5) for r in range(2)))
        refused = [await rpc_error(stub.Propose(ask(r, 2, other), timeout=5)) for r in range(2)]
    assert [e.code() for e in refused] == [grpc.StatusCode.FAILED_PRECONDITION] * 2
    message = details(refused[0])
    assert details(refused[1]) == message
    for name in (group, first.layer, other.layer):
        assert quote_name(name) in message
        assert name[: QUOTED_NAME_CHARACTERS + 1] not in message
    assert "(256 characters)" in message and "top_k=4" in message


async def test_get_and_reset_of_unknown_or_malformed_groups(server: RunningServer) -> None:
    async with coordinator_stub(server.addresses.listen[0]) as stub:
        before = await _snapshot(stub)
        error = await rpc_error(stub.GetGroup(pb.GetGroupRequest(group="nope"), timeout=5))
        assert error.code() == grpc.StatusCode.NOT_FOUND and "group='nope'" in details(error)
        error = await rpc_error(stub.GetGroup(pb.GetGroupRequest(group=""), timeout=5))
        assert error.code() == INVALID and "group=''" in details(error)
        error = await rpc_error(stub.Watch(pb.WatchRequest(group="a\tb"), timeout=5).read())
        assert error.code() == INVALID and "group='a\\tb'" in details(error)
        error = await rpc_error(stub.Watch(pb.WatchRequest(group="nope"), timeout=5).read())
        assert error.code() == grpc.StatusCode.NOT_FOUND and "group='nope'" in details(error)
        # Admin calls are off: refused whatever the group.
        for name in (GROUP, "nope"):
            error = await rpc_error(stub.ResetGroup(pb.ResetGroupRequest(group=name), timeout=5))
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED
            assert f"group={name!r}" in details(error) and "--enable-admin" in details(error)
        assert await _snapshot(stub) == before


async def test_reset_with_admin_enabled(tmp_path: Path) -> None:
    async with (
        running_server(make_config(tmp_path, enable_admin=True)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        error = await rpc_error(stub.ResetGroup(pb.ResetGroupRequest(group="nope"), timeout=5))
        assert error.code() == grpc.StatusCode.NOT_FOUND and "group='nope'" in details(error)
        await asyncio.gather(
            *(
                stub.Propose(
                    propose_request(r, 1, NVFP4, group=GROUP, ep_size=2, local_ranks=2),
                    timeout=5,
                )
                for r in range(2)
            )
        )
        group = await stub.ResetGroup(pb.ResetGroupRequest(group=GROUP), timeout=5)
        assert not group.HasField("plan") and not group.history
        again = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
        assert again == group


async def test_undecodable_bytes_are_invalid_argument_counted_and_change_nothing(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    async with coordinator_stub(server.addresses.listen[0]) as stub:
        before = await _snapshot(stub)
    async with grpc.aio.insecure_channel(server.addresses.listen[0]) as channel:
        for method in ("Propose", "Commit", "GetGroup", "ListGroups", "ResetGroup"):
            raw = channel.unary_unary(
                f"/moe_workspace.v1.WorkspaceCoordinator/{method}",
                request_serializer=lambda b: b,
                response_deserializer=lambda b: b,
            )
            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await raw(b"\xff\xff\xff\xff not a protobuf", timeout=5)
                assert info.value.code() == INVALID, method
                assert "bytes that are not a moe_workspace.v1." in (info.value.details() or "")
    async with coordinator_stub(server.addresses.listen[0]) as stub:
        assert await _snapshot(stub) == before
    counted = server.metrics.undecodable.labels(method="Propose")._value.get()
    assert counted == 3
    # Logged once for the one peer (the same connection), not fifteen times.
    logged = [r for r in caplog.records if r.getMessage() == "undecodable request"]
    assert len(logged) == 1 and logged[0].__dict__["method"] == "Propose"
