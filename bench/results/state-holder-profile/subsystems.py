"""The state holder's parts, per proposal, in two profile_holder.py pstats: calls and
cumulative microseconds (under cProfile) of each part the per-proposal path runs.

Usage: python subsystems.py BEFORE.pstats AFTER.pstats [PROPOSALS]
Prints a Markdown table.
"""

from __future__ import annotations

import pstats
import re
import sys

PROPOSALS = int(sys.argv[3]) if len(sys.argv) > 3 else 8080


def cum(file: str, pat: str, caller: str | None = None) -> tuple[float, float]:
    """Calls and cumulative us per proposal of the functions ``pat`` matches (only
    their calls from ``caller`` when given)."""
    stats = pstats.Stats(file).stats  # type: ignore[attr-defined]
    total, calls = 0.0, 0
    for (path, _line, name), (_cc, ncalls, _tt, cumtime, callers) in stats.items():
        if not re.search(pat, f"{path}:{name}"):
            continue
        if caller is None:
            calls, total = calls + ncalls, total + cumtime
            continue
        for (cpath, _cline, cname), edge in callers.items():
            if re.search(caller, f"{cpath}:{cname}"):
                calls, total = calls + edge[1], total + edge[3]
    return calls / PROPOSALS, total / PROPOSALS * 1e6


ROWS = [
    ("Coordinator.propose (all of it)", r"/state.py:propose$", None),
    (
        "  replace(proposal, release=default) in it",
        r"dataclasses.py:replace$",
        r"/state.py:propose$",
    ),
    ("  policy.propose (the core)", r"policy/propose.py:propose$", None),
    ("    validate_known_proposal", r"validation.py:validate_known_proposal$", None),
    ("      check_workspace_ceiling", r"limits.py:check_workspace_ceiling$", None),
    ("    _add_proposal", r"policy/propose.py:_add_proposal$", None),
    ("      replace(state, ...) in it", r"dataclasses.py:replace$", r"_add_proposal$"),
    ("      decide_round", r"rounds.py:decide_round$", None),
    ("      next_deadline", r"group.py:next_deadline$", None),
    ("    why_cannot_join", r"rounds.py:why_cannot_join$", None),
    ("      _release_conflict", r"rounds.py:_release_conflict$", None),
    (
        "  effects (state._execute before, StepExecutor.execute now)",
        r"(state.py:_execute|step_executor.py:execute)$",
        None,
    ),
    ("    persist (Persist / RecordReuse)", r"(state.py|step_executor.py):_persist$", None),
    ("      StateStore.record_reuse (SQLite commit)", r"sqlite.py:record_reuse$", None),
    ("    observer.update_gauges", r"observer.py:update_gauges$", None),
]


def main() -> int:
    print("| part | calls/proposal before | after | cum us/proposal before | after | delta |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, pat, caller in ROWS:
        b = cum(sys.argv[1], pat, caller)
        a = cum(sys.argv[2], pat, caller)
        print(
            f"| {label} | {b[0]:.2f} | {a[0]:.2f} | {b[1]:.1f} | {a[1]:.1f} | {a[1] - b[1]:+.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
