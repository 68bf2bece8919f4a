"""The group proof with real rank processes: 4 ranks (reference backend, gloo)
share a secret at each lifetime's first initialize() and send it with every
proposal and commit; a stranger in the test process, who watches GetGroup and
proposes for the rank that has not proposed yet with a lifetime of its own,
is refused PERMISSION_DENIED in the group's first lifetime and in its
restart, and the real ranks build their own plan. A stranger that proposed
for every slot of a group first (a whole-group squat) stores its plan, and
the real ranks, whose rank 0's owner key it lacks, still build their own."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from moe_sidecar.flashinfer.v0_7_2_post1 import capacities_workspace_bytes
from moe_sidecar.wire.codec import capacities_to_proto
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc
from tests.multiprocess import workers
from tests.multiprocess.harness import Sidecar, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.attack, pytest.mark.timeout(180)]

RANKS = 4
GROUP = "proof-test:fp4/tp1-ep4/pp0"


def _stranger_tries(sidecar: Sidecar, lifetime: int, counted: str) -> str:
    """Waits until three ranks wait (``counted``: ``waiting_ranks`` in a first
    lifetime, ``restarting_ranks`` in a restart), then proposes as rank 3
    with its own lifetime and a huge layer; returns the status it got."""
    sidecar.wait_for_group(
        GROUP, lambda g: getattr(g, counted) == RANKS - 1, timeout=60, what=f"three {counted}"
    )
    request = pb.ProposeRequest(
        group=GROUP,
        ep_size=RANKS,
        ep_rank=RANKS - 1,
        local_ranks=RANKS,
        lifetime=f"stranger-{lifetime}-with-its-own-lifetime",
        round=1,
        requirement=pb.Requirement(
            capacities=pb.Capacities(
                max_tokens=1 << 20,
                dispatch_bytes_per_token=1 << 12,
                combine_bytes_per_token=512,
                top_k=workers.TOP_K,
                num_experts=workers.NUM_EXPERTS,
            )
        ),
        group_proof="a-guess-at-the-group-proof",
    )
    with grpc.insecure_channel(sidecar.target) as channel:
        stub = pb_grpc.WorkspaceCoordinatorStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Propose(request, timeout=10)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, caught.value.details()
    details = str(caught.value.details())
    assert f"group {GROUP!r} rank 3: the group proof does not match" in details
    return details


def test_real_ranks_share_a_proof_and_a_stranger_is_refused(
    sidecar: Sidecar, tmp_path: Path
) -> None:
    import threading

    directory = tmp_path / "go"
    directory.mkdir()
    outcomes: dict[int, str] = {}

    def stranger() -> None:
        for lifetime, counted in ((1, "waiting_ranks"), (2, "restarting_ranks")):
            outcomes[lifetime] = _stranger_tries(sidecar, lifetime, counted)
            (directory / f"go-{lifetime}").touch()

    thread = threading.Thread(target=stranger, daemon=True)
    thread.start()
    results = run_ranks(
        workers.group_proof_worker,
        RANKS,
        timeout=120,
        tmp_path=tmp_path / "ranks",
        args=(sidecar.target, GROUP, str(directory)),
        envs=[{"MOE_SIDECAR_TARGET": sidecar.target}] * RANKS,
    )
    thread.join(timeout=10)
    assert set(outcomes) == {1, 2}
    own = capacities_workspace_bytes(
        workers.layer_capacities(RANKS, workers.nvfp4_layer("x")), RANKS
    )
    for rank, result in enumerate(results):
        for lifetime in result["lifetimes"]:
            (record,) = lifetime["records"]
            # One broadcast per lifetime shares the proof, counted by the manager.
            assert lifetime["proof_calls"] == ["broadcast"], rank
            assert record["delta"]["builds"] == 1 and record["workspace_size"] == own, rank
            assert record["max_error"] == 0.0, rank
    group = sidecar.get_group(GROUP)
    assert group.lifetimes == 2 and group.refused_proposals == 2
    assert group.plan.workspace_bytes == own
    assert [r.committed_generation for r in group.ranks] == [1] * RANKS


def test_a_whole_group_squat_is_not_built_and_a_warm_restart_still_inherits(
    sidecar: Sidecar, tmp_path: Path
) -> None:
    group = "squat-test:fp4/tp1-ep2/pp0"
    planted = workers.layer_capacities(2, workers.bf16_layer("x"))
    planted = replace(planted, max_tokens=planted.max_tokens * 64)
    requests = [
        pb.ProposeRequest(
            group=group,
            ep_size=2,
            ep_rank=rank,
            local_ranks=2,
            lifetime=f"stranger-{rank}-with-its-own-lifetime",
            round=1,
            requirement=pb.Requirement(capacities=capacities_to_proto(planted)),
            group_proof="a-stranger-s-own-group-proof",
        )
        for rank in range(2)
    ]
    with grpc.insecure_channel(sidecar.target) as channel:
        stub = pb_grpc.WorkspaceCoordinatorStub(channel)
        calls = [stub.Propose.future(request, timeout=20) for request in requests]
        squat = [call.result() for call in calls]
    planted_bytes = capacities_workspace_bytes(planted, 2)
    assert {(a.action, a.plan.workspace_bytes) for a in squat} == {(pb.ACTION_BUILD, planted_bytes)}
    cold, warm = (
        run_ranks(
            workers.warm_restart_worker,
            2,
            timeout=60,
            tmp_path=tmp_path / f"start{start}",
            args=(sidecar.target, group),
        )
        for start in range(2)
    )
    own = capacities_workspace_bytes(workers.layer_capacities(2, workers.nvfp4_layer("x")), 2)
    union = cold[0]["records"][-1]["workspace_size"]
    assert union < planted_bytes
    for result in cold:
        # The real ranks' first lifetime builds from their own first layer.
        assert result["records"][0]["workspace_size"] == own, "built the stranger's plan"
        assert result["counters"]["builds"] == 1 and result["counters"]["rebuilds"] == 1
    for result in warm:
        # Their restart carries their owner digest: it inherits their union.
        assert result["records"][0]["workspace_size"] == union
        assert result["counters"]["builds"] == 1 and result["counters"]["rebuilds"] == 0
    stored = sidecar.get_group(group)
    assert stored.lifetimes == 3 and stored.plan.workspace_bytes == union
