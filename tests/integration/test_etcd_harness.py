"""The test etcd's ports: ``free_port()`` only saw a port free, so a first
start whose port another process took moves to fresh ports; a restart keeps
its endpoint, which clients already hold."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.etcd_server import EtcdServer, etcd_binary_or_skip

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(90)]


def test_a_first_start_on_a_taken_port_moves_to_fresh_ports(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path, binary=etcd_binary_or_skip())
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server.client_port = taken.getsockname()[1]
        try:
            server.start()
            assert server.running
            assert server.client_port != taken.getsockname()[1]
            assert "address already in use" in server.log_path.read_text()
        finally:
            server.kill()


def test_a_restart_on_a_taken_port_fails_instead_of_moving(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path, binary=etcd_binary_or_skip())
    server.start()
    try:
        endpoint = server.endpoint
        server.stop()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
            # etcd's own connections of the first run may linger in TIME_WAIT.
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            taken.bind(("127.0.0.1", server.client_port))
            taken.listen()
            with pytest.raises(RuntimeError, match="exited while starting"):
                server.start(timeout=30)
        assert server.endpoint == endpoint
    finally:
        server.kill()
