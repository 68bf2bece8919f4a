"""The sidecars a simulation talks to: reaching one, starting one per node, reading what they hold.

``--nodes N --store etcd://HOST:PORT/PREFIX`` is the multi-node story on one
machine: N sidecars (``node-a``, ``node-b``, ...), each with its own
throwaway state dir, share plans through the given etcd, and each serves the
ranks of its "node". ``--start-sidecar`` starts one, with no store but its
throwaway state dir, for a run that needs a sidecar and has none to hand.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_sidecar import flashinfer
from moe_sidecar.client.simulate.records import (
    NODE_NAMES,
    NodeView,
    SimulationConfig,
    SimulationResult,
)
from moe_sidecar.core.cluster import plan_origin
from moe_sidecar.wire.codec import summary_from_proto
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = ["check_reachable", "fetch_history", "fetch_node_views", "node_sidecars"]


def check_reachable(target: str, timeout: float) -> str:
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


def _sidecar_command(
    config: SimulationConfig, name: str, target: str, state_dir: Path
) -> list[str]:
    store = ["--store", config.store] if config.store else []
    return [
        sys.executable,
        "-m",
        "moe_sidecar",
        "--listen",
        target,
        *store,
        "--node-name",
        name,
        "--state-dir",
        str(state_dir),
        "--health-port",
        "0",
        "--metrics-port",
        "0",
        "--log-format",
        "text",
        "--log-level",
        "WARNING",
    ]


@contextlib.contextmanager
def node_sidecars(config: SimulationConfig, say: Callable[[str], None]) -> Iterator[list[str]]:
    """Starts one sidecar per node on ``config.store`` (or the one of
    ``--start-sidecar``); yields their targets.

    Each has a throwaway state dir: whatever a node knows at start comes from etcd.

    Raises:
        RuntimeError: a sidecar exited or did not serve in time (with its log).
    """
    directory = Path(tempfile.mkdtemp(prefix="moe-simulate-"))
    processes: list[subprocess.Popen[bytes]] = []
    targets: list[str] = []
    try:
        for name in NODE_NAMES[: config.starts_sidecars]:
            target = f"unix://{directory}/{name}.sock"
            command = _sidecar_command(config, name, target, directory / name)
            env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")}
            with open(directory / f"{name}.log", "ab") as log:
                processes.append(
                    subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
                )
            targets.append(target)
        for name, target, process in zip(NODE_NAMES, targets, processes, strict=False):
            deadline = time.monotonic() + 30.0
            while check_reachable(target, timeout=1.0):
                if process.poll() is not None or time.monotonic() > deadline:
                    log_text = (directory / f"{name}.log").read_text(errors="replace")
                    raise RuntimeError(
                        f"the sidecar of {name} did not start ({config.store or 'no store'}):\n"
                        + "\n".join(log_text.splitlines()[-15:])
                    )
                time.sleep(0.1)
            if config.store:
                say(f"  {name}: a sidecar on {target}, plans in {config.store}")
            else:
                say(f"  a sidecar on {target}, started for this run")
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


def fetch_node_views(result: SimulationResult, targets: Sequence[str]) -> None:
    """Adds each node's view of the group to ``result.nodes``.

    Raises:
        grpc.RpcError: a sidecar did not answer GetGroup.
    """
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
                workspace_bytes=group.workspace_bytes(group.plan, flashinfer.workspace_size),
                origin_node=origin.node if origin is not None else "",
                origin_time=origin.at if origin is not None else 0.0,
            )
        )


def fetch_history(result: SimulationResult, target: str) -> None:
    """Puts the sidecar's lifetimes and growth history of the group into ``result``.

    Raises:
        grpc.RpcError: the sidecar did not answer GetGroup.
    """
    with grpc.insecure_channel(target) as channel:
        group = summary_from_proto(
            pb_grpc.WorkspaceCoordinatorStub(channel).GetGroup(
                pb.GetGroupRequest(group=result.group), timeout=5.0
            )
        )
    result.sidecar_lifetimes = group.lifetimes
    result.sidecar_history = list(group.history)
