"""A hand-made HTTP/2 client for the attack tests: it starts one gRPC call the
way a hostile peer would, then never reads again.

grpc's own client cannot be made to misbehave like this: it reads the socket
whatever the application does, and it announces only the flow-control window
the application asks for. Here the peer announces the largest window HTTP/2
allows (so the server's transport may send as much as it likes) and then lets
its socket fill up, or sends a call's headers and never its message.
"""

from __future__ import annotations

import socket
import struct

__all__ = ["MAX_WINDOW", "grpc_message", "open_call"]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
MAX_WINDOW = (1 << 31) - 1
"""The largest flow-control window HTTP/2 allows."""
_DATA, _HEADERS, _SETTINGS, _WINDOW_UPDATE = 0x0, 0x1, 0x4, 0x8
_END_STREAM, _ACK, _END_HEADERS = 0x1, 0x1, 0x4
_SETTINGS_ENABLE_PUSH, _SETTINGS_INITIAL_WINDOW_SIZE = 0x2, 0x4


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([kind, flags])
        + struct.pack(">I", stream)
        + payload
    )


def _literal(name: bytes, value: bytes) -> bytes:
    """An HPACK "literal header field without indexing, new name" (no Huffman)."""
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def grpc_message(message: bytes) -> bytes:
    """``message`` framed as one uncompressed gRPC message."""
    return b"\x00" + struct.pack(">I", len(message)) + message


def _read_frame(sock: socket.socket, buffered: bytearray) -> tuple[int, int]:
    while len(buffered) < 9:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        buffered += chunk
    length = int.from_bytes(buffered[:3], "big")
    kind, flags = buffered[3], buffered[4]
    while len(buffered) < 9 + length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        buffered += chunk
    del buffered[: 9 + length]
    return kind, flags


def open_call(
    address: str | tuple[str, int],
    path: str,
    message: bytes | None,
    *,
    window: int = MAX_WINDOW,
    receive_buffer: int = 4096,
) -> socket.socket:
    """Connects to ``address`` (a Unix socket path or host and port), opens a
    connection window and a stream window of ``window`` bytes, starts a call
    of ``path`` (e.g. ``/grpc.health.v1.Health/Check``) and sends ``message``
    (raw protobuf bytes) as its whole request, or only the headers when
    ``message`` is None. Returns the socket, which the caller never reads
    and closes when done.

    Raises:
        OSError: the connection failed.
    """
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(10.0)
    sock.connect(address)
    settings = struct.pack(">HI", _SETTINGS_ENABLE_PUSH, 0) + struct.pack(
        ">HI", _SETTINGS_INITIAL_WINDOW_SIZE, window
    )
    grow = window - 65535  # the connection's window starts at 65,535 bytes
    sock.sendall(
        PREFACE
        + _frame(_SETTINGS, 0, 0, settings)
        + (_frame(_WINDOW_UPDATE, 0, 0, struct.pack(">I", grow)) if grow > 0 else b"")
    )
    # Acknowledge the server's settings (else it drops the connection), then
    # read nothing more.
    buffered = bytearray()
    while True:
        kind, flags = _read_frame(sock, buffered)
        if kind == _SETTINGS and not flags & _ACK:
            break
    headers = b"".join(
        _literal(name, value)
        for name, value in (
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path.encode()),
            (b":authority", b"localhost"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        )
    )
    sock.sendall(_frame(_SETTINGS, _ACK, 0) + _frame(_HEADERS, _END_HEADERS, 1, headers))
    if message is not None:
        sock.sendall(_frame(_DATA, _END_STREAM, 1, grpc_message(message)))
    return sock
