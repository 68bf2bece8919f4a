"""What a rank does when a peer of its EP group dies: the peer-loss watcher.

FlashInfer's one-sided all-to-all detects nothing: a rank waiting in combine
for a peer that died traps minutes later, or hangs. The sidecar knows at once
(the dead rank's session stream breaks), so each rank runs a watcher: a
daemon thread holding its own ``Watch`` stream of the group, on its own
channel, which acts on a ``RANK_LEFT`` event that is a death (``lost``) of a
rank of this rank's own lifetime of the group (its short lifetime id is among
the event's ``survivors``). The thread needs nothing from the main thread, so
it acts while that one is blocked in a CUDA wait, a kernel or a collective.

``MOE_SIDECAR_ON_PEER_LOSS`` says how (:class:`PeerLossPolicy`):

* ``exit`` (the default): one line on stderr naming the group, the dead rank
  and the cause, then ``os._exit(PEER_LOSS_EXIT_STATUS)``: no 5-minute trap,
  no hang; the orchestrator restarts the rank;
* ``raise``: the rank's next call into the manager raises
  :class:`~moe_sidecar.client.errors.RankLost` naming the dead rank (once);
* ``wait``: no watcher; the rank learns of the death as before (a failed
  round or collective, or FlashInfer's trap);
* ``mask``: the watcher records the loss (no exit, no raise): the manager
  builds its all-to-all with ``enable_rank_mask``, ``peer_fault()`` says a
  peer is gone, and the survivors go on without it once ``adopt_view()``
  has committed the sidecar's next view (:mod:`moe_sidecar.client.membership_view`).

A clean close of a peer's session (its ``cleanup()``) is not a death: the
event is not ``lost``, and nothing happens. Embedded mode has no sidecar to
hear from: no watcher runs there (a death shows only as a failed collective).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, NoReturn

import grpc

from moe_sidecar.client.errors import InvalidArgument, RankLost
from moe_sidecar.client.transport import CHANNEL_OPTIONS, GrpcTransport, Transport
from moe_sidecar.core.defaults import ENV_ON_PEER_LOSS
from moe_sidecar.core.effects import EventKind, GroupEvent
from moe_sidecar.core.errors import quote_name
from moe_sidecar.core.identity import lifetime_id, short_id
from moe_sidecar.wire.codec import event_from_proto
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = [
    "PEER_LOSS_EXIT_STATUS",
    "SUBSCRIBE_WAIT_S",
    "PeerLoss",
    "PeerLossPolicy",
    "PeerLossWatch",
    "PeerLossWatcher",
    "policy_from_environment",
]

_log = logging.getLogger(__name__)

PEER_LOSS_EXIT_STATUS: Final = 75
"""The status a rank ends with under ``exit`` (``EX_TEMPFAIL``: restart it)."""
SUBSCRIBE_WAIT_S: Final = 5.0
"""Most seconds a watcher's start waits for its Watch stream to be subscribed."""
_RECONNECT_S: Final = (0.1, 2.0)
"""First and longest wait before a broken Watch stream is opened again."""


class PeerLossPolicy(enum.Enum):
    """What a rank does when a peer of its group dies."""

    EXIT = "exit"
    RAISE = "raise"
    WAIT = "wait"
    MASK = "mask"


def policy_from_environment(environ: Mapping[str, str]) -> PeerLossPolicy:
    """The policy ``MOE_SIDECAR_ON_PEER_LOSS`` names (unset or empty: ``exit``).

    Raises:
        InvalidArgument: any other value, naming the variable and the value.
    """
    text = environ.get(ENV_ON_PEER_LOSS, "").strip()
    if not text:
        return PeerLossPolicy.EXIT
    try:
        return PeerLossPolicy(text.lower())
    except ValueError:
        choices = ", ".join(p.value for p in PeerLossPolicy)
        raise InvalidArgument.of(ENV_ON_PEER_LOSS, text, f"must be one of {choices}") from None


@dataclass(frozen=True)
class PeerLoss:
    """A peer of this rank's lifetime of the group died."""

    group: str
    ep_rank: int
    """The dead rank."""
    cause: str
    """The sidecar's words: the rank, its last round and layer, and why it is gone."""

    def line(self, own_rank: int, action: str) -> str:
        """The one line a rank prints about the loss."""
        return (
            f"moe-sidecar: EP group {quote_name(self.group)}: rank {self.ep_rank} died "
            f"({self.cause}); rank {own_rank} {action}"
        )


class PeerLossWatcher:
    """One rank lifetime's watcher thread (see the module's text).

    Args:
        target: the sidecar's address.
        group: the EP group.
        ep_rank: this rank.
        lifetime: this rank lifetime's secret token (only its short id is compared).
        on_loss: called in the watcher's thread with the first loss (then the
            thread ends), or with every loss when ``every_loss``.
        every_loss: keep watching after a loss (``mask``: the survivors go on,
            and a later death must be heard too).
    """

    def __init__(
        self,
        target: str,
        group: str,
        ep_rank: int,
        lifetime: str,
        on_loss: Callable[[PeerLoss], None],
        *,
        every_loss: bool = False,
    ) -> None:
        self._every_loss = every_loss
        self._target = target
        self._group = group
        self._ep_rank = ep_rank
        self._me = short_id(lifetime_id(lifetime))
        self._on_loss = on_loss
        self._stopped = threading.Event()
        self._subscribed = threading.Event()
        self._settled = threading.Event()
        """Set once the stream is subscribed, or the target serves no Watch."""
        self._channel: grpc.Channel | None = None
        self._call: grpc.RpcContext | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="moe-sidecar-peer-loss", daemon=True)

    def start(self, wait: float = SUBSCRIBE_WAIT_S) -> bool:
        """Starts the thread and waits at most ``wait`` seconds until its Watch
        stream is subscribed (no later death can be missed); False when it is
        not yet (the thread goes on trying), or when the target serves no
        Watch (UNIMPLEMENTED: a health port, say; the rank's own call to it
        says so next, and the thread ends)."""
        self._thread.start()
        self._settled.wait(wait)
        subscribed = self._subscribed.is_set()
        if not subscribed and not self._settled.is_set():
            _log.warning(
                "moe-sidecar: the peer-loss watcher of rank %d could not subscribe to group %s "
                "within %gs; it keeps trying",
                self._ep_rank,
                quote_name(self._group),
                wait,
            )
        return subscribed

    def stop(self) -> None:
        """Ends the watcher (its stream and channel). Idempotent."""
        self._stopped.set()
        with self._lock:
            call, channel = self._call, self._channel
            self._call = self._channel = None
        if call is not None:
            call.cancel()
        if channel is not None:
            channel.close()

    def concerns_me(self, event: GroupEvent) -> bool:
        """Whether ``event`` is the death of another rank of this rank's lifetime."""
        return (
            event.kind is EventKind.RANK_LEFT
            and event.lost
            and event.group == self._group
            and event.ep_rank != self._ep_rank
            and self._me in event.survivors
        )

    def _run(self) -> None:
        pause = _RECONNECT_S[0]
        while not self._stopped.is_set():
            was_subscribed = self._subscribed.is_set()
            try:
                loss = self._watch_once()
            except grpc.RpcError as error:
                if self._stopped.is_set():
                    return
                if isinstance(error, grpc.Call) and error.code() is grpc.StatusCode.UNIMPLEMENTED:
                    # No coordinator there: nothing to watch, ever.
                    _log.debug("peer-loss watch: %s serves no Watch; not watching", self._target)
                    self._settled.set()
                    return
                _log.debug("peer-loss watch stream ended: %s; reopening", error)
            else:
                if loss is not None:
                    self._on_loss(loss)
                    return
            if self._subscribed.is_set() and not was_subscribed:
                pause = _RECONNECT_S[0]  # it was live: the next break starts from the shortest wait
            self._stopped.wait(pause)
            pause = min(pause * 2, _RECONNECT_S[1])

    def _watch_once(self) -> PeerLoss | None:
        """Reads one Watch stream until a loss that concerns this rank (returned;
        with ``every_loss`` each goes to ``on_loss`` and the reading goes on)
        or its end (None).

        Raises:
            grpc.RpcError: the stream failed (the sidecar restarted, cut it off).
        """
        with self._lock:
            if self._stopped.is_set():
                return None
            if self._channel is None:
                # Reconnect within a second of the sidecar's return (gRPC's
                # own backoff grows to two minutes: deaths unheard meanwhile).
                self._channel = grpc.insecure_channel(self._target, options=CHANNEL_OPTIONS)
            stub = pb_grpc.WorkspaceCoordinatorStub(self._channel)
            # wait_for_ready: while the sidecar restarts the stream waits for
            # it and subscribes as soon as it is back, not after a backoff.
            call = stub.Watch(pb.WatchRequest(group=self._group), wait_for_ready=True)
            self._call = call
        # The sidecar sends the headers once subscribed; a refused stream
        # (the group not known yet, too many watchers) ends without them, and
        # initial_metadata() returns then too: only a live stream counts.
        call.initial_metadata()
        if isinstance(call, grpc.Future) and call.done():
            for _ in call:  # raises the stream's error
                pass
            return None
        self._subscribed.set()
        self._settled.set()
        for message in call:
            event = event_from_proto(message)
            if event is not None and self.concerns_me(event):
                loss = PeerLoss(self._group, event.ep_rank, event.message)
                if not self._every_loss:
                    return loss
                self._on_loss(loss)
        return None


class PeerLossWatch:
    """The manager's side of the watcher: one watcher per rank lifetime, and
    what the policy does with a loss.

    Args:
        target: the sidecar's address; None in embedded mode (nothing to watch).
        policy: what to do; None reads ``MOE_SIDECAR_ON_PEER_LOSS``.
        end_process: how ``exit`` ends the process (``os._exit``).

    Raises:
        InvalidArgument: ``MOE_SIDECAR_ON_PEER_LOSS`` is malformed (naming it).
    """

    def __init__(
        self,
        target: str | None,
        policy: PeerLossPolicy | None = None,
        *,
        end_process: Callable[[int], NoReturn] = os._exit,
    ) -> None:
        self.policy = policy_from_environment(os.environ) if policy is None else policy
        self._target = target
        self._end_process = end_process
        self._watcher: PeerLossWatcher | None = None
        self._lifetime: str | None = None
        self._ep_rank = -1
        self._loss: PeerLoss | None = None

    @classmethod
    def for_transport(cls, transport: Transport) -> PeerLossWatch:
        """The watch of a manager talking over ``transport`` (embedded: none).

        Raises:
            InvalidArgument: ``MOE_SIDECAR_ON_PEER_LOSS`` is malformed (naming it).
        """
        return cls(transport.target if isinstance(transport, GrpcTransport) else None)

    def check(self, group: str, ep_rank: int, lifetime: str, *, ep_size: int) -> None:
        """Called at every call into the manager: arms the watcher for this
        rank lifetime (once), and under ``raise`` raises a loss it heard of.

        A group of one rank has no peer to lose: nothing is watched (its
        watcher would wait in vain for the group, which the sidecar learns of
        only at the rank's first proposal, after this call).

        Raises:
            RankLost: (``raise``) a peer of this lifetime died; raised once.
        """
        if self._target is None or self.policy is PeerLossPolicy.WAIT or ep_size == 1:
            return
        if lifetime != self._lifetime:
            self.stop()
            self._lifetime, self._ep_rank, self._loss = lifetime, ep_rank, None
            self._watcher = PeerLossWatcher(
                self._target,
                group,
                ep_rank,
                lifetime,
                self._lost,
                every_loss=self.policy is PeerLossPolicy.MASK,
            )
            self._watcher.start()
        if self.policy is PeerLossPolicy.MASK:
            return  # the loss stays recorded until a view is adopted (see fault)
        loss, self._loss = self._loss, None
        if loss is not None:
            raise RankLost(
                f"EP group {quote_name(loss.group)}: rank {loss.ep_rank} died ({loss.cause}); "
                f"rank {ep_rank} stops using the all-to-all: restart every rank",
                (loss.ep_rank,),
            )

    @property
    def fault(self) -> PeerLoss | None:
        """(``mask``) the first loss heard of since the last :meth:`clear_fault`
        (None: none). Reads one attribute: no RPC, no device work."""
        return self._loss if self.policy is PeerLossPolicy.MASK else None

    def clear_fault(self) -> None:
        """A view without the lost peer was adopted: the loss is dealt with."""
        self._loss = None

    def stop(self) -> None:
        """Ends the watcher of the current lifetime, if any. Idempotent."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.stop()

    def _lost(self, loss: PeerLoss) -> None:
        """The watcher heard of a loss (in its own thread)."""
        if self.policy is PeerLossPolicy.EXIT:
            _exit_now(loss.line(self._ep_rank, f"exits with status {PEER_LOSS_EXIT_STATUS}"))
            self._end_process(PEER_LOSS_EXIT_STATUS)
        if self.policy is PeerLossPolicy.MASK:
            # The first loss since the last adopted view stays the one reported.
            self._loss = self._loss or loss
            _log.warning(loss.line(self._ep_rank, "goes on under a mask once it adopts a view"))
            return
        self._loss = loss
        _log.warning(loss.line(self._ep_rank, "raises RankLost at its next call"))


def _exit_now(line: str) -> None:
    """Writes ``line`` to stderr past every buffer (the process ends next)."""
    for stream in (sys.stdout, sys.stderr):
        # A closed or broken stream must not keep the rank alive.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os.write(2, (line + "\n").encode(errors="replace"))
