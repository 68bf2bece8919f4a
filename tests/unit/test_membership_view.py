"""The client's side of membership views: the ``mask`` policy's follower,
its wrapper of the all-to-all, the refusals and the failed view's error.

The follower's decisions are driven through a recorded sequence of the
sidecar's answers (the views a sidecar returns are the core's own values);
the real sidecar, ranks and kill are ``tests/multiprocess/test_masked_view.py``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from moe_sidecar.client.embedded_transport import EmbeddedTransport
from moe_sidecar.client.errors import (
    PreconditionFailed,
    SessionStatus,
    ViewFailed,
    error_from_rpc,
)
from moe_sidecar.client.masked_alltoall import MaskedAlltoAll
from moe_sidecar.client.membership_view import ViewFollower
from moe_sidecar.client.peer_loss import PeerLoss, PeerLossPolicy, PeerLossWatch
from moe_sidecar.core.membership import View, ViewState, acknowledge, first_view, join, leave

pytestmark = pytest.mark.timeout(10)

GROUP = "views:fp4/tp1-ep4/pp0"


class AnsweringSidecar:
    """The view calls answered from the core's own view values, recording the calls."""

    def __init__(self, latest: View | None, after_ack: View, decided: View | None = None) -> None:
        self.latest, self.after_ack, self.decided = latest, after_ack, decided
        self.calls: list[tuple[Any, ...]] = []

    def latest_view(self, group: str) -> View | None:
        self.calls.append(("latest", group))
        return self.latest

    def acknowledge_view(self, group: str, view: int, rounds: int) -> View:
        self.calls.append(("acknowledge", group, view, rounds))
        return self.after_ack

    def await_view(self, group: str, view: int, timeout: float) -> View:
        self.calls.append(("await", group, view))
        assert self.decided is not None
        return self.decided


class RecordingAlltoAll:
    """An all-to-all that records the masks it was called with."""

    def __init__(self) -> None:
        self.masks: list[tuple[str, int | None]] = []
        self.params = "the wrapped object's"

    def dispatch(self, *args: Any, active_rank_mask: int | None = None) -> str:
        self.masks.append(("dispatch", active_rank_mask))
        return "dispatched"

    def combine(self, *args: Any, active_rank_mask: int | None = None) -> str:
        self.masks.append(("combine", active_rank_mask))
        return "combined"


def _proposed_without_3() -> View:
    view = leave(first_view((0, 1, 2, 3), 1, "lifetime 1 began"), 3, "rank 3 died", 0.0, 60.0)
    assert view is not None
    return view


def _follower(views: Any, policy: PeerLossPolicy = PeerLossPolicy.MASK) -> ViewFollower:
    watch = PeerLossWatch("unix:///nowhere", policy)
    return ViewFollower(views, watch, GROUP, 4, 0, default_wait_s=5.0)


def test_a_proposed_view_is_acknowledged_with_the_rounds_and_adopted_once_committed() -> None:
    proposed = _proposed_without_3()
    acked = acknowledge(proposed, 0, proposed.number, 3, 1.0)
    committed = acknowledge(acknowledge(acked, 1, 2, 3, 1.0), 2, 2, 3, 1.0)
    assert committed.state is ViewState.COMMITTED
    sidecar = AnsweringSidecar(proposed, acked, committed)
    follower = _follower(sidecar)
    follower.rounds = 3
    assert follower.active_mask() == 0b1111 and follower.step_mask() is None
    adopted = follower.adopt()
    assert sidecar.calls == [("latest", GROUP), ("acknowledge", GROUP, 2, 3), ("await", GROUP, 2)]
    assert (adopted.number, adopted.members, adopted.mask) == (2, (0, 1, 2), 0b0111)
    assert follower.active_mask() == follower.step_mask() == 0b0111


def test_a_failed_view_raises_view_failed_naming_it_and_its_cause() -> None:
    proposed = _proposed_without_3()
    failed = acknowledge(acknowledge(proposed, 1, 2, 4, 1.0), 2, 2, 4, 1.0)
    failed = acknowledge(failed, 0, 2, 3, 1.0)
    assert failed.state is ViewState.FAILED
    follower = _follower(AnsweringSidecar(proposed, failed))
    with pytest.raises(ViewFailed) as info:
        follower.adopt()
    assert info.value.view == 2
    assert "different all-to-all rounds" in info.value.cause
    assert "membership view 2 failed" in info.value.message
    assert follower.adopted is None and follower.active_mask() == 0b1111


def test_a_failed_view_refused_by_the_sidecar_maps_to_view_failed() -> None:
    refusal = SessionStatus.named(
        "FAILED_PRECONDITION",
        "view 2 failed (rank 3 died; ranks 1 did not ack): the group must restart",
    )
    error = error_from_rpc(refusal, method="AcknowledgeView", target="unix:///s.sock")
    assert isinstance(error, ViewFailed) and isinstance(error, PreconditionFailed)
    assert (error.view, error.cause) == (2, "rank 3 died; ranks 1 did not ack")
    other = SessionStatus.named("FAILED_PRECONDITION", "rank 0 is no member of view 2")
    assert type(error_from_rpc(other, method="AcknowledgeView", target="t")) is PreconditionFailed


def test_adopt_view_needs_the_mask_policy_and_names_it() -> None:
    sidecar = AnsweringSidecar(_proposed_without_3(), _proposed_without_3())
    follower = _follower(sidecar, PeerLossPolicy.RAISE)
    with pytest.raises(PreconditionFailed, match=r"MOE_SIDECAR_ON_PEER_LOSS=mask.*'raise'"):
        follower.adopt()
    assert sidecar.calls == []  # nothing asked, nothing changed
    inner = RecordingAlltoAll()
    assert follower.wrap(inner) is inner  # not wrapped: no mask, the object itself


def test_embedded_mode_refuses_views_saying_masks_need_a_sidecar() -> None:
    transport = EmbeddedTransport()
    for call in (
        lambda: transport.latest_view(GROUP),
        lambda: transport.acknowledge_view(GROUP, 2, 3),
        lambda: transport.await_view(GROUP, 2, 1.0),
    ):
        with pytest.raises(PreconditionFailed, match="need sidecar mode"):
            call()
    with pytest.raises(PreconditionFailed, match="need sidecar mode"):
        _follower(transport).adopt()


def test_the_wrapper_passes_the_adopted_mask_and_counts_rounds() -> None:
    proposed = _proposed_without_3()
    committed = View(2, (0, 1, 2), 1, ViewState.COMMITTED, "rank 3 died")
    follower = _follower(AnsweringSidecar(proposed, committed))
    inner = RecordingAlltoAll()
    wrapped = follower.wrap(inner)
    assert isinstance(wrapped, MaskedAlltoAll) and follower.wrap(inner) is wrapped
    assert wrapped.params == "the wrapped object's"
    assert (wrapped.dispatch("x"), wrapped.combine("y")) == ("dispatched", "combined")
    assert follower.rounds == 1
    follower.adopt()
    assert follower.rounds == 1  # adopting is no round
    wrapped.dispatch("x")
    wrapped.combine("y")
    assert inner.masks == [
        ("dispatch", None),
        ("combine", None),
        ("dispatch", 0b0111),
        ("combine", 0b0111),
    ]
    assert follower.rounds == 2
    # An explicit None is no mask named: the view's still goes, to both calls.
    wrapped.dispatch("x", active_rank_mask=None)
    wrapped.combine("y", active_rank_mask=None)
    assert inner.masks[-2:] == [("dispatch", 0b0111), ("combine", 0b0111)]
    wrapped.dispatch("x", active_rank_mask=0b0011)  # a mask named is passed as it is
    wrapped.combine("y")
    assert inner.masks[-2:] == [("dispatch", 0b0011), ("combine", 0b0011)]
    follower.forget()
    assert (follower.rounds, follower.adopted, follower.active_mask()) == (0, None, 0b1111)


def test_a_loss_under_mask_is_recorded_not_raised() -> None:
    watch = PeerLossWatch("unix:///nowhere", PeerLossPolicy.MASK)
    watch._lost(PeerLoss(GROUP, 3, "its session stream closed"))
    assert watch.fault is not None and watch.fault.ep_rank == 3
    follower = ViewFollower(
        AnsweringSidecar(None, _proposed_without_3()), watch, GROUP, 4, 0, default_wait_s=1.0
    )
    assert follower.peer_fault()
    watch.clear_fault()
    assert not follower.peer_fault()


def test_a_view_a_replacement_joined_is_refused_before_acknowledging_it() -> None:
    proposed = _proposed_without_3()
    committed = proposed
    for rank in (0, 1, 2):
        committed = acknowledge(committed, rank, 2, 3, 1.0)
    joining = join(committed, 3, 2, "rank 3 rejoined", 2.0, 60.0)
    for latest in (joining, replace(joining, state=ViewState.COMMITTED)):
        sidecar = AnsweringSidecar(latest, latest)
        follower = _follower(sidecar)
        with pytest.raises(PreconditionFailed) as info:
            follower.adopt(held_generation=1)
        assert "view 3 (members [0, 1, 2, 3]) is at generation 2, above the 1 rank 0 built" in (
            info.value.message
        )
        assert sidecar.calls == [("latest", GROUP)]  # nothing acknowledged
        assert follower.adopted is None
    same = AnsweringSidecar(committed, committed)
    assert _follower(same).adopt(held_generation=1).number == 2
