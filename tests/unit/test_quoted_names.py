"""Names in the core's messages are quoted by one helper
(:func:`moe_sidecar.core.errors.quote_name`): whole up to its limit, else cut
with an ellipsis and their length, so no message echoes a 256-character
group or layer name whole. No I/O, no clock."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from moe_sidecar.core import limits, policy
from moe_sidecar.core.cluster import ClusterPlan
from moe_sidecar.core.effects import Step
from moe_sidecar.core.errors import (
    QUOTED_NAME_CHARACTERS,
    CoordinatorError,
    GroupNotFound,
    quote_name,
)
from moe_sidecar.core.group import CommitRecord, GroupState, Proposal, Refusal, Requirement
from moe_sidecar.core.plan import Capacities, Plan
from tests.ceiling import CEILING

pytestmark = pytest.mark.timeout(10)

GROUP = "m" * (limits.MAX_NAME_LENGTH - 4) + "/ep2"
"""A group name as long as names may be."""
LAYER = "a" * limits.MAX_NAME_LENGTH
OTHER_LAYER = "b" * limits.MAX_NAME_LENGTH
TIMEOUT = 30.0
SMALL = Capacities(256, 100, 200, 2, 16)
OTHER_SHAPE = replace(SMALL, top_k=4)


def prop(rank: int, rnd: int, layer: str = LAYER, capacities: Capacities = SMALL) -> Proposal:
    return Proposal(GROUP, 2, rank, 2, f"life-{rank}", rnd, Requirement(capacities, layer))


def decided() -> GroupState:
    """Round 1 decided for both ranks, at layer ``LAYER``."""
    state = policy.propose(None, prop(0, 1), 0.0, TIMEOUT, ceiling=CEILING).state
    return policy.propose(state, prop(1, 1), 0.0, TIMEOUT, ceiling=CEILING).state


def reply_text(step: Step | None) -> str:
    assert step is not None and isinstance(step.reply, Refusal), step
    return step.reply.message


def raised_text(call: Callable[[], object]) -> str:
    with pytest.raises(CoordinatorError) as info:
        call()
    return info.value.message


def heterogeneous() -> str:
    return reply_text(
        policy.propose(decided(), prop(0, 2, OTHER_LAYER, OTHER_SHAPE), 1.0, 30.0, ceiling=CEILING)
    )


def disagreeing_layers() -> str:
    state = policy.propose(None, prop(0, 1), 0.0, TIMEOUT, ceiling=CEILING).state
    return reply_text(policy.propose(state, prop(1, 1, OTHER_LAYER), 0.0, TIMEOUT, ceiling=CEILING))


def disagreeing_shapes() -> str:
    state = policy.propose(None, prop(0, 1), 0.0, TIMEOUT, ceiling=CEILING).state
    return reply_text(
        policy.propose(state, prop(1, 1, OTHER_LAYER, OTHER_SHAPE), 0.0, TIMEOUT, ceiling=CEILING)
    )


def timed_out() -> str:
    state = policy.propose(decided(), prop(0, 2), 1.0, TIMEOUT, ceiling=CEILING).state
    return reply_text(policy.expire(state, 1.0 + TIMEOUT))


def gone() -> str:
    state = policy.propose(decided(), prop(0, 2), 1.0, TIMEOUT, ceiling=CEILING).state
    return reply_text(policy.depart(state, 1, "life-1", "its session ended", 2.0))


def re_proposed() -> str:
    state = policy.propose(decided(), prop(0, 2), 1.0, TIMEOUT, ceiling=CEILING).state
    return raised_text(
        lambda: policy.propose(state, prop(0, 2, OTHER_LAYER), 2.0, TIMEOUT, ceiling=CEILING)
    )


def another_layout() -> str:
    return raised_text(
        lambda: policy.propose(
            decided(), replace(prop(0, 2), ep_size=4), 1.0, 30.0, ceiling=CEILING
        )
    )


def merged_shape() -> str:
    remote = ClusterPlan(GROUP, 2, epoch=0, plan=Plan(OTHER_SHAPE, 0, 5), generation=5)
    return raised_text(lambda: policy.merge(decided(), remote, 1.0, ceiling=CEILING))


def committed_stranger() -> str:
    record = CommitRecord(0, "stranger", 1, Plan(SMALL, 0, 1), 0.0)
    return raised_text(lambda: policy.commit(decided(), record, 1.0, ceiling=CEILING))


def busy() -> str:
    state = policy.propose(decided(), prop(0, 2), 1.0, TIMEOUT, ceiling=CEILING).state
    return raised_text(lambda: policy.check_removable(state))


def unknown() -> str:
    return GroupNotFound.named(GROUP).message


def unprintable() -> str:
    return raised_text(lambda: limits.check_name("group", "\x07" * 200, allow_empty=False))


MESSAGES: list[tuple[str, Callable[[], str], tuple[str, ...]]] = [
    ("heterogeneous layer", heterogeneous, (GROUP, LAYER, OTHER_LAYER)),
    ("ranks at different layers", disagreeing_layers, (GROUP, LAYER, OTHER_LAYER)),
    ("ranks of different shapes", disagreeing_shapes, (GROUP, LAYER, OTHER_LAYER)),
    ("round timed out", timed_out, (GROUP, LAYER)),
    ("rank gone", gone, (GROUP, LAYER)),
    ("re-proposed another layer", re_proposed, (GROUP, LAYER, OTHER_LAYER)),
    ("another ep_size", another_layout, (GROUP,)),
    ("merge of another shape", merged_shape, (GROUP,)),
    ("commit from a stranger", committed_stranger, (GROUP,)),
    ("removal while busy", busy, (GROUP,)),
    ("unknown group", unknown, (GROUP,)),
    ("unprintable name", unprintable, ("\x07" * 200,)),
]


@pytest.mark.parametrize(("what", "make", "names"), MESSAGES, ids=[m[0] for m in MESSAGES])
def test_long_names_are_quoted_cut(
    what: str, make: Callable[[], str], names: tuple[str, ...]
) -> None:
    message = make()
    for name in names:
        assert quote_name(name) in message, what
        assert repr(name[: QUOTED_NAME_CHARACTERS + 1])[:-1] not in message, what


def test_a_short_name_is_quoted_whole() -> None:
    name = "n" * QUOTED_NAME_CHARACTERS
    assert quote_name(name) == repr(name)


def test_a_long_name_is_cut_with_an_ellipsis_and_its_length() -> None:
    quoted = quote_name("x" * 100_000)
    assert quoted == repr("x" * QUOTED_NAME_CHARACTERS) + "\u2026 (100000 characters)"
