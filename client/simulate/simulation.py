"""``moe-sidecar simulate``: a model's MoE layers on N CPU ranks, end to end.

Spawns one process per EP rank (gloo on 127.0.0.1), and in each runs the
model's MoE layer sequence through :class:`moe_sidecar.client.WorkspaceManager` with the
``reference`` backend: the same rounds, builds, rebuilds and commits an
inference server does at start-up, against a running sidecar (``--target``,
default ``$MOE_SIDECAR_TARGET``) or, with no target, the decision core inside
the ranks (embedded mode). Where it is cheap (after every build and, at the
end, once per layer shape on the final workspace) it runs a real dispatch and
combine and checks the result exactly, which is what fails with
``workspace insufficient for combine payload region`` when a workspace is
too small.

The parent prints one line per round as rank 0 finishes it, then a summary:
rounds, builds, the final workspace of every rank, the builds and growths with
the layers that caused them, the sidecar's history of the group, wall time.
Run it twice against one sidecar and the second run builds once (the warm
restart).

``--nodes 2 --store etcd://HOST:PORT/PREFIX`` is the multi-node story on one
machine: simulate starts two sidecars (``node-a``, ``node-b``, each with its
own throwaway state dir) on the given etcd, gives each half of the ranks,
and the EP group spans both "nodes": every round is decided by each node's
sidecar for its ranks and agreed across nodes with one all-gather folded
with the join. Run it twice and the second run builds once although its
sidecars start with empty state dirs: the plan came back from etcd.

The ``sidecar`` package imports no torch; this module does, so ``moe_sidecar.cli``
imports it only when ``simulate`` runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, TextIO

import grpc
import torch
import torch.distributed as dist
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_sidecar.client.backends.reference import expert_owner
from moe_sidecar.client.errors import CoordinatorError
from moe_sidecar.client.manager import WorkspaceManager
from moe_sidecar.core.cluster import plan_origin
from moe_sidecar.core.defaults import EMBEDDED, ENV_TARGET
from moe_sidecar.core.group import Growth
from moe_sidecar.core.limits import MAX_EP_SIZE
from moe_sidecar.wire.codec import summary_from_proto
from moe_sidecar.wire.display import format_bytes, format_time
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = [
    "MODELS",
    "ModelPreset",
    "MoeLayer",
    "NodeView",
    "RankFailure",
    "RankReport",
    "RoundRecord",
    "SimulationConfig",
    "SimulationResult",
    "format_summary",
    "resolve_target",
    "run_cli",
    "run_simulation",
]

Quantization = Literal["nvfp4", "bf16"]


@dataclass(frozen=True)
class MoeLayer:
    """One MoE layer as an inference server describes it to the manager."""

    name: str
    quant: Quantization
    hidden_size: int
    top_k: int
    num_experts: int

    @property
    def x_bytes_per_token(self) -> int:
        """Dispatched hidden states: two FP4 values per byte, or bf16."""
        return self.hidden_size // 2 if self.quant == "nvfp4" else self.hidden_size * 2

    @property
    def x_sf_bytes_per_token(self) -> int:
        """NVFP4's one FP8 scale per 16 values; bf16 has none."""
        return self.hidden_size // 16 if self.quant == "nvfp4" else 0


@dataclass(frozen=True)
class ModelPreset:
    """A model's MoE layers, in the order its ranks initialize them."""

    name: str
    summary: str
    layers: tuple[MoeLayer, ...]


def _deepseek_v3() -> ModelPreset:
    # DeepSeek-V3: layers 0-2 are dense, 3-60 are MoE, 61 is the MTP head.
    # Quantized to NVFP4 the base MoE layers dispatch hidden/2 + hidden/16
    # bytes per token; the MTP head stays bf16 and dispatches hidden*2.
    def layer(index: int, quant: Quantization) -> MoeLayer:
        return MoeLayer(f"model.layers.{index}.mlp", quant, 7168, top_k=8, num_experts=256)

    base = tuple(layer(i, "nvfp4") for i in range(3, 61))
    mtp = layer(61, "bf16")
    return ModelPreset(
        "deepseek-v3",
        "DeepSeek-V3 with NVFP4 experts: 58 NVFP4 MoE layers, then the bf16 MTP layer "
        "(hidden 7168, top_k 8, 256 experts); the MTP layer grows the workspace",
        (*base, mtp),
    )


def _qwen3_30b_a3b() -> ModelPreset:
    return ModelPreset(
        "qwen3-30b-a3b",
        "Qwen3-30B-A3B in bf16: 48 identical MoE layers (hidden 2048, top_k 8, 128 experts); "
        "homogeneous, so one build and no growth",
        tuple(
            MoeLayer(f"model.layers.{i}.mlp", "bf16", 2048, top_k=8, num_experts=128)
            for i in range(48)
        ),
    )


MODELS: Mapping[str, ModelPreset] = {p.name: p for p in (_deepseek_v3(), _qwen3_30b_a3b())}
"""The presets ``--model`` accepts, by name."""
MAX_NODES = 4
"""Sidecars ``--nodes`` may start."""
NODE_NAMES = tuple(f"node-{letter}" for letter in "abcd")


# --- configuration and results ------------------------------------------------------


@dataclass(frozen=True)
class SimulationConfig:
    """One run of the demo; validated on construction.

    Raises:
        ValueError: a value out of range (the message names it).
    """

    model: ModelPreset
    ranks: int
    target: str | None
    """The sidecar's address, or None for embedded mode."""
    group: str
    max_tokens: int
    propose_timeout: float | None
    """Seconds one Propose may wait (None: the manager's default)."""
    timeout: float
    """Seconds the whole run may take before the ranks are stopped."""
    check: bool
    """Run the dispatch+combine checks."""
    nodes: int = 1
    """Sidecars to start on ``store`` and split the ranks between (1: none started)."""
    store: str = ""
    """The etcd URL the started sidecars share (``nodes`` > 1)."""

    def __post_init__(self) -> None:
        fewest_experts = min(layer.num_experts for layer in self.model.layers)
        if not 1 <= self.ranks <= min(MAX_EP_SIZE, fewest_experts):
            raise ValueError(
                f"--ranks {self.ranks}: must be in [1, {min(MAX_EP_SIZE, fewest_experts)}] "
                f"({self.model.name} has {fewest_experts} experts; FlashInfer allows "
                f"{MAX_EP_SIZE} ranks)"
            )
        if not 1 <= self.max_tokens <= 4096:
            raise ValueError(f"--max-tokens {self.max_tokens}: must be in [1, 4096]")
        if not 0 < self.timeout <= 86400:
            raise ValueError(f"--timeout {self.timeout}: must be in (0, 86400] seconds")
        if self.propose_timeout is not None and not 0 < self.propose_timeout <= 86400:
            raise ValueError(
                f"--propose-timeout {self.propose_timeout}: must be in (0, 86400] seconds"
            )
        if not 1 <= self.nodes <= min(MAX_NODES, self.ranks):
            raise ValueError(
                f"--nodes {self.nodes}: must be in [1, {min(MAX_NODES, self.ranks)}] "
                f"(at most {MAX_NODES}, and at least one rank per node)"
            )
        if self.nodes > 1 and self.target is not None:
            raise ValueError("--nodes starts its own sidecars: leave out --target")
        if self.nodes > 1 and not self.store.startswith(("etcd://", "etcds://")):
            raise ValueError(
                f"--nodes {self.nodes} needs --store etcd://HOST:PORT/PREFIX, the etcd the "
                "started sidecars share (e.g. run `etcd --data-dir /tmp/etcd` and pass "
                "--store etcd://127.0.0.1:2379/moe-simulate)"
            )

    @property
    def embedded(self) -> bool:
        return self.target is None and self.nodes == 1

    def node_of(self, ep_rank: int) -> int:
        """The node (0-based) whose sidecar rank ``ep_rank`` talks to: contiguous blocks."""
        return ep_rank * self.nodes // self.ranks

    def local_ranks(self, ep_rank: int) -> int:
        """How many ranks share ``ep_rank``'s node."""
        node = self.node_of(ep_rank)
        return sum(1 for r in range(self.ranks) if self.node_of(r) == node)


@dataclass(frozen=True)
class RoundRecord:
    """What one round did, as rank 0 saw it (every rank takes the same branch)."""

    round: int
    layer: str
    quant: str
    action: str
    """``build``, ``rebuild`` or ``reuse``."""
    workspace_bytes: int
    max_num_tokens: int
    generation: int
    seconds: float


@dataclass(frozen=True)
class RankReport:
    """Where one rank ended."""

    ep_rank: int
    workspace_bytes: int
    max_num_tokens: int
    generation: int
    rounds: int
    builds: int
    rebuilds: int
    reuses: int
    rpcs: int
    collectives: int
    checked_layers: tuple[str, ...]
    """Layers whose dispatch+combine was checked (exact on every one)."""


@dataclass(frozen=True)
class RankFailure:
    """A rank's error, sent to the parent before the rank exits."""

    ep_rank: int
    error_type: str
    message: str
    traceback: str


@dataclass(frozen=True)
class NodeView:
    """What one node's sidecar holds of the group at the end of a ``--nodes`` run."""

    node: str
    target: str
    epoch: int
    generation: int
    workspace_bytes: int
    origin_node: str
    """The node whose sidecar made the plan (from the growth history)."""
    origin_time: float


@dataclass
class SimulationResult:
    """Everything the summary shows; ``failures`` empty means success."""

    model: str
    ranks: int
    target: str | None
    group: str
    rounds: list[RoundRecord] = field(default_factory=list)
    reports: list[RankReport] = field(default_factory=list)
    failures: list[RankFailure] = field(default_factory=list)
    error: str = ""
    """A failure outside the ranks (sidecar unreachable, the run timed out)."""
    sidecar_lifetimes: int = 0
    sidecar_history: list[Growth] = field(default_factory=list)
    nodes: list[NodeView] = field(default_factory=list)
    """Each started node's view of the group (``--nodes``)."""
    startup_seconds: float = 0.0
    wall_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures and not self.error and len(self.reports) == self.ranks

    @property
    def nodes_agree(self) -> bool:
        """Every started node holds the same plan (vacuously true without ``--nodes``)."""
        return len({(v.epoch, v.generation, v.workspace_bytes) for v in self.nodes}) <= 1

    @property
    def builds(self) -> int:
        return sum(1 for r in self.rounds if r.action == "build")

    @property
    def rebuilds(self) -> int:
        return sum(1 for r in self.rounds if r.action == "rebuild")

    def as_json(self) -> dict[str, Any]:
        """Plain JSON values, with the derived counts."""
        document = asdict(self)
        document.update(
            ok=self.ok, builds=self.builds, rebuilds=self.rebuilds, nodes_agree=self.nodes_agree
        )
        return document


@dataclass(frozen=True)
class _RankStarted:
    ep_rank: int


# --- inside a rank ------------------------------------------------------------------


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
    error = _exchange(manager, layer, tokens, seed)
    if error != 0.0:
        raise RuntimeError(
            f"dispatch+combine of layer {layer.name!r} on rank {manager.ep_rank}: the "
            f"combined result is off by {error} (expected exact)"
        )


def _run_rank(ep_rank: int, config: SimulationConfig, events: Any, target: str | None) -> None:
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
        if config.check and action != "reuse":
            # Every rank takes the same branch, so the collective exchange matches up.
            _checked_exchange(manager, layer, config.max_tokens, seed=index)
            checked.append(layer.name)
        if ep_rank == 0:
            events.put(
                RoundRecord(
                    round=after.rounds,
                    layer=layer.name,
                    quant=layer.quant,
                    action=action,
                    workspace_bytes=manager.workspace_size,
                    max_num_tokens=manager.max_num_tokens,
                    generation=manager.generation,
                    seconds=seconds,
                )
            )
    if config.check:
        # The point of the union: the final workspace serves every layer shape.
        shapes: dict[tuple[str, int], MoeLayer] = {}
        for layer in config.model.layers:
            shapes.setdefault((layer.quant, layer.hidden_size), layer)
        for index, layer in enumerate(shapes.values()):
            _checked_exchange(manager, layer, config.max_tokens, seed=10_000 + index)
            checked.append(layer.name)
    counters = manager.counters
    report = RankReport(
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
    manager.cleanup()
    events.put(report)


def _rank_main(
    ep_rank: int, config: SimulationConfig, port: int, events: Any, target: str | None
) -> None:
    """A rank process: joins the gloo group, runs the layers, reports."""
    # N ranks share a small machine; one intra-op thread each avoids thrashing.
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=ep_rank,
            world_size=config.ranks,
            timeout=timedelta(seconds=config.timeout),
        )
        try:
            events.put(_RankStarted(ep_rank))
            _run_rank(ep_rank, config, events, target)
        finally:
            dist.destroy_process_group()
    except BaseException as error:
        events.put(
            RankFailure(
                ep_rank=ep_rank,
                error_type=type(error).__name__,
                message=str(error),
                traceback="" if isinstance(error, CoordinatorError) else traceback.format_exc(),
            )
        )
        raise SystemExit(1) from None


# --- the parent -----------------------------------------------------------------------


def resolve_target(given: str | None, environ: Mapping[str, str]) -> str | None:
    """The sidecar address to use, or None for embedded mode.

    ``given`` (``--target``) wins; else ``$MOE_SIDECAR_TARGET``; unset, empty
    or ``embedded`` means embedded mode.
    """
    target = (given if given is not None else environ.get(ENV_TARGET, "")).strip()
    return None if not target or target == EMBEDDED else target


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _check_reachable(target: str, timeout: float) -> str:
    """An error message when the sidecar at ``target`` does not answer health checks."""
    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
    except grpc.RpcError as error:
        code = error.code().name if isinstance(error, grpc.Call) else "error"
        details = error.details() if isinstance(error, grpc.Call) else str(error)
        return (
            f"cannot reach the sidecar at {target}: {code}: {details}. Start one with "
            "`moe-sidecar serve`, or leave out --target (and MOE_SIDECAR_TARGET) for "
            "embedded mode"
        )
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return f"the sidecar at {target} is {status}"
    return ""


@contextlib.contextmanager
def _node_sidecars(config: SimulationConfig, say: Callable[[str], None]) -> Iterator[list[str]]:
    """Starts one sidecar per node on ``config.store``; yields their targets.

    Each has a throwaway state dir: whatever a node knows at start comes from etcd.

    Raises:
        RuntimeError: a sidecar exited or did not serve in time (with its log).
    """
    directory = Path(tempfile.mkdtemp(prefix="moe-simulate-"))
    processes: list[subprocess.Popen[bytes]] = []
    targets: list[str] = []
    try:
        for name in NODE_NAMES[: config.nodes]:
            target = f"unix://{directory}/{name}.sock"
            command = [
                sys.executable,
                "-m",
                "moe_sidecar",
                "--listen",
                target,
                "--store",
                config.store,
                "--node-name",
                name,
                "--state-dir",
                str(directory / name),
                "--health-port",
                "0",
                "--metrics-port",
                "0",
                "--log-format",
                "text",
                "--log-level",
                "WARNING",
            ]
            env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")}
            with open(directory / f"{name}.log", "ab") as log:
                processes.append(
                    subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
                )
            targets.append(target)
        for name, target, process in zip(NODE_NAMES, targets, processes, strict=False):
            deadline = time.monotonic() + 30.0
            while _check_reachable(target, timeout=1.0):
                if process.poll() is not None or time.monotonic() > deadline:
                    log_text = (directory / f"{name}.log").read_text(errors="replace")
                    raise RuntimeError(
                        f"the sidecar of {name} did not start ({config.store}):\n"
                        + "\n".join(log_text.splitlines()[-15:])
                    )
                time.sleep(0.1)
            say(f"  {name}: a sidecar on {target}, plans in {config.store}")
        yield targets
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        shutil.rmtree(directory, ignore_errors=True)


def _fetch_node_views(result: SimulationResult, targets: Sequence[str]) -> None:
    for name, target in zip(NODE_NAMES, targets, strict=False):
        with grpc.insecure_channel(target) as channel:
            group = summary_from_proto(
                pb_grpc.WorkspaceCoordinatorStub(channel).GetGroup(
                    pb.GetGroupRequest(group=result.group), timeout=5.0
                )
            )
        if group.plan is None:
            continue
        origin = plan_origin(group.history, group.plan)
        result.nodes.append(
            NodeView(
                node=name,
                target=target,
                epoch=group.plan.epoch,
                generation=group.plan.generation,
                workspace_bytes=group.workspace_bytes(group.plan),
                origin_node=origin.node if origin is not None else "",
                origin_time=origin.at if origin is not None else 0.0,
            )
        )


def _fetch_history(result: SimulationResult, target: str) -> None:
    with grpc.insecure_channel(target) as channel:
        group = summary_from_proto(
            pb_grpc.WorkspaceCoordinatorStub(channel).GetGroup(
                pb.GetGroupRequest(group=result.group), timeout=5.0
            )
        )
    result.sidecar_lifetimes = group.lifetimes
    result.sidecar_history = list(group.history)


def _progress_line(record: RoundRecord, total: int) -> str:
    width = len(str(total))
    return (
        f"  round {record.round:>{width}}/{total}  {record.layer:<22} {record.quant:<5}  "
        f"{record.action.upper():<7}  workspace {format_bytes(record.workspace_bytes):>10}  "
        f"generation {record.generation}  {record.seconds * 1000:7.1f} ms"
    )


def _stop(processes: Sequence[multiprocessing.process.BaseProcess]) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)


def _collect(
    config: SimulationConfig,
    result: SimulationResult,
    processes: Sequence[multiprocessing.process.BaseProcess],
    events: Any,
    say: Callable[[str], None],
    wall_start: float,
) -> None:
    """Reads the ranks' events into ``result`` until they finish, fail or time out."""
    deadline = wall_start + config.timeout
    started: set[int] = set()
    failed_at: float | None = None
    while True:
        try:
            event = events.get(timeout=0.1)
        except queue.Empty:
            event = None
        if isinstance(event, _RankStarted):
            started.add(event.ep_rank)
            if len(started) == config.ranks:
                result.startup_seconds = time.monotonic() - wall_start
                say(f"  {config.ranks} ranks up in {result.startup_seconds:.1f} s")
        elif isinstance(event, RoundRecord):
            result.rounds.append(event)
            say(_progress_line(event, len(config.model.layers)))
        elif isinstance(event, RankReport):
            result.reports.append(event)
        elif isinstance(event, RankFailure):
            result.failures.append(event)
            failed_at = failed_at or time.monotonic()
        if event is not None:
            continue
        if all(not p.is_alive() for p in processes):
            return
        now = time.monotonic()
        # After one failure the others usually fail too (and say why); give
        # them a moment, then stop the ones still waiting.
        if failed_at is not None and now - failed_at > 3.0:
            return
        if now > deadline:
            result.error = (
                f"timed out after {config.timeout:g} s (--timeout); rank 0 finished "
                f"{len(result.rounds)} of {len(config.model.layers)} rounds"
            )
            return


def _settle(
    result: SimulationResult, processes: Sequence[multiprocessing.process.BaseProcess]
) -> None:
    """Names a rank that exited without a report; orders reports and failures."""
    for rank, process in enumerate(processes):
        reported = any(f.ep_rank == rank for f in result.failures) or any(
            r.ep_rank == rank for r in result.reports
        )
        if not reported and not result.error and not result.failures:
            result.error = f"rank {rank} exited with code {process.exitcode} without a report"
    result.reports.sort(key=lambda r: r.ep_rank)
    result.failures.sort(key=lambda f: f.ep_rank)


def run_simulation(config: SimulationConfig, progress: TextIO | None = None) -> SimulationResult:
    """Runs the demo and returns what happened.

    A rank's failure, an unreachable sidecar or a run past ``config.timeout``
    is reported in the result (``ok`` is False), not raised. Progress (one
    line per round) goes to ``progress`` when given.

    Raises:
        OSError: the rank processes could not be started.
    """
    result = SimulationResult(
        model=config.model.name, ranks=config.ranks, target=config.target, group=config.group
    )
    wall_start = time.monotonic()

    def say(line: str) -> None:
        if progress is not None:
            print(line, file=progress, flush=True)

    if config.target is not None:
        result.error = _check_reachable(config.target, timeout=5.0)
        if result.error:
            return result
    if config.nodes > 1:
        where = f"{config.nodes} sidecars (nodes) sharing plans through {config.store}"
    elif config.target:
        where = f"the sidecar at {config.target}"
    else:
        where = "embedded mode (no sidecar)"
    say(
        f"simulate {config.model.name}: {len(config.model.layers)} MoE layers on "
        f"{config.ranks} CPU ranks, max_num_tokens {config.max_tokens}, group "
        f"{config.group!r}, decided by {where}"
    )
    with contextlib.ExitStack() as stack:
        if config.nodes > 1:
            try:
                targets = stack.enter_context(_node_sidecars(config, say))
            except RuntimeError as error:
                result.error = str(error)
                return result
        else:
            targets = [config.target] if config.target is not None else []
        _run_ranks(config, result, targets, say, wall_start)
        if targets and not result.error:
            # The history is a nicety; the run's own results stand without it.
            with contextlib.suppress(grpc.RpcError):
                _fetch_history(result, targets[0])
            if config.nodes > 1:
                with contextlib.suppress(grpc.RpcError):
                    _fetch_node_views(result, targets)
    result.wall_seconds = time.monotonic() - wall_start
    return result


def _run_ranks(
    config: SimulationConfig,
    result: SimulationResult,
    targets: Sequence[str],
    say: Callable[[str], None],
    wall_start: float,
) -> None:
    context = multiprocessing.get_context("spawn")
    events = context.Queue()
    port = _free_port()
    processes = [
        context.Process(
            target=_rank_main,
            args=(rank, config, port, events, targets[config.node_of(rank)] if targets else None),
            name=f"simulate-rank{rank}",
            daemon=True,
        )
        for rank in range(config.ranks)
    ]
    for process in processes:
        process.start()
    try:
        _collect(config, result, processes, events, say, wall_start)
    finally:
        _stop(processes)
    _settle(result, processes)


def _count(n: int, noun: str) -> str:
    """``1 collective``, ``2 collectives``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def format_summary(result: SimulationResult) -> str:
    """The summary printed at the end of a run."""
    lines = [""]
    if result.error:
        lines.append(f"FAILED: {result.error}")
    seen: set[tuple[str, str]] = set()
    for failure in result.failures:
        if (failure.error_type, failure.message) in seen:
            lines.append(f"FAILED: rank {failure.ep_rank}: the same {failure.error_type}")
            continue
        seen.add((failure.error_type, failure.message))
        lines.append(f"FAILED: rank {failure.ep_rank}: {failure.error_type}: {failure.message}")
        if failure.traceback:
            lines.append(failure.traceback.rstrip())
    reuses = len(result.rounds) - result.builds - result.rebuilds
    lines.append(
        f"rounds: {len(result.rounds)}   builds: {result.builds}   rebuilds: "
        f"{result.rebuilds}   reuses: {reuses}"
    )
    if result.reports:
        lines.append("final workspace per rank:")
        for report in result.reports:
            lines.append(
                f"  rank {report.ep_rank}: {format_bytes(report.workspace_bytes)} "
                f"({report.workspace_bytes} B), max_num_tokens {report.max_num_tokens}, "
                f"generation {report.generation}; {_count(report.rpcs, 'RPC')}, "
                f"{_count(report.collectives, 'collective')}"
            )
        checked = result.reports[0].checked_layers
        if checked:
            lines.append(
                f"dispatch+combine: exact on {len(checked)} checks (after every build, then "
                "every layer shape on the final workspace)"
            )
    lines.append("builds and growths in this run:")
    grown = [r for r in result.rounds if r.action != "reuse"]
    for record in grown:
        verb = "built" if record.action == "build" else "grew to"
        lines.append(
            f"  round {record.round} {record.layer} ({record.quant}): {verb} "
            f"{format_bytes(record.workspace_bytes)}, generation {record.generation}"
        )
    if not grown:
        lines.append("  (none)")
    elif result.rebuilds == 0 and result.sidecar_lifetimes > 1:
        lines.append(
            "  warm restart: the sidecar remembered the plan, so round 1 built the union at once"
        )
    elif result.rebuilds == 0 and result.nodes and grown[0].round == 1 and grown[0].generation > 1:
        lines.append(
            "  warm start from etcd: the sidecars started with empty state dirs, and round 1 "
            "built the plan the cluster had"
        )
    if result.nodes:
        lines.append(f"nodes ({len(result.nodes)} sidecars, one etcd):")
        for view in result.nodes:
            lines.append(
                f"  {view.node}: generation {view.generation} (epoch {view.epoch}), "
                f"{format_bytes(view.workspace_bytes)}, plan from "
                f"{view.origin_node or 'an unrecorded node'} at {format_time(view.origin_time)}"
            )
        lines.append(
            "  the nodes agree on the plan"
            if result.nodes_agree
            else "  the nodes DISAGREE on the plan"
        )
    if result.sidecar_history:
        lines.append(
            f"sidecar history of {result.group!r} ({result.sidecar_lifetimes} lifetime(s)):"
        )
        for growth in result.sidecar_history:
            workspace = growth.plan.capacities.workspace_bytes(result.ranks)
            lines.append(
                f"  generation {growth.plan.generation}: {format_bytes(workspace)}, "
                f"max_tokens {growth.plan.capacities.max_tokens}, caused by layer "
                f"{growth.layer!r} (rank {growth.ep_rank}, round {growth.round}"
                + (f", {growth.node})" if growth.node else ")")
            )
    lines.append(
        f"wall time: {result.wall_seconds:.1f} s (ranks up after {result.startup_seconds:.1f} s)"
    )
    lines.append("OK" if result.ok and result.nodes_agree else "FAILED")
    return "\n".join(lines) + "\n"


def _list_models() -> str:
    lines = []
    for preset in MODELS.values():
        lines.append(f"{preset.name}: {preset.summary}")
    return "\n".join(lines) + "\n"


def run_cli(args: argparse.Namespace) -> int:
    """The ``moe-sidecar simulate`` command, on flags parsed by ``moe_sidecar.cli``.

    Returns 0 when every rank finished and every check held, 1 on any
    failure (printed with the error), 2 for bad flags.
    """
    if args.list_models:
        sys.stdout.write(_list_models())
        return 0
    model = MODELS.get(args.model)
    if model is None:
        print(
            f"moe-sidecar simulate: unknown --model {args.model!r}; presets: {', '.join(MODELS)}",
            file=sys.stderr,
        )
        return 2
    try:
        config = SimulationConfig(
            model=model,
            ranks=args.ranks,
            target=resolve_target(args.target, os.environ),
            group=args.group or f"simulate:{model.name}/ep{args.ranks}/pp0",
            max_tokens=args.max_tokens,
            propose_timeout=args.propose_timeout,
            timeout=args.timeout,
            check=args.check,
            nodes=args.nodes,
            store=args.store or "",
        )
    except ValueError as error:
        print(f"moe-sidecar simulate: {error}", file=sys.stderr)
        return 2
    progress = sys.stderr if args.json else sys.stdout
    try:
        result = run_simulation(config, progress=progress)
    except KeyboardInterrupt:
        print("moe-sidecar simulate: interrupted", file=sys.stderr)
        return 130
    ok = result.ok and result.nodes_agree
    if args.json:
        print(json.dumps(result.as_json(), indent=2))
        if not ok:
            sys.stderr.write(format_summary(result))
    else:
        sys.stdout.write(format_summary(result))
    return 0 if ok else 1
