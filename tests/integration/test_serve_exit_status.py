"""``moe-sidecar serve`` exits with status 1 when the state or a port cannot be used,
and the log says which (README, "Exit status of `serve`")."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from moe_sidecar.server import running_server
from moe_sidecar.store import DATABASE_FILE
from tests.integration.helpers import log_records, make_config, start_sidecar_process, stop_process

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
    assert ("is not usable" if obstacle == "a-regular-file" else "not a usable SQLite") in error


async def test_serve_exits_1_when_another_sidecar_holds_the_state_dir(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    async with running_server(config):
        code, error = await _serve_exit(tmp_path, "--state-dir", str(config.state_dir))
    assert code == 1
    assert str(config.state_dir) in error and "in use by another moe-sidecar" in error


@pytest.mark.parametrize("which", ["listen", "health", "metrics"])
async def test_serve_exits_1_when_a_port_is_taken(tmp_path: Path, which: str) -> None:
    # --listen binds exactly the host given; the health and metrics ports bind 0.0.0.0.
    host = "127.0.0.1" if which == "listen" else "0.0.0.0"
    with _listening(host) as port:
        flag, value = {
            "listen": ("--listen", f"127.0.0.1:{port}"),
            "health": ("--health-port", str(port)),
            "metrics": ("--metrics-port", str(port)),
        }[which]
        code, error = await _serve_exit(tmp_path, flag, value)
    assert code == 1
    assert f"{host}:{port}" in error


async def test_serve_exits_1_when_the_socket_path_is_a_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "precious"
    path.write_text("keep me")
    code, error = await _serve_exit(tmp_path, "--listen", f"unix://{path}")
    assert code == 1
    assert str(path) in error and "not a socket" in error
    assert path.read_text() == "keep me"
