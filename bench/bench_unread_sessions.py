"""Memory a sidecar holds for Session streams that write and never read,
against the same sidecar idle, in the same run.

    .venv/bin/python -m bench.bench_unread_sessions [--streams N] [--seconds S]

Starts a real sidecar process on a TCP port and opens N Session streams
from a real HTTP/2 peer (``tests/integration/raw_http2.py``) that announces
a zero flow-control window: the sidecar may send none of its answers. Each
stream proposes once, then keeps sending as many bytes of further messages
as the sidecar's flow-control windows allow, for S seconds (acknowledging
its SETTINGS and PINGs, as a live peer does). Prints the sidecar's RSS idle
and at the end, the bytes the sidecar let the peers send, and the ratio.
"""

from __future__ import annotations

import argparse
import sys
import time

import h2.exceptions

from bench.sidecar_process import rss_mib, running_sidecar
from moe_workspace.v1 import coordinator_pb2 as pb
from tests.integration.helpers import propose_request
from tests.integration.raw_http2 import RawCall, grpc_message, open_call

METHOD = "/moe_workspace.v1.WorkspaceCoordinator/Session"


def feed_unread(call: RawCall, chunk: bytes) -> int:
    """Sends what the sidecar's windows allow now, then acknowledges what
    it sent; returns the bytes sent."""
    connection = call._connection
    call._sock.settimeout(2.0)
    sent = 0
    room = connection.local_flow_control_window(call.stream_id)
    while room >= len(chunk):
        connection.send_data(call.stream_id, chunk)
        sent += len(chunk)
        room -= len(chunk)
    call._sock.sendall(connection.data_to_send())
    call._sock.settimeout(0.01)
    try:
        while data := call._sock.recv(65536):
            connection.receive_data(data)
    except (TimeoutError, BlockingIOError):
        pass
    except h2.exceptions.ProtocolError:
        pass
    call._sock.sendall(connection.data_to_send())
    return sent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    with running_sidecar() as (process, port):
        idle = rss_mib(process.pid)
        calls = []
        for n in range(args.streams):
            call = open_call(("127.0.0.1", port), METHOD, None, window=0)
            request = propose_request(0, group=f"unread-{n}/ep1", ep_size=1, local_ranks=1)
            call.send_data(
                grpc_message(pb.SessionRequest(id=1, propose=request).SerializeToString())
            )
            calls.append(call)
        chunk = grpc_message(b"\x00" * 16_000)
        sent = 0
        end = time.monotonic() + args.seconds
        stuck: set[int] = set()
        while time.monotonic() < end and len(stuck) < len(calls):
            for index, call in enumerate(calls):
                if index in stuck:
                    continue
                try:
                    sent += feed_unread(call, chunk)
                except TimeoutError:
                    stuck.add(index)  # the sidecar stopped reading this socket
        held = rss_mib(process.pid)
        for call in calls:
            call.close()
    print(time.strftime("bench_unread_sessions, %Y-%m-%d %H:%M UTC", time.gmtime()))
    print(f"{args.streams} Session streams with a zero window, writing for {args.seconds:g} s")
    print(f"bytes the sidecar let them send: {sent:,} ({sent / args.streams:,.0f} per stream)")
    print(f"streams whose socket the sidecar stopped reading: {len(stuck)}")
    print(f"sidecar RSS idle:            {idle:7.1f} MiB")
    print(f"sidecar RSS with the streams: {held:7.1f} MiB  ({held / idle:.2f}x idle)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
