"""Ablations of bench_sidecar.coordinator_rounds at 8 ranks on this tree, interleaved,
to put unprofiled microseconds on the parts the profiles point at. Not a fix: each
variant switches one part off (which changes behaviour) only to weigh it.

Usage: python ablate_holder.py [RUNS] [ROUNDS]
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import tempfile
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from bench import bench_sidecar as bench
from moe_sidecar import flashinfer
from moe_sidecar.core.group import GroupState, Proposal
from moe_sidecar.logs import configure_logging
from moe_sidecar.store.sqlite import StateStore

_record_reuse = StateStore.record_reuse
_next_deadline = GroupState.next_deadline


def _baseline() -> None:
    setattr(GroupState, "next_deadline", _next_deadline)  # noqa: B010
    StateStore.record_reuse = _record_reuse  # type: ignore[method-assign]
    setattr(bench, "Proposal", Proposal)  # noqa: B010 - the bench module's own name


def _no_reuse_record() -> None:
    StateStore.record_reuse = lambda self, record: None  # type: ignore[method-assign]


def _release_stated() -> None:
    """The proposals state the default release, so Coordinator.propose need not
    replace() them to spell it (what a current client sends)."""
    _baseline()
    stated = functools.partial(Proposal, release=flashinfer.DEFAULT_RELEASE.name)
    setattr(bench, "Proposal", stated)  # noqa: B010 - the bench module's own name


def _old_next_deadline(self: GroupState) -> float | None:
    """GroupState.next_deadline as it was before the fix: it built the first view."""
    deadlines = [r.deadline for r in (self.open_round, self.pending) if r is not None]
    view = self.current_view()
    if view is not None and view.deadline is not None:
        deadlines.append(view.deadline)
    return min(deadlines) if deadlines else None


def _next_deadline_unfixed() -> None:
    _baseline()
    setattr(GroupState, "next_deadline", _old_next_deadline)  # noqa: B010


VARIANTS = {
    "today": _baseline,
    "without the REUSE record write": _no_reuse_record,
    "release stated by the proposal": _release_stated,
    "next_deadline as before its fix": _next_deadline_unfixed,
}


def main() -> int:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    devnull = open(os.devnull, "w")  # noqa: SIM115
    configure_logging("json", "INFO", devnull)
    results: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(runs):
            for name, switch in VARIANTS.items():
                switch()
                workdir = Path(tmp) / f"{run}-{len(results[name])}-{hash(name)}"
                series = asyncio.run(bench.coordinator_rounds(workdir, 8, rounds, 10))
                results[name].append(series.wall / series.proposals * 1e6)
    _baseline()
    for name, values in results.items():
        runs_us = " ".join(f"{v:.0f}" for v in values)
        print(f"{name:<36} median {median(values):6.1f} us/proposal  (runs: {runs_us})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
