"""What the sidecar counts and logs of its groups: :class:`EventObserver`.

The state holder hands it every event a step publishes and every group
state it keeps; it turns them into the group's metrics series and one log
line per event, chosen by the event's kind from one table (a round decided
REUSE is logged at DEBUG, every other event at INFO or above).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeAlias

from moe_sidecar import flashinfer
from moe_sidecar.core.capacity_fields import CAPACITY_FIELDS
from moe_sidecar.core.effects import EventKind, GroupEvent
from moe_sidecar.core.group import GroupState
from moe_sidecar.core.plan import Action
from moe_sidecar.metrics import GroupSeries, SidecarMetrics
from moe_sidecar.status import OncePerPeer

__all__ = ["CLOSED_AS", "EventObserver"]

_log = logging.getLogger("moe_sidecar.state")

CLOSED_AS = {
    EventKind.ROUND_REFUSED: "refused",
    EventKind.RANK_TIMEOUT: "timed_out",
    EventKind.ROUND_ABORTED: "aborted",
}
"""The metric label of a round that closed without a decision, by event."""

_MAX_UNLOGGED_GROUPS = 1024
"""Groups whose unlogged proof refusals are counted for their next line."""

_Fields: TypeAlias = dict[str, object]
_Handler: TypeAlias = Callable[[GroupEvent, _Fields, GroupSeries], None]


class EventObserver:
    """Counts and logs group events; keeps the per-group gauges current.

    ``sizing_of`` tells the EP size and FlashInfer release of a group (None:
    unknown), which the workspace bytes in a log line are derived by.
    """

    def __init__(
        self, metrics: SidecarMetrics, sizing_of: Callable[[str], tuple[int, str] | None]
    ) -> None:
        self._metrics = metrics
        self._sizing_of = sizing_of
        # A stranger can earn thousands of proof refusals a second: one
        # warning per group per minute, the counter counts every one.
        self._log_refusal = OncePerPeer()
        self._unlogged_refusals: dict[str, int] = {}
        self._handlers: dict[EventKind, _Handler] = {
            EventKind.ROUND_DECIDED: self._round_decided,
            **{kind: self._round_closed_undecided for kind in CLOSED_AS},
            EventKind.COMMIT: self._committed,
            EventKind.RANK_LEFT: self._rank_left,
            EventKind.RESET: self._reset,
            EventKind.LIFETIME_STARTED: self._lifetime_started,
            EventKind.PLAN_MERGED: self._plan_merged,
            EventKind.PROOF_REFUSED: self._proof_refused,
            EventKind.VIEW_CHANGED: self._view_changed,
        }

    def observe(self, event: GroupEvent) -> None:
        """Counts ``event`` in its group's series and logs it."""
        if event.kind is EventKind.GROUP_REMOVED:
            # The group's series are gone with it: only the log line remains.
            _log.warning("group removed", extra={"group": event.group, "detail": event.message})
            return
        series = self._metrics.group(event.group)
        if event.latency is not None:
            self._metrics.round_latency.observe(event.latency)
        fields: _Fields = {"group": event.group}
        if event.round:
            fields["round"] = event.round
        if event.ranks:
            fields["ranks"] = list(event.ranks)
        if event.layer:
            fields["layer"] = event.layer
        handler = self._handlers.get(event.kind)
        if handler is not None:
            handler(event, fields, series)

    def update_gauges(self, state: GroupState, before: GroupState | None = None) -> None:
        """Sets the group's workspace bytes and waiting-ranks gauges from ``state``.

        With ``before`` (the group's state before the step), only what moved:
        the waiting-ranks count, and the workspace bytes when the plan or the
        EP size changed.
        """
        waiting = len(state.open_round.proposals) if state.open_round is not None else 0
        if (
            before is not None
            and before.plan is state.plan
            and (before.ep_size, before.release) == (state.ep_size, state.release)
        ):
            before_waiting = len(before.open_round.proposals) if before.open_round else 0
            if waiting != before_waiting:
                self._metrics.group(state.name).set_waiting(waiting)
            return
        self._metrics.group(state.name).set_sizes(
            (
                flashinfer.workspace_size(state.release, state.plan.capacities, state.ep_size)
                if state.plan is not None
                else 0
            ),
            waiting,
        )

    def _workspace_bytes(self, event: GroupEvent) -> int:
        sizing = self._sizing_of(event.group)
        if event.plan is None or sizing is None:
            return 0
        ep_size, release = sizing
        return flashinfer.workspace_size(release, event.plan.capacities, ep_size)

    def _round_decided(self, event: GroupEvent, fields: _Fields, series: GroupSeries) -> None:
        assert event.action is not None and event.plan is not None
        series.round_closed(event.action.value)
        if event.action is Action.REBUILD:
            series.rebuilds.inc()
        # A REUSE round (every covered layer) is the common case and tells an
        # operator nothing new: DEBUG, and not even formatted unless enabled.
        # Growths, rebuilds and every refusal stay at INFO or above.
        level = logging.DEBUG if event.action is Action.REUSE else logging.INFO
        if not _log.isEnabledFor(level):
            return
        capacities = event.plan.capacities
        _log.log(
            level,
            "round decided",
            extra={
                **fields,
                "action": event.action.value,
                "workspace_bytes": self._workspace_bytes(event),
                **{field.name: getattr(capacities, field.name) for field in CAPACITY_FIELDS},
                "epoch": event.plan.epoch,
                "generation": event.plan.generation,
                "grew": event.grew,
            },
        )

    def _round_closed_undecided(
        self, event: GroupEvent, fields: _Fields, series: GroupSeries
    ) -> None:
        outcome = CLOSED_AS[event.kind]
        series.round_closed(outcome)
        if event.ep_rank >= 0:
            fields["rank"] = event.ep_rank
        if event.missing_ranks:
            fields["missing_ranks"] = list(event.missing_ranks)
        _log.warning(
            f"round {outcome.replace('_', ' ')}", extra={**fields, "reason": event.message}
        )

    def _committed(self, event: GroupEvent, fields: _Fields, series: GroupSeries) -> None:
        assert event.plan is not None
        _log.info(
            "commit",
            extra={
                **fields,
                "rank": event.ep_rank,
                "generation": event.plan.generation,
                "workspace_bytes": self._workspace_bytes(event),
                "detail": event.message,
            },
        )

    def _rank_left(self, event: GroupEvent, fields: _Fields, series: GroupSeries) -> None:
        # A rank that said goodbye (its cleanup) left normally: INFO. One whose
        # session broke without it died, or was killed: WARNING, as its peers'
        # watchers act on it. A departure that fails an open round is logged
        # again, at WARNING, as that round's abort.
        extra = {**fields, "rank": event.ep_rank, "detail": event.message}
        if event.lost:
            self._metrics.ranks_lost.inc()
            _log.warning("rank lost: its session broke without a goodbye", extra=extra)
        else:
            _log.info("rank left the group normally", extra=extra)

    def _view_changed(self, event: GroupEvent, fields: _Fields, series: GroupSeries) -> None:
        if event.view is not None:
            self._metrics.views.labels(state=event.view.state.value).inc()
        _log.info("view changed", extra={**fields, "rank": event.ep_rank, "detail": event.message})

    def _reset(self, event: GroupEvent, fields: _Fields, series: GroupSeries) -> None:
        _log.warning("group reset", extra={**fields, "detail": event.message})

    def _lifetime_started(self, event: GroupEvent, fields: _Fields, series: GroupSeries) -> None:
        _log.info(
            "lifetime started", extra={**fields, "rank": event.ep_rank, "detail": event.message}
        )

    def _plan_merged(self, event: GroupEvent, fields: _Fields, series: GroupSeries) -> None:
        _log.info(
            "plan merged",
            extra={
                **fields,
                "from_node": event.node,
                "epoch": event.plan.epoch if event.plan else None,
                "generation": event.plan.generation if event.plan else None,
                "workspace_bytes": self._workspace_bytes(event),
                "detail": event.message,
            },
        )

    def _proof_refused(self, event: GroupEvent, fields: _Fields, series: GroupSeries) -> None:
        self._metrics.proof_refusals.inc()
        if not self._log_refusal(event.group):
            if len(self._unlogged_refusals) < _MAX_UNLOGGED_GROUPS:
                unlogged = self._unlogged_refusals.get(event.group, 0) + 1
                self._unlogged_refusals[event.group] = unlogged
            return
        _log.warning(
            "proof refused",
            extra={
                **fields,
                "rank": event.ep_rank,
                "reason": event.message,
                "refused_unlogged": self._unlogged_refusals.pop(event.group, 0),
                "note": "at most one line per group per minute; "
                "moe_sidecar_proof_refusals_total counts every refusal",
            },
        )
