"""Sidecars as nodes of one cluster on a real etcd, for the etcd tests.

Every node is a real ``python -m moe_sidecar`` process with ``--store
etcd://...``, its own state dir and ``--node-name``; etcd is Debian's
(tests/etcd_server.py). Waits are on conditions, with deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc

from moe_sidecar.core.cluster import ClusterPlan
from moe_sidecar.core.plan import Plan
from moe_sidecar.etcd.client import EtcdClient
from moe_sidecar.etcd.replica import group_key
from moe_sidecar.store.row_codec import decode_cluster_plan
from moe_sidecar.wire.codec import plan_from_proto
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc
from tests.etcd_server import EtcdServer, free_port
from tests.multiprocess.harness import Sidecar

__all__ = [
    "GROUP",
    "PREFIX",
    "Node",
    "group_of",
    "in_etcd",
    "nodes",
    "stored_plan",
    "stub",
    "until",
]

GROUP = "deepseek-v3:fp4/tp1-ep2/pp0"
PREFIX = "/test/"
"""The key prefix of :attr:`EtcdServer.url`."""
T = TypeVar("T")


class Node:
    """One node: a sidecar process on etcd, with its own state dir and name."""

    def __init__(self, tmp_path: Path, name: str, etcd: EtcdServer, *args: str) -> None:
        """``args`` are more ``serve`` flags."""
        self.name = name
        self.sidecar = Sidecar(
            tmp_path / name,
            round_timeout=20.0,
            args=("--store", etcd.url, "--node-name", name, "--enable-admin", *args),
            metrics_port=free_port(),
        )

    @property
    def target(self) -> str:
        return self.sidecar.target

    def start(self) -> Node:
        self.sidecar.start()
        return self

    def log(self) -> str:
        return self.sidecar.log.read_text(errors="replace")

    def metric(self, name: str) -> float:
        """The first sample of ``name`` (a series name, or one with its labels:
        ``name{label="value"}``); 0 when there is none."""
        url = f"http://127.0.0.1:{self.sidecar.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    async def metric_now(self, name: str) -> float:
        """:meth:`metric`, off the event loop."""
        return await asyncio.to_thread(self.metric, name)


@contextlib.contextmanager
def nodes(
    tmp_path: Path, etcd: EtcdServer, *names: str, args: tuple[str, ...] = ()
) -> Iterator[list[Node]]:
    """Started nodes named ``names`` (each with ``args``), stopped at the end."""
    started: list[Node] = []
    try:
        for name in names:
            started.append(Node(tmp_path, name, etcd, *args).start())
        yield started
    finally:
        for node in started:
            node.sidecar.stop()


@contextlib.asynccontextmanager
async def stub(node: Node) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(node.target) as channel:
        yield pb_grpc.WorkspaceCoordinatorStub(channel)


async def group_of(node: Node, group: str = GROUP) -> pb.Group | None:
    async with stub(node) as s:
        try:
            found: pb.Group = await s.GetGroup(pb.GetGroupRequest(group=group), timeout=5)
            return found
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise


def stored_plan(group: pb.Group | None) -> Plan | None:
    if group is None or not group.HasField("plan"):
        return None
    return plan_from_proto(group.plan)


async def in_etcd(etcd: EtcdServer, group: str = GROUP) -> ClusterPlan | None:
    async with EtcdClient([etcd.endpoint]) as client:
        got = await client.get(group_key(PREFIX, group))
    return None if got is None else decode_cluster_plan(got.value)


async def until(
    probe: Callable[[], Awaitable[T]], ok: Callable[[T], bool], what: str, within: float = 30.0
) -> T:
    """Polls ``probe()`` until ``ok`` holds; fails naming ``what`` and the last value."""
    deadline = time.monotonic() + within
    while True:
        value = await probe()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within}s; last: {value}")
        await asyncio.sleep(0.05)
