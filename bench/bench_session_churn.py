"""Memory a sidecar holds after Session streams opened and closed, batch by
batch, against its own first batch in the same run.

    .venv/bin/python -m bench.bench_session_churn [--batches B] [--per-batch N]

Starts a real sidecar process on a TCP port. Each batch opens N Session
streams from a real grpc-python client, one after another; each proposes a
round of one one-rank group (a new lifetime each time) and reads its answer,
then closes. After each batch it prints the sidecar's RSS (VmRSS). Prints the last batch's RSS over the first's.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import grpc

from bench.sidecar_process import rss_mib, running_sidecar
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc
from tests.integration.helpers import propose_request

GROUP = "churn/ep1"


async def _open_session(stub: Any, lifetime: str, group: str = GROUP) -> Any:
    call = stub.Session()
    request = propose_request(0, group=group, ep_size=1, local_ranks=1, lifetime=lifetime)
    await call.write(pb.SessionRequest(id=1, propose=request))
    await call.read()
    return call


async def _churn(target: str, pid: int, args: argparse.Namespace) -> list[float]:
    rss: list[float] = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub: Any = pb_grpc.WorkspaceCoordinatorStub(channel)
        serial = 0
        for _ in range(args.batches):
            for _ in range(args.per_batch):
                serial += 1
                call = await _open_session(stub, f"churn-{serial}")
                call.cancel()
            await asyncio.sleep(0.2)  # let the sidecar see the streams end
            rss.append(rss_mib(pid))
            print(f"after {serial:6d} sessions closed: RSS {rss[-1]:7.1f} MiB", flush=True)
    return rss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--per-batch", type=int, default=500)
    args = parser.parse_args()
    with running_sidecar() as (process, port):
        idle = rss_mib(process.pid)
        print(time.strftime("bench_session_churn, %Y-%m-%d %H:%M UTC", time.gmtime()))
        print(f"sidecar RSS idle: {idle:7.1f} MiB")
        rss = asyncio.run(_churn(f"127.0.0.1:{port}", process.pid, args))
    first, last = rss[0], rss[-1]
    print(f"last batch over first: {last / first:.2f}x; over idle: {last / idle:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
