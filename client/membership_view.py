"""A rank following its group's membership views: the ``mask`` peer-loss policy.

When a rank of the group dies, the sidecar proposes the next view without it
(:mod:`moe_sidecar.core.membership`). Under ``MOE_SIDECAR_ON_PEER_LOSS=mask``
the survivors' watchers only record the loss (:meth:`ViewFollower.peer_fault`);
each survivor, at a quiesced point (its last combine done), calls
:meth:`ViewFollower.adopt`: it acknowledges the group's latest PROPOSED view
with the all-to-all rounds it has completed, waits until the view is
COMMITTED (every member acknowledged it at one count) and from then on
every dispatch and combine of what the manager hands out passes the view's
mask (:class:`~moe_sidecar.client.masked_alltoall.MaskedAlltoAll`). A view
that FAILED raises :class:`~moe_sidecar.client.errors.ViewFailed`: the
group's ranks restart.

The rounds counted are the dispatch + combine pairs made through the
manager's objects since the manager was made: every member counts the same
steps, so members that quiesced at the same step state the same count.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from moe_sidecar.client.backends.rank_mask import all_ranks_mask
from moe_sidecar.client.errors import PreconditionFailed, ViewFailed
from moe_sidecar.client.masked_alltoall import MaskedAlltoAll
from moe_sidecar.client.peer_loss import PeerLossPolicy, PeerLossWatch
from moe_sidecar.client.view_rpcs import ViewCalls
from moe_sidecar.core.defaults import ENV_ON_PEER_LOSS
from moe_sidecar.core.errors import quote_name
from moe_sidecar.core.membership import View, ViewState, mask

__all__ = ["AdoptedView", "ViewFollower"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdoptedView:
    """The committed membership view a rank runs its all-to-all under."""

    number: int
    members: tuple[int, ...]
    """The EP ranks taking part, ascending."""
    generation: int
    mask: int
    """FlashInfer's active-rank mask of ``members`` (bit i = rank i a member)."""
    cause: str
    """Why the view exists, in the sidecar's words."""

    @classmethod
    def of(cls, view: View) -> AdoptedView:
        """The adopted form of a committed ``view``."""
        return cls(view.number, view.members, view.generation, mask(view), view.cause)


class ViewFollower:
    """One rank's side of its group's membership views.

    Args:
        views: the transport's view calls.
        peer_loss: the rank's peer-loss watch (its policy, the loss it heard of).
        group: the EP group.
        ep_size: ranks of the group.
        ep_rank: this rank.
        default_wait_s: how long :meth:`adopt` waits by default for the view
            to be decided (it must exceed the sidecar's ``--round-timeout``,
            after which an unacknowledged view fails).
    """

    def __init__(
        self,
        views: ViewCalls,
        peer_loss: PeerLossWatch,
        group: str,
        ep_size: int,
        ep_rank: int,
        *,
        default_wait_s: float,
    ) -> None:
        self._views = views
        self._peer_loss = peer_loss
        self._group = group
        self._ep_size = ep_size
        self._ep_rank = ep_rank
        self._default_wait_s = default_wait_s
        self.rounds = 0
        """All-to-all rounds (dispatch + combine pairs) completed through the manager."""
        self.adopted: AdoptedView | None = None
        """The view adopted last (None: none; every rank takes part)."""
        self._wrappers: list[MaskedAlltoAll] = []

    @property
    def masking(self) -> bool:
        """Whether the manager's all-to-all is wrapped (the ``mask`` policy)."""
        return self._peer_loss.policy is PeerLossPolicy.MASK

    def peer_fault(self) -> bool:
        """A peer of this lifetime died and no view was adopted since (no RPC)."""
        return self._peer_loss.fault is not None

    def active_mask(self) -> int:
        """The adopted view's mask; every rank's while none is adopted."""
        return self.adopted.mask if self.adopted is not None else all_ranks_mask(self._ep_size)

    def step_mask(self) -> int | None:
        """The mask a step passes (None while no view is adopted: every rank)."""
        return self.adopted.mask if self.adopted is not None else None

    def round_done(self) -> None:
        """A dispatch + combine pair completed."""
        self.rounds += 1

    def wrap(self, inner: Any) -> Any:
        """What the manager hands out of ``inner`` (a built object, or None):
        under ``mask`` its :class:`MaskedAlltoAll`, one per object (the same
        wrapper every time it is asked for), otherwise ``inner`` itself."""
        if inner is None or not self.masking:
            return inner
        for wrapper in self._wrappers:
            if wrapper.wrapped is inner:
                return wrapper
        wrapper = MaskedAlltoAll(inner, self)
        # The handle and its moe_ep object: older ones are superseded (released).
        self._wrappers = [wrapper, *self._wrappers[:1]]
        return wrapper

    def reset_steps(self) -> None:
        """A fault cut a step short: no wrapper keeps a dispatch's mask for a
        combine that never came."""
        for wrapper in self._wrappers:
            wrapper.reset_step()

    def forget(self) -> None:
        """A new lifetime begins (the manager cleaned up): no view, no rounds."""
        self.rounds = 0
        self.adopted = None
        self._wrappers = []

    def adopt(
        self, timeout_s: float | None = None, *, held_generation: int | None = None
    ) -> AdoptedView:
        """Acknowledges the group's latest proposed view at this quiesced
        point and waits until it commits; from then on the manager's steps
        pass its mask. A view already committed with this rank in it is
        adopted as it is. ``held_generation``: the generation of what this
        rank built (None: not checked).

        Raises:
            PreconditionFailed: the policy is not ``mask``, embedded mode
                (masks need a sidecar), nothing built yet, this rank is no
                member of the view, or the view is above ``held_generation``
                (a replacement joined: its members must rebuild, which the
                manager's ``rejoin()`` does; nothing is acknowledged).
            ViewFailed: the view failed (the group must restart).
            RoundTimedOut: not decided within ``timeout_s`` seconds.
            CoordinatorError: the sidecar could not be asked.
        """
        if not self.masking:
            raise PreconditionFailed(
                f"adopt_view() needs {ENV_ON_PEER_LOSS}=mask (only then is the all-to-all built "
                f"to take a rank mask); the policy is {self._peer_loss.policy.value!r}"
            )
        wait_s = self._default_wait_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        view = self._views.latest_view(self._group)
        while view is not None and view.state is ViewState.PROPOSED:
            self._check_generation(view, held_generation)
            view = self._views.acknowledge_view(self._group, view.number, self.rounds)
            if view.state is ViewState.PROPOSED:
                remaining = max(deadline - time.monotonic(), 0.001)
                view = self._views.await_view(self._group, view.number, remaining)
        if view is not None and view.state is ViewState.COMMITTED:
            self._check_generation(view, held_generation)
        return self._adopt_decided(view)

    def _check_generation(self, view: View, held: int | None) -> None:
        """Refuses a view above what this rank built: a replacement joined it.

        Raises:
            PreconditionFailed: naming the view, its generation and the held one.
        """
        if held is None or view.generation <= held:
            return
        raise PreconditionFailed(
            f"EP group {quote_name(self._group)}: view {view.number} (members "
            f"{list(view.members)}) is at generation {view.generation}, above the {held} rank "
            f"{self._ep_rank} built: a replacement joined, and every member must rebuild at "
            "the stored plan over a CPU group with it: call the manager's rejoin() with that "
            "group instead (its mask would name a rank this workspace was never built with)"
        )

    def _adopt_decided(self, view: View | None) -> AdoptedView:
        if view is None:
            raise PreconditionFailed(
                f"EP group {quote_name(self._group)} has no membership view yet: nothing is built"
            )
        if view.state is ViewState.FAILED:
            raise ViewFailed.of(self._group, view.number, view.cause)
        if self._ep_rank not in view.members:
            raise PreconditionFailed(
                f"EP group {quote_name(self._group)}: rank {self._ep_rank} is no member of view "
                f"{view.number} (members {list(view.members)}): it must leave the all-to-all"
            )
        self.adopted = AdoptedView.of(view)
        self._peer_loss.clear_fault()
        _log.info(
            "EP group %s: rank %d adopted view %d (members %s, %d all-to-all rounds done)",
            quote_name(self._group),
            self._ep_rank,
            view.number,
            list(view.members),
            self.rounds,
        )
        return self.adopted
