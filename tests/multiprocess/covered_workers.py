"""What the spawned ranks of the covered-round tests run (imported in rank processes only).

A covered round is one whose layer the built plan covers: the rank sends its
proposal and goes on. To show that it does not wait, rank 0 runs its
covered rounds while rank 1 is held in a gloo barrier that only opens once
rank 0 has returned from all of them: had a covered round waited for its
answer (which needs rank 1's proposal), rank 0 would never reach the
barrier and the sidecar's round timeout would fail the round.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from tests.multiprocess.workers import (
    MAX_TOKENS,
    exchange,
    failure_report,
    initialize,
    nvfp4_layer,
    reference_manager,
)


def _error(call: Any) -> dict[str, Any] | None:
    try:
        call()
    except Exception as error:
        return failure_report(error)
    return None


def _after_covered_rounds(manager: Any, unanswered: list[int]) -> dict[str, Any]:
    """What a rank reports once it has read every answer: the answers
    outstanding after each covered round (``unanswered``) and now, and its counters."""
    counters = manager.counters
    return {
        "unanswered": unanswered,
        "after": manager._transport.unanswered,
        "covered": counters.covered,
        "reuses": counters.reuses,
        "builds": counters.builds,
        "rebuilds": counters.rebuilds,
        "collectives": counters.collectives,
    }


def no_wait_worker(rank: int, world: int, target: str, group: str, covered: int) -> dict[str, Any]:
    """Round 1 builds; then ``covered`` covered rounds, rank 1 only after rank 0 finished them."""
    cpu_group = dist.new_group(backend="gloo")
    side = dist.new_group(backend="gloo")  # the hold: no collective of the manager's
    manager = reference_manager(cpu_group, group, target)
    initialize(manager, nvfp4_layer("model.layers.0.mlp"))
    if rank == 1:
        dist.barrier(group=side)
    unanswered = []
    for i in range(1, covered + 1):
        initialize(manager, nvfp4_layer(f"model.layers.{i}.mlp"))
        unanswered.append(manager._transport.unanswered)
    if rank == 0:
        dist.barrier(group=side)
    communication = manager.get_communication()  # reads every answer
    result = _after_covered_rounds(manager, unanswered)
    result["max_error"] = exchange(manager.moe_alltoall, nvfp4_layer("check"), rank, world, seed=1)
    result["communication"] = type(communication).__name__
    manager.cleanup()
    return result


def window_worker(
    rank: int, world: int, target: str, group: str, window: int, covered: int
) -> dict[str, Any]:
    """Round 1 builds; then ``covered`` covered rounds with at most ``window``
    answers outstanding: past it a covered round reads the oldest first."""
    cpu_group = dist.new_group(backend="gloo")
    manager = reference_manager(cpu_group, group, target, max_unanswered=window)
    initialize(manager, nvfp4_layer("model.layers.0.mlp"))
    unanswered = []
    for i in range(1, covered + 1):
        initialize(manager, nvfp4_layer(f"model.layers.{i}.mlp"))
        unanswered.append(manager._transport.unanswered)
    manager.get_communication()  # reads every answer
    result = _after_covered_rounds(manager, unanswered)
    manager.cleanup()
    return result


def refused_worker(rank: int, world: int, target: str, group: str, settle: str) -> dict[str, Any]:
    """Round 3 (covered on both ranks) names another layer on rank 1; the
    refusal surfaces at ``settle``: ``"communication"``, ``"growth"`` (a round
    that waits), or ``"cleanup"``."""
    cpu_group = dist.new_group(backend="gloo")
    manager = reference_manager(cpu_group, group, target)
    initialize(manager, nvfp4_layer("model.layers.0.mlp"))
    initialize(manager, nvfp4_layer("model.layers.1.mlp"))
    odd = "model.layers.2.mlp" if rank == 0 else "model.layers.7.mlp"
    returned = _error(lambda: initialize(manager, nvfp4_layer(odd))) is None
    covered = manager.counters.covered
    if settle == "communication":
        raised = _error(manager.get_communication)
        manager.cleanup()
    elif settle == "growth":
        bigger = nvfp4_layer("model.layers.3.mlp", max_num_tokens=MAX_TOKENS * 2)
        raised = _error(lambda: initialize(manager, bigger))
        manager.cleanup()
    else:
        raised = _error(manager.cleanup)
    return {"returned": returned, "covered": covered, "raised": raised}


def growth_in_covered_round_worker(
    rank: int, world: int, target: str, group: str
) -> dict[str, Any]:
    """Round 3: rank 1 needs more tokens than were built, rank 0 passes the
    same layer as covered (and two more after it). Every rank must end on
    the same larger workspace, built once each, and exchange through it."""
    cpu_group = dist.new_group(backend="gloo")
    manager = reference_manager(cpu_group, group, target)
    initialize(manager, nvfp4_layer("model.layers.0.mlp"))
    initialize(manager, nvfp4_layer("model.layers.1.mlp"))
    tokens = MAX_TOKENS * 2 if rank == 1 else MAX_TOKENS
    initialize(manager, nvfp4_layer("model.layers.2.mlp", max_num_tokens=tokens))
    for i in (3, 4):
        initialize(manager, nvfp4_layer(f"model.layers.{i}.mlp"))
    communication = manager.get_communication()
    big = nvfp4_layer("check", max_num_tokens=MAX_TOKENS * 2)
    error = exchange(manager.moe_alltoall, big, rank, world, seed=2)
    counters = manager.counters
    result = {
        "generation": manager.generation,
        "max_num_tokens": manager.max_num_tokens,
        "workspace_size": manager.workspace_size,
        "builds": counters.builds,
        "rebuilds": counters.rebuilds,
        "covered": counters.covered,
        "communication": type(communication).__name__,
        "max_error": error,
    }
    manager.cleanup()
    return result


def merged_plan_worker(
    rank: int, world: int, target: str, group: str, merged: Any, layers: int
) -> dict[str, Any]:
    """Round 1 builds; before the covered rounds, the sidecar's plan is raised
    from another node (``merged``: an event set once it is). Every rank
    passes the covered rounds and rebuilds, together, when it reads the answer."""
    cpu_group = dist.new_group(backend="gloo")
    manager = reference_manager(cpu_group, group, target)
    initialize(manager, nvfp4_layer("model.layers.0.mlp"))
    generation = manager.generation
    dist.barrier(group=cpu_group)
    if not merged.wait(timeout=60):
        raise AssertionError("the other node's plan never reached this sidecar")
    for i in range(1, layers + 1):
        initialize(manager, nvfp4_layer(f"model.layers.{i}.mlp"))
    covered = manager.counters.covered
    manager.get_communication()
    counters = manager.counters
    result = {
        "first_generation": generation,
        "generation": manager.generation,
        "max_num_tokens": manager.max_num_tokens,
        "builds": counters.builds,
        "rebuilds": counters.rebuilds,
        "covered": covered,
    }
    manager.cleanup()
    return result


def embedded_worker(rank: int, world: int, group: str, grow_on_rank_1: bool) -> dict[str, Any]:
    """Embedded mode: round 1 builds, rounds 2-5 are covered (no collective),
    ``get_communication()`` agrees once on what is held. With
    ``grow_on_rank_1``, rank 1 needs more tokens in round 3, a round rank 0
    passes as covered: the ranks are out of step and both raise."""
    cpu_group = dist.new_group(backend="gloo")
    manager = reference_manager(cpu_group, group, "embedded")
    initialize(manager, nvfp4_layer("model.layers.0.mlp"))
    built = manager.counters.collectives
    per_round = []
    raised = None
    try:
        for i in range(1, 5):
            tokens = MAX_TOKENS * 2 if grow_on_rank_1 and rank == 1 and i == 2 else MAX_TOKENS
            before = manager.counters.collectives
            initialize(manager, nvfp4_layer(f"model.layers.{i}.mlp", max_num_tokens=tokens))
            per_round.append(manager.counters.collectives - before)
        manager.get_communication()
    except Exception as error:
        raised = failure_report(error)
    counters = manager.counters
    max_error = None
    if raised is None:
        max_error = exchange(manager.moe_alltoall, nvfp4_layer("check"), rank, world, seed=3)
    manager.cleanup()
    return {
        "built_collectives": built,
        "per_round": per_round,
        "collectives": counters.collectives,
        "covered": counters.covered,
        "raised": raised,
        "max_error": max_error,
    }


__all__ = [
    "embedded_worker",
    "growth_in_covered_round_worker",
    "merged_plan_worker",
    "no_wait_worker",
    "refused_worker",
    "window_worker",
]


def restart_storm_worker(
    rank: int, world: int, target: str, group: str, layers: int, stop_file: str
) -> dict[str, Any]:
    """Round 1 builds; then passes of ``layers`` covered rounds (the model's
    layers again), each pass ended by ``get_communication()``, until the ranks
    agree that ``stop_file`` exists. Any error ends the rank (and the test)."""
    import os

    import torch

    cpu_group = dist.new_group(backend="gloo")
    side = dist.new_group(backend="gloo")  # the stop vote: no collective of the manager's
    manager = reference_manager(cpu_group, group, target)
    initialize(manager, nvfp4_layer("model.layers.0.mlp"))
    passes = 0
    while True:
        for i in range(1, layers + 1):
            initialize(manager, nvfp4_layer(f"model.layers.{i}.mlp"))
        manager.get_communication()  # reads every answer
        passes += 1
        stop = torch.tensor([1 if os.path.exists(stop_file) else 0])
        dist.all_reduce(stop, group=side)
        if int(stop.item()) == world:
            break
    result = _after_covered_rounds(manager, [])
    result["passes"] = passes
    result["rpc_count"] = manager._transport.rpc_count
    result["max_error"] = exchange(manager.moe_alltoall, nvfp4_layer("check"), rank, world, seed=1)
    manager.cleanup()
    return result
