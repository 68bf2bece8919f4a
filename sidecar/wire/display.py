"""How groups and plans read for people: ``moe-sidecar groups`` and ``simulate``.

Pure formatting of domain values (no grpc, no torch), so the command line
and the client's demo share it without importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from moe_sidecar import flashinfer
from moe_sidecar.core.capacity_fields import CAPACITY_FIELDS
from moe_sidecar.core.cluster import plan_origin
from moe_sidecar.core.group import GroupSummary, Growth
from moe_sidecar.core.membership import View
from moe_sidecar.core.plan import Capacities, Plan

__all__ = [
    "capacities_text",
    "format_bytes",
    "format_groups",
    "format_time",
    "groups_as_json",
    "plan_as_json",
]


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units: ``512 B``, ``1.5 KiB``, ``29.3 MiB``, ``2.0 GiB``."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024.0
        if value < 1024.0 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def format_time(seconds: float) -> str:
    """A UTC timestamp, or ``-`` for 0 (never)."""
    if not seconds:
        return "-"
    moment = datetime.fromtimestamp(seconds, tz=UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%SZ")


def capacities_text(c: Capacities) -> str:
    """``max_tokens=..., dispatch=... B/token, combine=... B/token, top_k=..., num_experts=...``:
    every field of the capacity table (one shown only while set is left out at 0)."""
    return ", ".join(
        f"{field.label or field.name}={value}{field.unit}"
        for field in CAPACITY_FIELDS
        if (value := getattr(c, field.name)) or field.shown_when_zero
    )


def _plan_line(plan: Plan, ep_size: int, release: str) -> str:
    workspace = flashinfer.workspace_size(release, plan.capacities, ep_size)
    return (
        f"{format_bytes(workspace)} per rank ({workspace} B), "
        f"{capacities_text(plan.capacities)}; epoch {plan.epoch}, generation {plan.generation}"
    )


def _node_text(node: str) -> str:
    return f"node {node}" if node else "an unrecorded node"


def _origin_text(g: Growth) -> str:
    """Where and when a plan was made: ``node NAME at TIME``."""
    return f"{_node_text(g.node)} at {format_time(g.at)}"


def _growth_line(g: Growth, ep_size: int, release: str) -> str:
    workspace = flashinfer.workspace_size(release, g.plan.capacities, ep_size)
    cause = (
        f"{g.layer}"
        if g.layer.startswith("(")
        else f"caused by layer {g.layer or '(unnamed)'!r} on rank {g.ep_rank} in round {g.round}"
    )
    return (
        f"generation {g.plan.generation}: {format_bytes(workspace)} ({workspace} B), "
        f"max_tokens={g.plan.capacities.max_tokens}, {cause}, on {_origin_text(g)}"
    )


def format_groups(groups: Sequence[GroupSummary]) -> str:
    """A human-readable report of every group (the ``groups`` command's text).

    In the ranks table, ``current`` says whether the rank belongs to the
    group's current lifetime (``no``: a rank of an earlier lifetime, i.e. a
    process that has since restarted; ``left``: a rank of the current
    lifetime whose session ended, with why on the next line).
    """
    if not groups:
        return "no groups\n"
    lines: list[str] = []
    for g in groups:
        lines.append(f"group {g.name}")
        lines.append(
            f"  ep_size={g.ep_size} local_ranks={g.local_ranks} lifetimes={g.lifetimes} "
            f"last_closed_round={g.last_closed_round} "
            f"flashinfer={flashinfer.release_named(g.release).name}"
            + (f" open_round={g.open_round} ({g.waiting_ranks} waiting)" if g.open_round else "")
        )
        if g.arrived_ranks:
            lines.append(
                f"  arrived at the first round, sharing the group's proof: ranks "
                f"{list(g.arrived_ranks)} (waiting for the other ranks of the EP group)"
            )
        if g.awaited_ranks:
            lines.append(
                f"  not back since the sidecar's start: ranks {list(g.awaited_ranks)} (declared "
                "lost once --reconnect-window passes)"
            )
        if g.refused_proposals:
            lines.append(
                f"  refused proposals: {g.refused_proposals} (their group proof did not match "
                "the group's ranks')"
            )
        lines.append(
            "  plan: "
            + (_plan_line(g.plan, g.ep_size, g.release) if g.plan is not None else "(none stored)")
        )
        origin = plan_origin(g.history, g.plan)
        if origin is not None:
            lines.append(f"  plan from: {_origin_text(origin)}")
        if g.view is not None:
            lines.append(f"  {_view_line(g.view)}")
        lines.append(
            "  ranks (current: yes, the rank belongs to the group's current lifetime; no, to an "
            "earlier one; left, its session ended):"
        )
        lines.append(
            "    rank  current  last round  last layer            committed gen  build s  lifetime"
        )
        for r in g.ranks:
            current = "left" if r.left and r.current else ("yes" if r.current else "no")
            lines.append(
                f"    {r.ep_rank:>4}  {current:<7}  {r.last_round:>10}  "
                f"{(r.last_layer or '-'):<20}  {r.committed_generation:>13}  "
                f"{r.build_seconds:>7.3f}  {r.lifetime}"
            )
            if r.left and r.current:
                lines.append(f"          gone: {r.left}")
        lines.append("  growth history:")
        if not g.history:
            lines.append("    (none)")
        for h in g.history:
            lines.append("    " + _growth_line(h, g.ep_size, g.release))
        lines.append("")
    return "\n".join(lines)


def plan_as_json(plan: Plan, ep_size: int, release: str) -> dict[str, Any]:
    """A plan as plain JSON values, with its workspace bytes derived in
    FlashInfer ``release``'s arithmetic (empty: the default release)."""
    workspace = flashinfer.workspace_size(release, plan.capacities, ep_size)
    c = plan.capacities
    return {
        "workspace_bytes": workspace,
        "workspace": format_bytes(workspace),
        "capacities": {field.name: getattr(c, field.name) for field in CAPACITY_FIELDS},
        "epoch": plan.epoch,
        "generation": plan.generation,
    }


def _plan_with_origin(g: GroupSummary) -> dict[str, Any] | None:
    if g.plan is None:
        return None
    document = plan_as_json(g.plan, g.ep_size, g.release)
    origin = plan_origin(g.history, g.plan)
    document["origin"] = (
        None if origin is None else {"node": origin.node, "time": format_time(origin.at)}
    )
    return document


def groups_as_json(groups: Sequence[GroupSummary]) -> list[dict[str, Any]]:
    """Every group as plain JSON values (integers stay integers); a plan's
    ``origin`` names the node that made it and when (None: not in the history)."""
    return [
        {
            "name": g.name,
            "ep_size": g.ep_size,
            "local_ranks": g.local_ranks,
            "flashinfer_release": flashinfer.release_named(g.release).name,
            "epoch": g.epoch,
            "plan": _plan_with_origin(g),
            "generation": g.plan.generation if g.plan is not None else None,
            "lifetimes": g.lifetimes,
            "last_closed_round": g.last_closed_round,
            "open_round": g.open_round,
            "waiting_ranks": g.waiting_ranks,
            "arrived_ranks": list(g.arrived_ranks),
            "awaited_ranks": list(g.awaited_ranks),
            "refused_proposals": g.refused_proposals,
            "view": _view_json(g.view),
            "ranks": [
                {
                    "ep_rank": r.ep_rank,
                    "lifetime": r.lifetime,
                    "current": r.current,
                    "left": r.left,
                    "last_round": r.last_round,
                    "last_layer": r.last_layer,
                    "committed_generation": r.committed_generation,
                    "last_build_seconds": r.build_seconds,
                    "last_seen": format_time(r.last_seen),
                }
                for r in g.ranks
            ],
            "history": [
                {
                    **plan_as_json(h.plan, g.ep_size, g.release),
                    "layer": h.layer,
                    "ep_rank": h.ep_rank,
                    "round": h.round,
                    "time": format_time(h.at),
                    "node": h.node,
                }
                for h in g.history
            ],
        }
        for g in groups
    ]


def _view_line(view: View) -> str:
    """The membership view as one line of ``groups`` (as the log's, a view
    every member left reads ``ended``: the ranks' normal exit ends it too)."""
    if not view.members:
        return f"view {view.number} ended at generation {view.generation} ({view.cause})"
    due = f", due {format_time(view.deadline)}" if view.deadline is not None else ""
    acked = f", acknowledged by {', '.join(str(a.ep_rank) for a in view.acks)}" if view.acks else ""
    return (
        f"view {view.number} {view.state.value}: {view.members_text()} at generation "
        f"{view.generation}{due}{acked} ({view.cause})"
    )


def _view_json(view: View | None) -> dict[str, Any] | None:
    if view is None:
        return None
    return {
        "number": view.number,
        "members": list(view.members),
        "generation": view.generation,
        "state": view.state.value,
        "deadline": format_time(view.deadline) if view.deadline is not None else None,
        "cause": view.cause,
        "acknowledged": [a.ep_rank for a in view.acks],
        "joined": list(view.joined),
    }
