"""Finding and shutting down the TCP connection of a peer (real sockets)."""

from __future__ import annotations

import ipaddress
import os
import socket

import pytest

from moe_sidecar.peer_socket import TcpPeer, parse_tcp_peer, shut_down_peer_connection

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("peer", "parsed"),
    [
        ("ipv4:127.0.0.1:50000", TcpPeer(ipaddress.ip_address("127.0.0.1"), 50000)),
        ("ipv6:[::1]:443", TcpPeer(ipaddress.ip_address("::1"), 443)),
        ("ipv6:[::ffff:10.0.0.1]:8", TcpPeer(ipaddress.ip_address("10.0.0.1"), 8)),
        ("ipv6:[fe80::1%eth0]:9", TcpPeer(ipaddress.ip_address("fe80::1"), 9)),
        ("unix:/run/sidecar.sock", None),
        ("unix:", None),
        ("ipv4:127.0.0.1:70000", None),
        ("ipv4:not-an-address:1", None),
        ("", None),
    ],
)
def test_a_peer_string_is_parsed_or_refused(peer: str, parsed: TcpPeer | None) -> None:
    assert parse_tcp_peer(peer) == parsed


def _connect(family: socket.AddressFamily, host: str) -> tuple[socket.socket, ...]:
    """A listener, a client connected to it and the accepted end."""
    listener = socket.socket(family)
    try:
        listener.bind((host, 0))
    except OSError as error:
        listener.close()
        pytest.skip(f"{host} cannot be bound here: {error}")
    listener.listen()
    client = socket.create_connection((host, listener.getsockname()[1]), timeout=5)
    accepted, _ = listener.accept()
    return listener, client, accepted


def _peer(accepted: socket.socket) -> str:
    """gRPC's name of the accepted connection's remote end."""
    host, port = accepted.getpeername()[:2]
    return f"ipv4:{host}:{port}" if accepted.family == socket.AF_INET else f"ipv6:[{host}]:{port}"


@pytest.mark.parametrize(
    ("family", "host"), [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")]
)
def test_the_accepted_connection_of_a_peer_is_shut_down_its_descriptor_kept(
    family: socket.AddressFamily, host: str
) -> None:
    listener, client, accepted = _connect(family, host)
    with listener, client, accepted:
        peer = _peer(accepted)
        assert shut_down_peer_connection(peer)
        assert client.recv(16) == b""  # the peer sees its connection end
        os.fstat(accepted.fileno())  # the owner's descriptor is still open
        assert not shut_down_peer_connection(peer)  # no longer established


def test_a_peer_that_is_not_a_connection_of_ours_is_not_found() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        # The client's own end: its remote port is a listening port, not a peer's.
        with socket.create_connection(("127.0.0.1", listener.getsockname()[1])) as client:
            port = listener.getsockname()[1]
            assert not shut_down_peer_connection(f"ipv4:127.0.0.1:{port}")
            assert not shut_down_peer_connection("unix:/tmp/sidecar.sock")
            client.sendall(b"x")  # still connected
