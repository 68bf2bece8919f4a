"""Deadlines: a round or a restart that waited too long, and a sidecar that
takes its groups up again after a restart of its own. Pure."""

from __future__ import annotations

from dataclasses import replace

from moe_sidecar.core.effects import EventKind, Step
from moe_sidecar.core.errors import ErrorCode, quote_name
from moe_sidecar.core.group import GroupState, OpenRound, Refusal
from moe_sidecar.core.policy.events import group_event, missing_text
from moe_sidecar.core.policy.proof import held_by_proofs_text
from moe_sidecar.core.policy.rounds import round_closed
from moe_sidecar.core.policy.views import expire_view, resume_view

__all__ = ["expire", "paused", "resume"]


def _expire_open(state: GroupState, rnd: OpenRound, now: float) -> Step:
    """Fails the open round past its deadline, naming every rank it missed."""
    present = {p.ep_rank for p in rnd.proposals}
    missing = [r for r in state.current_ranks() if r.ep_rank not in present]
    unseen = state.local_ranks - len(present) - len(missing)
    parts = missing_text(missing)
    if unseen > 0 and state.local_ranks == state.ep_size:
        # Every rank is local: the ones never seen are known by number.
        known = present | {r.ep_rank for r in missing}
        never = [rank for rank in range(state.ep_size) if rank not in known]
        parts.extend(f"rank {rank} (never seen in this lifetime)" for rank in never)
    elif unseen > 0:
        parts.append(f"{unseen} rank(s) never seen in this lifetime")
    why = [held_by_proofs_text(rnd)]
    if parts:
        why.insert(
            0,
            f"{state.local_ranks - len(present)} of {state.local_ranks} local ranks "
            f"missing: {'; '.join(parts)}",
        )
    layer = rnd.proposals[0].requirement.layer if rnd.proposals else ""
    message = (
        f"round {rnd.number} of group {quote_name(state.name)} (layer {quote_name(layer)}) timed "
        f"out after {rnd.deadline - rnd.opened_at:.1f}s: {'; '.join(w for w in why if w)}; "
        f"ranks present: {sorted(present)}"
    )
    refusal = Refusal(
        round=rnd.number,
        code=ErrorCode.DEADLINE_EXCEEDED,
        message=message,
        missing_ranks=tuple(r.ep_rank for r in missing),
    )
    event = group_event(
        state,
        EventKind.RANK_TIMEOUT,
        now,
        closes=rnd,
        layer=layer,
        message=message,
        missing_ranks=refusal.missing_ranks,
        ranks=tuple(sorted(present)),
    )
    return round_closed(state.closed_by(refusal), state.lifetime_index, rnd, refusal, event)


def _expire_restart(state: GroupState, pending: OpenRound, now: float) -> Step:
    """Fails a restart past its deadline; the running lifetime goes on."""
    present = sorted(p.ep_rank for p in pending.proposals)
    running = [r for r in state.current_ranks() if r.ep_rank not in present]
    layout = state.restart_layout()
    split = held_by_proofs_text(pending)
    message = (
        f"the restart of group {quote_name(state.name)} timed out after "
        f"{pending.deadline - pending.opened_at:.1f}s: {len(present)} of {layout} "
        f"local ranks began a new lifetime (ranks {present}); "
    )
    if split and len(present) >= layout:
        message += split
    elif state.never_ran():
        message += (
            "the group's last start failed (its round 1 was refused), so nothing runs: a new "
            "start needs every local rank to propose" + (f"; {split}" if split else "")
        )
    else:
        message += (
            "a new lifetime begins only when every local rank of the group restarts, and the "
            "running lifetime's " + ("; ".join(missing_text(running)) or "ranks") + " did not"
        )
        message += f"; {split}" if split else ""
    refusal = Refusal(
        round=1,
        code=ErrorCode.DEADLINE_EXCEEDED,
        message=message,
        missing_ranks=tuple(r.ep_rank for r in running),
    )
    state = replace(state, pending=None)
    event = group_event(
        state,
        EventKind.RANK_TIMEOUT,
        now,
        closes=pending,
        round=1,
        message=message,
        missing_ranks=refusal.missing_ranks,
        ranks=tuple(present),
    )
    return round_closed(state, state.lifetime_index + 1, pending, refusal, event)


def expire(state: GroupState, now: float) -> Step | None:
    """Fails the open round, or the pending restart, whose deadline has
    passed (the earlier one first), else a proposed membership view past
    its deadline; None when nothing is due.

    A refusal names every missing rank and the last layer each reported.
    """
    rnd, pending = state.open_round, state.pending
    open_due = rnd is not None and rnd.deadline <= now
    pending_due = pending is not None and pending.deadline <= now
    if (
        open_due
        and rnd is not None
        and not (pending_due and pending and pending.deadline < rnd.deadline)
    ):
        return _expire_open(state, rnd, now)
    if pending_due and pending is not None:
        return _expire_restart(state, pending, now)
    return expire_view(state, now)


def paused(state: GroupState, seconds: float) -> GroupState:
    """The group after its sidecar stood still for ``seconds`` (stopped,
    throttled, a long pause): the pause does not count against the ranks, so
    the open round's, the open restart's and a proposed view's deadlines move
    that much later."""
    if state.open_round is not None:
        rnd = state.open_round
        state = replace(state, open_round=replace(rnd, deadline=rnd.deadline + seconds))
    if state.pending is not None:
        pending = state.pending
        state = replace(state, pending=replace(pending, deadline=pending.deadline + seconds))
    view = state.current_view()
    if view is not None and view.deadline is not None:
        state = replace(state, view=replace(view, deadline=view.deadline + seconds))
    return state


def resume(state: GroupState, now: float, round_timeout: float) -> GroupState:
    """The group as a restarted sidecar takes it up: the time the sidecar was
    down does not count against the ranks, so an open round and an open
    restart get a full ``round_timeout`` from ``now``."""
    if state.open_round is not None:
        state = replace(state, open_round=replace(state.open_round, deadline=now + round_timeout))
    if state.pending is not None:
        state = replace(state, pending=replace(state.pending, deadline=now + round_timeout))
    return resume_view(state, now, round_timeout)
