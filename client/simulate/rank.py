"""One rank process of ``moe-sidecar simulate``: a model's MoE layers through the manager.

Each rank joins a gloo group on 127.0.0.1, builds every layer's all-to-all
through :class:`moe_sidecar.client.WorkspaceManager` with the ``reference``
backend (the rounds, builds, rebuilds and commits of an inference server's
start-up) and, where it is cheap, runs a real dispatch and combine whose
result is checked exactly: that is what fails with ``workspace insufficient
for combine payload region`` when a workspace is too small. What happens goes
to the parent through a pipe of its own, each message written before the
call returns: a rank that a peer-loss policy ends with ``os._exit`` loses
nothing it sent. Its stderr goes to a file the parent reads (the line the
library prints about a dead peer is there).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from moe_sidecar.client import WorkspaceManager
from moe_sidecar.client.errors import CoordinatorError
from moe_sidecar.client.simulate.kill_round import run_kill_round
from moe_sidecar.client.simulate.presets import MoeLayer
from moe_sidecar.client.simulate.records import (
    RankReport,
    RankStarted,
    RoundRecord,
    SimulatedRankFailure,
    SimulationConfig,
)
from moe_sidecar.client.simulate.steps import exchange
from moe_sidecar.core.defaults import EMBEDDED, ENV_ON_PEER_LOSS
from moe_sidecar.core.errors import quote_name

__all__ = ["rank_main"]


def _checked_exchange(manager: WorkspaceManager, layer: MoeLayer, tokens: int, seed: int) -> None:
    """A dispatch+combine of ``layer``'s shape on the current workspace, checked exact.

    Raises:
        RuntimeError: the combined result is off.
    """
    error = exchange(manager, layer, tokens, seed)
    if error != 0.0:
        raise RuntimeError(
            f"dispatch+combine of layer {quote_name(layer.name)} on rank {manager.ep_rank}: the "
            f"combined result is off by {error} (expected exact)"
        )


def _initialize_layer(
    manager: WorkspaceManager, config: SimulationConfig, layer: MoeLayer
) -> RoundRecord:
    """One layer's round through the manager, and the branch it took."""
    before = manager.counters
    started = time.perf_counter()
    manager.initialize(
        config.max_tokens,
        layer.top_k,
        layer.num_experts,
        layer.hidden_size,
        layer.x_bytes_per_token,
        layer.x_sf_bytes_per_token,
        layer=layer.name,
    )
    seconds = time.perf_counter() - started
    after = manager.counters
    action = (
        "build"
        if after.builds > before.builds
        else "rebuild"
        if after.rebuilds > before.rebuilds
        else "reuse"
    )
    return RoundRecord(
        round=after.rounds,
        layer=layer.name,
        quant=layer.quant,
        action=action,
        workspace_bytes=manager.workspace_size,
        max_num_tokens=manager.max_num_tokens,
        generation=manager.generation,
        seconds=seconds,
    )


def _check_every_shape(manager: WorkspaceManager, config: SimulationConfig) -> list[str]:
    """The point of the union: the final workspace serves every layer shape.

    Raises:
        RuntimeError: a shape's dispatch+combine was not exact.
    """
    shapes: dict[tuple[str, int], MoeLayer] = {}
    for layer in config.model.layers:
        shapes.setdefault((layer.quant, layer.hidden_size), layer)
    for index, layer in enumerate(shapes.values()):
        _checked_exchange(manager, layer, config.max_tokens, seed=10_000 + index)
    return [layer.name for layer in shapes.values()]


def _report(manager: WorkspaceManager, ep_rank: int, checked: list[str]) -> RankReport:
    counters = manager.counters
    return RankReport(
        ep_rank=ep_rank,
        workspace_bytes=manager.workspace_size,
        max_num_tokens=manager.max_num_tokens,
        generation=manager.generation,
        rounds=counters.rounds,
        builds=counters.builds,
        rebuilds=counters.rebuilds,
        reuses=counters.reuses,
        rpcs=counters.rpcs,
        collectives=counters.collectives,
        checked_layers=tuple(checked),
    )


def _run_rank(
    ep_rank: int, config: SimulationConfig, channel: Connection, target: str | None
) -> bool:
    """Runs the model's layers on this rank and sends its report (rank 0: every
    round too); True when a peer was killed and this survivor reported on it
    instead (the group is broken: no teardown that would wait for the dead).

    Raises:
        RuntimeError: a dispatch+combine check was not exact.
        CoordinatorError: the manager's round or build failed.
    """
    # Every rank of the run is one EP group; its gloo group is what vLLM hands over.
    manager = WorkspaceManager(
        dist.new_group(backend="gloo"),
        group=config.group,
        target=target or EMBEDDED,
        backend="reference",
        local_ranks=None if target is None else config.local_ranks(ep_rank),
        propose_timeout=config.propose_timeout,
    )
    checked: list[str] = []
    for index, layer in enumerate(config.model.layers):
        record = _initialize_layer(manager, config, layer)
        if ep_rank == 0:
            channel.send(record)  # sent at once: a failure after it leaves the round counted
        if config.check and record.action != "reuse":
            # Every rank takes the same branch, so the collective exchange matches up.
            _checked_exchange(manager, layer, config.max_tokens, seed=index)
            checked.append(layer.name)
        if config.kill_rank is not None and record.round == config.kill_round:
            run_kill_round(manager, config, layer, record.round, channel.send)
            with contextlib.suppress(CoordinatorError):  # the dead rank's round may be refused
                manager.cleanup()
            return True
    if config.check:
        checked.extend(_check_every_shape(manager, config))
    report = _report(manager, ep_rank, checked)
    manager.cleanup()
    channel.send(report)
    return False


def _stderr_to(path: str) -> None:
    """This process's stderr (file descriptor 2, and so ``sys.stderr``) into ``path``."""
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)
    os.close(fd)


def rank_main(
    ep_rank: int,
    config: SimulationConfig,
    init_method: str,
    channel: Connection,
    target: str | None,
    stderr_path: str,
) -> None:
    """A rank process: joins the gloo group at ``init_method``, runs the layers, reports.

    A failure is sent to the parent as a :class:`SimulatedRankFailure`.

    Raises:
        SystemExit: with status 1, after any failure.
    """
    _stderr_to(stderr_path)
    if config.on_peer_loss is not None:
        os.environ[ENV_ON_PEER_LOSS] = config.on_peer_loss  # read by the manager's watcher
    # N ranks share a small machine; one intra-op thread each avoids thrashing.
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=ep_rank,
            world_size=config.ranks,
            timeout=timedelta(seconds=config.timeout),
        )
        channel.send(RankStarted(ep_rank))
        if _run_rank(ep_rank, config, channel, target):
            # A peer is dead: tearing the process group down could wait for it.
            sys.stderr.flush()
            os._exit(0)
        dist.destroy_process_group()
    except BaseException as error:
        channel.send(
            SimulatedRankFailure(
                ep_rank=ep_rank,
                error_type=type(error).__name__,
                message=str(error),
                traceback="" if isinstance(error, CoordinatorError) else traceback.format_exc(),
                at=time.monotonic(),
            )
        )
        raise SystemExit(1) from None
