"""A REUSE round writes its short record, not the group; a restarted sidecar
replays the records onto the row; a row of a release that recorded none
lags such rounds and is caught up from the ranks' next proposals (core only)."""

from __future__ import annotations

import pytest

from moe_sidecar.core import policy
from moe_sidecar.core.effects import Answer, Persist, RecordReuse, Step, Wait
from moe_sidecar.core.errors import PreconditionFailed
from moe_sidecar.core.group import Decision, GroupState, Proposal, Requirement
from moe_sidecar.core.plan import Action, Capacities
from tests.ceiling import CEILING

pytestmark = pytest.mark.timeout(30)

NEED = Requirement(Capacities(256, 4096, 14336, 8, 256), "layer")


def _propose(state: GroupState | None, rank: int, rnd: int, *, recovered: bool = False) -> Step:
    p = Proposal("g", 2, rank, 2, f"life-{rank}", rnd, Requirement(NEED.capacities, f"l{rnd}"))
    return policy.propose(state, p, float(rnd), 60.0, recovered=recovered, ceiling=CEILING)


def _round(state: GroupState | None, rnd: int) -> tuple[GroupState, Step]:
    first = _propose(state, 0, rnd)
    last = _propose(first.state, 1, rnd)
    return last.state, last


def _persists(step: Step) -> bool:
    return any(isinstance(e, Persist) for e in step.effects)


def test_a_reuse_round_is_not_written_a_build_is() -> None:
    state, build = _round(None, 1)
    assert isinstance(build.reply, Decision) and build.reply.action is Action.BUILD
    assert _persists(build)
    state, reuse = _round(state, 2)
    assert isinstance(reuse.reply, Decision) and reuse.reply.action is Action.REUSE
    assert not _persists(reuse)
    # Its record comes before its answer: a crash between loses no answer.
    kinds = [type(e) for e in reuse.effects]
    assert kinds.index(RecordReuse) < kinds.index(Answer)
    assert reuse.reuse_record == RecordReuse(1, 2, "l2")


def test_ranks_past_unwritten_reuse_rounds_catch_a_recovered_group_up() -> None:
    row, _ = _round(None, 1)  # what the store holds: round 1 written
    state = row
    for rnd in (2, 3, 4):
        state, _ = _round(state, rnd)
    assert state.last_closed_round == 4
    # Without a restart a jump is out of sequence, as it always was.
    with pytest.raises(PreconditionFailed, match="next round is 2"):
        _propose(row, 0, 5)
    waiting = _propose(row, 0, 5, recovered=True)
    assert isinstance(waiting.reply, Wait) and _persists(waiting)
    decided = _propose(waiting.state, 1, 5, recovered=True)
    assert isinstance(decided.reply, Decision)
    assert (decided.reply.round, decided.reply.action) == (5, Action.REUSE)
    # A rank that missed round 4's answer gets the REUSE it was.
    retry = _propose(decided.state, 1, 4)
    assert isinstance(retry.reply, Decision) and retry.reply.action is Action.REUSE
    assert retry.reply.round == 4


def test_a_retry_of_an_unwritten_round_is_answered_when_its_peer_has_passed_it() -> None:
    row, _ = _round(None, 1)
    state = row
    for rnd in (2, 3):
        state, _ = _round(state, rnd)
    # Rank 0 missed round 3's answer and retries it; rank 1 is at round 4.
    retried = _propose(row, 0, 3, recovered=True)
    assert isinstance(retried.reply, Wait)
    ahead = _propose(retried.state, 1, 4, recovered=True)
    assert isinstance(ahead.reply, Wait)
    answers = [e for e in ahead.effects if isinstance(e, Answer)]
    assert [(a.round, a.outcome) for a in answers] == [
        (3, Decision(3, Action.REUSE, row.plan, False, "l3"))  # type: ignore[arg-type]
    ]
    done = _propose(ahead.state, 0, 4, recovered=True)
    assert isinstance(done.reply, Decision) and done.reply.round == 4


def test_replaying_the_records_gives_every_answer_again() -> None:
    stored, _ = _round(None, 1)  # the row as written: round 1 built
    state = stored
    records = []
    for rnd in (2, 3, 4):
        state, step = _round(state, rnd)
        assert step.reuse_record is not None
        records.append(step.reuse_record)
    replayed: GroupState | None = stored
    for record in records:
        assert replayed is not None
        replayed = policy.replay_reuse(replayed, record.lifetime_index, record.round, record.layer)
    assert replayed is not None
    assert replayed.last_closed_round == 4
    for rnd in (2, 3, 4):
        assert replayed.outcome_of(rnd) == state.outcome_of(rnd)
    # A retry of a replayed round gets its answer back, at once.
    retry = _propose(replayed, 0, 3)
    assert retry.reply == state.outcome_of(3) and not retry.effects
    assert [(r.last_round, r.last_layer) for r in replayed.ranks] == [(4, "l4")] * 2


@pytest.mark.parametrize(
    ("lifetime_index", "rnd"),
    [(2, 2), (1, 3), (1, 1)],
    ids=["another-lifetime", "not-the-next-round", "a-round-the-row-holds"],
)
def test_a_record_that_does_not_follow_its_row_changes_nothing(
    lifetime_index: int, rnd: int
) -> None:
    stored, _ = _round(None, 1)
    assert policy.replay_reuse(stored, lifetime_index, rnd, "l") is None


def test_a_record_needs_a_built_plan() -> None:
    first = _propose(None, 0, 1).state  # round 1 open: nothing built
    assert policy.replay_reuse(first, 1, 1, "l1") is None
