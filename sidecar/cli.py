"""The ``moe-sidecar`` command: ``serve``, ``groups``, ``simulate`` and ``prewarm``.

Each subcommand is one :class:`Command` in :data:`COMMANDS`: a name, a
function that adds its arguments, and a function that runs it. A new
subcommand is a new :class:`Command` appended to that tuple.

This is the only place (with ``__main__``) that installs signal handlers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from moe_sidecar.config import (
    ADDRESS_FORMS,
    ConfigError,
    SidecarConfig,
    add_serve_arguments,
    config_from_flags,
    parse_listen_address,
)
from moe_sidecar.defaults import DEFAULT_TARGET, ENV_TARGET
from moe_sidecar.display import format_groups, groups_as_json
from moe_sidecar.errors import InvalidArgument
from moe_sidecar.group import GroupSummary
from moe_sidecar.logs import configure_logging
from moe_sidecar.server import StartupError, serve
from moe_sidecar.store import StoreError
from moe_sidecar.wire_codec import summary_from_proto
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = [
    "COMMANDS",
    "PREWARM_DEFAULT_ARCHS",
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


# --- talking to a running sidecar: groups, reset, remove ------------------------------


class _CliError(Exception):
    """A failure a command reports as one line and exit status 1 (2 for bad flags)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def _add_target_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        default=None,
        help=f"sidecar address: {ADDRESS_FORMS} (default ${ENV_TARGET}, else {DEFAULT_TARGET})",
    )
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for the sidecar (default 5)"
    )
    parser.add_argument(
        "--tls-ca",
        type=Path,
        default=None,
        metavar="FILE",
        help="a sidecar serving TLS: the CA bundle that signed its certificate",
    )
    parser.add_argument(
        "--tls-cert", type=Path, default=None, metavar="FILE", help="client certificate (mTLS)"
    )
    parser.add_argument(
        "--tls-key", type=Path, default=None, metavar="FILE", help="client key (mTLS)"
    )


def _target(args: argparse.Namespace) -> str:
    """The address to dial: --target, else $MOE_SIDECAR_TARGET, else the default.

    Raises:
        _CliError: the address is malformed (status 2).
    """
    if args.target:
        source, value = "--target", args.target
    elif os.environ.get(ENV_TARGET, "").strip():
        source, value = ENV_TARGET, os.environ[ENV_TARGET].strip()
    else:
        source, value = "default target", DEFAULT_TARGET
    try:
        return parse_listen_address(value, source).target
    except ConfigError as error:
        raise _CliError(str(error), status=2) from None


@contextlib.contextmanager
def _stub(args: argparse.Namespace) -> Iterator[tuple[str, pb_grpc.WorkspaceCoordinatorStub]]:
    """A stub of the sidecar the flags name; RPC failures become one-line errors.

    Raises:
        _CliError: a malformed address, unreadable TLS files, or a failed call.
    """
    target = _target(args)
    credentials = None
    if args.tls_ca or args.tls_cert or args.tls_key:
        try:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=args.tls_ca.read_bytes() if args.tls_ca else None,
                private_key=args.tls_key.read_bytes() if args.tls_key else None,
                certificate_chain=args.tls_cert.read_bytes() if args.tls_cert else None,
            )
        except OSError as error:
            raise _CliError(f"cannot read the TLS files: {error}", status=2) from None
    channel = (
        grpc.secure_channel(target, credentials)
        if credentials is not None
        else grpc.insecure_channel(target)
    )
    try:
        yield target, pb_grpc.WorkspaceCoordinatorStub(channel)
    except grpc.RpcError as error:
        code = error.code() if isinstance(error, grpc.Call) else None
        details = error.details() if isinstance(error, grpc.Call) else str(error)
        raise _CliError(f"{target}: {code.name if code else 'error'}: {details}") from None
    finally:
        channel.close()


def _list_all(
    stub: pb_grpc.WorkspaceCoordinatorStub, timeout: float, idle_for: float = 0.0
) -> list[GroupSummary]:
    """Every group (or every idle one), page by page."""
    groups: list[GroupSummary] = []
    token = ""
    while True:
        response = stub.ListGroups(
            pb.ListGroupsRequest(page_token=token, idle_for_seconds=idle_for), timeout=timeout
        )
        try:
            groups.extend(summary_from_proto(g) for g in response.groups)
        except InvalidArgument as error:
            raise _CliError(f"malformed answer: {error}") from None
        token = response.next_page_token
        if not token:
            return groups


def _run_client_command(
    name: str, body: Callable[[argparse.Namespace], int]
) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return body(args)
        except _CliError as error:
            print(f"moe-sidecar {name}: {error}", file=sys.stderr)
            return error.status

    return run


def _add_groups_arguments(parser: argparse.ArgumentParser) -> None:
    _add_target_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument(
        "--idle-for",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="only groups with no open round and no activity for this long (candidates for remove)",
    )


def _groups(args: argparse.Namespace) -> int:
    with _stub(args) as (_, stub):
        groups = _list_all(stub, args.timeout, args.idle_for)
    if args.json:
        print(json.dumps(groups_as_json(groups), indent=2))
    else:
        sys.stdout.write(format_groups(groups))
    return 0


GROUPS = Command(
    name="groups",
    help="print every group of a running sidecar: plan, generation, ranks, growth history",
    add_arguments=_add_groups_arguments,
    run=_run_client_command("groups", _groups),
)


def _add_reset_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("group", help="the group whose stored plan to forget")
    _add_target_arguments(parser)


def _reset(args: argparse.Namespace) -> int:
    with _stub(args) as (target, stub):
        group = summary_from_proto(
            stub.ResetGroup(pb.ResetGroupRequest(group=args.group), timeout=args.timeout)
        )
    print(
        f"group {group.name} at {target}: stored plan forgotten, epoch {group.epoch} begins; "
        "the group's next lifetime starts from its first layer"
    )
    return 0


RESET = Command(
    name="reset",
    help="forget a group's stored plan (admin: the sidecar needs --enable-admin)",
    add_arguments=_add_reset_arguments,
    run=_run_client_command("reset", _reset),
)


def _add_remove_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("groups", nargs="*", metavar="GROUP", help="groups to remove")
    _add_target_arguments(parser)
    parser.add_argument(
        "--idle-for",
        type=float,
        default=None,
        metavar="SECONDS",
        help="remove every group idle this long (no open round, no activity)",
    )


def _remove(args: argparse.Namespace) -> int:
    if bool(args.groups) == (args.idle_for is not None):
        raise _CliError("name the groups to remove, or give --idle-for SECONDS (not both)", 2)
    if args.idle_for is not None and not args.idle_for > 0:
        # ListGroups reads 0 as "no filter": every group, busy or not.
        raise _CliError(f"--idle-for {args.idle_for:g}: give a positive number of seconds", 2)
    with _stub(args) as (target, stub):
        names = args.groups or [g.name for g in _list_all(stub, args.timeout, args.idle_for)]
        for name in names:
            stub.RemoveGroup(pb.RemoveGroupRequest(group=name), timeout=args.timeout)
            print(f"removed group {name} from {target}")
    if not names:
        print(f"no group of {target} has been idle for {args.idle_for:g} s")
    return 0


REMOVE = Command(
    name="remove",
    help="remove groups entirely, e.g. idle ones (admin: the sidecar needs --enable-admin)",
    add_arguments=_add_remove_arguments,
    run=_run_client_command("remove", _remove),
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

# --- prewarm -------------------------------------------------------------------------

PREWARM_DEFAULT_ARCHS = "9.0a,10.0a"
"""``client.prewarm.DEFAULT_ARCHS``, spelled here so ``--help`` imports no torch."""


def _add_prewarm_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Compile FlashInfer's all-to-all module (mnnvl_moe_alltoall, the one the client's "
        "flashinfer backend loads) into FlashInfer's JIT cache ahead of time, with nvcc and "
        "no GPU, so an inference process finds it instead of compiling it for about 3 "
        "minutes. A module already in the cache is not built again. Needs the client and "
        "flashinfer extras (pip install 'moe-sidecar[client,flashinfer]'), nvcc, ninja and "
        "a C++ compiler. Exit status: 0 built or already there, 1 a build failed, 2 a bad "
        "flag or a missing prerequisite, 130 interrupted."
    )
    parser.add_argument(
        "--arch",
        action="append",
        default=[],
        metavar="ARCH",
        help="CUDA architecture to build for (9.0a, 10.0a, 10.3a, 90a, sm_100a; repeat the "
        "flag or separate with commas). Each is its own build: FlashInfer keeps one cache "
        "directory per set of architectures a process sees, so join with '+' (9.0a+10.0a) "
        "only for processes that see GPUs of several kinds at once. Default: "
        "$FLASHINFER_CUDA_ARCH_LIST as FlashInfer reads it (one set), else the visible "
        f"GPUs' (one set), else {PREWARM_DEFAULT_ARCHS} (Hopper and Blackwell, one build each)",
    )
    parser.add_argument(
        "--workspace-base",
        default=None,
        metavar="DIR",
        help="FlashInfer's FLASHINFER_WORKSPACE_BASE: the module goes to "
        "DIR/.cache/flashinfer/<version>/<archs>/cached_ops/. Default: "
        "$FLASHINFER_WORKSPACE_BASE, else $HOME, as FlashInfer. The inference processes "
        "must see the same directory at the same path",
    )
    parser.add_argument(
        "--ignore-aot",
        action="store_true",
        help="build into the cache even when FlashInfer ships the module ahead of time "
        "(flashinfer/data/aot), which it would load instead",
    )
    parser.add_argument(
        "--refresh",
        action="store_true",
        help="run FlashInfer's build for modules already in the cache too: ninja recompiles "
        "only what changed (sources, compiler, flags)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the plan and check the tools; build nothing"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        metavar="SECONDS",
        help="stop a build that runs longer than this (default 1800)",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="show ninja's and nvcc's output while building"
    )
    parser.add_argument(
        "--json", action="store_true", help="the result as JSON on stdout, the report on stderr"
    )


def _run_prewarm(args: argparse.Namespace) -> int:
    # Imported here: the client needs torch, which serve and groups must not import.
    try:
        from moe_sidecar.client.prewarm import run_cli
    except ModuleNotFoundError as error:
        if error.name != "torch":
            raise
        message = (
            "needs torch and flashinfer-python 0.7.2.post1, i.e. the client and flashinfer "
            "extras: pip install 'moe-sidecar[client,flashinfer]'"
        )
        print(f"moe-sidecar prewarm: {message}", file=sys.stderr)
        if args.json:
            print(json.dumps({"ok": False, "exit_status": 2, "error": message}))
        return 2
    return run_cli(args)


PREWARM = Command(
    name="prewarm",
    help="compile FlashInfer's all-to-all module into its JIT cache ahead of time (no GPU)",
    add_arguments=_add_prewarm_arguments,
    run=_run_prewarm,
)

COMMANDS: tuple[Command, ...] = (SERVE, GROUPS, RESET, REMOVE, SIMULATE, PREWARM)


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
