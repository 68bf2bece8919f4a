"""Benchmark of the etcd plan store against the SQLite store, in the same run.

    .venv/bin/python -m bench.bench_etcd [--quick]     (from the repository root)

Starts a real etcd (Debian's etcd-server, as the tests do: tests/etcd_server.py)
and real sidecar processes: one on ``--store sqlite:///...`` (the baseline)
and two "nodes", A and B, on ``--store etcd://...``. Drives 8 simulated local
ranks per node over the Unix socket with grpc.aio. Prints:

1. the cost a round pays for the store: round latency p50/p99 on node A
   (etcd) and on the SQLite sidecar, for REUSE rounds (nothing to replicate)
   and for rounds that grow the plan (a SQLite transaction with the outbox
   row, and a push to etcd in the background), with short histories and
   with the 256 growths a group keeps at most, as ratios etcd/SQLite; the
   blocks of rounds alternate between the two sidecars so that load drifts
   hit both alike, and node B is not started yet (in a cluster its merges
   run on its own machine);
2. cross-node warm start: a model init (58 NVFP4-sized layers, then one
   larger MTP layer) on node A, then the same init in a new lifetime on
   node B, against the same init on a fresh SQLite sidecar (what a pod
   re-created on another node gets without etcd): builds and rebuilds, the
   plan at round 1, and the init's wall time as a ratio;
3. how long a growth on A takes to be B's plan (from A's answer to B's
   PLAN_MERGED event on a Watch stream);
4. sidecar start to SERVING, etcd store vs SQLite store (the etcd one reads
   the prefix before it serves).

The sidecars, etcd and this client share the machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_sidecar.core.plan import Capacities
from moe_sidecar.wire.codec import capacities_to_proto
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc
from tests.etcd_server import EtcdServer, etcd_binary

ROOT = Path(__file__).resolve().parent.parent
RANKS = 8
# A DeepSeek-V3 NVFP4 layer (hidden/2 + hidden/16 + routing; bf16 combine) and its bf16 MTP layer.
NVFP4 = Capacities(256, 3584 + 448 + 64, 14336, 8, 256)
MTP = Capacities(256, 14336 + 64, 14336, 8, 256)


def _grown(rnd: int) -> Capacities:
    """A layer needing a little more dispatch bytes each round: every round grows."""
    return Capacities(256, NVFP4.dispatch_bytes_per_token + 64 * rnd, 14336, 8, 256)


@dataclass
class Node:
    name: str
    process: subprocess.Popen[bytes]
    target: str
    start_seconds: float

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_node(workdir: Path, name: str, store: str | None) -> Node:
    """A sidecar process; returns once its health check says SERVING."""
    sock = workdir / f"{name}.sock"
    command = [
        sys.executable,
        "-m",
        "moe_sidecar",
        "--listen",
        f"unix://{sock}",
        "--state-dir",
        str(workdir / name),
        "--node-name",
        name,
        "--health-port",
        "0",
        "--metrics-port",
        "0",
        "--round-timeout",
        "60",
        "--log-level",
        "WARNING",
        *(("--store", store) if store else ()),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")}
    started = time.perf_counter()
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    target = f"unix://{sock}"
    deadline = time.monotonic() + 60
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1, wait_for_ready=True)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return Node(name, process, target, time.perf_counter() - started)
            except grpc.RpcError:
                time.sleep(0.01)
    process.kill()
    raise SystemExit(f"sidecar {name} did not start")


class Ranks:
    """``RANKS`` local ranks of one node, one channel each, as real ranks have."""

    def __init__(self, target: str) -> None:
        self.channels = [grpc.aio.insecure_channel(target) for _ in range(RANKS)]
        self.stubs: list[Any] = [pb_grpc.WorkspaceCoordinatorStub(c) for c in self.channels]

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()

    async def round(
        self, group: str, lifetime: str, rnd: int, need: Capacities, layer: str
    ) -> tuple[float, pb.ProposeResponse]:
        """Every rank proposes round ``rnd`` at once; the time until the last answer."""
        requirement = pb.Requirement(capacities=capacities_to_proto(need), layer=layer)
        t0 = time.perf_counter()
        answers = await asyncio.gather(
            *(
                stub.Propose(
                    pb.ProposeRequest(
                        group=group,
                        ep_size=RANKS,
                        ep_rank=rank,
                        local_ranks=RANKS,
                        lifetime=f"bench-{lifetime}-rank-{rank:04d}",  # >= 16 characters
                        round=rnd,
                        requirement=requirement,
                    ),
                    timeout=60,
                )
                for rank, stub in enumerate(self.stubs)
            )
        )
        return time.perf_counter() - t0, answers[0]


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f}"


# --- 1. the cost a round pays for the store ------------------------------------------


async def round_costs(
    etcd_ranks: Ranks, sqlite_ranks: Ranks, kind: str, rounds: int, blocks: int
) -> dict[str, list[float]]:
    """Alternating blocks of rounds on the two sidecars; latencies per store.

    ``kind``: ``reuse`` (one group, every round after the first a REUSE),
    ``grow`` (every round grows; a new group every 4 rounds, so histories
    stay short, as real ones are) or ``grow-256`` (every round grows one
    group, whose history soon holds the 256 growths it keeps).
    """
    found: dict[str, list[float]] = {"etcd": [], "sqlite": []}
    per_block = rounds // blocks
    done = {"etcd": 0, "sqlite": 0}
    for block in range(blocks):
        order = (("etcd", etcd_ranks), ("sqlite", sqlite_ranks))
        for store, ranks in order if block % 2 == 0 else reversed(order):
            for _ in range(per_block):
                done[store] += 1
                count = done[store]
                group, rnd = f"cost-{kind}", count
                if kind == "grow":
                    group, rnd = f"cost-grow-{(count - 1) // 4}", (count - 1) % 4 + 1
                need = NVFP4 if kind == "reuse" else _grown(rnd)
                seconds, answer = await ranks.round(group, "life", rnd, need, "l")
                assert answer.grew == (kind != "reuse" or rnd == 1), (store, rnd, answer)
                if count > 1:
                    found[store].append(seconds)
    return found


# --- 2 and 3. across nodes -----------------------------------------------------------


async def model_init(ranks: Ranks, group: str, lifetime: str, layers: int) -> dict[str, Any]:
    """``layers - 1`` NVFP4 layers then the MTP layer, as one lifetime; what it did."""
    actions: list[int] = []
    first_plan: pb.Plan | None = None
    started = time.perf_counter()
    for rnd in range(1, layers + 1):
        need = MTP if rnd == layers else NVFP4
        _, answer = await ranks.round(group, lifetime, rnd, need, f"layer.{rnd}")
        actions.append(answer.action)
        if rnd == 1:
            first_plan = answer.plan
    assert first_plan is not None
    return {
        "seconds": time.perf_counter() - started,
        "builds": actions.count(pb.ACTION_BUILD),
        "rebuilds": actions.count(pb.ACTION_REBUILD),
        "round1_bytes": first_plan.workspace_bytes,
    }


async def propagation(a: Ranks, b_target: str, samples: int) -> list[float]:
    """Seconds from A's answer to a growing round until B's PLAN_MERGED event for it."""
    lags: list[float] = []
    group = "propagation"
    async with grpc.aio.insecure_channel(b_target) as channel:
        b: Any = pb_grpc.WorkspaceCoordinatorStub(channel)
        stream = b.Watch(pb.WatchRequest(group=""))
        for rnd in range(1, samples + 1):
            _, answer = await a.round(group, "life", rnd, _grown(rnd), "l")
            answered = time.perf_counter()
            while True:
                event = await asyncio.wait_for(stream.read(), 30)
                if (
                    event.group == group
                    and event.kind == pb.EVENT_KIND_PLAN_MERGED
                    and event.plan.generation == answer.plan.generation
                ):
                    break
            lags.append(time.perf_counter() - answered)
        stream.cancel()
    return lags


# --- report ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """How much each section runs."""

    grow_rounds: int
    reuse_rounds: int
    blocks: int
    samples: int
    layers: int = 59
    extra_starts: int = 5


QUICK = Sizes(grow_rounds=40, reuse_rounds=200, blocks=4, samples=20, extra_starts=3)
FULL = Sizes(grow_rounds=400, reuse_rounds=2000, blocks=8, samples=200)


async def report_round_costs(a_ranks: Ranks, s_ranks: Ranks, sizes: Sizes) -> None:
    print()
    print("1. the cost a round pays for the store (8 local ranks, all released at once)")
    print("   etcd: node A, --store etcd://...; sqlite: --store sqlite:///... (default)")
    print("kind     rounds | etcd p50   p99 ms | sqlite p50  p99 ms | etcd/sqlite p50 x  p99 x")
    for kind, count in (
        ("reuse", sizes.reuse_rounds),
        ("grow", sizes.grow_rounds),
        ("grow-256", sizes.grow_rounds),
    ):
        found = await round_costs(a_ranks, s_ranks, kind, count, sizes.blocks)
        e, s = found["etcd"], found["sqlite"]
        print(
            f"{kind:<8} {len(e):>6} |{ms(pct(e, 50))} "
            f"{ms(pct(e, 99))} |  {ms(pct(s, 50))}{ms(pct(s, 99))} |"
            f"        {pct(e, 50) / pct(s, 50):8.2f} {pct(e, 99) / pct(s, 99):6.2f}"
        )


async def wait_for_generation(target: str, group: str, generation: int) -> None:
    """Until ``group`` on the sidecar at ``target`` has a plan of ``generation`` (30 s at most)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub: Any = pb_grpc.WorkspaceCoordinatorStub(channel)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                found = await stub.GetGroup(pb.GetGroupRequest(group=group))
                if found.plan.generation >= generation:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.01)


async def report_warm_start(
    a_ranks: Ranks, b_ranks: Ranks, b: Node, workdir: Path, nodes: list[Node], layers: int
) -> Node:
    """Section 2; returns the fresh SQLite sidecar it started (also appended to ``nodes``)."""
    on_a = await model_init(a_ranks, "deepseek", "a", layers)
    # B has heard of A's plan once its watch merged it.
    await wait_for_generation(b.target, "deepseek", 2)
    on_b = await model_init(b_ranks, "deepseek", "b", layers)
    fresh = start_node(workdir, "fresh-sqlite", None)
    nodes.append(fresh)
    f_ranks = Ranks(fresh.target)
    try:
        on_fresh = await model_init(f_ranks, "deepseek", "f", layers)
    finally:
        await f_ranks.close()
    print("where                          | builds rebuilds | round-1 plan bytes | init ms")
    for label, result in (
        ("node A (first, etcd)", on_a),
        ("node B (warm, from etcd)", on_b),
        ("fresh node, SQLite only", on_fresh),
    ):
        print(
            f"{label:<30} | {result['builds']:>6} {result['rebuilds']:>8} | "
            f"{result['round1_bytes']:>18} | {result['seconds'] * 1e3:7.1f}"
        )
    print(
        f"node B vs fresh SQLite node: rebuilds {on_b['rebuilds']} vs "
        f"{on_fresh['rebuilds']}; round-1 plan x"
        f"{on_b['round1_bytes'] / on_fresh['round1_bytes']:.2f}; init time x"
        f"{on_b['seconds'] / on_fresh['seconds']:.2f}"
    )
    return fresh


def report_starts(workdir: Path, url: str, nodes: list[Node], extra: int) -> None:
    """Section 4: the start times of ``nodes`` (by store) and of ``extra`` more of each."""
    print()
    print("4. sidecar start to SERVING (a process start, state load, and for etcd the read)")
    starts: dict[str, list[float]] = {"sqlite": [], "etcd": []}
    for node in nodes:
        starts["sqlite" if "sqlite" in node.name else "etcd"].append(node.start_seconds)
    for i in range(extra):
        for store in ("sqlite", "etcd"):
            node = start_node(workdir, f"start-{store}-{i}", url if store == "etcd" else None)
            starts[store].append(node.start_seconds)
            node.stop()
    etcd_start = statistics.median(starts["etcd"])
    sqlite_start = statistics.median(starts["sqlite"])
    print(
        f"median of {len(starts['etcd'])}: etcd {etcd_start * 1e3:.0f} ms, sqlite "
        f"{sqlite_start * 1e3:.0f} ms, etcd/sqlite x{etcd_start / sqlite_start:.2f}"
    )


async def run_sections(workdir: Path, url: str, sizes: Sizes, nodes: list[Node]) -> None:
    """Sections 1-4 against one etcd; every sidecar started is appended to ``nodes``."""
    sqlite = start_node(workdir, "sqlite", None)
    nodes.append(sqlite)
    a = start_node(workdir, "node-a", url)
    nodes.append(a)
    a_ranks, s_ranks = Ranks(a.target), Ranks(sqlite.target)
    b_ranks: Ranks | None = None
    try:
        await report_round_costs(a_ranks, s_ranks, sizes)
        print()
        print(
            f"2. cross-node warm start: a model init of {sizes.layers} layers (58 NVFP4, then MTP)"
        )
        # Node B starts now: section 1 measured node A with no other node
        # sharing this machine's cores (in a cluster, B's merges run on B).
        b = start_node(workdir, "node-b", url)
        nodes.append(b)
        b_ranks = Ranks(b.target)
        fresh = await report_warm_start(a_ranks, b_ranks, b, workdir, nodes, sizes.layers)
        print()
        print(f"3. a growth on node A reaches node B ({sizes.samples} growths, one at a time)")
        lags = await propagation(a_ranks, b.target, sizes.samples)
        print(
            f"A's answer -> B's PLAN_MERGED: p50 {ms(pct(lags, 50))} ms, "
            f"p99 {ms(pct(lags, 99))} ms, mean {ms(statistics.fmean(lags))} ms"
        )
    finally:
        for ranks in (a_ranks, b_ranks, s_ranks):
            if ranks is not None:
                await ranks.close()
    report_starts(workdir, url, [sqlite, fresh, a, b], sizes.extra_starts)


async def run(quick: bool, binary: str) -> None:
    sizes = QUICK if quick else FULL
    print(
        f"# bench_etcd: python {sys.version.split()[0]}, grpcio {grpc.__version__}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, {RANKS} local ranks"
    )
    with tempfile.TemporaryDirectory(prefix="bench-etcd-") as tmp:
        workdir = Path(tmp)
        etcd = EtcdServer(workdir / "etcd", binary=binary)
        (workdir / "etcd").mkdir()
        etcd.start()
        nodes: list[Node] = []
        try:
            await run_sections(workdir, f"etcd://{etcd.endpoint}/bench", sizes, nodes)
        finally:
            for node in nodes:
                node.stop()
            etcd.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    args = parser.parse_args(argv)
    binary = etcd_binary()
    if binary is None:
        raise SystemExit("etcd not installed (Debian: apt-get install etcd-server)")
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    print(f"# {version.stdout.splitlines()[0] if version.stdout else binary}")
    asyncio.run(run(args.quick, binary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
