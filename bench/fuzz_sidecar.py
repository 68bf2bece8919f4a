"""Seeded, bounded fuzzing of a real sidecar.

    .venv/bin/python bench/fuzz_sidecar.py [--requests 10000] [--seed N] [--out FILE]

Starts ``python -m moe_sidecar`` (admin calls on, --max-groups 24,
--max-watchers 4, --max-page-size 50, a round timeout no run reaches) and
sends it, one at a time, random requests: complete rounds of valid groups
(so that there is state to damage), and mutations of valid Propose, Commit,
ListGroups, GetGroup, Watch, ResetGroup and RemoveGroup requests (extreme
numbers, bad and wrong lifetime tokens, the short ids GetGroup shows, wrong
rounds, plans and groups), random bytes and flipped bits on every method.
Every few thousand requests it restarts the sidecar and checks that every
group came back as it was.

It checks that no call is answered INTERNAL, UNKNOWN, UNIMPLEMENTED,
UNAVAILABLE or DATA_LOSS, that every accepted proposal's plan covers what
was proposed within the sidecar's ranges, and that every refusal changed
nothing: the ListGroups pages after a refused call equal those before it.
The one refusal that moves state by design is a round closed as refused for
all its ranks (ranks that disagree, a growth out of range): there the round
is closed, and a retry of the same proposal gets the same answer and changes
nothing more.

Prints the seed, the count of every status per method, and each violation;
exits 1 if there was any. ``--out`` also writes that output to a file.
"""

from __future__ import annotations

import argparse
import base64
import collections
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import text_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_sidecar.core import limits
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
SERVICE = "/moe_workspace.v1.WorkspaceCoordinator"
METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["WorkspaceCoordinator"].methods]
REQUEST_TYPES = {
    m.name: m.input_type.name
    for m in pb.DESCRIPTOR.services_by_name["WorkspaceCoordinator"].methods
}
MAX_GROUPS = 24
RESTART_EVERY = 2500
WAIT = 0.15
"""Client deadline of a call that may wait for other ranks (it joins their round)."""

FORBIDDEN = {
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DATA_LOSS,
}
REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.OUT_OF_RANGE,
}

U32 = [0, 1, 2, 63, 64, 65, (1 << 16), (1 << 16) + 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1]
U64 = [
    *U32,
    (1 << 40),
    limits.MAX_GENERATION,
    limits.MAX_GENERATION + 1,
    (1 << 63),
    (1 << 64) - 1,
]
DOUBLES = [
    0.0,
    -0.0,
    0.5,
    -1.0,
    86399.9,
    86400.0,
    1e308,
    float("inf"),
    float("-inf"),
    float("nan"),
]
NAMES = [
    "",
    " ",
    "a\tb",
    "a\nb",
    "\x00",
    "g" * 256,
    "g" * 257,
    "\u00e9\u4e2d\U0001f600",
    "\u200b",
    "..",
    "/",
    "deepseek-v3:fp4/tp1-ep8/pp0",
]


@dataclass
class Group:
    """What the fuzzer knows a group has accepted."""

    name: str
    ep_size: int
    local_ranks: int
    tokens: list[str]
    round: int = 0
    plan: pb.Plan | None = None
    shape: tuple[int, int] = (2, 64)
    tainted: bool = False
    """A call joined one of its rounds and left (a client deadline): no more rounds."""


@dataclass
class Report:
    seed: int
    requests: int = 0
    counts: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    violations: list[str] = field(default_factory=list)
    restarts: int = 0
    round_outcomes: int = 0
    seconds: float = 0.0


class Sidecar:
    """``python -m moe_sidecar`` in a directory of its own."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.target = f"unix://{directory}/fuzz.sock"
        self.log = directory / "sidecar.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            health = int(probe.getsockname()[1])
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")}
        flags = {
            "--listen": self.target,
            "--state-dir": str(self.directory / "state"),
            "--health-port": str(health),
            "--metrics-port": "0",
            "--round-timeout": "86400",
            "--max-groups": str(MAX_GROUPS),
            "--max-watchers": "4",
            "--max-page-size": "50",
            "--log-format": "text",
            "--log-level": "ERROR",
        }
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "moe_sidecar", "--enable-admin"]
                + [item for pair in flags.items() for item in pair],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        with grpc.insecure_channel(f"127.0.0.1:{health}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise SystemExit(f"the sidecar exited:\n{self.log.read_text()}")
                with contextlib.suppress(grpc.RpcError):
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                time.sleep(0.05)
        raise SystemExit(f"the sidecar did not start:\n{self.log.read_text()}")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process.returncode != 0:
            raise SystemExit(f"the sidecar exited {process.returncode}:\n{self.log.read_text()}")


class Fuzzer:
    def __init__(self, seed: int, sidecar: Sidecar, report: Report) -> None:
        self.rng = random.Random(seed)
        self.sidecar = sidecar
        self.report = report
        self.groups: dict[str, Group] = {}
        self.serial = 0
        self.channel: grpc.Channel | None = None
        self.stub: Any = None
        self.snapshot: list[pb.Group] = []
        self.page_tokens: list[str] = []

    # --- plumbing -------------------------------------------------------------------

    def connect(self) -> None:
        self.channel = grpc.insecure_channel(self.sidecar.target)
        self.stub = pb_grpc.WorkspaceCoordinatorStub(self.channel)
        self.snapshot = self.list_all()

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()

    def list_all(self) -> list[pb.Group]:
        groups: list[pb.Group] = []
        page_token = ""
        while True:
            page = self.stub.ListGroups(pb.ListGroupsRequest(page_token=page_token), timeout=10)
            groups.extend(page.groups)
            page_token = page.next_page_token
            if not page_token:
                return groups

    def raw(self, method: str, payload: bytes, timeout: float) -> tuple[grpc.StatusCode, str, Any]:
        """Calls ``method`` with ``payload`` as its request bytes."""
        assert self.channel is not None
        path = f"{SERVICE}/{method}"
        try:
            if method == "Watch":
                stream = self.channel.unary_stream(path, bytes, bytes)(payload, timeout=timeout)
                with contextlib.suppress(StopIteration):
                    next(stream)
                stream.cancel()
                return grpc.StatusCode.OK, "", None
            if method == "Session":
                return self.session_message(path, payload, timeout)
            reply = self.channel.unary_unary(path, bytes, bytes)(payload, timeout=timeout)
            return grpc.StatusCode.OK, "", reply
        except grpc.RpcError as error:
            code: grpc.StatusCode = error.code()
            if method == "Watch" and code == grpc.StatusCode.CANCELLED:
                return grpc.StatusCode.OK, "", None
            return code, error.details() or "", None

    def session_message(
        self, path: str, payload: bytes, timeout: float
    ) -> tuple[grpc.StatusCode, str, Any]:
        """Sends ``payload`` as a session's one message, then ends the session:
        its answer's error is the status (the stream itself stays OK)."""
        assert self.channel is not None
        answers = self.channel.stream_stream(path, bytes, bytes)(iter([payload]), timeout=timeout)
        first = next(answers)
        answers.cancel()
        answer = pb.SessionResponse.FromString(first)
        if answer.WhichOneof("result") != "error":
            return grpc.StatusCode.OK, "", first
        try:
            code = grpc.StatusCode[answer.error.code]
        except KeyError:
            self.violation(f"Session answered the code {answer.error.code!r}")
            code = grpc.StatusCode.UNKNOWN
        return code, answer.error.message, None

    def call(
        self, method: str, request: Any, timeout: float = 5.0
    ) -> tuple[grpc.StatusCode, str, Any]:
        code, message, reply = self.raw(method, request.SerializeToString(), timeout)
        if reply is not None:
            reply = getattr(pb, method_reply(method)).FromString(reply)
        return code, message, reply

    def record(self, method: str, code: grpc.StatusCode, message: str, what: str) -> None:
        self.report.requests += 1
        self.report.counts[(method, code.name)] += 1
        if code in FORBIDDEN:
            self.violation(f"{method} answered {code.name}: {message!r} ({what})")

    def violation(self, text: str) -> None:
        self.report.violations.append(f"request {self.report.requests}: {text}")

    # --- one request and its checks ---------------------------------------------------

    def send(
        self,
        method: str,
        request: Any,
        what: str,
        *,
        timeout: float = 5.0,
        raw: bytes | None = None,
    ) -> tuple[grpc.StatusCode, str, Any]:
        """Sends one request, records its status and checks that a refusal
        changed nothing (or closed its round, retried once)."""
        before = self.snapshot
        if raw is not None:
            code, message, reply = self.raw(method, raw, timeout)
        else:
            code, message, reply = self.call(method, request, timeout)
        self.record(method, code, message, what)
        after = self.list_all()
        if code in REFUSALS and after != before:
            self.check_round_outcome(
                method, request if raw is None else None, code, message, before, after, what
            )
            after = self.list_all()
        self.snapshot = after
        if code == grpc.StatusCode.OK and method == "Propose" and raw is None:
            self.check_decision(request, reply, what)
        return code, message, reply

    def check_round_outcome(
        self,
        method: str,
        request: Any,
        code: grpc.StatusCode,
        message: str,
        before: list[pb.Group],
        after: list[pb.Group],
        what: str,
    ) -> None:
        changed = {g.name for g in before} ^ {g.name for g in after} | {
            b.name for b in before for a in after if a.name == b.name and a != b
        }
        proposal = isinstance(request, pb.ProposeRequest)
        group = next((g for g in after if proposal and g.name == request.group), None)
        closed = (
            proposal
            and code == grpc.StatusCode.FAILED_PRECONDITION
            and changed == {request.group}
            and group is not None
            and group.open_round == 0
            and group.last_closed_round == request.round
        )
        if not closed:
            self.violation(
                f"{method} refused {code.name} ({message!r}) but changed {sorted(changed)} ({what})"
            )
            return
        self.report.round_outcomes += 1
        again = self.call(method, request)
        self.record(method, again[0], again[1], what + ", retried")
        if again[:2] != (code, message) or self.list_all() != after:
            self.violation(
                f"the retry of a refused round answered {again[:2]}, not {(code, message)} ({what})"
            )

    def check_decision(
        self, request: pb.ProposeRequest, reply: pb.ProposeResponse, what: str
    ) -> None:
        plan = reply.plan
        need = request.requirement.capacities
        sizes = (
            "max_tokens",
            "dispatch_bytes_per_token",
            "combine_bytes_per_token",
            "eplb_experts",
        )
        if not (
            reply.round == request.round
            and plan.capacities.top_k == need.top_k
            and plan.capacities.num_experts == need.num_experts
            and all(getattr(plan.capacities, s) >= getattr(need, s) for s in sizes)
            and 1 <= plan.generation <= limits.MAX_GENERATION
            and plan.epoch <= limits.MAX_GENERATION
            and 0 < plan.workspace_bytes <= limits.MAX_WORKSPACE_BYTES
        ):
            self.violation(f"decision {_text(reply)} does not serve {_text(request)} ({what})")

    # --- requests ---------------------------------------------------------------------

    def new_token(self) -> str:
        return f"{self.rng.getrandbits(128):032x}"

    def capacities(self, group: Group | None, grow: bool) -> pb.Capacities:
        top_k, num_experts = group.shape if group else (2, 64)
        base = group.plan.capacities if group and group.plan else None
        if base is not None and not grow:
            return pb.Capacities(
                max_tokens=self.rng.randint(1, base.max_tokens),
                dispatch_bytes_per_token=self.rng.randint(1, base.dispatch_bytes_per_token),
                combine_bytes_per_token=self.rng.randint(1, base.combine_bytes_per_token),
                top_k=top_k,
                num_experts=num_experts,
                eplb_experts=self.rng.randint(0, base.eplb_experts),
            )
        return pb.Capacities(
            max_tokens=self.rng.choice([1, 16, 256, 4096, 65536]) * self.rng.randint(1, 4),
            dispatch_bytes_per_token=self.rng.choice([64, 1024, 7168, 1 << 16]),
            combine_bytes_per_token=self.rng.choice([64, 14336, 1 << 16]),
            top_k=top_k,
            num_experts=num_experts,
            eplb_experts=self.rng.choice([0, 0, 0, num_experts]),
        )

    def new_group(self) -> Group:
        self.serial += 1
        local = self.rng.choice([1, 1, 1, 1, 2, 3, 4])
        ep_size = self.rng.choice([local, local, local * 2, 64 if local == 1 else local * 4])
        shape = (self.rng.choice([1, 2, 8, 22]), self.rng.choice([64, 256, 1 << 16]))
        return Group(
            f"fuzz-{self.serial:05d}/ep{ep_size}",
            ep_size,
            local,
            [self.new_token() for _ in range(local)],
            shape=shape,
        )

    def stranger_proposal(self) -> pb.ProposeRequest:
        proposal = self.proposal(self.some_group(), 0, 1, self.capacities(None, True), "l")
        proposal.lifetime = self.new_token()
        return proposal

    def proposal(
        self, group: Group, rank: int, rnd: int, need: pb.Capacities, layer: str
    ) -> pb.ProposeRequest:
        return pb.ProposeRequest(
            group=group.name,
            ep_size=group.ep_size,
            ep_rank=rank,
            local_ranks=group.local_ranks,
            lifetime=group.tokens[rank],
            round=rnd,
            requirement=pb.Requirement(capacities=need, layer=layer),
        )

    def valid_round(self) -> None:
        """Every local rank of a group proposes its next round at once."""
        usable = [g for g in self.groups.values() if not g.tainted]
        if not usable or (len(self.groups) < MAX_GROUPS and self.rng.random() < 0.3):
            group = self.new_group()
        else:
            group = self.rng.choice(usable)
        if self.rng.random() < 0.1 and group.round:  # a restart of every rank
            group.tokens = [self.new_token() for _ in range(group.local_ranks)]
            group.round = 0
        rnd = group.round + 1
        need = self.capacities(group, grow=self.rng.random() < 0.4)
        layer = self.rng.choice(["", f"model.layers.{rnd}.mlp"])
        requests = [self.proposal(group, r, rnd, need, layer) for r in range(group.local_ranks)]
        assert self.channel is not None
        before = self.snapshot
        futures = [self.stub.Propose.future(r, timeout=5) for r in requests]
        replies = []
        for request, future in zip(requests, futures, strict=True):
            try:
                replies.append(future.result())
                self.record("Propose", grpc.StatusCode.OK, "", "a valid round")
                self.check_decision(request, replies[-1], "a valid round")
            except grpc.RpcError as error:
                code = error.code()
                self.record("Propose", code, error.details() or "", "a valid round")
        self.snapshot = self.list_all()
        if len(replies) == len(requests):
            group.round, group.plan = rnd, replies[0].plan
            self.groups[group.name] = group
        elif group.name not in self.groups and self.snapshot == before:
            pass  # refused (e.g. RESOURCE_EXHAUSTED): the group does not exist
        else:
            group.tainted = True
            self.groups.setdefault(group.name, group)

    def some_group(self) -> Group:
        return self.rng.choice(list(self.groups.values())) if self.groups else self.new_group()

    def shown_id(self, group: Group) -> str:
        for g in self.snapshot:
            if g.name == group.name and g.ranks:
                return str(self.rng.choice(g.ranks).lifetime)
        return "0123456789ab"

    def lifetime_variant(self, group: Group, rank: int) -> str:
        other = self.rng.choice(list(self.groups.values())) if self.groups else group
        return self.rng.choice(
            [
                "",
                "short",
                "x" * 15,
                "x" * 16,
                "x" * 256,
                "x" * 257,
                "\u00e9" * 20,
                "tab\there-and-long-enough",
                self.shown_id(group),
                self.shown_id(group).ljust(64, "0"),
                self.new_token(),
                group.tokens[(rank + 1) % len(group.tokens)],
                other.tokens[0],
            ]
        )

    def mutated_proposal(self) -> None:
        group = self.some_group()
        rank = self.rng.randrange(group.local_ranks)
        request = self.proposal(group, rank, group.round + 1, self.capacities(group, grow=True), "")
        mutations: list[Callable[[], None]] = [
            lambda: setattr(request, "group", self.rng.choice([*NAMES, self.some_group().name])),
            lambda: setattr(request, "ep_size", self.rng.choice(U32)),
            lambda: setattr(request, "ep_rank", self.rng.choice(U32)),
            lambda: setattr(request, "local_ranks", self.rng.choice(U32)),
            lambda: setattr(request, "lifetime", self.lifetime_variant(group, rank)),
            lambda: setattr(
                request, "round", self.rng.choice([*U64, group.round, group.round + 2])
            ),
            lambda: request.ClearField("requirement"),
            lambda: request.requirement.ClearField("capacities"),
            lambda: setattr(request.requirement, "layer", self.rng.choice(NAMES)),
            lambda: setattr(
                request.requirement.capacities,
                self.rng.choice(
                    ["max_tokens", "dispatch_bytes_per_token", "combine_bytes_per_token"]
                ),
                self.rng.choice(U64),
            ),
            lambda: setattr(
                request.requirement.capacities,
                self.rng.choice(["top_k", "num_experts", "eplb_experts"]),
                self.rng.choice(U32),
            ),
        ]
        for mutate in self.rng.sample(mutations, self.rng.choice([1, 1, 2, 3])):
            mutate()
        before = {g.name: g for g in self.snapshot}
        waits = request.local_ranks > 1
        code, _, reply = self.send(
            "Propose", request, "a mutated Propose", timeout=WAIT if waits else 5
        )
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            self.heal(request)
            return
        self.resync(request, code, reply, before.get(request.group))

    def resync(
        self, request: pb.ProposeRequest, code: grpc.StatusCode, reply: Any, before: pb.Group | None
    ) -> None:
        """Brings the model of a one-rank group in line with what the sidecar did."""
        after = next((g for g in self.snapshot if g.name == request.group), None)
        known = self.groups.get(request.group)
        if after is None:
            self.groups.pop(request.group, None)
            return
        if known is None:
            self.model_unknown(after)
            return
        if known.local_ranks != 1 or after.open_round:
            known.tainted = known.tainted or after != before
            return
        if before is None or after.lifetimes != before.lifetimes:
            known.tokens = [request.lifetime]
        known.round = after.last_closed_round
        if code == grpc.StatusCode.OK:
            known.plan = reply.plan

    def heal(self, stray: pb.ProposeRequest) -> None:
        """A proposal joined a round (or a restart) of a group with more local
        ranks and its caller left: the group's other ranks propose the same, so
        the round closes and the group goes on."""
        state = next((g for g in self.snapshot if g.name == stray.group), None)
        if state is None:
            return
        group = self.groups.get(stray.group) or Group(
            stray.group,
            stray.ep_size,
            stray.local_ranks,
            [self.new_token() for _ in range(stray.local_ranks)],
        )
        if state.restarting_ranks:  # a new lifetime: all of them restart with it
            tokens = [self.new_token() for _ in range(group.local_ranks)]
        else:
            tokens = list(group.tokens)
        tokens[stray.ep_rank] = stray.lifetime
        rnd = stray.round
        if not (state.restarting_ranks or state.open_round == rnd):
            group.tainted = True
            self.groups[group.name] = group
            return
        requests = []
        for r in range(group.local_ranks):
            request = pb.ProposeRequest()
            request.CopyFrom(stray)
            request.ep_rank, request.lifetime = r, tokens[r]
            requests.append(request)
        futures = [self.stub.Propose.future(r, timeout=5) for r in requests]
        replies = []
        for future in futures:
            try:
                replies.append(future.result())
                self.record("Propose", grpc.StatusCode.OK, "", "the rest of a round")
            except grpc.RpcError as error:
                code = error.code()
                self.record("Propose", code, error.details() or "", "the rest of a round")
        self.snapshot = self.list_all()
        after = next((g for g in self.snapshot if g.name == stray.group), None)
        if after is None or after.open_round or after.restarting_ranks:
            group.tainted = True
        else:
            group.tokens, group.round = tokens, after.last_closed_round
            if len(replies) == len(requests):
                group.plan = replies[0].plan
        self.groups[group.name] = group

    def model_unknown(self, state: pb.Group) -> None:
        """A group the fuzzer did not make (a mutated or raw proposal made it):
        kept in the model for Commit, GetGroup and RemoveGroup, never for rounds."""
        if state.name not in self.groups:
            self.groups[state.name] = Group(
                state.name,
                state.ep_size,
                state.local_ranks,
                ["?" * 32] * state.local_ranks,
                tainted=True,
            )

    def commit(self) -> None:
        decided = [g for g in self.groups.values() if g.plan is not None and g.round]
        if not decided:
            return self.list_groups()
        group = self.rng.choice(decided)
        assert group.plan is not None
        rank = self.rng.randrange(group.local_ranks)
        plan = pb.Plan()
        plan.CopyFrom(group.plan)
        plan.ClearField("workspace_bytes")
        request = pb.CommitRequest(
            group=group.name,
            ep_rank=rank,
            lifetime=group.tokens[rank],
            round=group.round,
            plan=plan,
            build_seconds=self.rng.uniform(0, 10),
        )
        if self.rng.random() < 0.75:
            mutations: list[Callable[[], None]] = [
                lambda: setattr(
                    request, "group", self.rng.choice([*NAMES, self.some_group().name])
                ),
                lambda: setattr(request, "ep_rank", self.rng.choice(U32)),
                lambda: setattr(request, "lifetime", self.lifetime_variant(group, rank)),
                lambda: setattr(request, "round", self.rng.choice(U64)),
                lambda: request.ClearField("plan"),
                lambda: request.plan.ClearField("capacities"),
                lambda: setattr(
                    request.plan, self.rng.choice(["epoch", "generation"]), self.rng.choice(U64)
                ),
                lambda: setattr(
                    request.plan.capacities,
                    self.rng.choice(
                        ["max_tokens", "dispatch_bytes_per_token", "combine_bytes_per_token"]
                    ),
                    self.rng.choice(U64),
                ),
                lambda: setattr(
                    request.plan.capacities,
                    self.rng.choice(["top_k", "num_experts", "eplb_experts"]),
                    self.rng.choice(U32),
                ),
                lambda: setattr(request, "build_seconds", self.rng.choice(DOUBLES)),
            ]
            for mutate in self.rng.sample(mutations, self.rng.choice([1, 1, 2])):
                mutate()
            what = "a mutated Commit"
        else:
            what = "a Commit of the decision"
        self.send("Commit", request, what)
        return None

    def list_groups(self) -> None:
        page_token = self.rng.choice(
            [
                "",
                "",
                *self.page_tokens[-3:],
                "garbage",
                "g1.",
                "g1.!!!!",
                "g1." + base64.urlsafe_b64encode(b"x" * 300).decode(),
                "g1." + base64.urlsafe_b64encode(b"\xff\xfe").decode(),
                "g1." + base64.urlsafe_b64encode(b"zzzz").decode(),
            ]
        )
        request = pb.ListGroupsRequest(
            page_size=self.rng.choice([-(1 << 31), -1, 0, 1, 2, 7, 50, 51, (1 << 31) - 1]),
            page_token=page_token,
            idle_for_seconds=self.rng.choice([*DOUBLES, 0.0, 0.0]),
        )
        code, _, reply = self.send("ListGroups", request, "ListGroups")
        if code == grpc.StatusCode.OK and reply.next_page_token:
            self.page_tokens.append(reply.next_page_token)

    def name_call(self, method: str) -> None:
        names = [*NAMES, *(g.name for g in self.groups.values()), "fuzz-unknown/ep1"]
        name = self.rng.choice(names)
        request = getattr(pb, REQUEST_TYPES[method])(group=name)
        code, _, _ = self.send(method, request, method, timeout=0.05 if method == "Watch" else 5)
        if method == "RemoveGroup" and code == grpc.StatusCode.OK:
            self.groups.pop(name, None)

    def raw_bytes(self) -> None:
        method = self.rng.choice(METHODS)
        kind = self.rng.random()
        if kind < 0.4:
            payload = self.rng.randbytes(self.rng.randrange(0, 64))
        else:
            valid = {
                "Propose": lambda: self.proposal(
                    self.some_group(), 0, 1, self.capacities(None, True), "l"
                ),
                "Commit": lambda: pb.CommitRequest(group="g", lifetime=self.new_token(), round=1),
                # A stranger's session (a rank's own would leave when it ends).
                "Session": lambda: pb.SessionRequest(id=1, propose=self.stranger_proposal()),
                "Watch": lambda: pb.WatchRequest(group=self.some_group().name),
                "ListGroups": lambda: pb.ListGroupsRequest(page_size=3, page_token="g1.Zw"),
                "GetGroup": lambda: pb.GetGroupRequest(group=self.some_group().name),
                "ResetGroup": lambda: pb.ResetGroupRequest(group="fuzz-unknown"),
                "RemoveGroup": lambda: pb.RemoveGroupRequest(group="fuzz-unknown"),
                "ExcludeRanks": lambda: pb.ExcludeRanksRequest(group="fuzz-unknown", ranks=[0]),
                "Arrive": lambda: pb.ArriveRequest(
                    group="fuzz-unknown", ep_size=2, ep_rank=0, local_ranks=2, lifetime="f" * 32
                ),
            }[method]().SerializeToString()
            data = bytearray(valid)
            if data and kind < 0.7:
                for _ in range(self.rng.randint(1, 4)):
                    data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
            elif data:
                del data[self.rng.randrange(len(data)) :]
            payload = bytes(data)
        timeout = 0.05 if method == "Watch" else WAIT
        code, _, _ = self.send(
            method, None, f"{len(payload)} raw bytes", timeout=timeout, raw=payload
        )
        if code not in REFUSALS:
            # A payload that decoded may have made a group, or joined a round.
            for g in self.snapshot:
                if g.name not in self.groups:
                    self.model_unknown(g)
                elif g.open_round or g.restarting_ranks:
                    self.groups[g.name].tainted = True
            for name in set(self.groups) - {g.name for g in self.snapshot}:
                del self.groups[name]

    # --- the run ---------------------------------------------------------------------

    def step(self) -> None:
        actions: list[tuple[float, Callable[[], None]]] = [
            (22, self.valid_round),
            (24, self.mutated_proposal),
            (16, self.commit),
            (7, self.list_groups),
            (5, lambda: self.name_call("GetGroup")),
            (3, lambda: self.name_call("Watch")),
            (3, lambda: self.name_call("ResetGroup")),
            (4, lambda: self.name_call("RemoveGroup")),
            (16, self.raw_bytes),
        ]
        weights = [w for w, _ in actions]
        self.rng.choices([a for _, a in actions], weights)[0]()

    def restart(self) -> None:
        before = self.list_all()
        self.close()
        self.sidecar.stop()
        self.sidecar.start()
        self.connect()
        self.report.restarts += 1
        # A group known only from ranks arriving at their first round is the
        # arrivals' waiting, not state: a restarted sidecar has none of it.
        if _stored(self.snapshot) != _stored(before):
            self.violation("the groups after a restart differ from those before it")


def _stored(groups: list[pb.Group]) -> list[pb.Group]:
    """What a restart keeps: the groups some rank has proposed for, each
    without what only its first round's arrivals show (ranks waiting there, and
    those whose arrival ended before they proposed, shown with lifetime "-"),
    nor the ranks a restarted sidecar waits to hear from again (``awaited_ranks``:
    whom the start awaits, not what is stored)."""
    kept = []
    for group in groups:
        if not (group.lifetimes or group.history or group.HasField("plan")):
            continue
        stored = pb.Group()
        stored.CopyFrom(group)
        stored.waiting_ranks -= len(group.arrived_ranks)
        del stored.arrived_ranks[:]
        del stored.awaited_ranks[:]
        del stored.ranks[:]
        stored.ranks.extend(rank for rank in group.ranks if rank.lifetime != "-")
        kept.append(stored)
    return kept


def _text(message: Any) -> str:
    return str(text_format.MessageToString(message, as_one_line=True))


def method_reply(method: str) -> str:
    return (
        pb.DESCRIPTOR.services_by_name["WorkspaceCoordinator"]
        .methods_by_name[method]
        .output_type.name
    )


def run(requests: int, seed: int, directory: Path) -> Report:
    """Fuzzes a sidecar in ``directory`` with at least ``requests`` requests."""
    report = Report(seed=seed)
    sidecar = Sidecar(directory)
    started = time.monotonic()
    sidecar.start()
    fuzzer = Fuzzer(seed, sidecar, report)
    try:
        fuzzer.connect()
        next_restart = RESTART_EVERY
        while report.requests < requests:
            fuzzer.step()
            if report.requests >= next_restart and report.requests < requests:
                fuzzer.restart()
                next_restart += RESTART_EVERY
        fuzzer.restart()  # and the state the run left loads back as it was
    finally:
        fuzzer.close()
        sidecar.stop()
    report.seconds = time.monotonic() - started
    return report


def format_report(report: Report, command: str) -> Iterator[str]:
    yield f"$ {command}"
    yield f"# seed {report.seed}: {report.requests} requests in {report.seconds:.1f} s, {report.restarts} restarts of the sidecar"
    yield f"# refused rounds that closed for all their ranks (retried, unchanged): {report.round_outcomes}"
    statuses = sorted({code for _, code in report.counts})
    yield f"{'method':<12}" + "".join(f"{code:>20}" for code in statuses) + f"{'total':>8}"
    for method in METHODS:
        row = [report.counts.get((method, code), 0) for code in statuses]
        yield f"{method:<12}" + "".join(f"{n:>20}" for n in row) + f"{sum(row):>8}"
    totals = [sum(n for (_, c), n in report.counts.items() if c == code) for code in statuses]
    yield f"{'all':<12}" + "".join(f"{n:>20}" for n in totals) + f"{sum(totals):>8}"
    forbidden = sum(
        n for (_, code), n in report.counts.items() if code in {c.name for c in FORBIDDEN}
    )
    yield (
        "(DEADLINE_EXCEEDED is the fuzzer's own deadline: a Watch with no event within 50 ms, "
        "or a proposal left waiting for the other ranks of its round; the sidecar's round "
        "timeout, a day, never fires)"
    )
    yield f"INTERNAL/UNKNOWN/UNIMPLEMENTED/UNAVAILABLE/DATA_LOSS answers: {forbidden}"
    yield f"violations: {len(report.violations)}"
    yield from (f"  {v}" for v in report.violations[:50])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    parser.add_argument("--out", type=Path, default=None, help="also write the output here")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    print(f"# fuzz_sidecar: seed {seed}, {args.requests} requests", flush=True)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="fuzz-sidecar-") as directory:
        report = run(args.requests, seed, Path(directory))
    command = f".venv/bin/python bench/fuzz_sidecar.py --requests {args.requests} --seed {seed}"
    if args.out is not None:
        command += f" --out {args.out}"
    command += (
        f"\n# python {sys.version.split()[0]}, grpcio {grpc.__version__}, {os.cpu_count()} CPUs, "
        f"load average {load} at the start"
    )
    lines = list(format_report(report, command))
    print("\n".join(lines))
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
