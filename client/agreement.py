"""Cross-rank agreement over the EP group's torch.distributed CPU group.

Each node's sidecar (or, embedded, each rank's own core) decides for the
ranks it sees. When an EP group spans more ranks than one decider sees, its
ranks agree with ONE ``all_gather`` of a small int64 row per rank::

    failed | round | settling | action | epoch | generation | capacities
    (one slot per field, in moe_sidecar.core.plan.Capacities' order)

``round`` and ``settling`` say where the rank is: agreeing on a round, or
(``settling``) on what it holds before using it, after rounds it passed as
covered without agreeing (embedded mode). Ranks whose rows name different
places are out of step (one passed as covered a round another needed agreed:
they stated different layers or sizes) and every rank raises, naming each
rank's round and layer.

and every rank then folds the gathered plans with the decision core's own
:func:`moe_sidecar.core.plan.join`, and the decided actions by what they ask
(REUSE, then REBUILD, then BUILD: a build any decider asked for is every
rank's). The same rows in, the same fold, so every rank holds the same plan
and executes the same action, the one its deciders gave (:func:`agree_round`).

A rank whose proposal failed still joins the collective, so every rank takes
the same branch: either all proceed with the same plan, or all raise. Only
on a failure or a shape mismatch does one more collective
(``all_gather_object``) run, to name the ranks and layers involved.

The group's proof (:func:`share_group_secret`) is agreed here too: once per
lifetime, before the first proposal, rank 0 of the EP group draws a random
secret and broadcasts it over the same CPU group, so every rank of the
lifetime sends the same proof and no process outside the group holds it.
The same broadcast carries the group's owner key, which rank 0 keeps on disk
(:mod:`moe_sidecar.client.owner_key`; zeros: rank 0 has none).
Where no one stated how many ranks of the group run on each node, the
ranks count them in the same exchange: one ``all_gather`` of a digest of
each rank's hostname, started with the broadcast. Both run in flight
(:class:`SecretShare`) so that a rank can wait for them and for its sidecar
at once (:mod:`moe_sidecar.client.first_round`): no collective before a
rank's first proposal waits longer than the sidecar's round timeout.

Every collective here runs on the group passed in, never the world: ranks of
other EP groups (other pipeline stages) are not involved.
"""

from __future__ import annotations

import functools
import hashlib
import secrets
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import cast

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
from moe_sidecar.core.plan import Action, Capacities, Plan, ShapeMismatch, join

__all__ = [
    "GROUP_SECRET_BYTES",
    "GroupSecrets",
    "LocalOutcome",
    "SecretShare",
    "agree_round",
    "failure_code",
    "share_group_secret",
]

GROUP_SECRET_BYTES = 16
"""Random bytes of a group's proof: 128 bits, guessed by nobody."""
_OWNER_KEY_BYTES = 32
"""Bytes of the owner key after the proof in the broadcast
(:data:`moe_sidecar.client.owner_key.OWNER_KEY_BYTES`)."""


@dataclass(frozen=True)
class GroupSecrets:
    """What rank 0 shares with its group at a lifetime's first initialize()."""

    proof: str
    """The lifetime's group proof, as hex digits."""
    owner_key: bytes | None
    """The group's owner key (None: rank 0 has none)."""
    local_ranks: int = 0
    """Ranks of the group on this rank's host, counted in the same exchange
    (0: not counted, as it was stated)."""


_CAPACITY_FIELDS = tuple(f.name for f in fields(Capacities))
_FAILED, _ROUND, _SETTLING, _ACTION, _EPOCH, _GENERATION = range(6)
"""The indices of the row's head, in the order the module's docstring draws it."""
_HEAD = _GENERATION + 1
"""Slots before the capacities: failed, round, settling, action, epoch, generation."""
_ACTIONS = (Action.REUSE, Action.REBUILD, Action.BUILD)
"""The row's action slot: the index here, in the order of what an action asks."""
_ROW = _HEAD + len(_CAPACITY_FIELDS)


@dataclass(frozen=True)
class LocalOutcome:
    """What one rank brings to the agreement: its local plan, or its failure."""

    ep_rank: int
    layer: str
    plan: Plan | None = None
    failure: BaseException | None = None
    round: int = 0
    """The round agreed on (0: not counted)."""
    settling: bool = False
    """The rank agrees on what it holds before using it, not on a round."""
    action: Action = Action.REUSE
    """What the rank's decider decided for ``plan``."""


def failure_code(error: BaseException) -> ErrorCode:
    """The error code a failure is reported under on every rank."""
    if isinstance(error, CoordinatorError):
        return error.code
    if isinstance(error, (ValueError, TypeError)):
        return ErrorCode.INVALID_ARGUMENT
    return ErrorCode.INTERNAL


def _row(mine: LocalOutcome) -> torch.Tensor:
    place = [mine.round, int(mine.settling)]
    if mine.failure is not None or mine.plan is None:
        return torch.tensor([1, *place] + [0] * (_ROW - 3), dtype=torch.int64)
    p = mine.plan
    return torch.tensor(
        [
            0,
            *place,
            _ACTIONS.index(mine.action),
            p.epoch,
            p.generation,
            *(getattr(p.capacities, name) for name in _CAPACITY_FIELDS),
        ],
        dtype=torch.int64,
    )


def _plan(row: list[int]) -> Plan:
    return Plan(
        capacities=Capacities(**dict(zip(_CAPACITY_FIELDS, row[_HEAD:], strict=True))),
        epoch=row[_EPOCH],
        generation=row[_GENERATION],
    )


def _raise_out_of_step(
    group: dist.ProcessGroup, mine: LocalOutcome, values: list[list[int]], group_name: str
) -> None:
    error = mine.failure
    failure = (str(error), failure_code(error).value) if error is not None else ("", "")
    gathered = _gather_objects(group, (mine.layer, *failure))
    failures = []
    parts = []
    codes = []
    for rank, (row, item) in enumerate(zip(values, gathered, strict=True)):
        # Every rank here gathers its (layer, text, code): the rows are the same on all.
        layer, text, code = cast(tuple[str, str, str], item)
        if text:
            codes.append(ErrorCode(code))
        where = (
            f"is settling after round {row[_ROUND]} (it passed rounds as covered)"
            if row[_SETTLING]
            else f"needs round {row[_ROUND]} agreed"
        )
        detail = where + (f" (it failed: {text})" if text else "")
        failures.append(RankFailure(ep_rank=rank, layer=str(layer), detail=detail))
        parts.append(f"rank {rank} (layer {_layer_text(str(layer))}) {detail}")
    message = (
        f"ranks of EP group {group_name!r} are out of step: " + "; ".join(parts) + "; a rank "
        "passes a round as covered when what is built serves its layer, so the ranks stated "
        "different layers or sizes in a round; every rank must run the same layers in the "
        "same order"
    )
    if codes:
        # A rank failed where its peers passed as covered: its error is the cause.
        raise error_for_code(codes[0], message) from mine.failure
    raise AgreementError(message, tuple(failures)) from mine.failure


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


def agree_round(
    group: dist.ProcessGroup, mine: LocalOutcome, *, group_name: str
) -> tuple[Action, Plan]:
    """Makes every rank of ``group`` hold the same plan and action, or raise the same error.

    The agreed plan is the join (:func:`moe_sidecar.core.plan.join`) of every
    rank's local plan; the agreed action is the one that asks most among the
    actions the ranks' deciders gave (REUSE < REBUILD < BUILD).

    Args:
        group: the EP group's CPU (gloo) process group; nothing else is used.
        mine: this rank's local plan and action, or failure.
        group_name: the EP group's name, for messages.

    Raises:
        AgreementError: ranks disagree on ``top_k`` or ``num_experts``, or
            are out of step (agreeing on different rounds, or some settling).
        CoordinatorError: at least one rank failed; every rank raises the
            failing rank's error class, naming every failed rank and layer
            (the local failure, if any, is the ``__cause__``).
        InvalidArgument: ``mine`` holds neither a plan nor a failure.
    """
    if mine.plan is None and mine.failure is None:
        raise InvalidArgument("agree_round() needs a plan or a failure")
    row = _row(mine)
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, row, group=group)
    values = [[int(v) for v in r.tolist()] for r in rows]
    if len({(v[_ROUND], v[_SETTLING]) for v in values}) > 1:
        _raise_out_of_step(group, mine, values, group_name)
    if any(v[_FAILED] for v in values):
        _raise_failures(group, mine, group_name)
    plans = [_plan(v) for v in values]
    try:
        plan = functools.reduce(join, plans)
    except ShapeMismatch:
        _raise_disagreement(group, mine, plans, group_name)
        raise  # pragma: no cover - _raise_disagreement always raises
    return _ACTIONS[max(v[_ACTION] for v in values)], plan


def _host_digest() -> int:
    """This host's name as a signed 64-bit number (the first 8 bytes of its
    SHA-256): ranks with equal digests run on one node."""
    digest = hashlib.sha256(socket.gethostname().encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class SecretShare:
    """The group's proof on its way: rank 0 of ``group`` draws
    :data:`GROUP_SECRET_BYTES` random bytes and broadcasts them over
    ``group``, followed by ``owner_key`` (rank 0's; zeros for None), in one
    collective, started here without waiting; with ``count_hosts``, an
    all-gather of each rank's host digest is started first, to count the
    ranks of each node. Every rank must start the same at the same point.

    Raises:
        RuntimeError: a collective could not be started.
        InvalidArgument: ``owner_key`` is not 32 bytes.
    """

    def __init__(
        self, group: dist.ProcessGroup, owner_key: bytes | None = None, *, count_hosts: bool = False
    ) -> None:
        if owner_key is not None and len(owner_key) != _OWNER_KEY_BYTES:
            raise InvalidArgument(f"an owner key is {_OWNER_KEY_BYTES} bytes, not {len(owner_key)}")
        works: list[dist.Work] = []
        self._hosts: list[torch.Tensor] = []
        if count_hosts:
            mine = torch.tensor([_host_digest()], dtype=torch.int64)
            self._hosts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
            works.append(_started(dist.all_gather(self._hosts, mine, group=group, async_op=True)))
        if dist.get_rank(group) == 0:
            key = owner_key or bytes(_OWNER_KEY_BYTES)
            data = list(secrets.token_bytes(GROUP_SECRET_BYTES) + key)
            drawn = torch.tensor(data, dtype=torch.uint8)
        else:
            drawn = torch.zeros(GROUP_SECRET_BYTES + _OWNER_KEY_BYTES, dtype=torch.uint8)
        self._drawn = drawn
        self._rank = dist.get_rank(group)
        source = dist.get_global_rank(group, 0)
        works.append(_started(dist.broadcast(drawn, src=source, group=group, async_op=True)))
        self._works = works
        self._ended = [work.get_future() for work in works]

    def on_done(self, callback: Callable[[], None]) -> None:
        """Calls ``callback`` once (from another thread) when the exchange
        ended: every collective of it done, or one failed."""
        lock = threading.Lock()
        called = False

        def one_ended(_: object) -> None:
            nonlocal called
            with lock:
                if called or not self.done():
                    return
                called = True
            callback()

        for future in self._ended:
            future.add_done_callback(one_ended)

    def done(self) -> bool:
        """Whether the exchange ended: every collective done (every rank of
        the group took part), or one failed (a rank is gone)."""
        return all(f.done() for f in self._ended) or any(_failed(f) for f in self._ended)

    def result(self) -> GroupSecrets:
        """Waits for the exchange; the proof as hex digits and the owner key,
        the same on every rank, and the ranks counted on this rank's host.

        Raises:
            RuntimeError: a collective failed (a rank of the group is gone).
        """
        # A failed collective first: the other may wait for the rank it lost.
        for work in sorted(self._works, key=lambda w: not _failed(w.get_future())):
            work.wait()
        shared = bytes(self._drawn.tolist())
        key = shared[GROUP_SECRET_BYTES:]
        hosts = [int(h.item()) for h in self._hosts]
        local = hosts.count(hosts[self._rank]) if hosts else 0
        return GroupSecrets(shared[:GROUP_SECRET_BYTES].hex(), key if any(key) else None, local)


def _started(work: dist.Work | None) -> dist.Work:
    assert work is not None, "an async_op collective returns its work"
    return work


def _failed(future: torch.futures.Future[object]) -> bool:
    """Whether ``future`` ended with an error."""
    if not future.done():
        return False
    try:
        future.value()
    except RuntimeError:
        return True
    return False


def share_group_secret(
    group: dist.ProcessGroup,
    wait_for: Callable[[SecretShare], None] | None = None,
    owner_key: bytes | None = None,
    *,
    count_hosts: bool = False,
) -> GroupSecrets:
    """The group's proof for this lifetime and rank 0's ``owner_key``
    (:class:`SecretShare`), the same on every rank of ``group``, with the
    ranks of this rank's host counted when ``count_hosts``; ``wait_for`` is
    called with the exchange in flight, to wait for it where more than gloo
    can end the wait.

    Raises:
        RuntimeError: a collective failed (a rank of the group is gone).
        CoordinatorError: raised by ``wait_for`` (the sidecar ended the wait).
    """
    share = SecretShare(group, owner_key, count_hosts=count_hosts)
    if wait_for is not None:
        wait_for(share)
    return share.result()
