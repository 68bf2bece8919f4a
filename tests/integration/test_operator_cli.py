"""The command line as a new user meets it: real processes, real sidecars.

* A malformed ``--listen``, ``--target`` or ``MOE_SIDECAR_TARGET`` is one
  line on stderr naming where the value came from and the forms expected,
  exit status 2, no traceback.
* ``moe-sidecar reset GROUP`` and ``moe-sidecar remove GROUP`` /
  ``remove --idle-for SECONDS`` against a sidecar started with
  ``--enable-admin``; PERMISSION_DENIED (one line) without it.
* ``serve --help`` says that ``--listen`` replaces the default listener, in
  sections; a bad flag of ``serve`` prints serve's usage;
  ``python -m moe_sidecar --version`` is the program's version.
* Every command refuses a misspelt ``MOE_SIDECAR_*`` variable, naming the one meant.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc
from tests.integration.helpers import (
    ROOT,
    propose_request,
    start_sidecar_process,
    stop_process,
    wait_until_serving,
)

pytestmark = pytest.mark.timeout(60)

FORMS = "'unix:///absolute/path.sock', 'unix:relative/path.sock' or 'host:port'"


def moe_sidecar(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``moe-sidecar ARGV`` (the console script's entry point) in its own process."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")}
    main = "import sys; from moe_sidecar.cli import main; sys.exit(main())"
    return subprocess.run(
        [sys.executable, "-c", main, *argv],
        cwd=ROOT,
        env={**environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a failed command (no traceback)."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_a_relative_path_after_unix_slash_slash_is_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_sidecar",
            "--listen",
            "unix://relative.sock",
            "--state-dir",
            str(tmp_path / "state"),
        ],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    line = one_line(result)
    assert line.startswith("moe-sidecar serve: --listen='unix://relative.sock': "), line
    # The forms that would have worked: an absolute path, or unix: for a relative one.
    assert "'unix:///run/x.sock'" in line and "'unix:relative.sock'" in line, line
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize(
    ("argv", "env", "source"),
    [
        (["--target", "localhost"], {}, "--target='localhost'"),
        (["--target", "tcp://1.2.3.4:5"], {}, "--target='tcp://1.2.3.4:5'"),
        ([], {"MOE_SIDECAR_TARGET": "localhost"}, "MOE_SIDECAR_TARGET='localhost'"),
    ],
    ids=["no-port", "scheme", "env"],
)
def test_a_bad_target_is_one_line_naming_its_source(
    argv: list[str], env: dict[str, str], source: str
) -> None:
    started = time.monotonic()
    result = moe_sidecar("groups", *argv, env=env)
    assert result.returncode == 2, result
    line = one_line(result)
    assert line.startswith(f"moe-sidecar groups: {source}: expected {FORMS}"), line
    # Refused before dialing anything (no port 443, no gRPC core line).
    assert time.monotonic() - started < 20
    assert result.stdout == ""


@pytest.fixture
def admin_sidecar(tmp_path: Path) -> Iterator[str]:
    yield from _sidecar(tmp_path, "--enable-admin")


@pytest.fixture
def plain_sidecar(tmp_path: Path) -> Iterator[str]:
    yield from _sidecar(tmp_path)


def _sidecar(tmp_path: Path, *flags: str) -> Iterator[str]:
    target = f"unix://{tmp_path}/s.sock"
    log = tmp_path / "sidecar.log"
    process = start_sidecar_process(
        log,
        "--listen",
        target,
        "--state-dir",
        str(tmp_path / "state"),
        "--health-port",
        "0",
        "--metrics-port",
        "0",
        *flags,
    )
    try:
        wait_until_serving(target, process, log)
        yield target
    finally:
        stop_process(process)


def _decide(stub: pb_grpc.WorkspaceCoordinatorStub, group: str) -> None:
    """One rank alone closes round 1 of ``group``: the group exists, with a plan."""
    stub.Propose(propose_request(0, group=group, ep_size=1, local_ranks=1), timeout=10)


def test_reset_and_remove_need_admin(plain_sidecar: str) -> None:
    with grpc.insecure_channel(plain_sidecar) as channel:
        stub = pb_grpc.WorkspaceCoordinatorStub(channel)
        _decide(stub, "kept/ep1")
        for argv in (["reset", "kept/ep1"], ["remove", "kept/ep1"]):
            result = moe_sidecar(*argv, "--target", plain_sidecar)
            assert result.returncode == 1, result
            line = one_line(result)
            assert line.startswith(f"moe-sidecar {argv[0]}: {plain_sidecar}: PERMISSION_DENIED:")
            assert "--enable-admin" in line, line
        # Nothing happened.
        assert stub.GetGroup(pb.GetGroupRequest(group="kept/ep1"), timeout=5).epoch == 0


def _exists(stub: pb_grpc.WorkspaceCoordinatorStub, group: str) -> bool:
    try:
        stub.GetGroup(pb.GetGroupRequest(group=group), timeout=5)
    except grpc.RpcError as error:
        if isinstance(error, grpc.Call) and error.code() == grpc.StatusCode.NOT_FOUND:
            return False
        raise
    return True


def test_reset_and_remove_against_a_running_sidecar(admin_sidecar: str) -> None:
    target = admin_sidecar
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.WorkspaceCoordinatorStub(channel)
        for group in ("reset-me/ep1", "remove-me/ep1", "idle-a/ep1", "idle-b/ep1"):
            _decide(stub, group)
        # A busy group: one of its two ranks waits in round 1.
        busy = "busy/ep2"
        waiting = stub.Propose.future(
            propose_request(0, group=busy, ep_size=2, local_ranks=2), timeout=30
        )

        result = moe_sidecar("reset", "reset-me/ep1", "--target", target)
        assert result.returncode == 0, result.stderr
        assert result.stdout == (
            f"group reset-me/ep1 at {target}: stored plan forgotten, epoch 1 begins; the "
            "group's next lifetime starts from its first layer\n"
        )
        reset = stub.GetGroup(pb.GetGroupRequest(group="reset-me/ep1"), timeout=5)
        assert reset.epoch == 1 and not reset.HasField("plan")

        result = moe_sidecar("remove", "remove-me/ep1", "--target", target)
        assert result.returncode == 0, result.stderr
        assert result.stdout == f"removed group remove-me/ep1 from {target}\n"
        assert not _exists(stub, "remove-me/ep1")

        # A busy group is refused, in one line.
        result = moe_sidecar("remove", busy, "--target", target)
        assert result.returncode == 1
        assert "FAILED_PRECONDITION" in one_line(result)
        assert _exists(stub, busy)

        # Prune: every group idle this long goes; the busy one stays.
        time.sleep(0.6)
        result = moe_sidecar("remove", "--idle-for", "0.5", "--target", target)
        assert result.returncode == 0, result.stderr
        removed = sorted(result.stdout.splitlines())
        assert removed == [
            f"removed group {g} from {target}" for g in ("idle-a/ep1", "idle-b/ep1", "reset-me/ep1")
        ]
        assert _exists(stub, busy)
        result = moe_sidecar("remove", "--idle-for", "0.5", "--target", target)
        assert result.returncode == 0, result.stderr
        assert result.stdout == f"no group of {target} has been idle for 0.5 s\n"

        # Names and --idle-for together (or neither) are a usage error.
        for argv in (["remove"], ["remove", busy, "--idle-for", "1"]):
            result = moe_sidecar(*argv, "--target", target)
            assert result.returncode == 2
            assert "name the groups to remove, or give --idle-for SECONDS" in one_line(result)
        # --idle-for 0 would list every group, the busy one too: refused.
        result = moe_sidecar("remove", "--idle-for", "0", "--target", target)
        assert result.returncode == 2
        assert "--idle-for 0: give a positive number of seconds" in one_line(result)
        assert _exists(stub, busy)
        waiting.cancel()


def test_serve_help_says_listen_replaces_the_default() -> None:
    result = moe_sidecar("serve", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert (
        "Any --listen replaces the default listener 127.0.0.1:50051: give it too to keep it" in text
    ), text


def test_serve_help_is_in_sections() -> None:
    result = moe_sidecar("serve", "--help")
    assert result.returncode == 0
    sections = [line[:-1] for line in result.stdout.splitlines() if line and line[0] != " "]
    assert sections[2:] == [
        "options",
        "listeners",
        "health and metrics",
        "state and store",
        "TLS",
        "rounds, admin and shutdown",
        "logs",
        "limits (each bounds a resource; moe_sidecar_limit exports them)",
    ], result.stdout


@pytest.mark.parametrize("entry", ["moe-sidecar serve", "python -m moe_sidecar"])
def test_a_bad_serve_flag_prints_serves_usage(entry: str) -> None:
    if entry == "moe-sidecar serve":
        result = moe_sidecar("serve", "--bogus-flag")
    else:
        result = subprocess.run(
            [sys.executable, "-m", "moe_sidecar", "--bogus-flag"],
            cwd=ROOT, capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith("usage: moe-sidecar serve [-h] [--listen ADDR]"), result.stderr
    assert result.stderr.splitlines()[-1] == (
        "moe-sidecar serve: error: unrecognized arguments: --bogus-flag"
    )


def test_python_m_moe_sidecar_version_is_the_programs() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "moe_sidecar", "--version"],
        cwd=ROOT, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == moe_sidecar("--version").stdout
    assert result.stdout.startswith("moe-sidecar ")


@pytest.mark.parametrize(
    "argv",
    [
        ("serve", "--listen", "unix:relative.sock"),
        ("groups",),
        ("reset", "some-group"),
        ("remove", "some-group"),
        ("simulate", "--ranks", "2"),
        ("size", "--ep", "2", "--tokens", "8", "--hidden", "64", "--top-k", "2",
         "--experts", "8", "--dispatch", "bf16"),
    ],
)  # fmt: skip
def test_every_command_refuses_a_misspelt_variable(argv: tuple[str, ...]) -> None:
    # Each would otherwise start, dial a sidecar or answer: the typo is the one line.
    result = moe_sidecar(*argv, env={"MOE_SIDECAR_STATEDIR": "/srv/state"})
    assert result.returncode == 2
    assert one_line(result) == (
        f"moe-sidecar {argv[0]}: unknown environment variable MOE_SIDECAR_STATEDIR='/srv/state'; "
        "did you mean MOE_SIDECAR_STATE_DIR?"
    )
