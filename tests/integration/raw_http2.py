"""A hostile HTTP/2 peer for the tests: it starts one gRPC call, built with
the ``h2`` library, and then never takes what the server sends.

grpc's own client cannot be made to misbehave like this: its transport reads
the socket whatever the application does, and it announces and re-opens its
flow-control windows by its own rules, so a server never meets a caller that
does not read.
Here the peer chooses the window it announces and never grants more:

* the largest window HTTP/2 allows, with a socket never read again (and a
  small receive buffer), so the server's transport may send as much as it
  likes and its writes back up once the socket fills;
* a window of 0 bytes, so the server may send the response headers but
  never a message; with :meth:`RawCall.keep_acknowledging` a thread still
  answers the server's SETTINGS and PINGs, as any live peer must, so the
  call stays open for as long as the server keeps it;
* the call's headers without its message (``message=None``), so the server
  holds a call whose request never comes.

Only the connection's own handshake is read before the call starts: the
server's SETTINGS must be acknowledged, else it drops the connection.
"""

from __future__ import annotations

import socket
import threading
from types import TracebackType

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings

__all__ = ["MAX_WINDOW", "RawCall", "grpc_message", "open_call"]

MAX_WINDOW = (1 << 31) - 1
"""The largest flow-control window HTTP/2 allows."""
_DEFAULT_WINDOW = 65_535
"""Every HTTP/2 window's size before SETTINGS or WINDOW_UPDATE change it."""


def grpc_message(message: bytes) -> bytes:
    """``message`` framed as one uncompressed gRPC message."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


class RawCall:
    """One gRPC call on its own HTTP/2 connection, opened by :func:`open_call`.

    Nothing reads the socket after the call starts unless
    :meth:`keep_acknowledging` is called, and nothing ever grants the server
    flow-control credit. Close it when done (or use it as a context manager).
    """

    def __init__(
        self, sock: socket.socket, connection: h2.connection.H2Connection, stream_id: int
    ) -> None:
        self._sock = sock
        self._connection = connection
        self.stream_id = stream_id
        """The call's HTTP/2 stream."""
        self.headers_received = threading.Event()
        """Set when the call's response headers arrive (only while acknowledging)."""
        self.data_received = 0
        """Bytes of DATA received on the call's stream (only while acknowledging)."""
        self.closed = threading.Event()
        """Set when the acknowledging thread stops: the connection ended."""
        self.ended = threading.Event()
        """Set when the call ends: its trailers came, or the stream was reset
        (only while acknowledging)."""
        self.trailers: dict[str, str] = {}
        """The call's trailers (``grpc-status``, ``grpc-message``) once it ended."""
        self._reader: threading.Thread | None = None

    def keep_acknowledging(self) -> None:
        """Starts a thread that reads the socket only to acknowledge the
        server's SETTINGS and PINGs and to note the call's response
        (:attr:`headers_received`, :attr:`data_received`); it never grants
        any flow-control credit. It stops, setting :attr:`closed`, when the
        connection ends.
        """
        assert self._reader is None, "already acknowledging"
        self._sock.settimeout(None)  # a quiet call is no reason to stop
        self._reader = threading.Thread(
            target=self._acknowledge, name=f"raw-http2-{self.stream_id}", daemon=True
        )
        self._reader.start()

    def _acknowledge(self) -> None:
        try:
            while data := self._sock.recv(65536):
                for event in self._connection.receive_data(data):
                    if isinstance(event, h2.events.ResponseReceived):
                        self.headers_received.set()
                    elif isinstance(event, h2.events.DataReceived):
                        self.data_received += event.flow_controlled_length
                    elif isinstance(event, h2.events.TrailersReceived):
                        self.trailers = {_text(k): _text(v) for k, v in event.headers}
                        self.ended.set()
                    elif isinstance(event, h2.events.StreamReset):
                        self.ended.set()
                # SETTINGS and PING acknowledgements only: no WINDOW_UPDATE.
                self._sock.sendall(self._connection.data_to_send())
        except (OSError, h2.exceptions.ProtocolError):
            pass  # the server went away (a PING after its GOAWAY, a reset)
        finally:
            self.closed.set()

    def send_data(self, body: bytes) -> None:
        """Sends ``body`` on the call's stream (more of its request), before
        :meth:`keep_acknowledging` reads the socket.

        Raises:
            h2.exceptions.FlowControlError: ``body`` does not fit the
                server's window (it is sent at once, never waiting).
        """
        size = self._connection.max_outbound_frame_size
        for start in range(0, len(body), size):
            self._connection.send_data(self.stream_id, body[start : start + size])
        self._sock.sendall(self._connection.data_to_send())

    def close(self) -> None:
        """Closes the socket (the server sees the peer go)."""
        self._sock.close()

    def __enter__(self) -> RawCall:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def open_call(
    address: str | tuple[str, int],
    path: str,
    message: bytes | None,
    *,
    window: int = MAX_WINDOW,
    receive_buffer: int = 4096,
) -> RawCall:
    """Connects to ``address`` (a Unix socket path, or a host and port),
    announces a connection window and a stream window of ``window`` bytes,
    starts a call of ``path`` (e.g. ``/grpc.health.v1.Health/Watch``) and
    sends ``message`` (raw protobuf bytes) as its whole request, or only the
    headers when ``message`` is None. ``receive_buffer`` is the socket's
    SO_RCVBUF, small so that a peer that never reads fills it soon.

    Returns the call, whose socket nobody reads from then on (see
    :meth:`RawCall.keep_acknowledging`).

    Raises:
        ValueError: ``window`` is not an HTTP/2 window size.
        OSError: the connection failed, or the server closed it during the
            handshake.
        h2.exceptions.FlowControlError: ``message`` does not fit the
            server's first windows (it is sent at once, never waiting).
    """
    if not 0 <= window <= MAX_WINDOW:
        raise ValueError(f"an HTTP/2 window is 0 to {MAX_WINDOW} bytes, not {window}")
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    authority = "localhost" if isinstance(address, str) else f"{address[0]}:{address[1]}"
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # Before connect(): the receive buffer sets the TCP window scale.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.settimeout(10.0)
        sock.connect(address)
        connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        # Our first SETTINGS frame: no server push, and every stream's window.
        connection.local_settings = h2.settings.Settings(
            client=True,
            initial_values={
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window,
            },
        )
        connection.initiate_connection()
        if window > _DEFAULT_WINDOW:  # SETTINGS leave the connection's own window
            connection.increment_flow_control_window(window - _DEFAULT_WINDOW)
        sock.sendall(connection.data_to_send())
        # Read until the server's SETTINGS, which h2 acknowledges; then read
        # nothing more.
        while not any(
            isinstance(event, h2.events.RemoteSettingsChanged)
            for event in connection.receive_data(_receive(sock))
        ):
            pass
        stream_id = connection.get_next_available_stream_id()
        connection.send_headers(
            stream_id,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", authority),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ],
        )
        if message is not None:
            body = grpc_message(message)
            size = connection.max_outbound_frame_size
            for start in range(0, len(body), size):
                last = start + size >= len(body)
                connection.send_data(stream_id, body[start : start + size], end_stream=last)
        sock.sendall(connection.data_to_send())
    except BaseException:
        sock.close()
        raise
    return RawCall(sock, connection, stream_id)


def _receive(sock: socket.socket) -> bytes:
    data = sock.recv(65536)
    if not data:
        raise ConnectionError("the server closed the connection")
    return data


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
