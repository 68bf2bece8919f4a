"""Shutting down the TCP connection of one gRPC call, found by its peer.

Why this exists: with grpcio's asyncio server, a call whose message write
waits on HTTP/2 flow control (a peer that announces a zero window and never
reads) cannot be ended from the server. ``context.abort()`` fails in gRPC
core (``GRPC_CALL_ERROR_TOO_MANY_OPERATIONS``: the pending send holds the
call), and neither raising nor returning from the handler sends a status;
the call stays open as long as the peer keeps its connection. The one thing
that ends it is the connection itself going: once the socket is shut down,
gRPC's transport sees the connection end and cancels every call on it.

gRPC tells a servicer only the peer's address (``context.peer()``:
``ipv4:127.0.0.1:PORT``, ``ipv6:[::1]:PORT``, ``unix:...``), never the
socket. This module finds the socket the kernel way: the process's TCP
sockets (``/proc/net/tcp`` and ``/proc/net/tcp6``, by inode) whose remote
end is the peer and whose local port is one this process listens on; then
the file descriptor of that inode in ``/proc/self/fd``. It shuts that socket
down through a duplicate of the descriptor (``shutdown`` acts on the socket,
not the descriptor) and closes only the duplicate: gRPC owns the descriptor,
closes it itself once it saw the connection end, and must never find it
closed or reused under it.

Limits: Linux only (``/proc``). A Unix-socket peer cannot be told apart from
the others on the same listener (its address is the listener's path, or
empty, for every connection, and ``/proc/net/unix`` names no peer), so it is
not found: :func:`shut_down_peer_connection` returns False for it. Every call
multiplexed on the connection ends with it (they reconnect, as after any
lost connection).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TcpPeer", "parse_tcp_peer", "shut_down_peer_connection"]

_PROC = Path("/proc")
_LISTEN = "0A"
"""The kernel's state code of a listening TCP socket (``TCP_LISTEN``)."""
_ESTABLISHED = "01"

_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class TcpPeer:
    """The remote end of a TCP connection, as gRPC names it."""

    host: _Address
    port: int


def parse_tcp_peer(peer: str) -> TcpPeer | None:
    """The TCP endpoint of gRPC's peer string; None for any other transport
    (``unix:``) or a string that is not one (gRPC's form may change)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    host = host.removeprefix("[").removesuffix("]").split("%", 1)[0]
    try:
        address = ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        return None
    return TcpPeer(_plain(address), number) if 0 < number < 65536 else None


def _plain(address: _Address) -> _Address:
    """An IPv4-mapped IPv6 address as IPv4 (a dual-stack socket's view of an IPv4 peer)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _kernel_address(text: str) -> tuple[_Address, int]:
    """An address of ``/proc/net/tcp{,6}``: hex words in host byte order, a hex port."""
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    # Each 32-bit word is printed in the host's byte order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words if sys.byteorder == "little" else raw)
    return _plain(address), int(port, 16)


@dataclass(frozen=True)
class _Row:
    local: tuple[_Address, int]
    remote: tuple[_Address, int]
    state: str
    inode: int


def _rows(table: Path) -> Iterator[_Row]:
    """The sockets of one ``/proc/net/tcp`` table (of this process's network namespace)."""
    try:
        lines = table.read_text().splitlines()[1:]
    except OSError:
        return
    for line in lines:
        fields = line.split()
        if len(fields) < 10:
            continue
        try:
            yield _Row(
                _kernel_address(fields[1]), _kernel_address(fields[2]), fields[3], int(fields[9])
            )
        except ValueError:
            continue


def _own_socket_inodes() -> dict[int, int]:
    """This process's socket inodes, each with one of its descriptors."""
    inodes: dict[int, int] = {}
    fds = _PROC / "self" / "fd"
    with contextlib.suppress(OSError):
        for name in os.listdir(fds):
            with contextlib.suppress(OSError, ValueError):
                target = os.readlink(fds / name)
                if target.startswith("socket:["):
                    inodes[int(target[8:-1])] = int(name)
    return inodes


def _connection_inode(peer: TcpPeer, own: dict[int, int]) -> int | None:
    """The inode of this process's established socket to ``peer`` on a port
    it listens on, or None."""
    rows = [row for name in ("tcp", "tcp6") for row in _rows(_PROC / "net" / name)]
    ours = [row for row in rows if row.inode in own]
    listening = {row.local[1] for row in ours if row.state == _LISTEN}
    for row in ours:
        if (
            row.state == _ESTABLISHED
            and row.remote == (peer.host, peer.port)
            and row.local[1] in listening
        ):
            return row.inode
    return None


def shut_down_peer_connection(peer: str) -> bool:
    """Shuts down (both ways) the TCP connection this process accepted from
    ``peer`` (``context.peer()``), without closing gRPC's descriptor.

    Returns:
        True when the connection was found and shut down; False when it was
        not found (a Unix-socket or unknown peer, a connection already gone,
        no ``/proc``).
    """
    tcp_peer = parse_tcp_peer(peer)
    if tcp_peer is None:
        return False
    own = _own_socket_inodes()
    inode = _connection_inode(tcp_peer, own)
    if inode is None:
        return False
    try:
        duplicate = os.dup(own[inode])
    except OSError:
        return False  # closed since it was listed
    try:
        # The descriptor may have been closed and reused since it was read.
        if os.fstat(duplicate).st_ino != inode:
            raise OSError(f"descriptor {own[inode]} is no longer socket {inode}")
        sock = socket.socket(fileno=duplicate)
    except OSError:
        os.close(duplicate)
        return False
    with sock:  # closes the duplicate only
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
    return True
