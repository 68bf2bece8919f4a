"""Benchmark of the sidecar over a Unix socket, against the bare decision core
and a bare gRPC stream server.

    python bench/bench_sidecar.py [--quick]

Starts ``python -m moe_sidecar`` as a subprocess (its own process, so that its
resident memory is its own). Every round after the first is a REUSE round,
the common case. In one run it measures:

* REUSE rounds at 8 local ranks from 8 rank processes, each a synchronous
  :class:`~moe_sidecar.client.transport.GrpcTransport` as real ranks use:
  over Session streams to the sidecar (what ranks do), over the same streams
  to a bare grpc.aio server that answers each round's 8 messages once all 8
  have arrived (the floor: what gRPC streams alone cost here), and as unary
  Propose calls to the sidecar (old clients, grpcurl). The three are
  interleaved in blocks, so a change of the machine's load hits each alike.
  A round lasts from the first rank's send to the last rank's answer
  (CLOCK_MONOTONIC, which every process shares). Targets: session/floor
  <= 1.3x p50 and <= 1.5x p99; the state holder <= 100 us per proposal at 8
  ranks.
* Rounds of Propose calls from simulated ranks in this process (grpc.aio, one
  channel per rank) at 1, 8 and 64 local ranks, next to the same rounds
  through :func:`moe_sidecar.core.policy.propose` (the core) and to empty health
  Checks; the in-process state holder (Coordinator) alone.
* What a round's answer commits to SQLite before it leaves: the group's
  row, and a REUSE round's short record, per write and as a ratio.
* Proposals per second with many groups in flight; the sidecar's RSS with
  1,000 groups next to the bare core's heap for the same groups.

The client ranks and the sidecar share this machine's cores, so the figures
include the clients' own gRPC cost.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import queue
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import grpc
import psutil  # type: ignore[import-untyped]
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_sidecar import flashinfer as _flashinfer
from moe_sidecar.core import limits as _limits
from moe_sidecar.core import policy
from moe_sidecar.core.group import Decision, GroupState, Proposal, Requirement
from moe_sidecar.core.plan import Action, Capacities, Plan
from moe_sidecar.logs import configure_logging
from moe_sidecar.servicer import SERVICE_NAME
from moe_sidecar.state import Coordinator
from moe_sidecar.store.sqlite import ReuseRecord, StateStore
from moe_sidecar.wire.codec import capacities_to_proto, decision_to_proto
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc

CEILING = _limits.WorkspaceCeiling(_limits.DEFAULT_MAX_WORKSPACE_BYTES, _flashinfer.workspace_size)

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {
    "session_over_floor_p50": 1.3,
    "session_over_floor_p99": 1.5,
    "holder_us_per_proposal_at_8": 100.0,
    "proposals_per_s": 2000.0,
    "rss_mb_1000_groups": 80.0,
}
PROCESS_RANKS = 8
"""Local ranks (and rank processes) of the rounds measured from processes."""
NEED = Requirement(
    # A DeepSeek-V3 NVFP4 layer: hidden/2 + hidden/16 + 8 * top_k, then bf16 combine.
    Capacities(
        max_tokens=256,
        dispatch_bytes_per_token=3584 + 448 + 64,
        combine_bytes_per_token=14336,
        top_k=8,
        num_experts=256,
    ),
    layer="model.layers.3.mlp",
)


def _grown(rnd: int) -> Capacities:
    """Round ``rnd``'s layer: a larger dispatch payload each round, so each round grows."""
    return Capacities(256, NEED.capacities.dispatch_bytes_per_token * rnd, 14336, 8, 256)


@dataclass
class Series:
    """Per-round latencies (seconds) and the wall time they took."""

    latencies: list[float]
    wall: float
    proposals: int

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]

    @property
    def rate(self) -> float:
        return self.proposals / self.wall


def _request(
    group: str, ranks: int, rank: int, rnd: int, ep_size: int | None = None
) -> pb.ProposeRequest:
    return pb.ProposeRequest(
        group=group,
        ep_size=ep_size or max(ranks, 8),
        ep_rank=rank,
        local_ranks=ranks,
        lifetime=f"bench-{group}-{rank}-lifetime-token",
        round=rnd,
        requirement=pb.Requirement(
            capacities=capacities_to_proto(NEED.capacities), layer=NEED.layer
        ),
    )


# --- the bare core ---------------------------------------------------------------------


def core_rounds(ranks: int, rounds: int, warmup: int) -> Series:
    """The same rounds through policy.propose alone: no gRPC, no asyncio, no disk."""
    state: GroupState | None = None
    ep_size = max(ranks, 8)
    latencies = []
    started = 0.0
    for rnd in range(1, warmup + rounds + 1):
        if rnd == warmup + 1:
            started = time.perf_counter()
        t0 = time.perf_counter()
        for rank in range(ranks):
            proposal = Proposal("core", ep_size, rank, ranks, f"core-{rank}", rnd, NEED)
            state = policy.propose(state, proposal, time.time(), 60.0, ceiling=CEILING).state
        if rnd > warmup:
            latencies.append(time.perf_counter() - t0)
    return Series(latencies, time.perf_counter() - started, ranks * rounds)


def store_writes(workdir: Path, blocks: int, writes: int) -> tuple[list[float], list[float]]:
    """Seconds per write of what a round's answer commits first, in
    interleaved blocks on one database: the group's row (a round that
    builds, grows or is refused) and a REUSE round's short record. The group
    is the core's own after 64 rounds of 8 ranks, so its row holds the 64
    retained outcomes it holds in the sidecar."""
    state: GroupState | None = None
    for rnd in range(1, 65):
        for rank in range(8):
            proposal = Proposal("store", 8, rank, 8, f"store-{rank}", rnd, NEED)
            state = policy.propose(state, proposal, time.time(), 60.0, ceiling=CEILING).state
    assert state is not None
    store = StateStore(workdir / "store-writes")
    rows: list[float] = []
    records: list[float] = []
    try:
        store.save(state)
        rnd = state.last_closed_round
        for _ in range(blocks):
            t0 = time.perf_counter()
            for _ in range(writes):
                store.save(state)
            rows.append((time.perf_counter() - t0) / writes)
            t0 = time.perf_counter()
            for _ in range(writes):
                rnd += 1
                store.record_reuse(ReuseRecord(state.name, 1, rnd, NEED.layer))
            records.append((time.perf_counter() - t0) / writes)
        return rows, records
    finally:
        store.close()


def core_heap_of_groups(groups: int, ranks: int, rounds: int) -> int:
    """Bytes of Python heap that ``groups`` group states hold (tracemalloc)."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    states: dict[str, GroupState] = {}
    for g in range(groups):
        name = f"model-{g}/ep{ranks}"
        state = None
        for rnd in range(1, rounds + 1):
            need = Requirement(_grown(rnd), f"layer.{rnd}")
            for rank in range(ranks):
                state = policy.propose(
                    state,
                    Proposal(name, ranks, rank, ranks, f"l{rank}", rnd, need),
                    0.0,
                    60.0,
                    ceiling=CEILING,
                ).state
        assert state is not None
        states[name] = state
    size = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return size


async def coordinator_rounds(workdir: Path, ranks: int, rounds: int, warmup: int) -> Series:
    """The same rounds through the sidecar's state holder in this process: the core
    plus asyncio waiting, the SQLite write, the JSON log line and the metrics; no gRPC."""
    store = StateStore(workdir / f"coordinator-{ranks}")
    coordinator = Coordinator(store, round_timeout=60.0)
    coordinator.start()
    ep_size = max(ranks, 8)
    latencies = []
    started = 0.0
    try:
        for rnd in range(1, warmup + rounds + 1):
            if rnd == warmup + 1:
                started = time.perf_counter()
            t0 = time.perf_counter()
            await asyncio.gather(
                *(
                    coordinator.propose(
                        Proposal("coord", ep_size, rank, ranks, f"c-{rank}", rnd, NEED)
                    )
                    for rank in range(ranks)
                )
            )
            if rnd > warmup:
                latencies.append(time.perf_counter() - t0)
        return Series(latencies, time.perf_counter() - started, ranks * rounds)
    finally:
        coordinator.close()


# --- the sidecar -----------------------------------------------------------------------


def start_sidecar(workdir: Path, max_groups: int) -> tuple[subprocess.Popen[bytes], str]:
    sock = workdir / "bench.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sidecar",
            "--listen",
            f"unix://{sock}",
            "--state-dir",
            str(workdir / "state"),
            "--health-port",
            "0",
            "--metrics-port",
            "0",
            "--round-timeout",
            "60",
            # Every group of the run must fit: the memory figure's fill alone
            # is beyond the default --max-groups.
            "--max-groups",
            str(max_groups),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    target = f"unix://{sock}"
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1, wait_for_ready=True)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return process, target
            except grpc.RpcError:
                time.sleep(0.05)
    process.kill()
    raise SystemExit("the sidecar did not start")


async def _timed_rounds(
    target: str,
    ranks: int,
    rounds: int,
    warmup: int,
    call: Callable[[grpc.aio.Channel, int, int], Awaitable[Any]],
) -> Series:
    """Runs ``call(channel, rank, round)`` for every rank at once, round after round."""
    channels = [grpc.aio.insecure_channel(target) for _ in range(ranks)]
    try:
        latencies = []
        started = 0.0
        for rnd in range(1, warmup + rounds + 1):
            if rnd == warmup + 1:
                started = time.perf_counter()
            t0 = time.perf_counter()
            await asyncio.gather(*(call(channels[rank], rank, rnd) for rank in range(ranks)))
            if rnd > warmup:
                latencies.append(time.perf_counter() - t0)
        return Series(latencies, time.perf_counter() - started, ranks * rounds)
    finally:
        for channel in channels:
            await channel.close()


async def sidecar_rounds(target: str, group: str, ranks: int, rounds: int, warmup: int) -> Series:
    """Rounds of Propose calls, every rank of a round at once."""

    async def propose(channel: grpc.aio.Channel, rank: int, rnd: int) -> None:
        stub: Any = pb_grpc.WorkspaceCoordinatorStub(channel)
        answer = await stub.Propose(_request(group, ranks, rank, rnd), timeout=30)
        assert answer.round == rnd and answer.plan.capacities == capacities_to_proto(
            NEED.capacities
        )

    return await _timed_rounds(target, ranks, rounds, warmup, propose)


async def empty_rpc_rounds(target: str, ranks: int, rounds: int, warmup: int) -> Series:
    """The gRPC floor: the same pattern of calls, each a health Check doing nothing."""

    async def check(channel: grpc.aio.Channel, rank: int, rnd: int) -> None:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)

    return await _timed_rounds(target, ranks, rounds, warmup, check)


async def saturated_rate(target: str, groups: int, ranks: int, rounds: int) -> float:
    """Proposals per second with ``groups`` groups running rounds at once."""
    started = time.perf_counter()
    await asyncio.gather(
        *(sidecar_rounds(target, f"sat-{g}", ranks, rounds, 0) for g in range(groups))
    )
    return groups * ranks * rounds / (time.perf_counter() - started)


async def fill_groups(target: str, groups: int, ranks: int, rounds: int, parallel: int) -> None:
    async def one(g: int, stubs: list[Any]) -> None:
        name = f"model-{g}/ep{ranks}"
        for rnd in range(1, rounds + 1):
            need = pb.Requirement(capacities=capacities_to_proto(_grown(rnd)), layer=f"layer.{rnd}")
            await asyncio.gather(
                *(
                    stubs[rank].Propose(
                        pb.ProposeRequest(
                            group=name,
                            ep_size=ranks,
                            ep_rank=rank,
                            local_ranks=ranks,
                            lifetime=f"l{rank}-lifetime-token",
                            round=rnd,
                            requirement=need,
                        ),
                        timeout=60,
                    )
                    for rank in range(ranks)
                )
            )

    channels = [grpc.aio.insecure_channel(target) for _ in range(ranks)]
    stubs: list[Any] = [pb_grpc.WorkspaceCoordinatorStub(c) for c in channels]
    try:
        queue = list(range(groups))

        async def worker() -> None:
            while queue:
                await one(queue.pop(), stubs)

        await asyncio.gather(*(worker() for _ in range(parallel)))
    finally:
        for channel in channels:
            await channel.close()


# --- rounds from rank processes: Session streams, the bare-stream floor, unary ---------

_MODES = ("session", "floor", "unary")


def _rank_process(rank: int, ranks: int, commands: Any, results: Any) -> None:
    """One rank: runs ``count`` REUSE rounds per ``(mode, target, group, count)``
    command through a synchronous GrpcTransport (Session streams, or unary
    calls for ``"unary"``), one transport per mode for the process's life.
    Puts ``(rank, [(sent, answered), ...], cpu_seconds)`` (CLOCK_MONOTONIC; the
    process's CPU time over the command, every thread) per command."""
    try:
        from moe_sidecar.client.transport import GrpcTransport

        transports: dict[str, GrpcTransport] = {}
        rounds: dict[str, int] = {}
        lifetime = f"bench-rank-{rank}-lifetime-token"
        while True:
            command = commands.get()
            if command is None:
                break
            mode, target, group, count = command
            if mode not in transports:
                transports[mode] = GrpcTransport(
                    target, propose_timeout=30.0, session=mode != "unary"
                )
                rounds[mode] = 0
            transport = transports[mode]
            times = []
            cpu = time.process_time()
            for _ in range(count):
                rounds[mode] += 1
                proposal = Proposal(group, ranks, rank, ranks, lifetime, rounds[mode], NEED)
                sent = time.monotonic()
                decision = transport.propose(proposal)
                times.append((sent, time.monotonic()))
                if rounds[mode] > 1 and decision.action is not Action.REUSE:
                    raise AssertionError(f"{mode} round {rounds[mode]}: {decision}")
            results.put((rank, times, time.process_time() - cpu))
        for transport in transports.values():
            transport.close()
    except BaseException as error:
        results.put((rank, f"{type(error).__name__}: {error}", 0.0))


def _floor_server(path: str, ranks: int, ready: Any) -> None:
    asyncio.run(_serve_floor(path, ranks, ready))


async def _serve_floor(path: str, ranks: int, ready: Any) -> None:
    """A bare grpc.aio server of the Session method on a Unix socket: each
    message is answered (with a REUSE decision of its round) once every one
    of the ``ranks`` streams has sent its message of that round. No state,
    no store, no logs: what the streams alone cost."""
    loop = asyncio.get_running_loop()
    template = decision_to_proto(
        Decision(0, Action.REUSE, Plan(NEED.capacities, 0, 1), False, NEED.layer), ranks, ""
    )
    arrived: dict[int, list[asyncio.Future[None]]] = {}

    async def session(requests: Any, context: Any) -> Any:
        async for request in requests:
            rnd = request.propose.round
            future: asyncio.Future[None] = loop.create_future()
            waiting = arrived.setdefault(rnd, [])
            waiting.append(future)
            if len(waiting) == ranks:
                del arrived[rnd]
                for each in waiting:
                    each.set_result(None)
            await future
            response = pb.SessionResponse(id=request.id)
            response.decision.CopyFrom(template)
            response.decision.round = rnd
            yield response

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE_NAME,
                {
                    "Session": grpc.stream_stream_rpc_method_handler(
                        session,
                        request_deserializer=pb.SessionRequest.FromString,
                        response_serializer=pb.SessionResponse.SerializeToString,
                    )
                },
            ),
        )
    )
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    ready.set()
    await server.wait_for_termination()


@dataclass
class ProcessRounds:
    """Round latencies and per-call latencies of one mode, and the server's CPU
    (the sidecar's, or the floor server's)."""

    rounds: list[float]
    calls: list[float]
    server_cpu: float = 0.0
    client_cpu: float = 0.0

    def pct(self, q: float, values: list[float] | None = None) -> float:
        ordered = sorted(self.rounds if values is None else values)
        return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def process_rounds(
    workdir: Path,
    target: str,
    sidecar: psutil.Process,
    blocks: int,
    rounds: int,
    warmup: int,
    modes: tuple[str, ...] = _MODES,
) -> dict[str, ProcessRounds]:
    """REUSE rounds at 8 local ranks from 8 rank processes, in each of
    ``modes``, interleaved block by block."""
    context = multiprocessing.get_context("spawn")
    floor_path = workdir / "floor.sock"
    ready = context.Event()
    floor = context.Process(
        target=_floor_server, args=(str(floor_path), PROCESS_RANKS, ready), daemon=True
    )
    floor.start()
    results: Any = context.Queue()
    commands = [context.Queue() for _ in range(PROCESS_RANKS)]
    ranks = [
        context.Process(
            target=_rank_process, args=(r, PROCESS_RANKS, commands[r], results), daemon=True
        )
        for r in range(PROCESS_RANKS)
    ]
    for process in ranks:
        process.start()
    targets = {"session": target, "floor": f"unix://{floor_path}", "unary": target}

    def run(mode: str, count: int) -> tuple[list[list[tuple[float, float]]], float]:
        for r in range(PROCESS_RANKS):
            commands[r].put((mode, targets[mode], f"bench-{mode}/ep{PROCESS_RANKS}", count))
        got: dict[int, Any] = {}
        cpu = 0.0
        while len(got) < PROCESS_RANKS:
            try:
                rank, times, seconds = results.get(timeout=300)
            except queue.Empty:
                raise SystemExit(f"{mode}: the rank processes did not answer") from None
            if isinstance(times, str):
                raise SystemExit(f"{mode}: rank {rank} failed: {times}")
            got[rank] = times
            cpu += seconds
        return [got[r] for r in range(PROCESS_RANKS)], cpu

    measured = {mode: ProcessRounds([], []) for mode in modes}
    try:
        deadline = time.monotonic() + 60
        while not ready.wait(timeout=0.1):
            if not floor.is_alive() or time.monotonic() > deadline:
                raise SystemExit("the floor server did not start")
        for mode in modes:
            run(mode, warmup)  # channels, streams, the group's first (BUILD) round
        servers = {"session": sidecar, "unary": sidecar, "floor": psutil.Process(floor.pid)}
        for _ in range(blocks):
            for mode in modes:
                cpu = _cpu_seconds(servers[mode])
                per_rank, client_cpu = run(mode, rounds)
                measured[mode].server_cpu += _cpu_seconds(servers[mode]) - cpu
                measured[mode].client_cpu += client_cpu
                for rnd in range(rounds):
                    sent = [times[rnd][0] for times in per_rank]
                    answered = [times[rnd][1] for times in per_rank]
                    measured[mode].rounds.append(max(answered) - min(sent))
                    measured[mode].calls.extend(a - s for s, a in zip(sent, answered, strict=True))
    finally:
        for r in range(PROCESS_RANKS):
            commands[r].put(None)
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        floor.kill()
        floor.join(timeout=10)
    return measured


# --- report ----------------------------------------------------------------------------


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f}"


async def run(quick: bool) -> int:
    print(
        f"# bench_sidecar: python {sys.version.split()[0]}, grpcio {grpc.__version__}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, "
        f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
    )
    plan = {1: (2000, 200), 8: (1000, 100), 64: (200, 20)}
    if quick:
        plan = {1: (200, 20), 8: (100, 10), 64: (20, 5)}
    results: dict[int, tuple[Series, Series]] = {}
    sat_groups, sat_ranks, sat_rounds = (16, 8, 20) if quick else (16, 8, 100)
    fill_groups_count, fill_ranks, fill_rounds = (1000, 8, 3) if not quick else (200, 8, 3)
    # The sidecar holds every group the run creates: one per process-round
    # mode that talks to it (session, unary), one per latency row, the
    # saturation groups and the fill.
    run_groups = (len(_MODES) - 1) + len(plan) + sat_groups + fill_groups_count
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
        process, target = start_sidecar(Path(tmp), run_groups)
        sidecar = psutil.Process(process.pid)
        try:
            idle_rss = sidecar.memory_info().rss
            blocks, block_rounds, block_warmup = (2, 100, 20) if quick else (10, 300, 50)
            by_mode = await asyncio.to_thread(
                process_rounds, Path(tmp), target, sidecar, blocks, block_rounds, block_warmup
            )
            session, floor_streams = by_mode["session"], by_mode["floor"]
            print()
            print(
                f"REUSE rounds at {PROCESS_RANKS} local ranks from {PROCESS_RANKS} rank processes "
                f"(synchronous GrpcTransport), {blocks} blocks x {block_rounds} rounds per mode,"
            )
            print(
                "  interleaved; a round: the first rank's send to the last rank's answer "
                "(CLOCK_MONOTONIC)"
            )
            print("  session: Session streams to the sidecar (what ranks use)")
            print(
                "  floor:   the same streams to a bare grpc.aio server answering each round's "
                f"{PROCESS_RANKS} messages once all have arrived"
            )
            print("  unary:   Propose calls to the sidecar (old clients, grpcurl)")
            print(
                f"{'mode':<8} | {'round p50':>9} {'p99 ms':>8} | {'call p50':>8} {'p99 ms':>8} | "
                f"{'CPU us/message: server':>22} {'rank':>5}"
            )
            for mode in _MODES:
                m = by_mode[mode]
                cpu = (
                    f"{m.server_cpu / len(m.calls) * 1e6:>22.0f} "
                    f"{m.client_cpu / len(m.calls) * 1e6:>5.0f}"
                )
                print(
                    f"{mode:<8} | {_ms(m.pct(50)):>9} {_ms(m.pct(99)):>8} | "
                    f"{_ms(m.pct(50, m.calls)):>8} {_ms(m.pct(99, m.calls)):>8} | {cpu}"
                )
            p50_ratio = session.pct(50) / floor_streams.pct(50)
            p99_ratio = session.pct(99) / floor_streams.pct(99)
            print(
                f"session / floor: p50 {p50_ratio:.2f}x, p99 {p99_ratio:.2f}x "
                f"(targets <= {TARGETS['session_over_floor_p50']:g}x, "
                f"<= {TARGETS['session_over_floor_p99']:g}x); session p99 "
                f"{session.pct(99) * 1e3:.3f} ms"
            )

            print()
            print(
                "round latency, simulated ranks in this process (grpc.aio; all ranks released at "
                "once, until the last answer)"
            )
            print("  sidecar: Propose over the Unix socket; core: policy.propose in this process;")
            print("  floor: the same calls as empty health Checks (what gRPC alone costs here)")
            print(
                f"{'ranks':>5} | {'sidecar p50':>11} {'p99 ms':>8} {'props/s':>8} | "
                f"{'core p50':>8} {'p99 ms':>7} {'props/s':>8} | "
                f"{'floor p50':>9} {'p99 ms':>7} | "
                f"{'vs core p50 x':>13} {'p99 x':>6} {'rate x':>7} | {'vs floor p99 x':>14}"
            )
            cpu_lines = []
            holder_lines = []
            holder_us: dict[int, float] = {}
            for ranks, (rounds, warmup) in plan.items():
                cpu0 = _cpu_seconds(sidecar)
                over_grpc = await sidecar_rounds(target, f"lat/ep{ranks}", ranks, rounds, warmup)
                cpu1 = _cpu_seconds(sidecar)
                core = core_rounds(ranks, rounds, warmup)
                floor = await empty_rpc_rounds(target, ranks, rounds, warmup)
                holder = await coordinator_rounds(Path(tmp), ranks, rounds, warmup)
                holder_us[ranks] = holder.wall / holder.proposals * 1e6
                holder_lines.append(
                    f"{ranks:>5} | {_ms(holder.pct(50)):>8} {_ms(holder.pct(99)):>8} "
                    f"{holder.rate:>8.0f} | {holder.wall / holder.proposals * 1e6:>14.1f} | "
                    f"{core.wall / core.proposals * 1e6:>11.1f}"
                )
                cpu2 = _cpu_seconds(sidecar)
                calls = ranks * (rounds + warmup)
                cpu_lines.append(
                    f"{ranks:>5} | {(cpu1 - cpu0) / calls * 1e6:>18.0f} | "
                    f"{(cpu2 - cpu1) / calls * 1e6:>22.0f}"
                )
                results[ranks] = (over_grpc, core)
                print(
                    f"{ranks:>5} | {_ms(over_grpc.pct(50)):>11} {_ms(over_grpc.pct(99)):>8} "
                    f"{over_grpc.rate:>8.0f} | {_ms(core.pct(50)):>8} {_ms(core.pct(99)):>7} "
                    f"{core.rate:>8.0f} | {_ms(floor.pct(50)):>9} {_ms(floor.pct(99)):>7} | "
                    f"{over_grpc.pct(50) / core.pct(50):>13.1f} "
                    f"{over_grpc.pct(99) / core.pct(99):>6.1f} {over_grpc.rate / core.rate:>7.4f} | "
                    f"{over_grpc.pct(99) / floor.pct(99):>14.2f}"
                )

            print()
            print(
                "in-process state holder (Coordinator: core + asyncio + SQLite + log + metrics, no gRPC)"
            )
            print(
                f"{'ranks':>5} | {'p50 ms':>8} {'p99 ms':>8} {'props/s':>8} | "
                f"{'us/proposal':>14} | {'core us/pr':>11}"
            )
            print("\n".join(holder_lines))
            print()
            print("sidecar process CPU per call (user+system), load-independent-ish")
            print(f"{'ranks':>5} | {'per Propose (us)':>18} | {'per empty Check (us)':>22}")
            print("\n".join(cpu_lines))

            rows, records = store_writes(Path(tmp), 5, 200 if quick else 2000)
            row_us, record_us = median(rows) * 1e6, median(records) * 1e6
            print()
            print(
                "what a round's answer commits first (SQLite WAL, 5 interleaved blocks, median): "
                f"the group's row {row_us:.1f} us, a REUSE round's record {record_us:.1f} us "
                f"(ratio {record_us / row_us:.2f}; {record_us / PROCESS_RANKS:.1f} us per "
                f"proposal at {PROCESS_RANKS} ranks)"
            )

            saturated = await saturated_rate(target, sat_groups, sat_ranks, sat_rounds)
            core_sat = core_rounds(8, 500, 50).rate
            print()
            print(
                f"throughput with {sat_groups} groups x {sat_ranks} ranks in flight: "
                f"{saturated:.0f} proposals/s (core alone: {core_sat:.0f}/s, "
                f"ratio {saturated / core_sat:.4f})"
            )

            groups, ranks, rounds = fill_groups_count, fill_ranks, fill_rounds
            fill_started = time.perf_counter()
            await fill_groups(target, groups, ranks, rounds, parallel=16)
            fill_wall = time.perf_counter() - fill_started
            full_rss = sidecar.memory_info().rss
            core_heap = core_heap_of_groups(groups, ranks, rounds)
            print()
            print(
                f"memory with {groups} groups ({ranks} local ranks, {rounds} rounds each, "
                f"filled at {groups * ranks * rounds / fill_wall:.0f} proposals/s):"
            )
            print(
                f"  sidecar RSS {full_rss / 2**20:.1f} MiB (idle with 0 groups: "
                f"{idle_rss / 2**20:.1f} MiB; growth {(full_rss - idle_rss) / 2**20:.1f} MiB)"
            )
            print(
                f"  bare core heap for the same groups: {core_heap / 2**20:.1f} MiB; "
                f"sidecar growth / core heap = {(full_rss - idle_rss) / max(core_heap, 1):.2f}"
            )
        finally:
            process.terminate()
            process.wait(timeout=30)

    best_rate = max(saturated, *(s.rate for s, _ in results.values()))
    rss_mb = full_rss / 2**20
    print()
    print(f"targets (load average at the end {os.getloadavg()[0]:.2f}):")
    for name, value, target_value, ok in (
        (
            "session / floor p50 at 8 ranks (x)",
            p50_ratio,
            TARGETS["session_over_floor_p50"],
            p50_ratio <= TARGETS["session_over_floor_p50"],
        ),
        (
            "session / floor p99 at 8 ranks (x)",
            p99_ratio,
            TARGETS["session_over_floor_p99"],
            p99_ratio <= TARGETS["session_over_floor_p99"],
        ),
        (
            "state holder at 8 ranks (us/proposal)",
            holder_us[8],
            TARGETS["holder_us_per_proposal_at_8"],
            holder_us[8] <= TARGETS["holder_us_per_proposal_at_8"],
        ),
        (
            "proposals/s (best sustained)",
            best_rate,
            TARGETS["proposals_per_s"],
            best_rate >= TARGETS["proposals_per_s"],
        ),
        (
            f"RSS with {groups} groups (MiB)",
            rss_mb,
            TARGETS["rss_mb_1000_groups"],
            rss_mb <= TARGETS["rss_mb_1000_groups"],
        ),
    ):
        print(f"  {name:<36} {value:10.2f}  target {target_value:g}  {'met' if ok else 'MISSED'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    args = parser.parse_args(argv)
    with open(os.devnull, "w") as devnull:
        # The in-process state holder logs like the sidecar does: JSON lines, discarded.
        configure_logging("json", "INFO", devnull)
        return asyncio.run(run(args.quick))


if __name__ == "__main__":
    sys.exit(main())
