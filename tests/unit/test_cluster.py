"""Cluster plans and the merge of the core: the lattice that lets nodes share plans.

Pure: no etcd, no clock. The convergence tests play nodes that grow, reset
and exchange documents in random orders through a store that does what the
etcd replica does (compare-and-swap, retried with the join).
"""

from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import replace

import pytest

from moe_sidecar.core import policy
from moe_sidecar.core.cluster import (
    JOINED_LAYER,
    MAX_HISTORY,
    ClusterPlan,
    LayoutMismatch,
    check_cluster_plan,
    cluster_plan_of,
    covers,
    join_cluster_plans,
    join_owners,
    plan_origin,
)
from moe_sidecar.core.effects import EventKind, Persist, Publish, Replicate, Step
from moe_sidecar.core.errors import InvalidArgument, PreconditionFailed
from moe_sidecar.core.group import CommitRecord, Decision, GroupState, Growth, Proposal, Requirement
from moe_sidecar.core.plan import Capacities, Plan, ShapeMismatch
from tests.ceiling import CEILING

pytestmark = pytest.mark.timeout(30)

GROUP = "deepseek-v3:fp4/tp1-ep2/pp0"


def owner(name: str) -> str:
    """An owner id (64 hex digits, as the wire codec makes it) per name; "" stays empty."""
    return hashlib.sha256(name.encode()).hexdigest() if name else ""


OWNER = owner("the group's ranks")
"""The owner every lifetime of these tests carries unless told otherwise."""


def caps(tokens: int = 256, dispatch: int = 100, combine: int = 200, top_k: int = 2) -> Capacities:
    return Capacities(tokens, dispatch, combine, top_k, 16)


def plan(generation: int, epoch: int = 0, **sizes: int) -> Plan:
    return Plan(caps(**sizes), epoch, generation)


def growth(p: Plan, node: str, at: float, layer: str = "l0") -> Growth:
    return Growth(p, layer, 0, 1, at, node)


def doc(
    p: Plan | None,
    *history: Growth,
    epoch: int = 0,
    generation: int | None = None,
    owner: str = "",
) -> ClusterPlan:
    counter = generation if generation is not None else (p.generation if p else 0)
    return ClusterPlan(GROUP, 2, epoch, p, counter, tuple(history), owner)


def grow_on(
    state: GroupState | None,
    node: str,
    req: Requirement,
    now: float,
    lifetime: str,
    owner: str = OWNER,
) -> GroupState:
    """Both local ranks of ``node`` run one round (a fresh lifetime, carrying
    ``owner``) needing ``req``."""
    step: Step | None = None
    for rank in range(2):
        p = Proposal(GROUP, 2, rank, 2, f"{lifetime}-{rank}", 1, req, owner=owner)
        step = policy.propose(state, p, now, 30.0, node=node, ceiling=CEILING)
        state = step.state
    assert step is not None and isinstance(step.reply, Decision)
    return step.state


# --- the join of cluster plans ----------------------------------------------------


def test_the_higher_epoch_wins_whole_and_keeps_the_larger_counter() -> None:
    old = doc(plan(5, tokens=4096), growth(plan(5, tokens=4096), "a", 1.0), generation=9)
    new = doc(None, epoch=1, generation=6)
    joined = join_cluster_plans(old, new, node="b", now=2.0)
    assert joined == replace(new, generation=9)
    assert join_cluster_plans(new, old, node="b", now=2.0) == joined


def test_one_epoch_joins_plans_with_the_plan_join_and_records_who_joined() -> None:
    a = doc(plan(3, tokens=512), growth(plan(3, tokens=512), "node-a", 10.0))
    b = doc(plan(3, dispatch=400), growth(plan(3, dispatch=400), "node-b", 11.0))
    joined = join_cluster_plans(a, b, node="node-b", now=12.0)
    assert joined.plan == Plan(caps(tokens=512, dispatch=400), 0, 4)
    assert joined.generation == 4
    assert [g.node for g in joined.history] == ["node-a", "node-b", "node-b"]
    assert joined.history[-1] == Growth(joined.plan, JOINED_LAYER, 0, 0, 12.0, "node-b")
    assert plan_origin(joined.history, joined.plan) == joined.history[-1]
    # Commutative, idempotent, and above both inputs.
    assert join_cluster_plans(b, a, node="node-b", now=12.0) == joined
    assert join_cluster_plans(joined, joined, node="x", now=99.0) == joined
    assert covers(joined, a) and covers(joined, b)
    assert not covers(a, joined) and not covers(a, b)


def test_a_dominating_plan_is_taken_as_it_is() -> None:
    small = doc(plan(1), growth(plan(1), "a", 1.0))
    big = doc(plan(2, tokens=512), growth(plan(1), "a", 1.0), growth(plan(2, tokens=512), "b", 2.0))
    assert join_cluster_plans(small, big, node="a", now=3.0) == big
    assert covers(big, small)


def test_no_plan_is_the_bottom() -> None:
    empty = doc(None)
    some = doc(plan(1), growth(plan(1), "a", 1.0))
    assert join_cluster_plans(empty, some, node="b", now=2.0) == some
    assert covers(some, empty) and not covers(empty, some)


def test_other_layouts_and_shapes_do_not_join() -> None:
    with pytest.raises(LayoutMismatch, match="ep_size=2"):
        join_cluster_plans(doc(None), replace(doc(None), ep_size=4), node="a", now=0.0)
    with pytest.raises(ShapeMismatch):
        join_cluster_plans(doc(plan(1)), doc(plan(1, top_k=4)), node="a", now=0.0)


def test_histories_unite_and_keep_the_newest() -> None:
    many = tuple(growth(plan(1), "a", float(i)) for i in range(MAX_HISTORY))
    more = tuple(growth(plan(1), "b", float(i) + 0.5) for i in range(10))
    joined = join_cluster_plans(doc(plan(1), *many), doc(plan(1), *more), node="a", now=0.0)
    # The newest MAX_HISTORY of the 266 in time order: the 10 oldest are dropped.
    assert joined.history == tuple(sorted(many + more, key=lambda g: g.at))[10:]
    assert joined.history[0].at == 5.0 and joined.history[-1].at == MAX_HISTORY - 1


# --- the owner in the join ------------------------------------------------------------

LOW, HIGH = sorted((owner("node a's ranks"), owner("a stranger on node b")))


@pytest.mark.parametrize(
    ("a", "b", "wanted"),
    [
        # The higher epoch's owner, whichever id is larger and even when it is none.
        (doc(None, epoch=1, owner=LOW), doc(None, epoch=0, owner=HIGH), LOW),
        (doc(None, epoch=2, owner=""), doc(plan(1, epoch=1), epoch=1, owner=HIGH), ""),
        # One epoch: the larger id; no owner is the bottom; one owner stays.
        (doc(None, owner=LOW), doc(None, owner=HIGH), HIGH),
        (doc(plan(1), owner=HIGH), doc(plan(2, tokens=512), owner=LOW), HIGH),
        (doc(plan(1), owner=""), doc(plan(1), owner=LOW), LOW),
        (doc(None, owner=LOW), doc(None, owner=LOW), LOW),
        (doc(None), doc(None), ""),
    ],
)
def test_the_join_takes_the_higher_epochs_owner_and_in_one_epoch_the_larger_id(
    a: ClusterPlan, b: ClusterPlan, wanted: str
) -> None:
    assert join_cluster_plans(a, b, node="n", now=1.0).owner == wanted
    assert join_cluster_plans(b, a, node="n", now=1.0).owner == wanted


OWNED = [
    doc(None, owner=LOW),
    doc(None, owner=HIGH),
    doc(None),
    doc(plan(1), owner=LOW),
    doc(plan(2, tokens=512), growth(plan(2, tokens=512), "b", 2.0), owner=HIGH),
    doc(plan(3, dispatch=400), owner=""),
    doc(None, epoch=1, generation=3, owner=LOW),
    doc(plan(4, epoch=1), epoch=1, owner=HIGH),
    doc(None, epoch=2, generation=4),
]
"""Cluster plans of three epochs, with both owners, none, plans and none."""


def _join(a: ClusterPlan, b: ClusterPlan) -> ClusterPlan:
    return join_cluster_plans(a, b, node="n", now=9.0)


@pytest.mark.parametrize(("a", "b"), list(itertools.product(OWNED, repeat=2)))
def test_the_owner_join_is_commutative_and_idempotent(a: ClusterPlan, b: ClusterPlan) -> None:
    assert _join(a, b) == _join(b, a)
    assert _join(a, a) == a
    assert join_owners(a.owner, b.owner) == join_owners(b.owner, a.owner)
    joined = _join(a, b)
    # The join covers both inputs, owner included, and covers nothing it does not hold.
    assert covers(joined, a) and covers(joined, b)
    assert covers(a, b) == (_join(a, b) == a)


@pytest.mark.parametrize(("a", "b", "c"), list(itertools.product(OWNED, repeat=3)))
def test_the_owner_join_is_associative(a: ClusterPlan, b: ClusterPlan, c: ClusterPlan) -> None:
    left, right = _join(_join(a, b), c), _join(a, _join(b, c))
    # Not the generations: a join that mints one mints it only in one grouping.
    assert (left.epoch, left.owner) == (right.epoch, right.owner)
    assert (left.plan and left.plan.capacities) == (right.plan and right.plan.capacities)
    assert join_owners(join_owners(a.owner, b.owner), c.owner) == join_owners(
        a.owner, join_owners(b.owner, c.owner)
    )


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (replace(doc(None), name=""), "group"),
        (replace(doc(None), ep_size=65), "ep_size"),
        (replace(doc(None), epoch=-1), "epoch"),
        (doc(plan(3), generation=2), "plan.generation"),
        (doc(plan(1, epoch=1)), "plan.epoch"),
        (doc(plan(1, tokens=0)), "plan.capacities.max_tokens"),
        (doc(plan(1), growth(plan(1), "a\n", 1.0)), "history[0].node"),
        (doc(plan(1), growth(plan(1), "a", float("nan"))), "history[0].at"),
        (doc(plan(1), replace(growth(plan(1), "a", 1.0), ep_rank=2)), "history[0].ep_rank"),
        (doc(plan(1), growth(plan(1, epoch=1), "a", 1.0)), "history[0].plan.epoch"),
        (doc(None, owner="not an id"), "owner"),
        (doc(None, owner=OWNER.upper()), "owner"),
        (doc(None, owner=OWNER[:-1]), "owner"),
    ],
)
def test_a_document_from_another_node_is_range_checked(bad: ClusterPlan, field: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        check_cluster_plan(bad)
    assert field in raised.value.message
    with pytest.raises(InvalidArgument):
        policy.merge(None, bad, 1.0, node="b", ceiling=CEILING)


# --- steps that replicate -----------------------------------------------------------


def test_only_growth_reset_and_absorbing_commits_replicate() -> None:
    nvfp4 = Requirement(caps(), "l0")
    state = None
    for rank in range(2):
        step = policy.propose(
            state,
            Proposal(GROUP, 2, rank, 2, f"x{rank}", 1, nvfp4),
            1.0,
            30.0,
            node="a",
            ceiling=CEILING,
        )
        state = step.state
    assert step.replicates and step.effects.index(Replicate()) == 1  # right after Persist
    assert step.state.history[-1].node == "a"
    for rank in range(2):  # round 2 reuses: nothing new for the cluster
        step = policy.propose(
            state,
            Proposal(GROUP, 2, rank, 2, f"x{rank}", 2, nvfp4),
            2.0,
            30.0,
            node="a",
            ceiling=CEILING,
        )
        state = step.state
    assert isinstance(step.reply, Decision) and not step.replicates
    assert state is not None
    committed = policy.commit(
        state, CommitRecord(0, "x0", 2, step.reply.plan, 0.1), 3.0, ceiling=CEILING
    )
    assert not committed.replicates  # a node-local group: the commit moves no plan
    reset = policy.reset(state, 4.0)
    assert reset.replicates and reset.persists


def test_a_commit_from_across_nodes_absorbs_a_later_epoch() -> None:
    # ep_size 4 with 2 ranks here: the group spans nodes and agrees with the join.
    state = None
    step = None
    for rank in range(2):
        p = Proposal(GROUP, 4, rank, 2, f"x{rank}", 1, Requirement(caps(), "l0"))
        step = policy.propose(state, p, 1.0, 30.0, node="a", ceiling=CEILING)
        state = step.state
    assert step is not None and isinstance(step.reply, Decision) and state is not None
    # Another node had heard of a reset: the agreed plan is of epoch 1.
    agreed = Plan(caps(tokens=512), 1, 7)
    committed = policy.commit(
        state, CommitRecord(0, "x0", 1, agreed, 0.1), 2.0, node="a", ceiling=CEILING
    )
    assert committed.replicates
    assert (committed.state.epoch, committed.state.plan) == (1, agreed)
    assert committed.state.history[-1].plan == agreed
    assert committed.state.generation == 7
    # ... and an agreed plan of an epoch this node has left changes only what is built.
    reset = policy.reset(committed.state, 3.0).state
    stale = policy.commit(reset, CommitRecord(1, "x1", 1, agreed, 0.1), 4.0, ceiling=CEILING)
    assert stale.state.plan is None and stale.state.epoch == 2 and not stale.replicates


# --- merge ------------------------------------------------------------------------


def test_a_plan_grown_on_one_node_is_round_1_of_another() -> None:
    bf16 = Requirement(caps(dispatch=400), "mtp")
    on_a = grow_on(None, "node-a", bf16, 10.0, "a")
    step = policy.merge(None, cluster_plan_of(on_a), 11.0, node="node-b", ceiling=CEILING)
    assert step.persists and not step.replicates  # B holds nothing the cluster lacks
    (event,) = [e.event for e in step.effects if isinstance(e, Publish)]
    assert event.kind is EventKind.PLAN_MERGED and event.node == "node-a"
    assert event.plan == on_a.plan
    on_b = grow_on(step.state, "node-b", Requirement(caps(), "l0"), 12.0, "b")
    assert on_b.plan == on_a.plan and on_a.plan is not None
    last = on_b.closed[-1]
    assert isinstance(last, Decision)
    assert last == Decision(1, last.action, on_a.plan, False, "l0")
    assert on_b.local_ranks == 2 and on_b.lifetime_index == 1


def test_merging_what_is_already_held_does_nothing() -> None:
    state = grow_on(None, "a", Requirement(caps(), "l0"), 1.0, "a")
    step = policy.merge(state, cluster_plan_of(state), 2.0, node="a", ceiling=CEILING)
    assert step.effects == () and step.state == state
    assert policy.merge(None, doc(None), 2.0, node="a", ceiling=CEILING).effects == ()


def test_an_older_document_is_answered_with_a_replicate() -> None:
    state = grow_on(None, "a", Requirement(caps(), "l0"), 1.0, "a")
    step = policy.merge(state, doc(None), 2.0, node="a", ceiling=CEILING)
    assert step.effects == (Replicate(),) and step.state == state


def test_nothing_shrinks_within_an_epoch_and_a_reset_is_not_undone() -> None:
    big = grow_on(None, "a", Requirement(caps(tokens=4096), "l0"), 1.0, "a")
    small = doc(plan(1), growth(plan(1), "b", 0.5))
    kept = policy.merge(big, small, 2.0, node="a", ceiling=CEILING)
    assert kept.state.plan == big.plan and kept.replicates
    # A reset on node B reaches A: epoch 1, no plan; what A's lifetime built stays.
    reset_on_b = doc(None, epoch=1, generation=0)
    step = policy.merge(big, reset_on_b, 3.0, node="a", ceiling=CEILING)
    assert step.state.epoch == 1 and step.state.plan is None and step.state.history == ()
    assert step.state.built == big.built and step.state.generation == big.generation
    assert Persist() in step.effects and step.replicates  # A's counter is higher
    (event,) = [e.event for e in step.effects if isinstance(e, Publish)]
    assert "reset on another node" in event.message
    # A's old epoch-0 document arriving late does not undo it.
    late = policy.merge(step.state, cluster_plan_of(big), 4.0, node="a", ceiling=CEILING)
    assert late.state == step.state and late.replicates and not late.persists


def test_a_merge_keeps_the_joined_owner_and_persists_a_new_one() -> None:
    state = grow_on(None, "a", Requirement(caps(), "l0"), 1.0, "a", owner=LOW)
    assert state.owner == LOW and cluster_plan_of(state).owner == LOW
    # The same plan with a larger owner in one epoch: only the owner changes, and is stored.
    taken = policy.merge(state, replace(cluster_plan_of(state), owner=HIGH), 2.0, ceiling=CEILING)
    assert taken.state.owner == HIGH and taken.persists and not taken.replicates
    # A smaller (or no) owner changes nothing here and gets the join back.
    for smaller in (LOW, ""):
        kept = policy.merge(
            taken.state, replace(cluster_plan_of(state), owner=smaller), 3.0, ceiling=CEILING
        )
        assert kept.state == taken.state and kept.effects == (Replicate(),)
    # A later epoch brings its owner, even none.
    later = doc(None, epoch=1, generation=state.generation)
    reset = policy.merge(taken.state, later, 4.0, ceiling=CEILING)
    assert reset.state.owner == "" and reset.state.epoch == 1


def test_a_merge_that_cannot_join_is_refused_naming_why() -> None:
    state = grow_on(None, "a", Requirement(caps(), "l0"), 1.0, "a")
    with pytest.raises(PreconditionFailed, match="top_k"):
        policy.merge(state, doc(plan(1, top_k=4)), 2.0, node="a", ceiling=CEILING)
    with pytest.raises(PreconditionFailed, match="ep_size"):
        policy.merge(state, replace(doc(None), ep_size=4), 2.0, node="a", ceiling=CEILING)


def test_an_open_round_decides_from_the_merged_plan() -> None:
    state = None
    p0 = Proposal(GROUP, 2, 0, 2, "x0", 1, Requirement(caps(), "l0"), owner=OWNER)
    state = policy.propose(state, p0, 1.0, 30.0, node="b", ceiling=CEILING).state
    assert state.open_round is not None
    merged = policy.merge(
        state,
        doc(plan(4, tokens=2048), growth(plan(4, tokens=2048), "a", 1.5), owner=OWNER),
        2.0,
        ceiling=CEILING,
    )
    assert merged.state.open_round == state.open_round
    p1 = replace(p0, ep_rank=1, lifetime="x1")
    closing = policy.propose(merged.state, p1, 3.0, 30.0, node="b", ceiling=CEILING)
    assert isinstance(closing.reply, Decision) and closing.reply.plan == plan(4, tokens=2048)
    assert not closing.reply.grew


# --- convergence ----------------------------------------------------------------------


class _Store:
    """A key's value and revision, with the replica's compare-and-swap loop."""

    def __init__(self) -> None:
        self.value: ClusterPlan | None = None
        self.revision = 0

    def push(self, state: GroupState, node: str, now: float) -> GroupState:
        mine = cluster_plan_of(state)
        seen = (self.value, self.revision)
        while True:
            remote, revision = seen
            value = mine if remote is None else join_cluster_plans(mine, remote, node=node, now=now)
            if revision == self.revision:  # the compare-and-swap
                self.value, self.revision = value, self.revision + 1
                return policy.merge(state, value, now, node=node, ceiling=CEILING).state
            seen = (self.value, self.revision)


@pytest.mark.parametrize("seed", range(20))
def test_nodes_growing_and_resetting_in_any_order_converge(seed: int) -> None:
    rng = random.Random(seed)
    nodes = {name: None for name in ("a", "b", "c")}
    states: dict[str, GroupState | None] = dict(nodes)
    store = _Store()
    unseen: dict[str, list[ClusterPlan]] = {n: [] for n in nodes}
    lifetimes = 0
    now = 0.0
    for _ in range(40):
        now += 1.0
        node = rng.choice(sorted(nodes))
        action = rng.random()
        state = states[node]
        if action < 0.4:
            lifetimes += 1
            need = caps(tokens=rng.choice((64, 128, 256)), dispatch=rng.choice((100, 300, 400)))
            state = grow_on(state, node, Requirement(need, "l"), now, f"life{lifetimes}")
        elif action < 0.45 and state is not None:
            state = policy.reset(state, now).state
        elif action < 0.8 and state is not None:
            state = store.push(state, node, now)
            assert store.value is not None
            for other in nodes:
                unseen[other].append(store.value)
        elif unseen[node]:
            # A watch delivers an older or the latest document.
            remote = unseen[node].pop(rng.randrange(len(unseen[node])))
            state = policy.merge(state, remote, now, node=node, ceiling=CEILING).state
        states[node] = state
    # Quiesce: every node pushes, then every node hears the store's last document.
    for node in sorted(nodes):
        held = states[node]
        if held is not None:
            states[node] = store.push(held, node, now + 1)
    assert store.value is not None
    for node in sorted(nodes):
        states[node] = policy.merge(
            states[node], store.value, now + 2, node=node, ceiling=CEILING
        ).state
    plans = {(s.epoch, s.plan) for s in states.values() if s is not None}
    assert plans == {(store.value.epoch, store.value.plan)}, plans
    for s in states.values():
        assert s is not None and covers(store.value, cluster_plan_of(s))


def test_a_join_out_of_range_is_not_merged() -> None:
    # Each in range; one node's tokens with the other's bytes per token are not.
    many_tokens = Plan(Capacities(1 << 27, 1, 1, 2, 16), 0, 1)
    wide = Plan(Capacities(1, 1 << 22, 1, 2, 16), 0, 1)
    state = policy.merge(
        None, doc(many_tokens, growth(many_tokens, "a", 1.0)), 2.0, ceiling=CEILING
    ).state
    with pytest.raises(PreconditionFailed, match="out of range"):
        policy.merge(state, doc(wide, growth(wide, "b", 1.5)), 3.0, node="a", ceiling=CEILING)
