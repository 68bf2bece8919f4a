"""How ``moe-sidecar simulate`` reads a death (pure: records in, a report out) and sums it up."""

from __future__ import annotations

import re
from typing import Any

import pytest

from moe_sidecar.client.peer_loss import PEER_LOSS_EXIT_STATUS
from moe_sidecar.client.simulate.death import (
    MaskedStep,
    RankExit,
    StepFailed,
    SurvivorReport,
    library_line,
    read_death,
)
from moe_sidecar.client.simulate.presets import MODELS
from moe_sidecar.client.simulate.records import RoundRecord, SimulationConfig, SimulationResult
from moe_sidecar.client.simulate.summary import format_summary

pytestmark = pytest.mark.timeout(30)

LINE = (
    "moe-sidecar: EP group 'g': rank 1 died (rank 1 (last reported round 2, layer 'L') is "
    "gone: its session stream closed (...)); rank {me} exits with status 75"
)


def _read(**overrides: Any) -> Any:
    arguments: dict[str, Any] = {
        "ranks": 3,
        "nodes": ["", "", ""],
        "policy": "exit",
        "loss_wait": 5.0,
        "kill": None,
        "kill_round": 0,
        "where": "",
        "rounds_done": 2,
        "exits": {},
        "step_failures": {},
        "reports": {},
        "raised": {},
        "finished": frozenset(),
        "stderr": {},
        "exit_status": PEER_LOSS_EXIT_STATUS,
    }
    arguments.update(overrides)
    return read_death(**arguments)


def test_the_rank_killed_is_the_cause_not_the_survivor_its_policy_ended() -> None:
    # Rank 0 ended first (status 75, its policy); rank 1 was the one killed.
    death = _read(
        exits={
            0: RankExit(0, 75, at=10.05),
            1: RankExit(1, -9, at=10.10),
            2: RankExit(2, 75, at=10.20),
        },
        step_failures={2: StepFailed(2, "RuntimeError: Connection closed by peer", at=10.01)},
        stderr={0: "noise\n" + LINE.format(me=0) + "\n", 2: LINE.format(me=2)},
    )
    assert (death.ep_rank, death.how, death.signal, death.requested) == (
        1,
        "killed by signal 9",
        "SIGKILL",
        False,
    )
    assert [s.ep_rank for s in death.survivors] == [0, 2]
    first, last = death.survivors
    assert first.action == "exited with status 75" and first.acted
    assert first.line == LINE.format(me=0)
    assert last.after == pytest.approx(0.10) and last.step_error_after == 0.0  # before the death
    assert death.every_survivor_acted


def test_no_death_when_every_rank_finished_or_said_why() -> None:
    exits = {r: RankExit(r, 0 if r else 1, at=1.0) for r in range(3)}
    assert (
        _read(
            exits=exits,
            finished=frozenset({1, 2}),
            raised={0: ("PreconditionFailed: refused", 0.5)},
        )
        is None
    )


def test_a_survivor_that_heard_nothing_did_not_act() -> None:
    death = _read(
        kill=(1, 10.0),
        kill_round=2,
        where="between its dispatch and its combine",
        exits={1: RankExit(1, -9, 10.0), 2: RankExit(2, 0, 15.0)},
        reports={2: SurvivorReport(2, True, "", 0.0)},
    )
    assert death.requested and death.round == 2
    by_rank = {s.ep_rank: s for s in death.survivors}
    assert by_rank[0].exit == "stopped by simulate" and not by_rank[0].acted
    assert by_rank[2].action == "did not hear of the death within 5 s (--loss-wait)"
    assert not death.every_survivor_acted


def test_mask_acts_only_with_exact_steps_under_the_view() -> None:
    def survivor(error: float) -> Any:
        report = SurvivorReport(
            0,
            True,
            "peer_fault()",
            10.1,
            view_number=2,
            view_members=(0, 2),
            view_mask=0b101,
            view_at=10.2,
            steps=(MaskedStep(1, error, 3, 64),),
        )
        death = _read(
            policy="mask", kill=(1, 10.0), exits={1: RankExit(1, -9, 10.0)}, reports={0: report}
        )
        return death.survivors[0]

    exact = survivor(0.0)
    assert exact.acted and exact.after == pytest.approx(0.1) and exact.view_number == 2
    assert exact.action == "heard of it (peer_fault())"
    assert exact.detail == "adopted view 2, then ran 1 steps under its mask: exact"
    assert not survivor(1.0).acted


def test_library_line_is_the_line_about_that_death() -> None:
    text = "warning: x\nWARNING:root:" + LINE.format(me=0) + "\n"
    assert library_line(text, 1) == LINE.format(me=0)
    assert library_line(text, 2) == ""


def test_no_summary_block_when_no_rank_came_up() -> None:
    result = SimulationResult(model="m", ranks=2, target=None, group="g", total_rounds=48)
    result.error = "rank 1 exited (killed by signal 9) before it reached the sidecar"
    assert format_summary(result) == (
        "\nFAILED: rank 1 exited (killed by signal 9) before it reached the sidecar\nFAILED\n"
    )
    result.startup_seconds = 1.0
    result.rounds.append(RoundRecord(1, "L", "bf16", "build", 100, 8, 1, 0.01))
    text = format_summary(result)
    assert "rounds: 1 of 48   builds: 1   rebuilds: 0   reuses: 0\n" in text
    assert "wall time" in text


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kill_rank": 2, "kill_round": 2}, "--kill-rank 2: must be in [0, 1]"),
        ({"kill_rank": 0, "kill_round": 49}, "--at-round 49: must be in [1, 48]"),
        ({"kill_rank": 0, "kill_round": 0}, "--at-round 0: must be in [1, 48]"),
        ({"kill_round": 3}, "--at-round 3: needs --kill-rank"),
        ({"loss_wait": 0.0}, "--loss-wait 0.0: must be in (0, 3600] seconds"),
        (
            {"on_peer_loss": "ignore"},
            "--on-peer-loss 'ignore': must be one of exit, raise, wait, mask",
        ),
        ({"ranks": 1, "kill_rank": 0, "kill_round": 1}, "needs --ranks 2 or more"),
        ({"start_sidecar": True, "target": "unix:///x.sock"}, "--start-sidecar starts the run's"),
    ],
)
def test_death_flags_are_checked_naming_the_flag(fields: dict[str, Any], message: str) -> None:
    values: dict[str, Any] = {
        "model": MODELS["qwen3-30b-a3b"],
        "ranks": 2,
        "target": None,
        "group": "g",
        "max_tokens": 8,
        "propose_timeout": None,
        "timeout": 60.0,
        "check": True,
    }
    values.update(fields)
    with pytest.raises(ValueError, match=re.escape(message)):
        SimulationConfig(**values)
