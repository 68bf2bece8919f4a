"""Cross-rank agreement over the EP group's torch.distributed CPU group.

Each node's sidecar (or, embedded, each rank's own core) decides for the
ranks it sees. When an EP group spans more ranks than one decider sees, its
ranks agree with ONE ``all_gather`` of a small int64 row per rank::

    failed | epoch | generation | capacities (one slot per field, in
    moe_sidecar.core.plan.Capacities' order)

and every rank then folds the gathered plans with the decision core's own
:func:`moe_sidecar.core.plan.join`. The same rows in, the same join, so every rank
holds the same plan, and the manager derives the same action from it with
:func:`moe_sidecar.core.plan.decide_action`. Nothing here takes a maximum.

A rank whose proposal failed still joins the collective, so every rank takes
the same branch: either all proceed with the same plan, or all raise. Only
on a failure or a shape mismatch does one more collective
(``all_gather_object``) run, to name the ranks and layers involved.

The group's proof (:func:`share_group_secret`) is agreed here too: once per
lifetime, before the first proposal, rank 0 of the EP group draws a random
secret and broadcasts it over the same CPU group, so every rank of the
lifetime sends the same proof and no process outside the group holds it.

Every collective here runs on the group passed in, never the world: ranks of
other EP groups (other pipeline stages) are not involved.
"""

from __future__ import annotations

import functools
import secrets
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from moe_sidecar.client.errors import (
    AgreementError,
    CoordinatorError,
    ErrorCode,
    InvalidArgument,
    RankFailure,
)
from moe_sidecar.core.errors import error_for_code, quote_name
from moe_sidecar.core.plan import Capacities, Plan, ShapeMismatch, join

__all__ = ["GROUP_SECRET_BYTES", "LocalOutcome", "agree", "failure_code", "share_group_secret"]

GROUP_SECRET_BYTES = 16
"""Random bytes of a group's proof: 128 bits, guessed by nobody."""

_CAPACITY_FIELDS = tuple(f.name for f in fields(Capacities))
_ROW = 3 + len(_CAPACITY_FIELDS)


@dataclass(frozen=True)
class LocalOutcome:
    """What one rank brings to the agreement: its local plan, or its failure."""

    ep_rank: int
    layer: str
    plan: Plan | None = None
    failure: BaseException | None = None


def failure_code(error: BaseException) -> ErrorCode:
    """The error code a failure is reported under on every rank."""
    if isinstance(error, CoordinatorError):
        return error.code
    if isinstance(error, (ValueError, TypeError)):
        return ErrorCode.INVALID_ARGUMENT
    return ErrorCode.INTERNAL


def _row(mine: LocalOutcome) -> torch.Tensor:
    if mine.failure is not None or mine.plan is None:
        return torch.tensor([1] + [0] * (_ROW - 1), dtype=torch.int64)
    p = mine.plan
    return torch.tensor(
        [0, p.epoch, p.generation, *(getattr(p.capacities, name) for name in _CAPACITY_FIELDS)],
        dtype=torch.int64,
    )


def _plan(row: list[int]) -> Plan:
    return Plan(
        capacities=Capacities(**dict(zip(_CAPACITY_FIELDS, row[3:], strict=True))),
        epoch=row[1],
        generation=row[2],
    )


def _layer_text(layer: str) -> str:
    return quote_name(layer) if layer else "(unnamed layer)"


def _gather_objects(group: dist.ProcessGroup, item: object) -> list[object]:
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
    gathered = _gather_objects(group, item)
    failures = [entry for entry in gathered if isinstance(entry, tuple)]
    parts = [
        f"rank {rank} (layer {_layer_text(layer)}): {text}" for rank, layer, _, text in failures
    ]
    first_code = ErrorCode(failures[0][2]) if failures else ErrorCode.INTERNAL
    message = (
        f"EP group {quote_name(group_name)}: {len(failures)} of {len(gathered)} ranks failed this "
        "round: " + "; ".join(parts)
    )
    raise error_for_code(first_code, message) from mine.failure


def _raise_disagreement(
    group: dist.ProcessGroup, mine: LocalOutcome, plans: list[Plan], group_name: str
) -> None:
    layers = _gather_objects(group, mine.layer)
    shapes = [plan.capacities.shape for plan in plans]
    failures = tuple(
        RankFailure(ep_rank=rank, layer=str(layer), detail=f"top_k={top_k}, num_experts={experts}")
        for rank, ((top_k, experts), layer) in enumerate(zip(shapes, layers, strict=True))
    )
    # Name the ranks that differ from the most common shape (ties: the smaller shape).
    counts = {shape: shapes.count(shape) for shape in shapes}
    top_k, experts = max(counts, key=lambda shape: (counts[shape], -shape[0], -shape[1]))
    majority = f"top_k={top_k}, num_experts={experts}"
    odd = [f for f in failures if f.detail != majority]
    raise AgreementError(
        f"ranks of EP group {quote_name(group_name)} disagree on the MoE layer shape: "
        + "; ".join(f"rank {f.ep_rank} layer {_layer_text(f.layer)} has {f.detail}" for f in odd)
        + f" while {counts[(top_k, experts)]} rank(s) have {majority}; every rank must run the "
        "same layers in the same order",
        failures,
    )


def agree(group: dist.ProcessGroup, mine: LocalOutcome, *, group_name: str) -> Plan:
    """Makes every rank of ``group`` hold the same plan, or raise the same error.

    The agreed plan is the join (:func:`moe_sidecar.core.plan.join`) of every
    rank's local plan.

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
    row = _row(mine)
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, row, group=group)
    values = [[int(v) for v in r.tolist()] for r in rows]
    if any(v[0] for v in values):
        _raise_failures(group, mine, group_name)
    plans = [_plan(v) for v in values]
    try:
        return functools.reduce(join, plans)
    except ShapeMismatch:
        _raise_disagreement(group, mine, plans, group_name)
        raise  # pragma: no cover - _raise_disagreement always raises


def share_group_secret(group: dist.ProcessGroup) -> str:
    """The group's proof for this lifetime: rank 0 of ``group`` draws
    :data:`GROUP_SECRET_BYTES` random bytes and broadcasts them over
    ``group`` (one collective; every rank must call it at the same point).

    Returns the secret as hex digits, the same on every rank of ``group``.

    Raises:
        RuntimeError: the broadcast failed (a rank of the group is gone).
    """
    if dist.get_rank(group) == 0:
        drawn = torch.tensor(list(secrets.token_bytes(GROUP_SECRET_BYTES)), dtype=torch.uint8)
    else:
        drawn = torch.zeros(GROUP_SECRET_BYTES, dtype=torch.uint8)
    dist.broadcast(drawn, src=dist.get_global_rank(group, 0), group=group)
    return bytes(drawn.tolist()).hex()
