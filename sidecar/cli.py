"""The ``moe-sidecar`` command: ``serve``, ``groups``, ``reset``, ``remove``, ``doctor``, and the tools.

Each of the daemon's subcommands is one :class:`Command` in :data:`COMMANDS`:
a name, a function that adds its arguments, and a function that runs it.
Tools that live elsewhere (the client's ``simulate`` and ``prewarm``) add
their subcommands through the ``moe_sidecar.commands`` entry points
(:data:`TOOL_ENTRY_POINTS`): the daemon never imports the client.

This is the only place (with ``__main__``) that installs signal handlers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

import grpc

from moe_sidecar.config import (
    ConfigError,
    SidecarConfig,
    add_serve_arguments,
    check_environment,
    config_from_flags,
)
from moe_sidecar.core.defaults import DEFAULT_TARGET, ENV_TARGET
from moe_sidecar.core.errors import InvalidArgument
from moe_sidecar.core.group import GroupSummary
from moe_sidecar.doctor import checks_as_json, diagnose, format_checks, not_a_coordinator
from moe_sidecar.logs import configure_logging, resolve_log_format
from moe_sidecar.server import StartupError, serve
from moe_sidecar.store.sqlite import StoreError
from moe_sidecar.wire.address import ADDRESS_FORMS, AddressError, parse_listen_address
from moe_sidecar.wire.codec import summary_from_proto
from moe_sidecar.wire.display import format_groups, groups_as_json
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = [
    "COMMANDS",
    "TOOL_ENTRY_POINTS",
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
        # A second signal takes the operating system's default action: the
        # process ends at once, no drain. (asyncio's remove_signal_handler
        # alone would put back Python's SIGINT handler, whose KeyboardInterrupt
        # is lost when it lands in a callback such as a weakref's.)
        for s in signals:
            loop.remove_signal_handler(s)
            signal.signal(s, signal.SIG_DFL)
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
        # One line in the form of the logs: JSON where logs are JSON (a
        # collector parses it), else the plain line a flag error prints.
        if resolve_log_format(config.log_format) == "json":
            _log.error("cannot start", extra={"error": str(error)})
        else:
            print(f"moe-sidecar serve: cannot start: {error}", file=sys.stderr)
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


def _target(args: argparse.Namespace, default: str = DEFAULT_TARGET) -> str:
    """The address to dial: --target, else $MOE_SIDECAR_TARGET, else ``default``.

    Raises:
        _CliError: the address is malformed (status 2).
    """
    if args.target:
        source, value = "--target", args.target
    elif os.environ.get(ENV_TARGET, "").strip():
        source, value = ENV_TARGET, os.environ[ENV_TARGET].strip()
    else:
        source, value = "default target", default
    try:
        return parse_listen_address(value, source).target
    except AddressError as error:
        raise _CliError(str(error), status=2) from None


def _channel(args: argparse.Namespace, target: str) -> grpc.Channel:
    """A channel to ``target``, with the TLS files the flags name.

    Raises:
        _CliError: a TLS file cannot be read (status 2).
    """
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
    return (
        grpc.secure_channel(target, credentials)
        if credentials is not None
        else grpc.insecure_channel(target)
    )


@contextlib.contextmanager
def _stub(args: argparse.Namespace) -> Iterator[tuple[str, pb_grpc.WorkspaceCoordinatorStub]]:
    """A stub of the sidecar the flags name; RPC failures become one-line errors.

    Raises:
        _CliError: a malformed address, unreadable TLS files, or a failed call.
    """
    target = _target(args)
    channel = _channel(args, target)
    try:
        yield target, pb_grpc.WorkspaceCoordinatorStub(channel)
    except grpc.RpcError as error:
        code = error.code() if isinstance(error, grpc.Call) else None
        details = error.details() if isinstance(error, grpc.Call) else str(error)
        if code is grpc.StatusCode.UNIMPLEMENTED:
            raise _CliError(not_a_coordinator(channel, target, details)) from None
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


def _add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    _add_target_arguments(parser)
    parser.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR",
        help="the sidecar's state directory (default: as serve reads it, "
        "$MOE_SIDECAR_STATE_DIR, else /var/lib/moe-sidecar)",
    )
    parser.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="the sidecar's --store (default: as serve reads it, $MOE_SIDECAR_STORE); with "
        "etcd:// etcd is checked too",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def _doctor(args: argparse.Namespace) -> int:
    config: SidecarConfig | ConfigError
    try:
        # As serve reads it: flags over the MOE_SIDECAR_* environment.
        flags = argparse.Namespace(state_dir=args.state_dir, store=args.store)
        config = config_from_flags(flags, os.environ)
    except ConfigError as error:
        config = error
    # Where serve listens (its first --listen) unless told otherwise.
    listens = config.listen_addresses[0].target if isinstance(config, SidecarConfig) else None
    target = _target(args, listens or DEFAULT_TARGET)
    channel = _channel(args, target)
    try:
        checks = diagnose(channel, target, config, args.timeout)
    finally:
        channel.close()
    if args.json:
        print(json.dumps(checks_as_json(target, checks), indent=2))
    else:
        sys.stdout.write(format_checks(checks))
    return 0 if all(c.ok for c in checks) else 1


DOCTOR = Command(
    name="doctor",
    help="check a sidecar in one go: it answers, is serving, its state dir is writable and "
    "its store is up; exit status 0 only when all hold (a probe)",
    add_arguments=_add_doctor_arguments,
    run=_run_client_command("doctor", _doctor),
)


COMMANDS: tuple[Command, ...] = (SERVE, GROUPS, RESET, REMOVE, DOCTOR)


TOOL_ENTRY_POINTS = "moe_sidecar.commands"
"""The entry-point group of the commands other packages add (the client's tools).

Each entry point names a function ``add_command(subparsers)`` that adds its
subparser and sets ``run`` on it, so the daemon lists a tool without importing
the tool's implementation (nor the torch it may need).
"""


def _add_tool_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for entry_point in sorted(entry_points(group=TOOL_ENTRY_POINTS), key=lambda e: e.name):
        add_command: Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None] = (
            entry_point.load()
        )
        add_command(subparsers)


def build_parser(
    commands: Sequence[Command] = COMMANDS, *, tools: bool = True
) -> argparse.ArgumentParser:
    """The ``moe-sidecar`` parser: one subparser per command, then the installed tools'.

    Args:
        commands: the daemon's own commands.
        tools: also add the commands of the ``moe_sidecar.commands`` entry points.
    """
    parser = argparse.ArgumentParser(
        prog="moe-sidecar",
        description="Per-node coordinator of FlashInfer MoE all-to-all workspaces. "
        "`moe-sidecar serve` runs the sidecar (`python -m moe_sidecar` is the same).",
    )
    parser.add_argument(
        "--version", action="version", version=f"moe-sidecar {_installed_version()}"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in commands:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    if tools:
        _add_tool_commands(subparsers)
    return parser


def _installed_version() -> str:
    try:
        return importlib.metadata.version("moe-sidecar")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: run from a checkout without pip install)"


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The subparser of ``command`` (``parser`` itself when there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            sub: argparse.ArgumentParser = action.choices[command]
            return sub
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``moe-sidecar``; returns the exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # The command's own usage, not the top-level one: the flag is the command's.
        _subparser(parser, args.command or "").error(f"unrecognized arguments: {' '.join(unknown)}")
    if getattr(args, "run", None) is None:
        # No command: the commands, and how to run the sidecar, instead of
        # argparse's "the following arguments are required".
        parser.print_help(sys.stderr)
        print(
            "\nmoe-sidecar: name a command; `moe-sidecar serve --state-dir ./state` runs the "
            "sidecar",
            file=sys.stderr,
        )
        return 2
    try:
        # Every command: a misspelt variable must not pass silently in any of them.
        check_environment(os.environ)
    except ConfigError as error:
        print(f"moe-sidecar {args.command}: {error}", file=sys.stderr)
        return 2
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except BrokenPipeError:
        # The reader went away (`moe-sidecar groups | head`): not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
