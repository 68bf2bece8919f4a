"""Table-driven tests of the owner's rule in the pure decision core
(:mod:`moe_sidecar.core.policy.owner`; its reads are the group's and the
round's methods): a restart inherits the stored plan only when its ranks
carry the stored owner. No I/O, no clock."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import pytest

from moe_sidecar.core import policy
from moe_sidecar.core.cluster import ClusterPlan, cluster_plan_of
from moe_sidecar.core.effects import Step
from moe_sidecar.core.errors import InvalidArgument
from moe_sidecar.core.group import Decision, GroupState, OpenRound, Proposal, Requirement
from moe_sidecar.core.identity import owner_id
from moe_sidecar.core.plan import Action, Capacities
from tests.ceiling import CEILING

pytestmark = pytest.mark.timeout(10)

GROUP = "g/ep4"
LOCAL = 4
TIMEOUT = 30.0
REAL = Requirement(Capacities(256, 100, 200, 2, 16), "l0")
"""The real ranks' layer."""
HUGE = Requirement(Capacities(3_880_000, 4096, 200, 2, 16), "")
"""A stranger's layer: 62.7 GiB per rank at EP 4, under the default ceiling of 64 GiB."""


def owner(name: str) -> str:
    """An owner id (as the wire codec makes it) per name; "" stays empty."""
    return hashlib.sha256(name.encode()).hexdigest() if name else ""


def prop(
    rank: int, proof: str, owner_name: str, *, req: Requirement = REAL, rnd: int = 1
) -> Proposal:
    return Proposal(
        group=GROUP,
        ep_size=LOCAL,
        ep_rank=rank,
        local_ranks=LOCAL,
        lifetime=f"{proof}-lifetime-{rank}",
        round=rnd,
        requirement=req,
        proof=proof,
        owner=owner(owner_name),
    )


def lifetime(
    state: GroupState | None, proof: str, owners: list[str], *, req: Requirement = REAL
) -> Step:
    """Round 1 of a lifetime whose rank r carries ``owners[r]``: the last step."""
    step = None
    for rank, name in enumerate(owners):
        step = policy.propose(
            state, prop(rank, proof, name, req=req), 1.0, TIMEOUT, ceiling=CEILING
        )
        state = step.state
    assert step is not None
    return step


def round_owner(owners: tuple[str, ...]) -> str:
    """The owner a round 1 whose rank r carries ``owners[r]`` stores."""
    rnd = OpenRound(number=1, opened_at=0.0, deadline=TIMEOUT)
    for rank, name in enumerate(owners):
        rnd = rnd.with_proposal(prop(rank, "p", name))
    return rnd.owner()


@dataclass(frozen=True)
class Case:
    name: str
    stored: str
    """The owner of the lifetime that stored the plan (every rank of it)."""
    restart: tuple[str, ...]
    """The owner each rank of the restart carries."""
    inherits: bool


CASES = [
    Case("the same owner inherits the stored plan", "ranks", ("ranks",) * LOCAL, True),
    Case("another owner (a squatter stored it)", "squatter", ("ranks",) * LOCAL, False),
    Case("a stored plan without an owner", "", ("ranks",) * LOCAL, False),
    Case("a restart without its key", "ranks", ("",) * LOCAL, False),
    Case("no owner on either side", "", ("",) * LOCAL, False),
    Case("the restart's ranks carry two owners", "ranks", ("ranks", "ranks", "ranks", "x"), False),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_restart_inherits_the_stored_plan_only_with_the_stored_owner(case: Case) -> None:
    stored = lifetime(None, "first-proof-of-16", [case.stored] * LOCAL, req=HUGE).state
    assert stored.owner == owner(case.stored) and stored.plan is not None
    step = lifetime(stored, "second-proof-of-16", list(case.restart))
    decision = step.reply
    assert isinstance(decision, Decision) and decision.action is Action.BUILD
    if case.inherits:
        assert decision.plan.capacities == stored.plan.capacities
        assert decision.plan == stored.plan and not decision.grew
        assert step.state.epoch == stored.epoch and step.state.history == stored.history
    else:
        # A new epoch from the restart's own proposals: the stored plan is not built.
        assert decision.plan.capacities == REAL.capacities
        assert decision.plan.epoch == step.state.epoch == stored.epoch + 1
        assert [g.plan for g in step.state.history] == [decision.plan]
        assert decision.plan.generation > stored.generation  # generations are never reused
    assert step.state.owner == round_owner(case.restart)


def test_the_whole_group_squat_is_not_built_by_the_real_ranks() -> None:
    """A stranger proposes for every local slot first, with a proof of its own
    and a huge plan; the real ranks' restart builds their own plan."""
    squatted = lifetime(None, "stranger-proof-16", ["stranger"] * LOCAL, req=HUGE)
    assert (
        isinstance(squatted.reply, Decision) and squatted.reply.plan.capacities == HUGE.capacities
    )
    real = lifetime(squatted.state, "real-ranks-proof", ["ranks"] * LOCAL)
    assert isinstance(real.reply, Decision)
    assert real.reply.plan.capacities == REAL.capacities
    assert real.state.owner == owner("ranks") and real.state.epoch == 1
    # The real ranks' next restart, with their key, inherits what they stored.
    again = lifetime(real.state, "real-ranks-again", ["ranks"] * LOCAL)
    assert isinstance(again.reply, Decision) and again.reply.plan == real.reply.plan
    assert again.state.epoch == 1


def test_the_first_lifetime_stores_its_owner_and_later_rounds_do_not_compare_it() -> None:
    first = lifetime(None, "the-ranks-proof-1", ["ranks"] * LOCAL)
    assert first.state.owner == owner("ranks")
    state = first.state
    step = None
    for rank in range(LOCAL):
        p = prop(rank, "the-ranks-proof-1", "someone-else", req=HUGE, rnd=2)
        step = policy.propose(state, p, 2.0, TIMEOUT, ceiling=CEILING)
        state = step.state
    assert step is not None and isinstance(step.reply, Decision) and step.reply.grew
    assert state.owner == owner("ranks")  # within a lifetime nothing changes


@pytest.mark.parametrize(
    ("stored", "owners", "expected"),
    [
        ("a", ["a", "a"], True),
        ("a", ["a", "b"], False),
        ("a", [], False),
        ("", ["", ""], False),
        ("a", ["", ""], False),
    ],
)
def test_inherits_stored_plan(stored: str, owners: list[str], expected: bool) -> None:
    state = GroupState(GROUP, LOCAL, LOCAL, owner=owner(stored))
    proposals = [prop(r, "p", name) for r, name in enumerate(owners)]
    assert state.inherits_stored_plan(proposals) is expected


def test_an_owner_digest_becomes_its_id_at_the_boundary() -> None:
    digest = hashlib.sha256(b"key" + GROUP.encode()).hexdigest()
    assert owner_id("") == ""
    assert owner_id(digest) == hashlib.sha256(b"owner:" + digest.encode()).hexdigest() != digest
    for bad in ("abc", digest.upper(), digest[:-1] + "g", digest + "0"):
        with pytest.raises(InvalidArgument, match=r"owner_digest: .* not an owner digest") as error:
            owner_id(bad)
        assert bad not in error.value.message and error.value.field == "owner_digest"


# --- across nodes: the owner travels with the cluster plan -------------------------------


def _node_b(doc: ClusterPlan) -> GroupState:
    """Node B's group once it merged ``doc`` (from node A), before any lifetime there."""
    step = policy.merge(None, doc, 2.0, node="node-b", ceiling=CEILING)
    assert step.state.lifetime_index == 0
    return step.state


def _stored_on_a() -> GroupState:
    """The real ranks' group on node A: one lifetime, its plan and owner stored."""
    return lifetime(None, "real-ranks-on-a", ["ranks"] * LOCAL, req=HUGE).state


@dataclass(frozen=True)
class NodeCase:
    name: str
    stored: str
    """The owner in node A's document ("" also: a document written before owners travelled)."""
    first: tuple[str, ...]
    """The owner each rank of node B's first lifetime carries."""
    inherits: bool


NODE_CASES = [
    NodeCase("the real ranks on node B inherit node A's plan", "ranks", ("ranks",) * LOCAL, True),
    NodeCase("a stranger on node B does not", "ranks", ("stranger",) * LOCAL, False),
    NodeCase("ranks without their key do not", "ranks", ("",) * LOCAL, False),
    NodeCase("a document without an owner is inherited by none", "", ("ranks",) * LOCAL, False),
    NodeCase("two owners in the round", "ranks", ("ranks", "ranks", "ranks", "x"), False),
]


@pytest.mark.parametrize("case", NODE_CASES, ids=[c.name for c in NODE_CASES])
def test_a_first_lifetime_on_another_node_inherits_only_with_the_documents_owner(
    case: NodeCase,
) -> None:
    on_a = _stored_on_a()
    doc = replace(cluster_plan_of(on_a), owner=owner(case.stored))
    on_b = _node_b(doc)
    assert on_b.owner == owner(case.stored)  # the merge keeps the owner
    assert on_b.plan == on_a.plan and on_a.plan is not None
    step = lifetime(on_b, "first-on-b", list(case.first))
    assert isinstance(step.reply, Decision)
    if case.inherits:
        assert step.reply.plan == on_a.plan and not step.reply.grew
        assert step.reply.action is Action.BUILD and step.state.epoch == on_a.epoch
    else:
        # A new epoch from its own proposals: node A's plan is never built here.
        assert step.reply.plan.capacities == REAL.capacities
        assert step.state.epoch == on_a.epoch + 1 and step.reply.plan.epoch == step.state.epoch
        assert step.reply.plan.generation > on_a.generation
    assert step.state.owner == round_owner(case.first)


def test_a_restart_is_checked_against_the_owner_a_merge_brought() -> None:
    """Node B ran the real ranks; a stranger's squat on node A began a later
    epoch, which reached B: the real ranks' restart on B does not build it."""
    on_b = lifetime(None, "real-ranks-on-b", ["ranks"] * LOCAL).state
    squat = lifetime(None, "stranger-on-a", ["stranger"] * LOCAL, req=HUGE).state
    doc = replace(cluster_plan_of(squat), epoch=on_b.epoch + 1)
    doc = replace(doc, plan=replace(squat.plan, epoch=doc.epoch) if squat.plan else None)
    doc = replace(doc, history=(), generation=max(doc.generation, on_b.generation))
    merged = policy.merge(on_b, doc, 3.0, node="node-b", ceiling=CEILING).state
    assert merged.owner == owner("stranger") and merged.epoch == doc.epoch
    again = lifetime(merged, "real-ranks-again", ["ranks"] * LOCAL)
    assert isinstance(again.reply, Decision)
    assert again.reply.plan.capacities == REAL.capacities
    assert again.state.epoch == doc.epoch + 1 and again.state.owner == owner("ranks")
