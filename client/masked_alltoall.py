"""The manager's all-to-all under a membership mask: one small wrapper.

:class:`MaskedAlltoAll` stands in front of what the manager hands out
(``moe_alltoall``, ``get_communication()``) when the ``mask`` peer-loss
policy is on. Every ``dispatch`` gets ``active_rank_mask=`` the adopted
view's mask (none while no view is adopted, i.e. every rank) unless the
caller names a mask (``active_rank_mask=None`` names none: FlashInfer's
default, which under a view without a dead rank would wait for it), its
``combine`` the same mask as its dispatch, and each combine done counts one
all-to-all round (a dispatch + combine pair): the count a rank states when
it acknowledges a view (:mod:`moe_sidecar.client.membership_view`). Every
other attribute is the wrapped object's.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["MaskSource", "MaskedAlltoAll"]


class MaskSource(Protocol):
    """Where the wrapper reads the mask and counts rounds."""

    def step_mask(self) -> int | None:
        """The mask of the next step (None: no view adopted, every rank)."""
        ...

    def round_done(self) -> None:
        """One dispatch + combine pair completed."""
        ...


class MaskedAlltoAll:
    """``inner`` (an all-to-all or its ``moe_ep`` object), its dispatch and
    combine passing ``source``'s mask.

    Args:
        inner: the backend's object.
        source: the mask and the round count.
    """

    def __init__(self, inner: Any, source: MaskSource) -> None:
        self.wrapped = inner
        """The backend's own object."""
        self._source = source
        self._dispatch_mask: int | None = None

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped ``dispatch``, with ``active_rank_mask`` the view's
        unless the caller names one (not None).

        Raises:
            RankMaskError: what the wrapped object raises for the mask.
        """
        if kwargs.get("active_rank_mask") is None:
            kwargs["active_rank_mask"] = self._source.step_mask()
        result = self.wrapped.dispatch(*args, **kwargs)
        self._dispatch_mask = kwargs["active_rank_mask"]
        return result

    def combine(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped ``combine`` with its dispatch's mask (a combine must take
        the mask its dispatch did); counts the round once it returns.

        Raises:
            RankMaskError: what the wrapped object raises for the mask.
        """
        if kwargs.get("active_rank_mask") is None:
            kwargs["active_rank_mask"] = self._dispatch_mask
        result = self.wrapped.combine(*args, **kwargs)
        self._source.round_done()
        return result

    def reset_step(self) -> None:
        """Forgets a dispatch left without its combine (a fault cut the step
        short): the next combine takes the next dispatch's mask."""
        self._dispatch_mask = None

    def __getattr__(self, name: str) -> Any:
        # Only names this class lacks come here: the wrapped object's own.
        return getattr(self.wrapped, name)
