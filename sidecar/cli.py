"""The ``moe-sidecar`` command: ``serve``, ``groups`` and ``simulate``.

Each subcommand is one :class:`Command` in :data:`COMMANDS`: a name, a
function that adds its arguments, and a function that runs it. A new
subcommand is a new :class:`Command` appended to that tuple.

This is the only place (with ``__main__``) that installs signal handlers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import grpc
from moe_sidecar.config import ConfigError, SidecarConfig, add_serve_arguments, config_from_flags
from moe_sidecar.logs import configure_logging
from moe_sidecar.server import StartupError, serve
from moe_sidecar.store import StoreError
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = [
    "COMMANDS",
    "DEFAULT_TARGET",
    "TARGET_ENV",
    "Command",
    "build_parser",
    "format_bytes",
    "format_groups",
    "groups_as_json",
    "main",
]

TARGET_ENV = "MOE_SIDECAR_TARGET"
DEFAULT_TARGET = "127.0.0.1:50051"

_log = logging.getLogger("moe_sidecar.cli")


@dataclass(frozen=True)
class Command:
    """One subcommand of ``moe-sidecar``."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    """Runs the command; returns the process exit status."""


# --- serve ---------------------------------------------------------------------------


async def _serve_until_signalled(config: SidecarConfig) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)

    def on_signal(signum: signal.Signals) -> None:
        _log.info("shutdown requested", extra={"signal": signum.name})
        # A second signal takes the default action: stop at once, no drain.
        for s in signals:
            loop.remove_signal_handler(s)
        stop.set()

    for s in signals:
        loop.add_signal_handler(s, on_signal, s)
    await serve(config, shutdown_trigger=stop.wait())


def _run_serve(args: argparse.Namespace) -> int:
    try:
        config = config_from_flags(args, os.environ)
    except ConfigError as error:
        print(f"moe-sidecar serve: {error}", file=sys.stderr)
        return 2
    configure_logging(config.log_format, config.log_level)
    try:
        asyncio.run(_serve_until_signalled(config))
    except (StoreError, StartupError) as error:
        _log.error("cannot start", extra={"error": str(error)})
        return 1
    return 0


SERVE = Command(
    name="serve",
    help="run the sidecar (the default of `python -m moe_sidecar`)",
    add_arguments=add_serve_arguments,
    run=_run_serve,
)


# --- groups --------------------------------------------------------------------------


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units: ``512 B``, ``1.5 KiB``, ``29.3 MiB``, ``2.0 GiB``."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024.0
        if value < 1024.0 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def _time(stamp: Any) -> str:
    if not stamp.seconds and not stamp.nanos:
        return "-"
    moment = datetime.fromtimestamp(stamp.seconds + stamp.nanos / 1e9, tz=timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%SZ")


def _plan_line(plan: pb.Plan) -> str:
    return (
        f"{format_bytes(plan.workspace_bytes)} per rank ({plan.workspace_bytes} B), "
        f"max_num_tokens={plan.max_num_tokens}, top_k={plan.top_k}, "
        f"num_experts={plan.num_experts}, generation {plan.generation}"
    )


def format_groups(groups: Sequence[pb.Group]) -> str:
    """A human-readable report of every group (the ``groups`` command's text)."""
    if not groups:
        return "no groups\n"
    lines: list[str] = []
    for g in groups:
        lines.append(f"group {g.name}")
        lines.append(
            f"  ep_size={g.ep_size} local_ranks={g.local_ranks} lifetimes={g.lifetimes} "
            f"last_closed_round={g.last_closed_round} "
            + (f"open_round={g.open_round} ({g.waiting_ranks} waiting)" if g.open_round else "")
        )
        lines.append("  plan: " + (_plan_line(g.plan) if g.HasField("plan") else "(none stored)"))
        lines.append("  ranks:")
        lines.append(
            "    rank  current  last round  last layer            committed gen  build s  lifetime"
        )
        for r in g.ranks:
            lines.append(
                f"    {r.ep_rank:>4}  {'yes' if r.current else 'no':<7}  {r.last_round:>10}  "
                f"{(r.last_layer or '-'):<20}  {r.committed_generation:>13}  "
                f"{r.last_build_seconds:>7.3f}  {r.lifetime}"
            )
        lines.append("  growth history:")
        if not g.history:
            lines.append("    (none)")
        for h in g.history:
            lines.append(
                f"    generation {h.generation}: {format_bytes(h.workspace_bytes)} "
                f"({h.workspace_bytes} B), max_num_tokens={h.max_num_tokens}, caused by layer "
                f"{h.layer or '(unnamed)'!r} on rank {h.ep_rank} in round {h.round} at "
                f"{_time(h.time)}"
            )
        lines.append("")
    return "\n".join(lines)


def groups_as_json(groups: Sequence[pb.Group]) -> list[dict[str, Any]]:
    """Every group as plain JSON values (integers stay integers)."""

    def plan(p: pb.Plan) -> dict[str, Any]:
        return {
            "workspace_bytes": p.workspace_bytes,
            "workspace": format_bytes(p.workspace_bytes),
            "max_num_tokens": p.max_num_tokens,
            "top_k": p.top_k,
            "num_experts": p.num_experts,
            "generation": p.generation,
        }

    return [
        {
            "name": g.name,
            "ep_size": g.ep_size,
            "local_ranks": g.local_ranks,
            "plan": plan(g.plan) if g.HasField("plan") else None,
            "generation": g.plan.generation if g.HasField("plan") else None,
            "lifetimes": g.lifetimes,
            "last_closed_round": g.last_closed_round,
            "open_round": g.open_round,
            "waiting_ranks": g.waiting_ranks,
            "ranks": [
                {
                    "ep_rank": r.ep_rank,
                    "lifetime": r.lifetime,
                    "current": r.current,
                    "last_round": r.last_round,
                    "last_layer": r.last_layer,
                    "committed_generation": r.committed_generation,
                    "last_build_seconds": r.last_build_seconds,
                    "last_seen": _time(r.last_seen),
                }
                for r in g.ranks
            ],
            "history": [
                {
                    "generation": h.generation,
                    "workspace_bytes": h.workspace_bytes,
                    "workspace": format_bytes(h.workspace_bytes),
                    "max_num_tokens": h.max_num_tokens,
                    "layer": h.layer,
                    "ep_rank": h.ep_rank,
                    "round": h.round,
                    "time": _time(h.time),
                }
                for h in g.history
            ],
        }
        for g in groups
    ]


def _add_groups_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        default=None,
        help=f"sidecar address (default ${TARGET_ENV}, else {DEFAULT_TARGET})",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for the sidecar (default 5)"
    )


def _run_groups(args: argparse.Namespace) -> int:
    target = args.target or os.environ.get(TARGET_ENV) or DEFAULT_TARGET
    try:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.WorkspaceCoordinatorStub(channel)
            response = stub.ListGroups(pb.ListGroupsRequest(), timeout=args.timeout)
    except grpc.RpcError as error:
        code = error.code() if isinstance(error, grpc.Call) else None
        details = error.details() if isinstance(error, grpc.Call) else str(error)
        print(
            f"moe-sidecar groups: {target}: {code.name if code else 'error'}: {details}",
            file=sys.stderr,
        )
        return 1
    groups = list(response.groups)
    if args.json:
        print(json.dumps(groups_as_json(groups), indent=2))
    else:
        sys.stdout.write(format_groups(groups))
    return 0


GROUPS = Command(
    name="groups",
    help="print every group of a running sidecar: plan, generation, ranks, growth history",
    add_arguments=_add_groups_arguments,
    run=_run_groups,
)


# --- simulate ------------------------------------------------------------------------


def _add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ranks", type=int, default=2, metavar="N", help="rank processes = EP size (default 2)"
    )
    parser.add_argument(
        "--model",
        default="deepseek-v3",
        metavar="PRESET",
        help="model preset (default deepseek-v3; --list-models prints them)",
    )
    parser.add_argument("--list-models", action="store_true", help="print the presets and exit")
    parser.add_argument(
        "--target",
        default=None,
        help=f"sidecar address (default ${TARGET_ENV}; unset, empty or 'embedded': no "
        "sidecar, the decision core runs inside the ranks)",
    )
    parser.add_argument(
        "--group", default=None, help="EP group name (default simulate:<model>/ep<N>/pp0)"
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=16,
        metavar="N",
        help="max_num_tokens of every layer (default 16: quick on CPU)",
    )
    parser.add_argument(
        "--propose-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long a rank waits for one round (default $MOE_SIDECAR_PROPOSE_TIMEOUT, "
        "else 120); must exceed the sidecar's --round-timeout",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="stop the ranks and fail after this long (default 300)",
    )
    parser.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip the dispatch+combine checks",
    )
    parser.add_argument(
        "--json", action="store_true", help="summary as JSON on stdout, progress on stderr"
    )


def _run_simulate(args: argparse.Namespace) -> int:
    # Imported here: the demo needs torch (the client extra), serve and groups
    # must not (the sidecar image has no torch).
    try:
        from moe_sidecar.client.simulate import run_cli
    except ModuleNotFoundError as error:
        if error.name != "torch":
            raise
        print(
            "moe-sidecar simulate: needs torch, i.e. the client extra: "
            "pip install 'moe-sidecar[client]' (the CPU build of torch is enough)",
            file=sys.stderr,
        )
        return 2
    return run_cli(args)


SIMULATE = Command(
    name="simulate",
    help="run a model's MoE layers on N CPU ranks against a sidecar (needs the client extra)",
    add_arguments=_add_simulate_arguments,
    run=_run_simulate,
)

COMMANDS: tuple[Command, ...] = (SERVE, GROUPS, SIMULATE)


def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
    """The ``moe-sidecar`` parser with one subparser per command."""
    parser = argparse.ArgumentParser(
        prog="moe-sidecar",
        description="Per-node coordinator of FlashInfer MoE all-to-all workspaces.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in commands:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``moe-sidecar``; returns the exit status."""
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except BrokenPipeError:
        # The reader went away (`moe-sidecar groups | head`): not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
