"""A rank's death in a simulation and what its survivors did: the records, and the reading of them.

The parent kills a rank on request (``--kill-rank R --at-round N``) or sees
one die; each survivor tells what its step raised (:class:`StepFailed`) and
what the library did (:class:`SurvivorReport`), and its stderr holds the line
the library printed. :func:`read_death` turns these, with the exits the
parent saw, into one :class:`DeathReport`: the dead rank named as the cause
and, per survivor, its action and how long after the death it came.

Pure: no torch, no processes, no clock (times are arguments).
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "AtKillPoint",
    "DeathReport",
    "MaskedStep",
    "RankExit",
    "StepFailed",
    "SurvivorOutcome",
    "SurvivorReport",
    "describe_exit",
    "library_line",
    "read_death",
    "signal_name",
]

_LINE_START = "moe-sidecar: EP group "


@dataclass(frozen=True)
class AtKillPoint:
    """The rank to be killed reached the point of its kill and waits for it."""

    ep_rank: int
    round: int
    where: str
    """``between its dispatch and its combine`` or ``between two steps``."""


@dataclass(frozen=True)
class StepFailed:
    """A survivor's step raised while a peer died (sent before the library acts)."""

    ep_rank: int
    error: str
    """``Type: first line of the message``."""
    at: float


@dataclass(frozen=True)
class MaskedStep:
    """One step a survivor ran under the committed view, checked exactly."""

    step: int
    max_error: float
    """Largest difference from the routing's result without the dead rank's experts."""
    dropped: int
    """Token copies routed to a masked rank's experts: dropped, not re-routed."""
    copies: int
    """Token copies of the step (tokens times top_k)."""


@dataclass(frozen=True)
class SurvivorReport:
    """What a survivor's library did about the death, as the survivor saw it."""

    ep_rank: int
    watched: bool
    """A watcher ran (sidecar mode and a policy other than ``wait``)."""
    heard: str
    """The library's word: ``RankLost: ...`` (raise) or ``peer_fault()`` (mask); "" none."""
    heard_at: float
    view_number: int = 0
    view_members: tuple[int, ...] = ()
    view_mask: int = 0
    view_at: float = 0.0
    view_error: str = ""
    """What ``adopt_view()`` raised ("" none)."""
    steps: tuple[MaskedStep, ...] = ()


@dataclass(frozen=True)
class RankExit:
    """How and when (as the parent saw it) a rank process ended."""

    ep_rank: int
    exitcode: int | None
    """The process's status, minus the signal that killed it (None: unknown)."""
    at: float
    stopped: bool = False
    """The parent stopped it (it was still running when the run ended)."""


@dataclass(frozen=True)
class SurvivorOutcome:
    """One survivor of a death: what it did, and whether that is what its policy says."""

    ep_rank: int
    node: str
    """Its node's name (``--nodes``), else ""."""
    exit: str
    """``ended (status 75)``, ``stopped by simulate``..."""
    action: str
    """What it did, in words."""
    detail: str
    """What the library raised (``RankLost: ...``), "" none."""
    after: float | None
    """Seconds from the death to that action (None: it took none)."""
    line: str
    """The line the library printed on its stderr ("" none)."""
    step_error: str
    step_error_after: float | None
    acted: bool
    """It did what its policy says, within the wait."""
    view_number: int = 0
    view_members: tuple[int, ...] = ()
    view_mask: int = 0
    view_after: float | None = None
    steps: tuple[MaskedStep, ...] = ()


@dataclass(frozen=True)
class DeathReport:
    """The rank that died, and its survivors."""

    ep_rank: int
    node: str
    how: str
    """``killed by signal 9`` or ``status 3``."""
    signal: str
    """``SIGKILL`` for a death by signal 9 ("" for an exit status)."""
    requested: bool
    round: int
    """The round it died in (asked for), else the rounds rank 0 had finished."""
    where: str
    policy: str
    loss_wait: float
    survivors: tuple[SurvivorOutcome, ...]

    @property
    def every_survivor_acted(self) -> bool:
        """Each survivor did what its policy says (vacuously true with none)."""
        return all(s.acted for s in self.survivors)


def describe_exit(exitcode: int | None) -> str:
    """``killed by signal 9``, ``status 75``, or ``status unknown``."""
    if exitcode is None:
        return "status unknown"
    if exitcode < 0:
        return f"killed by signal {-exitcode}"
    return f"status {exitcode}"


def signal_name(exitcode: int | None) -> str:
    """``SIGKILL`` for an exit by signal 9; "" otherwise."""
    if exitcode is None or exitcode >= 0:
        return ""
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return ""


def library_line(stderr: str, dead: int) -> str:
    """The line the library's watcher printed about rank ``dead``'s death ("" none)."""
    for line in stderr.splitlines():
        start = line.find(_LINE_START)
        if start >= 0 and f": rank {dead} died (" in line:
            return line[start:].strip()
    return ""


@dataclass(frozen=True)
class _Seen:
    """What the parent gathered of one run, for :func:`read_death`."""

    exits: Mapping[int, RankExit]
    step_failures: Mapping[int, StepFailed]
    reports: Mapping[int, SurvivorReport]
    raised: Mapping[int, tuple[str, float]]
    """Per rank, the failure it reported (``Type: message``, when)."""
    finished: frozenset[int]
    stderr: Mapping[int, str]
    exit_status: int
    """The status the ``exit`` policy ends a survivor with."""


def _the_dead(seen: _Seen, kill: tuple[int, float] | None) -> tuple[int, float] | None:
    """The rank that died first, and when: the one killed, else the first to end
    by a signal or without a word (a status 75 is a survivor's policy, not a cause)."""
    if kill is not None:
        return kill
    unexplained = [
        e
        for e in seen.exits.values()
        if not e.stopped
        and e.ep_rank not in seen.finished
        and e.ep_rank not in seen.raised
        and e.exitcode != seen.exit_status
    ]
    if not unexplained:
        return None
    first = min(unexplained, key=lambda e: e.at)
    return first.ep_rank, first.at


def _after(at: float, death_at: float) -> float | None:
    return max(0.0, at - death_at) if at else None


def _mask_outcome(report: SurvivorReport) -> tuple[str, bool]:
    """What a survivor did after it heard (``mask``), and whether it went on exactly."""
    if report.view_error:
        return f"adopt_view() raised {report.view_error}", False
    exact = bool(report.steps) and all(step.max_error == 0.0 for step in report.steps)
    return (
        f"adopted view {report.view_number}, then ran {len(report.steps)} steps under its "
        f"mask: {'exact' if exact else 'NOT exact'}",
        exact,
    )


def _ended(exit_: RankExit | None) -> str:
    if exit_ is None or exit_.stopped:
        return "stopped by simulate"
    return f"ended ({describe_exit(exit_.exitcode)})"


def _survivor(
    rank: int, node: str, policy: str, seen: _Seen, dead: tuple[int, float], loss_wait: float
) -> SurvivorOutcome:
    """One survivor's outcome under ``policy``."""
    dead_rank, death_at = dead
    exit_ = seen.exits.get(rank)
    report = seen.reports.get(rank)
    step = seen.step_failures.get(rank)
    raised, raised_at = seen.raised.get(rank, ("", 0.0))
    if report is not None and report.heard.startswith("RankLost"):
        raised, raised_at = report.heard, report.heard_at
    detail, after, acted = "", None, False
    if exit_ is not None and exit_.exitcode == seen.exit_status:
        action, after = f"exited with status {seen.exit_status}", _after(exit_.at, death_at)
        acted = policy == "exit"
    elif raised.startswith("RankLost"):
        action = "raised RankLost at its next call into the manager"
        detail, after, acted = raised, _after(raised_at, death_at), policy == "raise"
    elif report is not None and report.heard and policy == "mask":
        action, after = "heard of it (peer_fault())", _after(report.heard_at, death_at)
        detail, acted = _mask_outcome(report)
    elif report is not None and report.heard:
        action, detail, after = "heard of it", report.heard, _after(report.heard_at, death_at)
    elif report is not None and not report.watched:
        # No watcher to hear it: the failed step is all there is.
        if policy == "wait":
            action, acted = "no watcher runs (wait): it learned of the death from its step", True
        else:
            action = (
                "no watcher runs in embedded mode (no sidecar to hear from): it learned of the "
                "death only from its step"
            )
    elif raised:
        action, detail = "failed", raised
    else:
        action = f"did not hear of the death within {loss_wait:g} s (--loss-wait)"
    return SurvivorOutcome(
        ep_rank=rank,
        node=node,
        exit=_ended(exit_),
        action=action,
        detail=detail,
        after=after,
        line=library_line(seen.stderr.get(rank, ""), dead_rank),
        step_error=step.error if step is not None else "",
        step_error_after=_after(step.at, death_at) if step is not None else None,
        acted=acted,
        view_number=report.view_number if report is not None else 0,
        view_members=report.view_members if report is not None else (),
        view_mask=report.view_mask if report is not None else 0,
        view_after=_after(report.view_at, death_at) if report is not None else None,
        steps=report.steps if report is not None else (),
    )


def read_death(
    *,
    ranks: int,
    nodes: Sequence[str],
    policy: str,
    loss_wait: float,
    kill: tuple[int, float] | None,
    kill_round: int,
    where: str,
    rounds_done: int,
    exits: Mapping[int, RankExit],
    step_failures: Mapping[int, StepFailed],
    reports: Mapping[int, SurvivorReport],
    raised: Mapping[int, tuple[str, float]],
    finished: frozenset[int],
    stderr: Mapping[int, str],
    exit_status: int,
) -> DeathReport | None:
    """The run's death, if one: the rank killed (``kill``: rank, when) or the
    first to end unexplained, and every other rank's outcome (None: no rank died).

    ``nodes`` names each rank's node ("" without ``--nodes``); ``raised`` is
    each rank's reported failure; ``finished`` the ranks that sent their report;
    ``exit_status`` the status the ``exit`` policy ends a survivor with (a
    survivor's, never a cause).
    """
    seen = _Seen(exits, step_failures, reports, raised, finished, stderr, exit_status)
    dead = _the_dead(seen, kill)
    if dead is None:
        return None
    rank = dead[0]
    exit_ = exits.get(rank)
    survivors = tuple(
        _survivor(r, nodes[r], policy, seen, dead, loss_wait) for r in range(ranks) if r != rank
    )
    code = exit_.exitcode if exit_ is not None else None
    return DeathReport(
        ep_rank=rank,
        node=nodes[rank],
        how=describe_exit(code),
        signal=signal_name(code),
        requested=kill is not None,
        round=kill_round if kill is not None else rounds_done,
        where=where if kill is not None else "",
        policy=policy,
        loss_wait=loss_wait,
        survivors=survivors,
    )
