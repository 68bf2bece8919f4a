"""The plan knows its release: a real sidecar process sizes a group in its ranks' FlashInfer release.

Ranks propose through the client's own gRPC transport (the session stream)
with the release their backend builds; ``moe-sidecar groups`` (the real
CLI, in its own process) then shows that release's workspace bytes, equal
to what ``moe-sidecar size --flashinfer RELEASE`` answers for the same
layers. Ranks of one group stating different releases are refused, naming
both releases and the ranks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from moe_sidecar import flashinfer
from moe_sidecar.client.size.answer import activation_bytes
from moe_sidecar.client.transport import GrpcTransport
from moe_sidecar.core.errors import CoordinatorError, ErrorCode
from moe_sidecar.core.group import Decision, Proposal, Requirement
from moe_sidecar.core.layer import layer_capacities
from moe_sidecar.flashinfer import v0_7_2_post1, v0_7_4
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc
from tests.integration.helpers import (
    ROOT,
    propose_request,
    start_sidecar_process,
    stop_process,
    wait_until_serving,
)

pytestmark = pytest.mark.timeout(120)

MOE_SIDECAR = Path(sys.executable).with_name("moe-sidecar")
"""The installed ``moe-sidecar`` command (the environment's console script)."""

EP = 2
TOKENS, HIDDEN, TOP_K, EXPERTS = 256, 7168, 8, 256
KINDS = ("nvfp4", "bf16")
"""The layer kinds of the model: NVFP4 MoE layers, then the bf16 MTP layer."""


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[str]:
    """A sidecar process on a socket in ``tmp_path``; yields its target."""
    target = f"unix://{tmp_path}/sidecar.sock"
    log = tmp_path / "sidecar.stderr"
    process = start_sidecar_process(
        log,
        *("--listen", target, "--state-dir", str(tmp_path / "state")),
        *("--health-port", "0", "--metrics-port", "0", "--round-timeout", "20"),
    )
    try:
        wait_until_serving(target, process, log)
        yield target
    finally:
        stop_process(process)


def _moe_sidecar(*args: str) -> Any:
    """``moe-sidecar ARGS`` in its own process; its JSON output."""
    done = subprocess.run(
        [str(MOE_SIDECAR), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _layer(kind: str, release: str) -> Requirement:
    activation = activation_bytes(kind, HIDDEN, release)
    return Requirement(
        layer_capacities(TOKENS, TOP_K, EXPERTS, HIDDEN, activation), f"{kind}-layer"
    )


def _proposal(group: str, rank: int, rnd: int, release: str) -> Proposal:
    kind = KINDS[rnd - 1]
    return Proposal(
        group=group,
        ep_size=EP,
        ep_rank=rank,
        local_ranks=EP,
        lifetime=f"{group}-rank-{rank}:lifetime-token",
        round=rnd,
        requirement=_layer(kind, release),
        release=release,
    )


def _every_rank(call: Callable[[int], Any]) -> list[Any]:
    """``call(rank)`` for every rank at once (a round closes when all proposed)."""
    with ThreadPoolExecutor(max_workers=EP) as pool:
        return list(pool.map(call, range(EP)))


def _propose_all_rounds(target: str, group: str, releases: tuple[str, ...]) -> list[Any]:
    """Each rank's transport proposes round 1 and 2 with its release; what each got."""

    def rank_life(rank: int) -> Any:
        transport = GrpcTransport(target, propose_timeout=30.0)
        try:
            return [
                transport.propose(_proposal(group, rank, rnd, releases[rank])) for rnd in (1, 2)
            ]
        except CoordinatorError as error:
            return error
        finally:
            transport.close()

    return _every_rank(rank_life)


@pytest.mark.parametrize("release", [r.name for r in flashinfer.RELEASES])
def test_the_groups_command_shows_the_ranks_release_and_its_size(
    sidecar: str, release: str
) -> None:
    group = f"model/ep{EP}/{release}"
    answers = _propose_all_rounds(sidecar, group, (release,) * EP)
    for rank_answers in answers:
        assert [type(a) for a in rank_answers] == [Decision, Decision], rank_answers
        assert rank_answers[-1].grew

    shown = {g["name"]: g for g in _moe_sidecar("groups", "--target", sidecar, "--json")}[group]
    size = _moe_sidecar(
        "size",
        *("--flashinfer", release, "--ep", str(EP), "--tokens", str(TOKENS)),
        *("--hidden", str(HIDDEN), "--top-k", str(TOP_K), "--experts", str(EXPERTS)),
        *(arg for kind in KINDS for arg in ("--dispatch", kind)),
        "--json",
    )
    assert shown["flashinfer_release"] == release == size["flashinfer"]
    assert shown["plan"]["capacities"] == size["capacities"]
    assert shown["plan"]["workspace_bytes"] == size["workspace_bytes_per_rank"]
    # Every growth of the history in the same release's arithmetic.
    assert shown["history"][-1]["workspace_bytes"] == size["workspace_bytes_per_rank"]


def test_the_two_releases_size_these_layers_apart() -> None:
    # What makes the test above tell the releases apart.
    union = _layer("bf16", "").capacities
    assert v0_7_4.RELEASE.workspace_bytes(union, EP) != v0_7_2_post1.RELEASE.workspace_bytes(
        union, EP
    )


def test_ranks_of_one_group_stating_two_releases_are_refused_naming_both(sidecar: str) -> None:
    group = f"model/ep{EP}/mixed"
    releases = (v0_7_4.RELEASE.name, v0_7_2_post1.RELEASE.name)
    answers = _propose_all_rounds(sidecar, group, releases)
    for error in answers:
        assert isinstance(error, CoordinatorError), answers
        assert error.code is ErrorCode.FAILED_PRECONDITION
        for release in releases:
            assert f"FlashInfer {release!r}" in str(error)
        # The rank whose proposal the sidecar took first is the one the other
        # disagrees with: the two calls race, so either order names both.
        assert ("rank(s) 0" in str(error) and "rank 1" in str(error)) or (
            "rank(s) 1" in str(error) and "rank 0" in str(error)
        ), str(error)


def test_an_old_client_without_the_field_is_the_default_release(sidecar: str) -> None:
    group = f"model/ep{EP}/old-client"
    requirement = _layer("bf16", "")

    def propose(rank: int) -> pb.ProposeResponse:
        request = propose_request(rank, 1, None, group=group, ep_size=EP, local_ranks=EP)
        request.requirement.capacities.CopyFrom(
            pb.Capacities(
                max_tokens=requirement.capacities.max_tokens,
                dispatch_bytes_per_token=requirement.capacities.dispatch_bytes_per_token,
                combine_bytes_per_token=requirement.capacities.combine_bytes_per_token,
                top_k=TOP_K,
                num_experts=EXPERTS,
            )
        )
        with grpc.insecure_channel(sidecar) as channel:
            response: pb.ProposeResponse = pb_grpc.WorkspaceCoordinatorStub(channel).Propose(
                request, timeout=30
            )
            return response

    default_size = flashinfer.DEFAULT_RELEASE.workspace_bytes(requirement.capacities, EP)
    assert {r.plan.workspace_bytes for r in _every_rank(propose)} == {default_size}
    shown = {g["name"]: g for g in _moe_sidecar("groups", "--target", sidecar, "--json")}[group]
    assert shown["flashinfer_release"] == flashinfer.DEFAULT_RELEASE.name
    assert shown["plan"]["workspace_bytes"] == default_size


def test_an_unknown_release_is_invalid_argument_naming_the_field(sidecar: str) -> None:
    request = propose_request(0, 1, group="model/unknown-release", ep_size=1, local_ranks=1)
    request.flashinfer_release = "9.9.9"
    with grpc.insecure_channel(sidecar) as channel, pytest.raises(grpc.RpcError) as caught:
        pb_grpc.WorkspaceCoordinatorStub(channel).Propose(request, timeout=10)
    error: Any = caught.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "flashinfer_release='9.9.9'" in error.details()
