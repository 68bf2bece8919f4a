"""A replacement rank rejoins through the manager (``MOE_SIDECAR_ON_PEER_LOSS=mask``).

Real processes throughout: a ``python -m moe_sidecar`` process and four rank
processes (``tests.multiprocess.masked_view_rank``). All four step exactly;
rank 3 is SIGKILLed; the survivors adopt view 2 and step masked. Then a
replacement process for rank 3 starts on a fresh rendezvous file, the
survivors re-form their gloo group with it there and call ``rejoin()``
while it calls ``join_as_replacement()``: every rank rebuilds at the join's
generation and view 3 (members 0-3) commits (GetGroup shows it). All four
then step with every rank's experts (exact), and initialize one more layer
that grows the plan: its round meets all four (the replacement numbers its
rounds after the survivors'), they rebuild at the next generation and step
exactly again. A replacement whose layer the stored plan does not serve is
refused, and every survivor raises the refusal instead of waiting.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiprocess.harness import Sidecar
from tests.multiprocess.masked_workers import TOKENS
from tests.multiprocess.test_masked_view import KILLED, SURVIVORS, WORLD, MaskedRanks, _check_steps
from tests.multiprocess.test_peer_loss import STARTUP_S

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

_COMMITTED = 2  # pb.VIEW_STATE_COMMITTED
EVERYONE = (1 << WORLD) - 1


class RejoiningRanks(MaskedRanks):
    """:class:`MaskedRanks` that can start a replacement for a dead rank."""

    def __enter__(self) -> RejoiningRanks:
        return self

    def replace(self, rank: int, group: str, init_method: str, tokens: int = TOKENS) -> None:
        """Starts the replacement for ``rank`` (dead) on ``init_method``,
        joining with a layer of ``tokens`` tokens per rank."""
        self.start(rank, ["unused", group, init_method, str(tokens)])


def test_a_replacement_rejoins_and_every_rank_steps_exactly(
    sidecar: Sidecar, tmp_path: Path
) -> None:
    group = "masked-rejoin:fp4/tp1-ep4/pp0"
    survivors_mask = EVERYONE & ~(1 << KILLED)
    with RejoiningRanks(tmp_path / "ranks", sidecar.target, group, policy="mask") as ranks:
        ready = ranks.expect(range(WORLD), "ready", STARTUP_S)
        ranks.send(range(WORLD), "steps 0 2")
        _check_steps(ranks.expect(range(WORLD), "stepped", 60), 0, 2, set(), EVERYONE)

        ranks.kill(KILLED)
        ranks.send(SURVIVORS, "fault")
        ranks.expect(SURVIVORS, "fault", 60)
        ranks.send(SURVIVORS, "adopt")
        for view in ranks.expect(SURVIVORS, "adopted", 90).values():
            assert view["number"] == 2 and view["members"] == list(SURVIVORS), view
        ranks.send(SURVIVORS, "steps 2 3")
        _check_steps(ranks.expect(SURVIVORS, "stepped", 60), 2, 3, {KILLED}, survivors_mask)

        rejoin = f"file://{tmp_path / 'rejoin-rendezvous'}"
        ranks.replace(KILLED, group, rejoin)
        ranks.send(SURVIVORS, f"rejoin {rejoin}")
        joined = ranks.expect(range(WORLD), "adopted", 120)
        generation = ready[0]["generation"] + 1
        for rank, view in joined.items():
            assert (view["number"], view["members"]) == (3, list(range(WORLD))), (rank, view)
            assert view["mask"] == view["active_mask"] == EVERYONE, (rank, view)
            assert view["generation"] == generation, (rank, view)
        shown = sidecar.get_group(group).view
        assert (shown.number, list(shown.members), shown.state) == (3, [0, 1, 2, 3], _COMMITTED)
        assert shown.generation == generation and f"rank {KILLED} rejoined" in shown.cause

        ranks.send(range(WORLD), "steps 5 4")
        _check_steps(ranks.expect(range(WORLD), "stepped", 60), 5, 4, set(), EVERYONE)

        # The next layer's round meets all four, and grows the plan.
        ranks.send(range(WORLD), f"layer model.layers.1.mlp {2 * TOKENS}")
        grown = ranks.expect(range(WORLD), "initialized", 120)
        assert {g["generation"] for g in grown.values()} == {generation + 1}, grown
        ranks.send(range(WORLD), "steps 9 4")
        _check_steps(ranks.expect(range(WORLD), "stepped", 60), 9, 4, set(), EVERYONE)
        shown = sidecar.get_group(group).view
        assert (shown.number, list(shown.joined)) == (3, [KILLED]), shown

        ranks.send(range(WORLD), "cleanup")
        ranks.expect(range(WORLD), "cleaned", 30)


def _view_2(ranks: RejoiningRanks) -> None:
    """Every rank steps once, rank 3 is killed, the survivors adopt view 2."""
    ranks.expect(range(WORLD), "ready", STARTUP_S)
    ranks.send(range(WORLD), "steps 0 1")
    ranks.expect(range(WORLD), "stepped", 60)
    ranks.kill(KILLED)
    # Adopting before the sidecar has proposed view 2 would adopt view 1.
    ranks.send(SURVIVORS, "fault")
    assert all(f["fault"] for f in ranks.expect(SURVIVORS, "fault", 60).values())
    ranks.send(SURVIVORS, "adopt")
    for rank, view in ranks.expect(SURVIVORS, "adopted", 90).items():
        assert view["number"] == 2, (rank, view)


def test_a_replacement_the_stored_plan_does_not_serve_is_refused_on_every_rank(
    sidecar: Sidecar, tmp_path: Path
) -> None:
    group = "masked-rejoin-refused:fp4/tp1-ep4/pp0"
    with RejoiningRanks(tmp_path / "ranks", sidecar.target, group, policy="mask") as ranks:
        _view_2(ranks)
        rejoin = f"file://{tmp_path / 'rejoin-rendezvous'}"
        ranks.replace(KILLED, group, rejoin, tokens=4 * TOKENS)
        ranks.send(SURVIVORS, f"rejoin {rejoin}")
        raised = ranks.expect(range(WORLD), "raised", 120)
        for rank, failure in raised.items():
            assert failure["type"] == "PreconditionFailed", (rank, failure)
            assert "which the stored plan" in failure["message"], (rank, failure)
        for rank in SURVIVORS:
            assert "the replacement for rank 3 was refused" in raised[rank]["message"]
        shown = sidecar.get_group(group).view
        assert (shown.number, shown.state) == (2, _COMMITTED), shown  # nothing changed
