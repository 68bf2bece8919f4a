"""Memory a sidecar holds after Session streams opened and closed, batch by
batch, against its own first batch in the same run.

    .venv/bin/python -m bench.bench_session_churn [--batches B] [--per-batch N] [--at-once]

Starts a real sidecar process on a TCP port. Each batch opens N Session
streams from a real grpc-python client, one after another (or, with
``--at-once``, all N held open together); each proposes round 1 of a one-rank
group (a new lifetime each time; with ``--at-once`` each session of a batch has
a group of its own, the same N groups every batch) and reads its answer, then closes. Once the sidecar counts
no session open (its ``moe_sidecar_sessions`` gauge), it prints the sidecar's
RSS (VmRSS). Prints the last batch's RSS over the first's.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import grpc

from bench.sidecar_process import metric_value, rss_mib, running_sidecar
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc
from tests.integration.helpers import propose_request
from tests.multiprocess.harness import free_port

GROUP = "churn/ep1"


async def _open_session(stub: Any, lifetime: str, group: str = GROUP) -> Any:
    call = stub.Session()
    request = propose_request(0, group=group, ep_size=1, local_ranks=1, lifetime=lifetime)
    await call.write(pb.SessionRequest(id=1, propose=request))
    await call.read()
    return call


async def _sessions_closed(metrics_port: int) -> None:
    """Returns once the sidecar counts no Session stream open.

    Raises:
        TimeoutError: some stay open for 60 s.
    """
    deadline = time.monotonic() + 60
    while metric_value(metrics_port, "moe_sidecar_sessions") > 0:
        if time.monotonic() > deadline:
            raise TimeoutError("the sidecar still counts open sessions after 60 s")
        await asyncio.sleep(0.05)  # the poll interval of a wait with a deadline


async def _batch_one_by_one(stubs: list[Any], first: int, count: int) -> None:
    """Opens, answers and closes ``count`` sessions one after another."""
    for serial in range(first, first + count):
        call = await _open_session(stubs[0], f"churn-{serial}")
        call.cancel()


async def _batch_at_once(stubs: list[Any], first: int, count: int, pid: int) -> float:
    """Opens ``count`` sessions together (spread over the channels), each
    answered, then closes them all; returns the RSS while all were open."""
    calls = await asyncio.gather(
        *(
            _open_session(stubs[i % len(stubs)], f"churn-{first + i}", f"{GROUP}-{i}")
            for i in range(count)
        )
    )
    held = rss_mib(pid)
    for call in calls:
        call.cancel()
    return held


async def _churn(target: str, pid: int, metrics_port: int, args: argparse.Namespace) -> list[float]:
    rss: list[float] = []
    # A connection carries at most --max-streams-per-connection (256) streams,
    # so sessions held together need several; channels of one target share
    # one connection unless each has a subchannel pool of its own.
    own_connection = [("grpc.use_local_subchannel_pool", 1)]
    channels = [
        grpc.aio.insecure_channel(target, options=own_connection)
        for _ in range(args.per_batch // 200 + 1)
    ]
    stubs: list[Any] = [pb_grpc.WorkspaceCoordinatorStub(c) for c in channels]
    try:
        for batch in range(args.batches):
            first = batch * args.per_batch + 1
            held = ""
            if args.at_once:
                held_mib = await _batch_at_once(stubs, first, args.per_batch, pid)
                held = f"; {held_mib:7.1f} MiB while {args.per_batch} were open"
            else:
                await _batch_one_by_one(stubs, first, args.per_batch)
            await _sessions_closed(metrics_port)
            rss.append(rss_mib(pid))
            closed = first + args.per_batch - 1
            print(f"after {closed:6d} sessions closed: RSS {rss[-1]:7.1f} MiB{held}", flush=True)
    finally:
        for channel in channels:
            await channel.close()
    return rss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--per-batch", type=int, default=500)
    parser.add_argument(
        "--at-once",
        action="store_true",
        help="hold each batch's sessions open together (at most --max-sessions, 2048)",
    )
    args = parser.parse_args()
    metrics_port = free_port()
    # --at-once holds a group per session: room for them beside the default 128.
    flags = ("--max-groups", str(max(128, args.per_batch)))
    with running_sidecar(metrics_port, flags) as (process, port):
        idle = rss_mib(process.pid)
        print(time.strftime("bench_session_churn, %Y-%m-%d %H:%M UTC", time.gmtime()))
        print(f"sidecar RSS idle: {idle:7.1f} MiB")
        rss = asyncio.run(_churn(f"127.0.0.1:{port}", process.pid, metrics_port, args))
    first, last = rss[0], rss[-1]
    print(f"last batch over first: {last / first:.2f}x; over idle: {last / idle:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
