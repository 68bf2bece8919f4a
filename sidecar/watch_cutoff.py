"""Cutting off Watch streams whose peer does not read.

A Watch stream's queue is bounded (:mod:`moe_sidecar.watch`): a subscriber
that falls too far behind is told UNAVAILABLE at its next event. But a peer
that never reads (a zero HTTP/2 window) leaves the stream's handler stuck in
a message write that gRPC cannot end from the server, so that next event is
never asked for: the call stays open, holding a ``--max-watchers`` place and
an RPC slot, and the peer is never told.

:class:`WatchCutoffs` guards every Watch stream. A stream is cut off when its
queue overflows while a write is pending, or when one write has been pending
``--stream-write-timeout`` seconds: its subscription is dropped (its queue
freed), and its TCP connection is shut down
(:func:`moe_sidecar.peer_socket.shut_down_peer_connection`), which is what
makes gRPC end the call; the peer sees its connection end. Each cut-off is
counted (``moe_sidecar_stream_cutoffs_total``) and logged at most once per
peer per minute. Every stream has its own handler and timer, so a slow
watcher never holds up the others.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from moe_sidecar.core.errors import CoordinatorUnavailable
from moe_sidecar.metrics import SidecarMetrics
from moe_sidecar.peer_socket import shut_down_peer_connection
from moe_sidecar.status import OncePerPeer
from moe_sidecar.watch import Subscription

__all__ = ["OVERFLOW", "WRITE_TIMEOUT", "StreamGuard", "WatchCutoffs"]

OVERFLOW = "overflow"
"""Why a stream was cut off: its queue overflowed while a write was pending."""
WRITE_TIMEOUT = "write_timeout"
"""Why a stream was cut off: one write was pending ``--stream-write-timeout`` seconds."""

_log = logging.getLogger("moe_sidecar.watch")


class WatchCutoffs:
    """Guards the sidecar's Watch streams against peers that do not read.

    Args:
        metrics: counts each cut-off.
        write_timeout: seconds one write may be pending (``--stream-write-timeout``).
        shut_down: shuts down the connection of a peer (``context.peer()``),
            True when it was found.
        log_peer: says whether to log a cut-off of a peer (once per minute).
    """

    def __init__(
        self,
        metrics: SidecarMetrics,
        write_timeout: float,
        *,
        shut_down: Callable[[str], bool] = shut_down_peer_connection,
        log_peer: OncePerPeer | None = None,
    ) -> None:
        self._metrics = metrics
        self.write_timeout = write_timeout
        self._shut_down = shut_down
        self._log_peer = log_peer if log_peer is not None else OncePerPeer()

    def guard(
        self, subscription: Subscription, peer: str, unwatch: Callable[[Subscription], None]
    ) -> StreamGuard:
        """Guards ``subscription``, the stream of ``peer``; ``unwatch`` drops
        it from the sidecar's watchers. Close the guard when the stream ends."""
        guard = StreamGuard(self, subscription, peer, unwatch)
        subscription.observe(guard)
        return guard

    def cut_off(self, peer: str, reason: str) -> None:
        """Shuts down ``peer``'s connection, counts and logs the cut-off."""
        shut = self._shut_down(peer)
        connection = "shut" if shut else "not_found"
        self._metrics.stream_cutoffs.labels(
            method="Watch", reason=reason, connection=connection
        ).inc()
        if self._log_peer(peer):
            _log.warning(
                "watch stream cut off: its peer does not read",
                extra={
                    "peer": peer,
                    "reason": reason,
                    "connection": connection,
                    "write_timeout": self.write_timeout,
                    "note": "at most one line per peer per minute; "
                    "moe_sidecar_stream_cutoffs_total counts every cut-off",
                },
            )


class StreamGuard:
    """One Watch stream's guard (a :class:`~moe_sidecar.watch.DeliveryObserver`):
    a timer runs while a write is pending; its expiry, or an overflow while
    the write is pending, cuts the stream off (once)."""

    def __init__(
        self,
        cutoffs: WatchCutoffs,
        subscription: Subscription,
        peer: str,
        unwatch: Callable[[Subscription], None],
    ) -> None:
        self._cutoffs = cutoffs
        self._subscription = subscription
        self._peer = peer
        self._unwatch = unwatch
        self._timer: asyncio.TimerHandle | None = None
        self._writing = False
        self.cut_reason: str | None = None
        """Why the stream was cut off; None while it was not."""

    @property
    def write_pending(self) -> bool:
        """Whether an event handed out is being written (its timer runs)."""
        return self._timer is not None

    def handed_out(self) -> None:
        self._writing = True
        self._stop_timer()
        if self.cut_reason is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._cutoffs.write_timeout, self._cut, WRITE_TIMEOUT)

    def asked_again(self) -> None:
        self._writing = False
        self._stop_timer()

    def overflowed(self) -> None:
        if self._writing:
            # Not inside the publisher's loop over the watchers: soon, on its own.
            asyncio.get_running_loop().call_soon(self._cut, OVERFLOW)

    def close(self) -> None:
        """The stream ended: stops the timer. Idempotent."""
        self._stop_timer()
        self._writing = False

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _cut(self, reason: str) -> None:
        if self.cut_reason is not None or not self._writing:
            return  # cut already, or the write went out meanwhile
        self.cut_reason = reason
        self._stop_timer()
        self._subscription.drop(
            CoordinatorUnavailable(
                "watch stream cut off: its peer did not read its events "
                f"({reason}); reconnect and resynchronise with ListGroups/GetGroup"
            )
        )
        self._unwatch(self._subscription)
        self._cutoffs.cut_off(self._peer, reason)
