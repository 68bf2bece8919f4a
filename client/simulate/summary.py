"""The summary printed at the end of ``moe-sidecar simulate``, and the list of its presets.

Pure: it reads a :class:`SimulationResult` and returns text.
"""

from __future__ import annotations

from moe_sidecar.client.simulate.death import SurvivorOutcome
from moe_sidecar.client.simulate.presets import MODELS
from moe_sidecar.client.simulate.records import RoundRecord, SimulationResult
from moe_sidecar.flashinfer.v0_7_2_post1 import capacities_workspace_bytes
from moe_sidecar.wire.display import format_bytes, format_time

__all__ = ["format_summary", "list_models"]


def _count(n: int, noun: str) -> str:
    """``1 collective``, ``2 collectives``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _failure_lines(result: SimulationResult) -> list[str]:
    lines = []
    if result.error:
        lines.append(f"FAILED: {result.error}")
    # After one rank fails the others usually fail the same way: say it once.
    seen: set[tuple[str, str]] = set()
    for failure in result.failures:
        if (failure.error_type, failure.message) in seen:
            lines.append(f"FAILED: rank {failure.ep_rank}: the same {failure.error_type}")
            continue
        seen.add((failure.error_type, failure.message))
        lines.append(f"FAILED: rank {failure.ep_rank}: {failure.error_type}: {failure.message}")
        if failure.traceback:
            lines.append(failure.traceback.rstrip())
    return lines


def _workspace_lines(result: SimulationResult) -> list[str]:
    if not result.reports:
        return []
    lines = ["final workspace per rank:"]
    for report in result.reports:
        lines.append(
            f"  rank {report.ep_rank}: {format_bytes(report.workspace_bytes)} "
            f"({report.workspace_bytes} B), max_num_tokens {report.max_num_tokens}, "
            f"generation {report.generation}; {_count(report.rpcs, 'RPC')}, "
            f"{_count(report.collectives, 'collective')}"
        )
    checked = result.reports[0].checked_layers
    if checked:
        lines.append(
            f"dispatch+combine: exact on {len(checked)} checks (after every build, then "
            "every layer shape on the final workspace)"
        )
    return lines


def _growth_lines(result: SimulationResult) -> list[str]:
    lines = ["builds and growths in this run:"]
    grown: list[RoundRecord] = [r for r in result.rounds if r.action != "reuse"]
    for record in grown:
        verb = "built" if record.action == "build" else "grew to"
        lines.append(
            f"  round {record.round} {record.layer} ({record.quant}): {verb} "
            f"{format_bytes(record.workspace_bytes)}, generation {record.generation}"
        )
    if not grown:
        lines.append("  (none)")
    elif result.rebuilds == 0 and result.sidecar_lifetimes > 1:
        lines.append(
            "  warm restart: the sidecar remembered the plan, so round 1 built the union at once"
        )
    elif result.rebuilds == 0 and result.nodes and grown[0].round == 1 and grown[0].generation > 1:
        lines.append(
            "  warm start from etcd: the sidecars started with empty state dirs, and round 1 "
            "built the plan the cluster had"
        )
    return lines


def _node_lines(result: SimulationResult) -> list[str]:
    if not result.nodes:
        return []
    lines = [f"nodes ({len(result.nodes)} sidecars, one etcd):"]
    for view in result.nodes:
        lines.append(
            f"  {view.node}: generation {view.generation} (epoch {view.epoch}), "
            f"{format_bytes(view.workspace_bytes)}, plan from "
            f"{view.origin_node or 'an unrecorded node'} at {format_time(view.origin_time)}"
        )
    lines.append(
        "  the nodes agree on the plan"
        if result.nodes_agree
        else "  the nodes DISAGREE on the plan"
    )
    return lines


def _history_lines(result: SimulationResult) -> list[str]:
    if not result.sidecar_history:
        return []
    lines = [f"sidecar history of {result.group!r} ({result.sidecar_lifetimes} lifetime(s)):"]
    for growth in result.sidecar_history:
        workspace = capacities_workspace_bytes(growth.plan.capacities, result.ranks)
        lines.append(
            f"  generation {growth.plan.generation}: {format_bytes(workspace)}, "
            f"max_tokens {growth.plan.capacities.max_tokens}, caused by layer "
            f"{growth.layer!r} (rank {growth.ep_rank}, round {growth.round}"
            + (f", {growth.node})" if growth.node else ")")
        )
    return lines


def _seconds(value: float | None) -> str:
    return f"{value:.3f} s" if value is not None else "never"


def _survivor_lines(survivor: SurvivorOutcome, dead: int) -> list[str]:
    where = f" ({survivor.node})" if survivor.node else ""
    when = f", {survivor.after:.3f} s after the death" if survivor.after is not None else ""
    # A survivor that acted ended as its policy says; how another ended is news.
    ended = "" if survivor.acted else f"; {survivor.exit}"
    lines = [f"  rank {survivor.ep_rank}{where}: {survivor.action}{when}{ended}"]
    if survivor.detail:
        lines.append(f"    {survivor.detail}")
    if survivor.line:
        lines.append(f"    the library printed: {survivor.line}")
    if survivor.step_error:
        lines.append(
            f"    its combine raised {_seconds(survivor.step_error_after)} after the death: "
            f"{survivor.step_error}"
        )
    if survivor.view_number:
        members = ", ".join(str(m) for m in survivor.view_members)
        lines.append(
            f"    view {survivor.view_number} committed {_seconds(survivor.view_after)} after "
            f"the death: members {members} (mask {survivor.view_mask:#b})"
        )
    for step in survivor.steps:
        verdict = "exact" if step.max_error == 0.0 else f"off by {step.max_error}"
        lines.append(
            f"    step {step.step} under the mask: {verdict}; {step.dropped} of {step.copies} "
            f"token copies (to rank {dead}'s experts) dropped, not re-routed"
        )
    return lines


def _death_lines(result: SimulationResult) -> list[str]:
    death = result.death
    if death is None:
        if result.kill_rank is None:
            return []
        return [
            f"rank {result.kill_rank} was not killed: the run ended before the step of round "
            f"{result.kill_round}"
        ]
    where = f" ({death.node})" if death.node else ""
    if death.requested:
        how = f"{death.how} ({death.signal})" if death.signal else death.how
        what = f"rank {death.ep_rank}{where} {how} in round {death.round}, {death.where}"
    else:
        what = f"rank {death.ep_rank}{where} exited ({death.how}), not asked for"
    lines = [f"death: {what}; MOE_SIDECAR_ON_PEER_LOSS={death.policy} in the survivors"]
    for survivor in death.survivors:
        lines.extend(_survivor_lines(survivor, death.ep_rank))
    if death.every_survivor_acted:
        lines.append(f"every survivor did what MOE_SIDECAR_ON_PEER_LOSS={death.policy} says")
    else:
        missed = ", ".join(str(s.ep_rank) for s in death.survivors if not s.acted)
        lines.append(
            f"NOT every survivor did what MOE_SIDECAR_ON_PEER_LOSS={death.policy} says: "
            f"rank(s) {missed}"
        )
    return lines


def format_summary(result: SimulationResult) -> str:
    """The summary printed at the end of a run.

    A run that failed before every rank was up has nothing to sum up: only
    its failure.
    """
    verdict = "OK" if result.ok and result.nodes_agree else "FAILED"
    if result.startup_seconds is None:
        return "\n".join(["", *_failure_lines(result), verdict]) + "\n"
    reuses = len(result.rounds) - result.builds - result.rebuilds
    rounds = str(len(result.rounds))
    if len(result.rounds) < result.total_rounds:
        rounds += f" of {result.total_rounds}"
    lines = [
        "",
        *_failure_lines(result),
        *_death_lines(result),
        f"rounds: {rounds}   builds: {result.builds}   rebuilds: "
        f"{result.rebuilds}   reuses: {reuses}",
        *_workspace_lines(result),
        *_growth_lines(result),
        *_node_lines(result),
        *_history_lines(result),
        f"wall time: {result.wall_seconds:.1f} s (ranks up after {result.startup_seconds:.1f} s)",
        verdict,
    ]
    return "\n".join(lines) + "\n"


def list_models() -> str:
    """``--list-models``: one line per preset, its name and what it exercises."""
    lines = []
    for preset in MODELS.values():
        lines.append(f"{preset.name}: {preset.summary}")
    return "\n".join(lines) + "\n"
