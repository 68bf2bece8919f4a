"""Cross-rank agreement over the EP group's torch.distributed CPU group.

Each node's sidecar (or, embedded, each rank's own core) decides for the
ranks it sees. When an EP group spans more ranks than one decider sees, its
ranks agree with ONE ``all_reduce(MAX)`` of a small int64 vector:

====  ===========================================================
slot  value
====  ===========================================================
0     workspace bytes of the local plan
1     max_num_tokens of the local plan
2     generation of the local plan
3, 4  top_k and -top_k (MAX of the negation is -MIN)
5, 6  num_experts and -num_experts
7     1 when this rank's proposal failed, else 0
8     payload bytes of the largest layer the local plan serves
====  ===========================================================

The agreed workspace is the largest of the ranks' workspaces, and at least
the auxiliary data at the agreed ``max_num_tokens`` plus the largest payload
(:func:`moe_sidecar.client.sizing.workspace_for_payload`): FlashInfer's auxiliary data
grows with the token count the workspace is built for.

A rank whose proposal failed still joins the collective, so every rank takes
the same branch: either all proceed with the same plan, or all raise. Only
on the failure branch does one more collective (``all_gather_object``) run,
to name the ranks and layers involved.

Every collective here runs on the group passed in, never the world: ranks of
other EP groups (other pipeline stages) are not involved and may be doing
something else entirely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from moe_sidecar.client.errors import (
    AgreementError,
    CoordinatorError,
    ErrorCode,
    InvalidArgument,
    RankFailure,
)
from moe_sidecar.client.sizing import workspace_for_payload
from moe_sidecar.errors import error_for_code
from moe_sidecar.policy import Plan

__all__ = ["AgreementOutcome", "LocalOutcome", "agree", "failure_code"]

# Neutral element for MAX of a negated field on a rank that has no value.
_NO_VALUE = -(1 << 62)


@dataclass(frozen=True)
class LocalOutcome:
    """What one rank brings to the agreement: its local plan, or its failure."""

    ep_rank: int
    layer: str
    plan: Plan | None = None
    failure: BaseException | None = None


@dataclass(frozen=True)
class AgreementOutcome:
    """The plan every rank of the EP group now holds the same view of."""

    plan: Plan
    collectives: int
    """Collectives this agreement issued (1 on success)."""


def failure_code(error: BaseException) -> ErrorCode:
    """The error code a failure is reported under on every rank."""
    if isinstance(error, CoordinatorError):
        return error.code
    if isinstance(error, (ValueError, TypeError)):
        return ErrorCode.INVALID_ARGUMENT
    return ErrorCode.INTERNAL


def _vector(mine: LocalOutcome) -> torch.Tensor:
    if mine.failure is not None or mine.plan is None:
        values = [0, 0, 0, 0, _NO_VALUE, 0, _NO_VALUE, 1, 0]
    else:
        p = mine.plan
        values = [
            p.workspace_bytes,
            p.max_num_tokens,
            p.generation,
            p.top_k,
            -p.top_k,
            p.num_experts,
            -p.num_experts,
            0,
            p.payload_bytes,
        ]
    return torch.tensor(values, dtype=torch.int64)


def _layer_text(layer: str) -> str:
    return repr(layer) if layer else "(unnamed layer)"


def _gather(group: dist.ProcessGroup, item: object) -> list[object]:
    gathered: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, item, group=group)
    return gathered


def _raise_failures(group: dist.ProcessGroup, mine: LocalOutcome, group_name: str) -> None:
    item: tuple[int, str, str, str] | None = None
    if mine.failure is not None or mine.plan is None:
        error = mine.failure
        code = failure_code(error) if error is not None else ErrorCode.INTERNAL
        text = str(error) if error is not None else "no plan and no error"
        item = (mine.ep_rank, mine.layer, code.value, text)
    gathered = _gather(group, item)
    failures = [entry for entry in gathered if isinstance(entry, tuple)]
    parts = [
        f"rank {rank} (layer {_layer_text(layer)}): {text}" for rank, layer, _, text in failures
    ]
    first_code = ErrorCode(failures[0][2]) if failures else ErrorCode.INTERNAL
    message = (
        f"EP group {group_name!r}: {len(failures)} of {len(gathered)} ranks failed this round: "
        + "; ".join(parts)
    )
    raise error_for_code(first_code, message) from mine.failure


def _raise_disagreement(group: dist.ProcessGroup, mine: LocalOutcome, group_name: str) -> None:
    assert mine.plan is not None
    gathered = _gather(group, (mine.ep_rank, mine.layer, mine.plan.top_k, mine.plan.num_experts))
    shapes = [entry for entry in gathered if isinstance(entry, tuple)]
    # Name the ranks that differ from the most common shape.
    counts: dict[tuple[int, int], int] = {}
    for _, _, top_k, num_experts in shapes:
        counts[(top_k, num_experts)] = counts.get((top_k, num_experts), 0) + 1
    majority = max(counts, key=lambda shape: (counts[shape], -shape[0], -shape[1]))
    failures = tuple(
        RankFailure(ep_rank=rank, layer=layer, detail=f"top_k={top_k}, num_experts={num_experts}")
        for rank, layer, top_k, num_experts in shapes
    )
    odd = [f for f in failures if f.detail != f"top_k={majority[0]}, num_experts={majority[1]}"]
    raise AgreementError(
        f"ranks of EP group {group_name!r} disagree on the MoE layer shape: "
        + "; ".join(f"rank {f.ep_rank} layer {_layer_text(f.layer)} has {f.detail}" for f in odd)
        + f" while {counts[majority]} rank(s) have top_k={majority[0]}, "
        f"num_experts={majority[1]}; every rank must run the same layers in the same order",
        failures,
    )


def agree(group: dist.ProcessGroup, mine: LocalOutcome, *, group_name: str) -> AgreementOutcome:
    """Makes every rank of ``group`` hold the same plan, or raise the same error.

    The agreed plan is the element-wise maximum of the ranks' workspace
    bytes, token counts and generations, its workspace raised where the
    agreed token count needs more auxiliary data; ``top_k`` and
    ``num_experts`` must be equal everywhere.

    Args:
        group: the EP group's CPU (gloo) process group; nothing else is used.
        mine: this rank's local plan or failure.
        group_name: the EP group's name, for messages.

    Raises:
        AgreementError: ranks disagree on ``top_k`` or ``num_experts``.
        CoordinatorError: at least one rank failed; every rank raises the
            failing rank's error class, naming every failed rank and layer
            (the local failure, if any, is the ``__cause__``).
        InvalidArgument: ``mine`` holds neither a plan nor a failure.
    """
    if mine.plan is None and mine.failure is None:
        raise InvalidArgument("agree() needs a plan or a failure")
    vector = _vector(mine)
    dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=group)
    ws, tokens, generation, top_k, neg_top_k, experts, neg_experts, failed, payload = (
        int(v) for v in vector.tolist()
    )
    if failed:
        _raise_failures(group, mine, group_name)
    if top_k != -neg_top_k or experts != -neg_experts:
        _raise_disagreement(group, mine, group_name)
    assert mine.plan is not None
    ep_size = dist.get_world_size(group)
    plan = Plan(
        workspace_bytes=max(ws, workspace_for_payload(ep_size, tokens, payload) if payload else 0),
        max_num_tokens=tokens,
        top_k=top_k,
        num_experts=experts,
        generation=generation,
        shape_layer=mine.plan.shape_layer,
        shape_rank=mine.plan.shape_rank,
        payload_bytes=payload,
    )
    return AgreementOutcome(plan=plan, collectives=1)
