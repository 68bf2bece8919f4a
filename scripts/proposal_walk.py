"""One proposal's walk through the decision core: the files it enters and the returns on its path.

    python scripts/proposal_walk.py

Each row of :data:`WALKS` is a proposal of the core's table-driven unit tests
(``tests/unit/test_policy.py``: its ``prop``, its requirements, its round
timeout; the default workspace ceiling), applied with
:func:`moe_sidecar.core.policy.propose` to the group the rows before it left,
under :func:`sys.settrace`. Counted inside ``sidecar/core/`` only:

* files: the distinct source files a call enters;
* returns: the return events of the functions on the path (comprehension and
  generator-expression frames are left out: they report a return at every
  item they yield, and are no step of the path).

The headline is the proposal that closes a round and grows the plan (the
longest common path: admitted, joined, decided, persisted); the per-file
counts below it say where its returns are, and the round's own part of them
(``group.py`` and ``policy/``: the steps and the values they call, without
the range checks and the plans' lattice they share with the rest of the
core) is printed apart. The figures depend on the code
only (no clock, no machine), so two runs of one tree print the same.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe_sidecar.core import policy  # noqa: E402
from moe_sidecar.core.effects import Step  # noqa: E402
from moe_sidecar.core.group import GroupState, Proposal  # noqa: E402
from tests.ceiling import CEILING  # noqa: E402
from tests.unit.test_policy import MORE_TOKENS, NVFP4, TIMEOUT, prop  # noqa: E402

CORE = ROOT / "sidecar" / "core"
HEADLINE = "closes round 2, grows the plan"


@dataclass(frozen=True)
class Walk:
    """One proposal's path: the files entered and the returns, per file."""

    files: frozenset[str]
    returns: Counter[str]

    @property
    def total(self) -> int:
        return sum(self.returns.values())


def walk(state: GroupState | None, proposal: Proposal) -> tuple[Walk, Step]:
    """Applies ``proposal`` to ``state`` under a tracer that counts what
    happens inside the core."""
    core = str(CORE)
    files: set[str] = set()
    returns: Counter[str] = Counter()

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        path = frame.f_code.co_filename
        if not path.startswith(core):
            return None
        name = str(Path(path).relative_to(CORE))
        if event == "call":
            files.add(name)
        elif event == "return" and not frame.f_code.co_name.startswith("<"):
            returns[name] += 1
        return tracer

    sys.settrace(tracer)
    try:
        step = policy.propose(state, proposal, 0.0, TIMEOUT, ceiling=CEILING)
    finally:
        sys.settrace(None)
    return Walk(frozenset(files), returns), step


WALKS: tuple[tuple[str, Proposal], ...] = (
    ("opens round 1 of a new group", prop(0, 1, NVFP4)),
    ("closes round 1", prop(1, 1, NVFP4)),
    ("waits in round 2", prop(0, 2, MORE_TOKENS)),
    (HEADLINE, prop(1, 2, MORE_TOKENS)),
    ("waits in round 3", prop(0, 3, MORE_TOKENS)),
    ("closes round 3, reuses", prop(1, 3, MORE_TOKENS)),
)
"""Proposals applied in order, each to the group the one before it left."""


def main() -> int:
    state: GroupState | None = None
    headline: Walk | None = None
    print(f"{'proposal':<32} {'files':>5} {'returns':>7}")
    for label, proposal in WALKS:
        found, step = walk(state, proposal)
        state = step.state
        print(f"{label:<32} {len(found.files):>5} {found.total:>7}")
        if label == HEADLINE:
            headline = found
    assert headline is not None
    print(f"\none proposal ({HEADLINE}): {len(headline.files)} files, {headline.total} returns")
    for name in sorted(headline.files):
        print(f"  {name:<28} {headline.returns[name]:>4}")
    own = [name for name in headline.files if name == "group.py" or name.startswith("policy/")]
    print(
        f"the round's own part (group.py, policy/): {len(own)} files, "
        f"{sum(headline.returns[name] for name in own)} returns"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
