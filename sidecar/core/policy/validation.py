"""Every field of a proposal or a commit, checked before it touches any state. Pure."""

from __future__ import annotations

from moe_sidecar.core import limits
from moe_sidecar.core.group import CommitRecord, GroupState, Proposal

__all__ = [
    "validate_commit",
    "validate_group_name",
    "validate_known_proposal",
    "validate_proposal",
]


def validate_group_name(group: str) -> None:
    """Checks a group name.

    Raises:
        InvalidArgument: empty, over-long or non-printable.
    """
    limits.check_name("group", group, allow_empty=False)


def validate_proposal(p: Proposal, ceiling: limits.WorkspaceCeiling) -> None:
    """Checks every field of a proposal before it touches any state, and its
    workspace (in its release's arithmetic) against the per-rank ``ceiling``.

    Raises:
        InvalidArgument: naming the first bad field and its value (or the ceiling).
    """
    validate_group_name(p.group)
    limits.check_count("ep_size", p.ep_size, 1, limits.MAX_EP_SIZE, limits.EP_SIZE_REASON)
    limits.check_count("ep_rank", p.ep_rank, 0, p.ep_size - 1, f"ep_size is {p.ep_size}")
    limits.check_count("local_ranks", p.local_ranks, 1, p.ep_size, f"ep_size is {p.ep_size}")
    limits.check_name("lifetime", p.lifetime, allow_empty=False)
    validate_known_proposal(p, ceiling)


def validate_known_proposal(
    p: Proposal, ceiling: limits.WorkspaceCeiling, *, proof_known: bool = False
) -> None:
    """Checks what a proposal of a lifetime the group knows can change: its
    round and its requirement (and its proof unless ``proof_known``), with
    the workspace against the per-rank ``ceiling``.

    The caller has found the group's record of this rank with this lifetime,
    its ``ep_size`` and its ``local_ranks`` equal to the proposal's: those
    fields (and the group name) are the values :func:`validate_proposal`
    checked at the lifetime's first proposal, so they are not checked again.

    Raises:
        InvalidArgument: naming the first bad field and its value (or the ceiling).
    """
    limits.check_count("round", p.round, 1, limits.MAX_ROUND, "rounds count from 1")
    limits.check_capacities("requirement.capacities", p.requirement.capacities, p.ep_size)
    limits.check_name("requirement.layer", p.requirement.layer, allow_empty=True)
    if not proof_known:
        limits.check_name("group_proof", p.proof, allow_empty=True)
        limits.check_name("owner_digest", p.owner, allow_empty=True)
    limits.check_name("release", p.release, allow_empty=True)
    limits.check_workspace_ceiling(
        "requirement.capacities", p.requirement.capacities, p.ep_size, ceiling, p.release
    )


def validate_commit(state: GroupState, c: CommitRecord, ceiling: limits.WorkspaceCeiling) -> None:
    """Checks every field of a commit to ``state`` before it touches it, and
    its plan's workspace against the per-rank ``ceiling``.

    Raises:
        InvalidArgument: naming the first bad field and its value (or the ceiling).
    """
    limits.check_count("ep_rank", c.ep_rank, 0, state.ep_size - 1, f"ep_size is {state.ep_size}")
    limits.check_name("lifetime", c.lifetime, allow_empty=False)
    limits.check_count("round", c.round, 1, limits.MAX_ROUND, "rounds count from 1")
    limits.check_plan("plan", c.plan, state.ep_size)
    limits.check_seconds("build_seconds", c.build_seconds)
    limits.check_name("group_proof", c.proof, allow_empty=True)
    limits.check_workspace_ceiling(
        "plan.capacities", c.plan.capacities, state.ep_size, ceiling, state.release
    )
