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

import grpc

from moe_sidecar.config import ConfigError, SidecarConfig, add_serve_arguments, config_from_flags
from moe_sidecar.defaults import DEFAULT_TARGET, ENV_TARGET
from moe_sidecar.display import format_groups, groups_as_json
from moe_sidecar.errors import InvalidArgument
from moe_sidecar.logs import configure_logging
from moe_sidecar.server import StartupError, serve
from moe_sidecar.store import StoreError
from moe_sidecar.wire_codec import summary_from_proto
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = [
    "COMMANDS",
    "Command",
    "build_parser",
    "main",
]

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


def _add_groups_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        default=None,
        help=f"sidecar address (default ${ENV_TARGET}, else {DEFAULT_TARGET})",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for the sidecar (default 5)"
    )


def _run_groups(args: argparse.Namespace) -> int:
    target = args.target or os.environ.get(ENV_TARGET) or DEFAULT_TARGET
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
    try:
        groups = [summary_from_proto(g) for g in response.groups]
    except InvalidArgument as error:
        print(f"moe-sidecar groups: {target}: malformed answer: {error}", file=sys.stderr)
        return 1
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
        help=f"sidecar address (default ${ENV_TARGET}; unset, empty or 'embedded': no "
        "sidecar, the decision core runs inside the ranks)",
    )
    parser.add_argument(
        "--group", default=None, help="EP group name (default simulate:<model>/ep<N>/pp0)"
    )
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        metavar="N",
        help="start N sidecars (node-a, node-b, ...) sharing plans through --store and split "
        "the ranks between them, so the EP group spans nodes (default 1: no sidecar started)",
    )
    parser.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="with --nodes: the etcd the started sidecars share, "
        "etcd://HOST:PORT[,HOST:PORT...]/PREFIX",
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
