"""``moe-sidecar serve`` exits with status 1 when the state or a port cannot be used,
and one line names the flag to change and the cause (docs/configuration.md, "Exit
status"): JSON where logs are JSON, the plain line of a flag error on a terminal."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pty
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from moe_sidecar.server import running_server
from moe_sidecar.store.sqlite import DATABASE_FILE
from tests.integration.helpers import (
    log_records,
    make_config,
    start_sidecar_process,
    stop_process,
    wait_for_serving_record,
)

pytestmark = pytest.mark.timeout(60)


async def _serve_exit(tmp_path: Path, *flags: str) -> tuple[int, str]:
    """Runs ``python -m moe_sidecar`` with ``flags`` after the defaults below;
    returns its exit status and the error of its ``cannot start`` log line."""
    log = tmp_path / "refused.log"
    defaults = {
        "--listen": f"unix://{tmp_path}/refused.sock",
        "--state-dir": str(tmp_path / "refused-state"),
        "--health-port": "0",
        "--metrics-port": "0",
    }
    given = dict(zip(flags[::2], flags[1::2], strict=True))
    argv = [item for pair in {**defaults, **given}.items() for item in pair]
    process = start_sidecar_process(log, *argv)
    try:
        code = await asyncio.to_thread(process.wait, 30)
    finally:
        await asyncio.to_thread(stop_process, process)
    errors = [r["error"] for r in log_records(log) if r["message"] == "cannot start"]
    assert len(errors) == 1, log.read_text()
    return code, errors[0]


@contextlib.contextmanager
def _listening(host: str) -> Iterator[int]:
    """A port on ``host`` that another program listens on."""
    with socket.create_server((host, 0)) as taken:
        yield int(taken.getsockname()[1])


_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def _skip_unless_nobody_imports_the_project() -> None:
    """Skips when uid 65534 cannot import this checkout's ``moe_sidecar``: a
    checkout (or its venv) under a directory only its owner may enter, e.g.
    a ``mktemp -d``. The check itself needs another user; root there proves
    nothing, since root may write anywhere."""
    probe = subprocess.run(
        [*_NOBODY, sys.executable, "-c", "import moe_sidecar"],
        capture_output=True, text=True, timeout=30, cwd="/",
    )  # fmt: skip
    if probe.returncode != 0:
        why = (
            f"uid 65534 cannot import moe_sidecar from {sys.executable}: make the checkout "
            f"and its venv readable by other users ({probe.stderr.strip()[-200:]})"
        )
        if os.environ.get("CI") == "true":  # CI's checkout must run them: never a silent skip
            pytest.fail(why)
        pytest.skip(why)


@pytest.mark.parametrize("obstacle", ["a-regular-file", "corrupt-database"])
async def test_serve_exits_1_when_the_state_dir_is_unusable(tmp_path: Path, obstacle: str) -> None:
    state_dir = tmp_path / "state"
    if obstacle == "a-regular-file":
        state_dir.write_text("not a directory")
    else:
        state_dir.mkdir()
        (state_dir / DATABASE_FILE).write_bytes(b"this is not sqlite" * 100)
    code, error = await _serve_exit(tmp_path, "--state-dir", str(state_dir))
    assert code == 1
    assert str(state_dir) in error
    if obstacle == "a-regular-file":
        assert error.startswith(f"--state-dir '{state_dir}': is a file, not a directory; give")
    else:
        assert "not a usable SQLite" in error


async def test_serve_exits_1_when_another_sidecar_holds_the_state_dir(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    async with running_server(config):
        code, error = await _serve_exit(tmp_path, "--state-dir", str(config.state_dir))
    assert code == 1
    assert str(config.state_dir) in error and "in use by another moe-sidecar" in error
    assert "give each sidecar its own --state-dir" in error


@pytest.mark.skipif(not shutil.which("setpriv"), reason="needs setpriv to drop root")
def test_a_state_dir_this_user_cannot_create_names_the_flag(tmp_path: Path) -> None:
    # As root, the check runs as uid 65534 (as a user without root runs the default
    # /var/lib/moe-sidecar); as another user, a directory it may not write.
    parent = tmp_path / "locked"
    parent.mkdir(mode=0o555)
    os.chmod(tmp_path, 0o755)
    if os.getuid() == 0:
        _skip_unless_nobody_imports_the_project()
    drop = _NOBODY if os.getuid() == 0 else []
    done = subprocess.run(
        [*drop, sys.executable, "-m", "moe_sidecar", "--state-dir", str(parent / "state"),
         "--listen", f"unix://{parent}/s.sock", "--health-port", "0", "--metrics-port", "0",
         "--log-format", "text"],
        capture_output=True, text=True, timeout=30, cwd="/",
        env={k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == (
        f"moe-sidecar serve: cannot start: --state-dir '{parent / 'state'}': permission denied "
        "creating it; give a directory this user may write (created if missing), e.g. "
        "--state-dir ./state"
    )


@pytest.mark.skipif(
    os.getuid() != 0 or not shutil.which("setpriv") or not shutil.which("unshare"),
    reason="needs root (to mount a private /var/lib and run as another user), setpriv, unshare",
)
def test_the_default_state_dir_tells_a_user_without_root_what_to_give(tmp_path: Path) -> None:
    # The real default path, whatever this machine's /var/lib holds: in a mount
    # namespace of its own, /var/lib is an empty tmpfs that only root may write,
    # as on a machine where no /var/lib/moe-sidecar was made for this user.
    _skip_unless_nobody_imports_the_project()
    os.chmod(tmp_path, 0o777)
    sidecar = [
        *_NOBODY, sys.executable, "-m",
        "moe_sidecar", "--listen", f"unix://{tmp_path}/s.sock", "--health-port", "0",
        "--metrics-port", "0", "--log-format", "text",
    ]  # fmt: skip
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount -t tmpfs -o mode=0755 tmpfs /var/lib && exec "$@"', "sh", *sidecar],
        capture_output=True, text=True, timeout=30, cwd="/",
        env={k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == (
        "moe-sidecar serve: cannot start: --state-dir '/var/lib/moe-sidecar': permission denied "
        "creating it (the default needs root); give a directory this user may write (created if "
        "missing), e.g. --state-dir ./state"
    )


@pytest.mark.parametrize(
    ("flags", "env", "named"),
    [
        (["--state-dir", ""], {}, "--state-dir ''"),
        ([], {"MOE_SIDECAR_STATE_DIR": ""}, "MOE_SIDECAR_STATE_DIR=''"),
    ],
)
def test_an_empty_state_dir_is_refused_and_nothing_is_written_here(
    tmp_path: Path, flags: list[str], env: dict[str, str], named: str
) -> None:
    here = tmp_path / "cwd"
    here.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "moe_sidecar", *flags, "--listen", f"unix://{tmp_path}/s.sock",
         "--health-port", "0", "--metrics-port", "0"],
        capture_output=True, text=True, timeout=30, cwd=here,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")}, **env},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"moe-sidecar serve: {named}: must name a path"), done.stderr
    assert list(here.iterdir()) == []


def test_serve_logs_the_absolute_state_dir_of_a_relative_flag(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with log.open("ab") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "moe_sidecar", "--state-dir", "state", "--listen",
             f"unix://{tmp_path}/s.sock", "--health-port", "0", "--metrics-port", "0",
             "--log-format", "json"],
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=stderr,
            env={k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")},
        )  # fmt: skip
    try:
        record = wait_for_serving_record(process, log)
    finally:
        stop_process(process)
    assert record["state_dir"] == str(tmp_path / "state")


@pytest.mark.parametrize("which", ["listen", "health", "metrics"])
async def test_serve_exits_1_when_a_port_is_taken(tmp_path: Path, which: str) -> None:
    # Every endpoint binds loopback by default; --listen binds exactly the host given.
    with _listening("127.0.0.1") as port:
        flag, value = {
            "listen": ("--listen", f"127.0.0.1:{port}"),
            "health": ("--health-port", str(port)),
            "metrics": ("--metrics-port", str(port)),
        }[which]
        code, error = await _serve_exit(tmp_path, flag, value)
    assert code == 1
    where = "" if which == "listen" else f" 127.0.0.1:{port}:"
    assert error.startswith(f"{flag} {value}:{where} address already in use"), error
    assert f"give another {flag}" in error
    assert "GRPC_VERBOSITY" not in error


async def test_a_socket_path_another_sidecar_serves_names_listen(tmp_path: Path) -> None:
    path = tmp_path / "taken.sock"
    async with running_server(make_config(tmp_path, listen=(f"unix://{path}",))):
        code, error = await _serve_exit(tmp_path, "--listen", f"unix://{path}")
    assert code == 1
    assert error == (
        f"--listen unix://{path}: address already in use (another moe-sidecar serves or is "
        f"starting on {str(path)!r}: its lock {str(path) + '.lock'!r} is held); give another "
        "--listen address, or stop the process that holds it"
    )


async def test_a_socket_path_another_process_listens_on_names_listen(tmp_path: Path) -> None:
    path = tmp_path / "taken.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as taken:
        taken.bind(str(path))
        taken.listen()
        code, error = await _serve_exit(tmp_path, "--listen", f"unix://{path}")
    assert code == 1
    assert error == (
        f"--listen unix://{path}: address already in use (another process listens on "
        f"{str(path)!r}); give another --listen address, or stop the process that holds it"
    )


def test_a_second_sidecar_on_a_terminal_gets_one_plain_line(tmp_path: Path) -> None:
    # The default --log-format auto writes text on a terminal: the start error is
    # the one plain line a flag error is, and gRPC's own bind failure is not printed.
    first_log = tmp_path / "first.log"
    with _listening("127.0.0.1") as port:
        primary, secondary = pty.openpty()
        try:
            done = subprocess.run(
                [sys.executable, "-m", "moe_sidecar", "--listen", f"127.0.0.1:{port}",
                 "--state-dir", str(tmp_path / "state"), "--health-port", "0",
                 "--metrics-port", "0"],
                stdout=subprocess.DEVNULL, stderr=secondary, timeout=30,
                env={k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")},
            )  # fmt: skip
            os.close(secondary)
            output = b""
            with contextlib.suppress(OSError):  # EIO once the child's end is closed
                while chunk := os.read(primary, 4096):
                    output += chunk
        finally:
            os.close(primary)
    assert done.returncode == 1
    lines = output.decode().splitlines()
    assert lines == [
        f"moe-sidecar serve: cannot start: --listen 127.0.0.1:{port}: address already in use "
        "(another process, perhaps another moe-sidecar, listens there); give another --listen "
        "address, or stop the process that holds it"
    ], output
    assert not first_log.exists()


async def test_serve_exits_1_when_the_socket_path_is_a_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "precious"
    path.write_text("keep me")
    code, error = await _serve_exit(tmp_path, "--listen", f"unix://{path}")
    assert code == 1
    assert error == (
        f"--listen unix://{path}: {str(path)!r} exists and is not a socket; refusing to replace "
        "it; give --listen a path where no file is, or remove it"
    )
    assert path.read_text() == "keep me"
    # Nothing of the refused start is left beside it (no lock file).
    assert not (tmp_path / "precious.lock").exists()


def test_an_address_not_of_this_machine_is_our_one_line_with_the_cause(tmp_path: Path) -> None:
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): never an address of a machine. gRPC's
    # own log line of the failed bind is not printed before ours.
    log = tmp_path / "refused.log"
    process = start_sidecar_process(
        log, "--listen", "192.0.2.1:5000", "--insecure", "--state-dir", str(tmp_path / "state"),
        "--health-port", "0", "--metrics-port", "0", "--log-format", "text",
    )  # fmt: skip
    try:
        code = process.wait(30)
    finally:
        stop_process(process)
    assert code == 1
    assert log.read_text().splitlines() == [
        "moe-sidecar serve: cannot start: --listen 192.0.2.1:5000: Cannot assign requested "
        "address (not an address of this machine); give another --listen"
    ]
