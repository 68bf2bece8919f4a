"""One rank process of ``moe-sidecar simulate``: a model's MoE layers through the manager.

Each rank joins a gloo group on 127.0.0.1, builds every layer's all-to-all
through :class:`moe_sidecar.client.WorkspaceManager` with the ``reference``
backend (the rounds, builds, rebuilds and commits of an inference server's
start-up) and, where it is cheap, runs a real dispatch and combine whose
result is checked exactly: that is what fails with ``workspace insufficient
for combine payload region`` when a workspace is too small. What happens goes
to the parent through a queue.
"""

from __future__ import annotations

import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from moe_sidecar.client import WorkspaceManager
from moe_sidecar.client.backends.reference import expert_owner
from moe_sidecar.client.errors import CoordinatorError
from moe_sidecar.client.simulate.presets import MoeLayer
from moe_sidecar.client.simulate.records import (
    RankReport,
    RankStarted,
    RoundRecord,
    SimulatedRankFailure,
    SimulationConfig,
)
from moe_sidecar.core.defaults import EMBEDDED
from moe_sidecar.core.errors import quote_name

__all__ = ["rank_main"]


def _exchange(manager: WorkspaceManager, layer: MoeLayer, tokens: int, seed: int) -> float:
    """Dispatch, expert compute and combine of ``tokens`` tokens per rank.

    Each token carries one small integer ``v`` in its hidden states; an
    expert multiplies it by the token's routing weight, so the combined
    result must be exactly ``v * sum(weights)`` in every column. Returns the
    largest difference (0.0 when exact).
    """
    a2a = manager.moe_alltoall
    assert a2a is not None
    g = torch.Generator().manual_seed(seed * 1009 + manager.ep_rank)
    # Values and weights small enough that every product is exact in bf16.
    values = torch.randint(1, 16, (tokens,), generator=g)
    ids = (
        torch.rand(tokens, layer.num_experts, generator=g)
        .topk(layer.top_k, dim=1)
        .indices.to(torch.int32)
    )
    weights = torch.randint(1, 3, (tokens, layer.top_k), generator=g).to(torch.float32)
    if layer.quant == "nvfp4":
        x = values.to(torch.uint8)[:, None].expand(tokens, layer.x_bytes_per_token).contiguous()
        x_sf = torch.randint(
            0, 256, (tokens, layer.x_sf_bytes_per_token), generator=g, dtype=torch.uint8
        )
        payloads = [x, x_sf, ids, weights]
    else:
        x = values.to(torch.bfloat16)[:, None].expand(tokens, layer.hidden_size).contiguous()
        payloads = [x, ids, weights]
    received = a2a.dispatch(ids, payloads, tokens)
    token_values = received[0][..., 0].to(torch.float32)
    mine = expert_owner(received[-2], layer.num_experts, manager.ep_size) == manager.ep_rank
    factor = (received[-1] * mine).sum(dim=-1)
    expert_out = (
        (token_values * factor)[..., None]
        .expand(manager.ep_size, tokens, layer.hidden_size)
        .to(torch.bfloat16)
        .contiguous()
    )
    output = torch.empty(tokens, layer.hidden_size, dtype=torch.bfloat16)
    manager.combine_into(expert_out, tokens, output)
    expected = (values.to(torch.float32) * weights.sum(dim=-1))[:, None]
    return float((output.to(torch.float32) - expected).abs().max())


def _checked_exchange(manager: WorkspaceManager, layer: MoeLayer, tokens: int, seed: int) -> None:
    """A dispatch+combine of ``layer``'s shape on the current workspace, checked exact.

    Raises:
        RuntimeError: the combined result is off.
    """
    error = _exchange(manager, layer, tokens, seed)
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


def _run_rank(ep_rank: int, config: SimulationConfig, events: Any, target: str | None) -> None:
    """Runs the model's layers on this rank and sends its report (rank 0: every round too).

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
        if config.check and record.action != "reuse":
            # Every rank takes the same branch, so the collective exchange matches up.
            _checked_exchange(manager, layer, config.max_tokens, seed=index)
            checked.append(layer.name)
        if ep_rank == 0:
            events.put(record)
    if config.check:
        checked.extend(_check_every_shape(manager, config))
    report = _report(manager, ep_rank, checked)
    manager.cleanup()
    events.put(report)


def rank_main(
    ep_rank: int, config: SimulationConfig, init_method: str, events: Any, target: str | None
) -> None:
    """A rank process: joins the gloo group at ``init_method``, runs the layers, reports.

    A failure is sent to the parent as a :class:`SimulatedRankFailure`.

    Raises:
        SystemExit: with status 1, after any failure.
    """
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
        try:
            events.put(RankStarted(ep_rank))
            _run_rank(ep_rank, config, events, target)
        finally:
            dist.destroy_process_group()
    except BaseException as error:
        events.put(
            SimulatedRankFailure(
                ep_rank=ep_rank,
                error_type=type(error).__name__,
                message=str(error),
                traceback="" if isinstance(error, CoordinatorError) else traceback.format_exc(),
            )
        )
        raise SystemExit(1) from None
