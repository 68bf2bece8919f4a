"""Idle-connection flood against every port of a real sidecar, with its default bounds.

    .venv/bin/python -m bench.bench_connection_flood [--connections 20000] [--hold 3]

Starts ``python -m moe_sidecar`` with its default limits (a Unix socket and a
loopback TCP listener, the health port and the metrics port on loopback),
then, one port after another, opens ``--connections`` idle connections to it
from two worker processes (each opens half, so that neither passes this
machine's limit of open files) and holds them ``--hold`` seconds: the gRPC
ports get an HTTP/2 preface and a SETTINGS frame, then silence; the metrics
port gets nothing. While they are held it asks the sidecar for a Health.Check
(unless the health port is the one flooded), a ListGroups over a fresh
connection to the other coordinator listener, and a metrics scrape. Prints,
per port: the connections opened, the ones the sidecar holds (its open file
descriptors beyond those before the flood), its peak RSS against the
manifest's 256 MiB, and which of the three requests were answered.

The sidecar, the workers and this process share the machine's cores.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import multiprocessing.connection
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import psutil  # type: ignore[import-untyped]
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc

MANIFEST_MEMORY = 256 << 20
"""The sidecar container's memory limit in the Kubernetes manifest."""
HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
WORKERS = 2
ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _flood_worker(
    address: str | tuple[str, int],
    count: int,
    hello: bytes,
    report: multiprocessing.connection.Connection,
) -> None:
    """Opens ``count`` idle connections, reports how many it opened, and holds
    them until told to close them."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    held: list[socket.socket] = []
    failed = 0
    for _ in range(count):
        family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
        connection = socket.socket(family, socket.SOCK_STREAM)
        try:
            connection.settimeout(5)
            connection.connect(address)
            if hello:
                with contextlib.suppress(OSError):  # closed by the sidecar already
                    connection.sendall(hello)
        except OSError:
            failed += 1
            connection.close()
            continue
        held.append(connection)
    report.send((len(held), failed))
    report.recv()  # close now
    for connection in held:
        connection.close()
    report.send("closed")


def _answered(call: Any) -> str:
    try:
        call()
    except (grpc.RpcError, OSError, AssertionError) as error:
        return f"no ({type(error).__name__})"
    return "yes"


def _health(port: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _list_groups(target: str) -> None:
    with grpc.insecure_channel(target) as channel:
        pb_grpc.WorkspaceCoordinatorStub(channel).ListGroups(pb.ListGroupsRequest(), timeout=5)


def _scrape(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
        connection.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        received = b""
        while chunk := connection.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 200"), received[:40]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=20000)
    parser.add_argument("--hold", type=float, default=3.0, help="seconds the flood is held")
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        ports = {"tcp": _free_port(), "health": _free_port(), "metrics": _free_port()}
        unix = f"{tmp}/s.sock"
        log = Path(tmp) / "sidecar.log"
        with log.open("wb") as stderr:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "moe_sidecar",
                    *("--listen", f"unix://{unix}", "--listen", f"127.0.0.1:{ports['tcp']}"),
                    *("--state-dir", f"{tmp}/state", "--metrics-host", "127.0.0.1"),
                    *("--health-port", str(ports["health"])),
                    *("--metrics-port", str(ports["metrics"])),
                ],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        try:
            deadline = time.monotonic() + 30
            while _answered(lambda: _health(ports["health"])) != "yes":
                assert process.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "the sidecar did not start"
                time.sleep(0.1)  # the poll interval of a wait with a deadline
            sidecar = psutil.Process(process.pid)
            print(
                f"sidecar with default bounds; {args.connections} idle connections per port, "
                f"held {args.hold:g} s; RSS before: {sidecar.memory_info().rss / 2**20:.1f} MiB"
            )
            print(
                f"{'port':<8} {'opened':>7} {'refused':>7} {'held':>5} {'peak RSS':>9} "
                f"{'of 256 MiB':>10}  health  ListGroups  scrape  alive"
            )
            targets: dict[str, str | tuple[str, int]] = {
                "tcp": ("127.0.0.1", ports["tcp"]),
                "unix": unix,
                "health": ("127.0.0.1", ports["health"]),
                "metrics": ("127.0.0.1", ports["metrics"]),
            }
            for name, address in targets.items():
                fds_before = sidecar.num_fds()
                peak = [sidecar.memory_info().rss]
                sampling = threading.Event()

                def sample(stop: threading.Event = sampling, top: list[int] = peak) -> None:
                    while not stop.is_set():
                        with contextlib.suppress(psutil.Error):
                            top[0] = max(top[0], sidecar.memory_info().rss)
                        time.sleep(0.02)

                sampler = threading.Thread(target=sample, daemon=True)
                sampler.start()
                pipes, workers = [], []
                hello = b"" if name == "metrics" else HTTP2_HELLO
                for _ in range(WORKERS):
                    ours, theirs = context.Pipe()
                    worker = context.Process(
                        target=_flood_worker,
                        args=(address, args.connections // WORKERS, hello, theirs),
                    )
                    worker.start()
                    pipes.append(ours)
                    workers.append(worker)
                opened = refused = 0
                for pipe in pipes:
                    held_by_worker, failed = pipe.recv()
                    opened += held_by_worker
                    refused += failed
                time.sleep(args.hold)
                held = sidecar.num_fds() - fds_before
                other = f"unix://{unix}" if name == "tcp" else f"127.0.0.1:{ports['tcp']}"
                health = "-" if name == "health" else _answered(lambda: _health(ports["health"]))
                listed = _answered(lambda target=other: _list_groups(target))
                scraped = _answered(lambda: _scrape(ports["metrics"]))
                for pipe in pipes:
                    pipe.send("close")
                for pipe in pipes:
                    pipe.recv()
                for worker in workers:
                    worker.join()
                sampling.set()
                sampler.join()
                alive = "yes" if process.poll() is None else f"no (exit {process.returncode})"
                print(
                    f"{name:<8} {opened:>7} {refused:>7} {held:>5} "
                    f"{peak[0] / 2**20:>7.1f} M {peak[0] / MANIFEST_MEMORY:>9.0%}  "
                    f"{health:<7} {listed:<11} {scraped:<7} {alive}"
                )
                if process.poll() is not None:
                    print(log.read_text())
                    return 1
            return 0
        finally:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
