"""A death between steps, a committed view, exact masked steps: the ``mask``
peer-loss policy through the manager.

Real processes throughout: a ``python -m moe_sidecar`` process and four rank
processes (``tests.multiprocess.masked_view_rank``: a gloo group, an
``AlltoAllManager`` on the reference backend talking to the sidecar, with
``MOE_SIDECAR_ON_PEER_LOSS=mask``, a watchdog each). All four run exact
steps; rank 3 is killed (SIGKILL) between steps; the survivors see
``peer_fault()``, call ``adopt_view()``, and the sidecar's view 2 commits
with members 0, 1, 2 (GetGroup and ``moe-sidecar groups`` show it). Then
the survivors run 20 more steps through the manager's all-to-all (the caller
passes no mask: the manager does), and every combined row equals the one
computed here from the routing with rank 3's experts' contributions dropped.
A second death (rank 2) under the committed view is heard too: ranks 0 and
1 adopt view 3 and step exactly without ranks 2 and 3.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.multiprocess.harness import REPO, Sidecar
from tests.multiprocess.masked_workers import expected_combine, expected_rows
from tests.multiprocess.test_peer_loss import STARTUP_S, Ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

WORLD = 4
KILLED = 3
SURVIVORS = (0, 1, 2)
BEFORE = 3
"""Steps every rank runs before the kill."""
AFTER = 20
"""Steps the survivors run under the committed view."""
SECOND = 2
"""Killed next, under the committed view."""
LAST = 5
"""Steps the last two run under view 3."""
_COMMITTED = 2  # pb.VIEW_STATE_COMMITTED
_FAILED = 3  # pb.VIEW_STATE_FAILED


class MaskedRanks(Ranks):
    """:class:`Ranks` running ``masked_view_rank`` instead."""

    command = (sys.executable, "-m", "tests.multiprocess.masked_view_rank")


def _check_steps(
    stepped: dict[int, Any], first: int, count: int, masked: set[int], mask: int
) -> float:
    """Every step of every rank equals the routing's prediction; the share
    the mask dropped, summed."""
    dropped = 0.0
    for rank, answer in stepped.items():
        assert [s["seed"] for s in answer["steps"]] == list(range(first, first + count))
        for step in answer["steps"]:
            seed = step["seed"]
            want = expected_combine(rank, seed, WORLD, masked)
            got = torch.tensor(step["combined"])
            assert torch.equal(got, want), (rank, seed, (got - want).abs().max())
            sent = [
                0 if source in masked else expected_rows(source, rank, seed, WORLD).size(0)
                for source in range(WORLD)
            ]
            assert step["received"] == sent, (rank, seed)
            assert step["active_mask"] == mask, (rank, seed)
            dropped += float((expected_combine(rank, seed, WORLD, set()) - want).abs().sum())
    return dropped


def _groups_cli(target: str) -> str:
    result = subprocess.run(
        [str(Path(sys.executable).with_name("moe-sidecar")), "groups", "--target", target],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_survivors_adopt_the_view_and_step_exactly_without_the_dead_rank(
    sidecar: Sidecar, tmp_path: Path
) -> None:
    group = "masked-view:fp4/tp1-ep4/pp0"
    everyone = (1 << WORLD) - 1
    survivors_mask = everyone & ~(1 << KILLED)
    with MaskedRanks(tmp_path / "ranks", sidecar.target, group, policy="mask") as ranks:
        ready = ranks.expect(range(WORLD), "ready", STARTUP_S)
        assert all(not r["fault"] for r in ready.values()), ready
        ranks.send(range(WORLD), f"steps 0 {BEFORE}")
        before = ranks.expect(range(WORLD), "stepped", 60)
        assert _check_steps(before, 0, BEFORE, set(), everyone) == 0.0

        ranks.kill(KILLED)  # between steps: every survivor has quiesced
        ranks.send(SURVIVORS, "fault")
        faults = ranks.expect(SURVIVORS, "fault", 60)
        assert all(f["fault"] for f in faults.values()), faults
        ranks.send(SURVIVORS, "adopt")
        adopted = ranks.expect(SURVIVORS, "adopted", 90)
        for rank, view in adopted.items():
            assert (view["number"], view["members"]) == (2, list(SURVIVORS)), (rank, view)
            assert view["mask"] == view["active_mask"] == survivors_mask, (rank, view)
            assert not view["fault"], (rank, view)  # the adopted view dealt with it

        shown = sidecar.get_group(group).view
        assert (shown.number, list(shown.members), shown.state) == (2, [0, 1, 2], _COMMITTED)
        assert f"rank {KILLED}" in shown.cause, shown
        listed = _groups_cli(sidecar.target)
        assert "view 2 committed: members 0, 1, 2" in listed, listed

        ranks.send(SURVIVORS, f"steps {BEFORE} {AFTER}")
        after = ranks.expect(SURVIVORS, "stepped", 120)
        dropped = _check_steps(after, BEFORE, AFTER, {KILLED}, survivors_mask)
        assert dropped > 0  # the routing does send tokens to rank 3's experts

        # A second death under the committed view: heard too, and the last
        # two go on under view 3.
        ranks.kill(SECOND)
        last = tuple(r for r in SURVIVORS if r != SECOND)
        ranks.send(last, "fault")
        assert all(f["fault"] for f in ranks.expect(last, "fault", 60).values())
        ranks.send(last, "adopt")
        for rank, view in ranks.expect(last, "adopted", 90).items():
            assert (view["number"], view["members"]) == (3, list(last)), (rank, view)
        first = BEFORE + AFTER
        ranks.send(last, f"steps {first} {LAST}")
        stepped = ranks.expect(last, "stepped", 120)
        _check_steps(stepped, first, LAST, {KILLED, SECOND}, 0b0011)

        ranks.send(last, "cleanup")
        ranks.expect(last, "cleaned", 30)
        exits = ranks.exits(last, 30)
        assert {r: code for r, (code, _) in exits.items()} == dict.fromkeys(last, 0)
    print(json.dumps({"dropped_share": dropped}))


def test_a_survivor_that_never_acknowledges_fails_the_view_for_everyone(
    sidecar: Sidecar, tmp_path: Path
) -> None:
    group = "masked-view-failed:fp4/tp1-ep4/pp0"
    with MaskedRanks(tmp_path / "ranks", sidecar.target, group, policy="mask") as ranks:
        ranks.expect(range(WORLD), "ready", STARTUP_S)
        ranks.send(range(WORLD), "steps 0 1")
        ranks.expect(range(WORLD), "stepped", 60)
        ranks.kill(KILLED)
        adopting = (0, 1)  # rank 2 never acknowledges: the view's deadline passes
        # Adopting before the sidecar has proposed view 2 would adopt view 1.
        ranks.send(adopting, "fault")
        assert all(f["fault"] for f in ranks.expect(adopting, "fault", 60).values())
        ranks.send(adopting, "adopt")
        raised = ranks.expect(adopting, "raised", sidecar.round_timeout + 60)
        for rank, failure in raised.items():
            assert failure["type"] == "ViewFailed", (rank, failure)
            assert "PreconditionFailed" in failure["mro"], (rank, failure)
            assert "membership view 2 failed" in failure["message"], (rank, failure)
            assert "ranks 2 did not acknowledge it in time" in failure["message"], (rank, failure)
        shown = sidecar.get_group(group).view
        assert (shown.number, shown.state) == (2, _FAILED), shown
        ranks.send(SURVIVORS, "cleanup")
        ranks.expect(SURVIVORS, "cleaned", 30)
